"""What a job on the local Ray head inherits: the object store's settings and the checkout's state
folder. No real service is started here."""

import json
import os
import subprocess
import sys

import ray

from dspark import cluster
from dspark.config import LOCAL_DIR, REPO_ROOT, load_config
from dspark.services import START_ORDER, RayHead, ServiceState, process_started

STORE_ENV = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_REGION": "us-east-1",
}


def _running_object_store(root):
    """A state file as a running object store leaves it (this process stands in for its pid)."""
    st = ServiceState("objectstore", os.getpid(), {"s3": 9}, STORE_ENV, started=process_started(os.getpid()))
    (root / "objectstore.json").write_text(json.dumps(st.__dict__))


def test_ray_head_passes_the_object_store_settings_to_its_jobs(tmp_path):
    _running_object_store(tmp_path)
    env = RayHead(tmp_path).process_env()
    assert {k: env[k] for k in STORE_ENV} == STORE_ENV
    assert env["DSPARK_LOCAL_DIR"] == str(LOCAL_DIR)  # the MLflow store of this checkout, not a job's copy
    assert RayHead(tmp_path).workdir() == REPO_ROOT  # `ray job submit -- python jobs/...` without --working-dir
    assert START_ORDER.index("objectstore") < START_ORDER.index("ray")


def test_the_ray_processes_wait_longer_for_a_proxy_unless_told_otherwise(tmp_path, monkeypatch):
    """Serve's default gives a new HTTP proxy 15 s before killing it, which a busy 2-core machine missed."""
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    assert RayHead(tmp_path).process_env()["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30"
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "7")
    assert RayHead(tmp_path).process_env()["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "7"
    # a local Ray's processes inherit the driver's environment as ray.init finds it
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local Ray, not a cluster's
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    seen = []
    monkeypatch.setattr(
        cluster, "_start_local", lambda start: seen.append(os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"))
    )
    cluster.init_ray(load_config())
    assert seen == ["30"]


def test_a_head_started_without_those_settings_is_stale(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    head = RayHead(tmp_path)
    _running_object_store(tmp_path)
    settings = {**head.job_env(), "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    without_ray_setting = {k: v for k, v in settings.items() if k != "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"}
    for env, stale in (({}, True), (without_ray_setting, True), (settings, False)):
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            proc.stdout.readline()  # exec'd: /proc shows its own environment now
            assert head.stale(ServiceState("ray", proc.pid, {})) == stale
        finally:
            proc.kill()
            proc.wait()


def test_local_dir_follows_dspark_local_dir(tmp_path):
    code = "from dspark.config import load_config; print(load_config().mlflow.tracking_uri)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DSPARK_LOCAL_DIR": str(tmp_path)},
    )
    assert out.stdout.strip() == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
