"""Distributed drafter training as users run it: `ray job submit` of jobs/train_dspark.py against a
local Ray head, 2 workers with DeepSpeed ZeRO-2, the cache streamed from s3:// on the local object
store (several epochs, each read from S3 again), MLflow on SQLite.

- The reference run goes through an object-store outage: the S3 server is killed once training has
  committed its first checkpoint and comes back 5 s later, while workers stream the cache and
  checkpoint to it; reads, checkpoint uploads and the export retry, and the run finishes with every
  step logged exactly once.
- One worker of a second run is killed after a committed checkpoint: the run resumes from its latest
  checkpoint and finishes with every step logged exactly once and the reference's final loss (an
  outage delays I/O but changes no number)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from conftest import SMALL_CACHE, wait_for

from dspark.services import ObjectStore

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 6, 2  # checkpoints at steps 2, 4 and 6; the 16 rows of the small cache at 8 per step: 3 epochs
JOB_TIMEOUT = 900


def _submit(ray_head, db: Path, run_name: str) -> str:
    """Submits the training job on the shared small cache (the head gives it the object store's
    settings); returns its id."""
    overrides = [
        *SMALL_CACHE,
        f"train.run_name={run_name}",
        f"train.max_steps={STEPS}",
        f"train.checkpoint_every={EVERY}",
        f"train.log_every={EVERY}",
        "train.num_workers=2",
        "train.zero_stage=2",
        "train.global_batch=8",
        "train.micro_batch=2",
        "train.lr=3e-3",
        "train.draft_vocab=1024",  # a draft vocabulary: its ids are weights that must survive resume and export
        "train.evaluate=false",
        f"mlflow.tracking_uri=sqlite:///{db}",
    ]
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "job",
        "submit",
        "--no-wait",
        "--address",
        ray_head.env["RAY_ADDRESS"],
        "--working-dir",
        str(ROOT),
        "--runtime-env-json",
        json.dumps({"env_vars": {"OMP_NUM_THREADS": "1"}, "excludes": [".venv", ".local", ".git", "results"]}),
        "--",
        "python",
        "jobs/train_dspark.py",
    ]
    for o in overrides:
        cmd += ["--set", o]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ray_head.env}, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return re.search(r"raysubmit_[A-Za-z0-9]+", out.stdout).group(0)  # the CLI colours its output


def _history(db: Path, run_name: str):
    """(the MLflow run, its train.loss history), (None, []) before the run exists."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"attributes.run_name = '{run_name}'"
    )
    if not runs:
        return None, []
    return runs[0], client.get_metric_history(runs[0].info.run_id, "train.loss")


def _last_step(db: Path, run_name: str) -> int:
    return max((m.step for m in _history(db, run_name)[1]), default=0)


def _finish(jobs, job_id: str):
    """The job's final status and its logs (the driver's and, forwarded, its workers')."""
    status = wait_for(
        lambda: (s := jobs.get_job_status(job_id)).is_terminal() and s, JOB_TIMEOUT, f"end of job {job_id}", 1.0
    )
    return status, jobs.get_job_logs(job_id)


@pytest.fixture(scope="module")
def jobs(ray_head):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(ray_head.env["RAY_ADDRESS"])


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    """An initialised store, so that the jobs and this test's polling never both create its tables."""
    import mlflow

    db = tmp_path_factory.mktemp("train-mlflow") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(scope="module")
def reference(ray_head, small_cache, services_dir, mlflow_db, jobs):
    """The reference run, with the object store down for 5 s once its first checkpoint is committed
    (steps reach MLflow only then). The run cannot finish without the store (checkpoints and the
    export go to it), so the outage lands while it runs."""
    job_id = _submit(ray_head, mlflow_db, "reference")
    wait_for(
        lambda: _last_step(mlflow_db, "reference") or jobs.get_job_status(job_id).is_terminal(),
        JOB_TIMEOUT,
        "committed checkpoint",
        0.5,
    )
    outage = not jobs.get_job_status(job_id).is_terminal()
    if outage:
        ObjectStore(services_dir).outage(5.0)
    status, logs = _finish(jobs, job_id)
    run, hist = _history(mlflow_db, "reference")
    return {"outage": outage, "status": status, "logs": logs, "run": run, "hist": hist}


def test_object_store_outage_during_streaming_does_not_fail_the_run(reference, mlflow_db, tmp_path):
    from ray.job_submission import JobStatus

    assert reference["outage"], "the run ended before its first checkpoint was committed"
    assert reference["status"] == JobStatus.SUCCEEDED, reference["logs"][-4000:]
    assert sorted(m.step for m in reference["hist"]) == list(range(1, STEPS + 1)), reference["logs"][-4000:]
    run = reference["run"]
    params = run.data.params
    assert params["train.zero_stage"] == "2" and params["world_size"] == "2" and params["train.num_workers"] == "2"
    assert {
        "train.expected_tau",
        "train.accept_1",
        "train.grad_norm",
        "train.lr",
        "train.data_wait_frac",
        "train.tokens_per_s",
        "train.epoch",
    } <= set(run.data.metrics)
    assert run.data.metrics["train.epoch"] == 2  # the cache was streamed three times
    assert re.search(r"\[train\] draft vocabulary: 1024 tokens cover \d+\.\d% of the cache", reference["logs"])
    import mlflow
    from safetensors.torch import load_file

    client = mlflow.MlflowClient(f"sqlite:///{mlflow_db}")
    arts = [a.path for a in client.list_artifacts(run.info.run_id, "drafter")]
    assert {"drafter/config.json", "drafter/model.safetensors"} <= set(arts)
    folder = Path(client.download_artifacts(run.info.run_id, "drafter", str(tmp_path)))
    saved = json.loads((folder / "config.json").read_text())
    assert saved["draft_vocab"] == 1024
    assert saved["cache_law"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 0}  # the cache's answers' law
    ids = load_file(str(folder / "model.safetensors"))["draft_ids"]
    assert ids.dtype == torch.int64 and ids.shape == (1024,) and bool((ids[1:] > ids[:-1]).all())
    # the drafter, with its speculators export, is the newest version of the registered model
    from dspark.artifacts import download_drafter
    from dspark.config import load_config

    assert re.search(r"\[train\] registered models:/small-dspark/\d+ \(alias candidate", reference["logs"])
    assert client.get_model_version_by_alias("small-dspark", "candidate").run_id == run.info.run_id
    cfg = load_config(overrides=[*SMALL_CACHE, f"mlflow.tracking_uri=sqlite:///{mlflow_db}"])
    got = download_drafter(cfg, "models:/small-dspark@candidate", tmp_path / "registered")
    assert torch.equal(load_file(str(got / "model.safetensors"))["draft_ids"], ids)
    spec = Path(client.download_artifacts(run.info.run_id, "drafter/speculators", str(tmp_path / "spec")))
    assert json.loads((spec / "config.json").read_text())["speculators_model_type"] == "dspark"


def test_two_workers_zero2_from_s3_survive_a_killed_worker(ray_head, reference, mlflow_db, jobs):
    from ray.job_submission import JobStatus
    from ray.util.state import list_actors

    job_id = _submit(ray_head, mlflow_db, "killed")
    ray_job = wait_for(lambda: jobs.get_job_info(job_id).job_id, JOB_TIMEOUT, f"driver of job {job_id}", 1.0)
    workers = wait_for(
        lambda: (
            (
                found := list_actors(
                    address=ray_head.env["RAY_ADDRESS"],
                    filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE"), ("job_id", "=", ray_job)],
                )
            )
            and len(found) == 2
            and found
        ),
        JOB_TIMEOUT,
        "2 training workers",
        1.0,
    )
    victim = psutil.Process(workers[1].pid)  # found before training starts: killed as soon as a checkpoint is in
    committed = wait_for(lambda: _last_step(mlflow_db, "killed"), JOB_TIMEOUT, "committed checkpoint", 0.5)
    victim.kill()  # the run still needs its later steps, checkpoints and export: it cannot have finished
    status, logs = _finish(jobs, job_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    resumed = [int(s) for s in re.findall(r"\[train\] resumed from the checkpoint of step (\d+)", logs)]
    assert resumed and committed <= resumed[0] <= STEPS and resumed[0] % EVERY == 0, (committed, logs[-4000:])
    progress = {int(s) for s in re.findall(rf"\[train\] step (\d+)/{STEPS} \| loss [\d.]+ \| expected tau", logs)}
    # rank 0's progress lines reach the job's log
    assert {min(resumed[0] + EVERY, STEPS), STEPS} <= progress, logs[-4000:]
    _, hist = _history(mlflow_db, "killed")
    assert sorted(m.step for m in hist) == list(range(1, STEPS + 1))  # no lost or repeated steps
    ref = {m.step: m.value for m in reference["hist"]}
    final, final_killed = ref[STEPS], {m.step: m.value for m in hist}[STEPS]
    print(
        f"[resume] killed after step {committed}, resumed from step {resumed[0]}; final loss {final:.4f} "
        f"uninterrupted, {final_killed:.4f} after the kill (step 1: {ref[1]:.4f})"
    )
    # the resumed run retraces the reference: the checkpoint holds the model, optimizer, schedule and
    # data position of a whole step (gradient accumulation: 2 micro-batches per step on each rank), so
    # a restart there ends where the uninterrupted run ended (a position one micro-batch off ended
    # 2.7% away; a restart from scratch ends near the reference's step-4 loss)
    micro = [
        int(s)
        for s in re.findall(r"\[train\] resumed from the checkpoint of step \d+ \(epoch \d+, micro-batch (\d+)\)", logs)
    ]
    assert micro and micro[0] % 2 == 0, logs[-4000:]
    assert abs(final - final_killed) <= 0.01 * final, (ref[1], final, final_killed)
