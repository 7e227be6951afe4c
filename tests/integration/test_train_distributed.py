"""Distributed drafter training as users run it: `ray job submit` of jobs/train_dspark.py against a
local Ray head, 2 workers with DeepSpeed ZeRO-2, the cache streamed from s3:// on the local object
store, MLflow on SQLite. One worker is killed mid-run: the run must finish from its checkpoint with
every step logged exactly once and the same final loss as an uninterrupted run."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.services import BUCKET

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS = 12  # the kill lands after step 4: the rest leaves time to find a live worker


def _submit(ray_head, object_store, tmp_path, run_name, wait=True):
    env_vars = {**object_store.env, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    overrides = [f"storage.root=s3://{BUCKET}/it-train", "cache.name=small", "cache.max_examples=32",
                 "cache.shard_rows=8", "cache.max_new_tokens=24", f"train.run_name={run_name}",
                 f"train.max_steps={STEPS}", "train.checkpoint_every=2", "train.num_workers=2", "train.zero_stage=2",
                 "train.global_batch=8", "train.micro_batch=2", "train.lr=3e-3", "train.evaluate=false",
                 f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--address",
           ray_head.env["RAY_ADDRESS"], "--working-dir", str(ROOT), "--runtime-env-json",
           json.dumps({"env_vars": env_vars, "excludes": [".venv", ".local", ".git", "results"]}),
           *([] if wait else ["--no-wait"]), "--", "python", "jobs/train_dspark.py"]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, **ray_head.env}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _history(tmp_path, run_name):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"attributes.run_name = '{run_name}'")
    if not runs:
        return None, []
    return runs[0], client.get_metric_history(runs[0].info.run_id, "train.loss")


def _train_workers(ray_head):
    from ray.util.state import list_actors

    return [a for a in list_actors(address=ray_head.env["RAY_ADDRESS"],
                                   filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])]


def test_two_workers_zero2_from_s3_survive_a_killed_worker(ray_head, object_store, tmp_path):
    clean = _submit(ray_head, object_store, tmp_path, "clean")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    run, hist = _history(tmp_path, "clean")
    assert sorted(m.step for m in hist) == list(range(1, STEPS + 1))
    params = run.data.params
    assert params["train.zero_stage"] == "2" and params["world_size"] == "2" and params["train.num_workers"] == "2"
    assert {"train.expected_tau", "train.accept_1", "train.grad_norm", "train.lr", "train.data_wait_frac",
            "train.tokens_per_s"} <= set(run.data.metrics)
    import mlflow

    arts = [a.path for a in mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(run.info.run_id, "drafter")]
    assert {"drafter/config.json", "drafter/model.safetensors"} <= set(arts)

    job = _submit(ray_head, object_store, tmp_path, "killed", wait=False)
    assert job.returncode == 0, job.stderr[-2000:]
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", job.stdout).group(0)  # the CLI colours its output
    from ray.job_submission import JobStatus, JobSubmissionClient

    jobs = JobSubmissionClient(ray_head.env["RAY_ADDRESS"])
    deadline = time.monotonic() + 600
    killed = None
    while time.monotonic() < deadline and killed is None and not jobs.get_job_status(job_id).is_terminal():
        _, progress = _history(tmp_path, "killed")
        if progress and max(m.step for m in progress) >= 4:  # a checkpoint at step 4 is committed
            workers = _train_workers(ray_head)
            if len(workers) == 2:
                killed = workers[1].pid
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.5)
    assert killed, f"no worker killed after step 4 (job {jobs.get_job_status(job_id)})"
    while time.monotonic() < deadline and not jobs.get_job_status(job_id).is_terminal():
        time.sleep(2)
    assert jobs.get_job_status(job_id) == JobStatus.SUCCEEDED, jobs.get_job_logs(job_id)[-4000:]
    _, hist_killed = _history(tmp_path, "killed")
    assert sorted(m.step for m in hist_killed) == list(range(1, STEPS + 1))  # no lost or repeated steps
    final = {m.step: m.value for m in hist}[STEPS]
    final_killed = {m.step: m.value for m in hist_killed}[STEPS]
    print(f"[resume] final loss uninterrupted {final:.4f}, after a killed worker {final_killed:.4f}")
    assert abs(final - final_killed) <= 0.02 * abs(final), (final, final_killed)


def test_object_store_outage_during_streaming_does_not_fail_the_run(object_store, services_dir, tmp_path):
    """The S3 server is killed and comes back 5 s later while workers stream the cache (several epochs,
    each read from S3 again) and checkpoint to it: reads, checkpoint uploads and the export retry."""
    import threading

    import ray

    from dspark.cache.build import build_cache
    from dspark.cluster import init_ray
    from dspark.config import load_config
    from dspark.services import ObjectStore
    from dspark.train import distributed

    cfg = load_config(overrides=[f"storage.root=s3://{BUCKET}/it-outage", "cache.name=small", "cache.max_examples=32",
                                 "cache.shard_rows=8", "cache.max_new_tokens=16", "train.run_name=outage",
                                 "train.max_steps=30", "train.checkpoint_every=5", "train.num_workers=1",
                                 "train.global_batch=4", "train.micro_batch=2", "train.evaluate=false", "ray.num_cpus=2",
                                 f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    init_ray(cfg)
    try:
        build_cache(cfg)
        import mlflow

        def outage_when_training():
            client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
                if runs and client.get_metric_history(runs[0].info.run_id, "train.loss"):
                    ObjectStore(services_dir).outage(5.0)
                    return
                time.sleep(0.5)

        t = threading.Thread(target=outage_when_training)
        t.start()
        res = distributed.fit(cfg)
        t.join()
        assert res["metrics"]["step"] == 30
    finally:
        ray.shutdown()
