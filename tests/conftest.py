"""Shared fixtures. Services are real processes on 127.0.0.1, started on free ports per test session
and stopped by PID (never `ray stop`)."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tests and CI: one thread per process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def object_store(services_dir):
    """A SeaweedFS S3 server; yields its state, with the client env exported for the session."""
    from dspark.services import ObjectStore

    svc = ObjectStore(services_dir)
    st = svc.start()
    saved = {k: os.environ.get(k) for k in st.env}
    os.environ.update(st.env)
    yield st
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    svc.stop()


@pytest.fixture(scope="session")
def ray_head(services_dir):
    from dspark.services import RayHead

    svc = RayHead(services_dir, num_cpus=2)
    st = svc.start()
    yield st
    svc.stop()


@pytest.fixture
def mlflow_config(tmp_path):
    from dspark.config import load_config

    return load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                  f"mlflow.artifact_location={(tmp_path / 'artifacts').as_uri()}"])
