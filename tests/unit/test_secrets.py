"""Secrets (the serving API key, storage credentials) never reach MLflow params, reprs, error
messages, or files other users can read."""

import stat

import pytest

from dspark import services, tracking
from dspark.config import ConfigError, load_config
from dspark.storage import Storage

KEY = "sk-very-secret-123"


def test_api_key_stays_out_of_params_reprs_and_errors():
    cfg = load_config(overrides=[f"serve.api_key={KEY}", "mlflow.tracking_uri=postgresql://u:pw-456@db:5432/ml"])
    assert cfg.serve.api_key == KEY  # the application still gets it
    flat = cfg.flat()
    assert (
        flat["serve.api_key"] == "<redacted>" and flat["mlflow.tracking_uri"] == "postgresql://u:<redacted>@db:5432/ml"
    )
    assert KEY not in repr(cfg) and KEY not in str(cfg.serve)
    assert load_config().flat()["serve.api_key"] is None  # unset stays visibly unset
    with pytest.raises(ConfigError) as e:
        load_config(
            overrides=["serve.api_key=[1, 2]", f"train.lr={KEY}"]
        )  # a wrong type, and a secret typed in the wrong key
    assert "serve.api_key" in str(e.value) and "train.lr" in str(e.value)
    assert "[1, 2]" not in str(e.value) and KEY in str(e.value)  # only secret keys are redacted


def test_empty_api_key_is_a_config_error_naming_the_key():
    for empty in ("serve.api_key=", "serve.api_key='  '"):
        with pytest.raises(ConfigError, match="serve.api_key: must not be empty"):
            load_config(overrides=[empty])
    assert load_config().serve.api_key is None  # unset: auth off


def test_tracker_redacts_params():
    class FakeMLflow:
        def log_params(self, params):
            self.logged = params

    mlflow = FakeMLflow()
    tracking.Tracker(mlflow).params({"serve.api_key": KEY, "train.lr": 0.1})
    assert mlflow.logged == {"serve.api_key": "<redacted>", "train.lr": "0.1"}


def test_storage_repr_hides_credentials():
    s = Storage(endpoint_url="http://127.0.0.1:9", access_key="AKIA-ID-789", secret_key=KEY)
    assert "AKIA-ID-789" not in repr(s) and KEY not in repr(s) and "127.0.0.1:9" in repr(s)


def test_object_store_credentials_files_are_private(tmp_path, monkeypatch):
    monkeypatch.setattr(services, "_bin", lambda name: name)
    store = services.ObjectStore(tmp_path)
    store.dir.mkdir(parents=True)
    (store.dir / "identities.json").write_text("{}")  # left by an older version, world-readable
    (store.dir / "identities.json").chmod(0o644)
    store.command({"s3": 1})
    for name in ("credentials.json", "identities.json"):
        assert stat.S_IMODE((store.dir / name).stat().st_mode) == 0o600, name
