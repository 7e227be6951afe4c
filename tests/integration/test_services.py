"""The real services the project starts: S3 object store, MLflow on SQLite, a Ray head for job submit."""

import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark.errors import UserError
from dspark.services import BUCKET
from dspark.storage import Storage

pytestmark = pytest.mark.integration


def test_parquet_roundtrip_through_s3(object_store):
    s = Storage(
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
    )
    uri = f"s3://{BUCKET}/tests/roundtrip.parquet"
    s.check(uri)
    fs, path = s.pyarrow_fs(uri)
    table = pa.table({"id": list(range(1000)), "x": [float(i) / 3 for i in range(1000)]})
    pq.write_table(table, path, filesystem=fs)
    assert pq.read_table(path, filesystem=fs).equals(table)
    sfs, spath = s.fsspec_fs(uri)
    assert sfs.info(spath)["size"] == fs.get_file_info(path).size > 0


def test_object_store_errors_name_the_problem(object_store):
    env = object_store.env
    wrong = Storage(endpoint_url=env["AWS_ENDPOINT_URL"], access_key="wrong", secret_key="wrong")
    with pytest.raises(UserError, match="rejected the credentials"):
        wrong.check(f"s3://{BUCKET}/x")
    with pytest.raises(UserError, match="bucket 'missing-bucket' does not exist"):
        Storage(env["AWS_ENDPOINT_URL"], "us-east-1", 1, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]).check(
            "s3://missing-bucket/x"
        )
    with pytest.raises(UserError, match="unreachable"):
        Storage("http://127.0.0.1:9", "us-east-1", 1, "a", "b").check(f"s3://{BUCKET}/x")


def test_mlflow_run_logged_and_read_back(mlflow_config, tmp_path):
    from dspark import tracking

    art = tmp_path / "note.txt"
    art.write_text("hello")
    with tracking.run(mlflow_config, "roundtrip") as t:
        t.params({"train.lr": 0.1})
        for step in range(5):
            t.metrics({"loss": 1.0 / (step + 1)}, step)
        t.artifact(art)
        run_id = t.run_id
    import mlflow

    client = mlflow.MlflowClient(mlflow_config.mlflow.tracking_uri)
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.1"
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.0, 0.5, 1 / 3, 0.25, 0.2]
    assert [f.path for f in client.list_artifacts(run_id)] == ["note.txt"]
    with tracking.run(mlflow_config, "ignored", run_id=run_id) as t:  # resuming keeps one run id
        t.metrics({"loss": 0.1}, 5)
    assert len(client.get_metric_history(run_id, "loss")) == 6


def test_registered_drafters_resolve_by_alias_and_version(mlflow_config, tmp_path, monkeypatch):
    from dspark import artifacts, tracking
    from dspark.config import load_config

    folder = tmp_path / "drafter"
    folder.mkdir()
    with tracking.run(mlflow_config, "registry") as t:
        run_id = t.run_id
    for version in (1, 2):
        (folder / "config.json").write_text(f'{{"version": {version}}}')
        uri = tracking.register_drafter(mlflow_config, run_id, folder, "builtin-dspark", "candidate")
        assert uri == f"models:/builtin-dspark/{version}"
    # the alias follows the newest version (a rerun of one run re-registers that run's files)
    got = artifacts.download_drafter(mlflow_config, "models:/builtin-dspark@candidate", tmp_path / "a")
    assert (got / "config.json").read_text() == '{"version": 2}'
    pinned = artifacts.download_drafter(mlflow_config, "models:/builtin-dspark/1", tmp_path / "v")
    assert (pinned / "config.json").exists()
    with pytest.raises(UserError, match=r"models:/builtin-dspark@prod: not in the model registry at sqlite:"):
        artifacts.download_drafter(mlflow_config, "models:/builtin-dspark@prod", tmp_path / "b")
    with pytest.raises(UserError, match="expected models:/NAME@ALIAS or models:/NAME/VERSION"):
        artifacts.download_drafter(mlflow_config, "models:/builtin-dspark", tmp_path / "c")
    # MLFLOW_TRACKING_URI is the default store; a setting still wins
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_config.mlflow.tracking_uri)
    assert load_config().mlflow.tracking_uri == mlflow_config.mlflow.tracking_uri
    assert load_config(overrides=["mlflow.tracking_uri=http://127.0.0.1:5000"]).mlflow.tracking_uri.startswith("http")


def test_ray_job_submit(ray_head, tmp_path):
    env = {**os.environ, **ray_head.env}
    script = "import ray; ray.init(); print('cpus', ray.cluster_resources()['CPU'])"
    t0 = time.monotonic()
    out = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "job",
            "submit",
            "--address",
            ray_head.env["RAY_ADDRESS"],
            "--",
            "python",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cpus 2.0" in out.stdout, out.stdout[-2000:]
    assert time.monotonic() - t0 < 300
