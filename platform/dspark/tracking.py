"""MLflow tracking shared by the jobs: SQLite backend by default, batched metric logging."""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dspark.config import LOCAL_DIR, Config, redact
from dspark.errors import UserError


def _prepare(cfg: Config):
    os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    import mlflow

    uri = cfg.mlflow.tracking_uri
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    artifacts = cfg.mlflow.artifact_location or (LOCAL_DIR / "mlflow" / "artifacts").as_uri()
    try:
        exp = mlflow.get_experiment_by_name(cfg.mlflow.experiment)
        exp_id = (
            exp.experiment_id if exp else mlflow.create_experiment(cfg.mlflow.experiment, artifact_location=artifacts)
        )
    except Exception as e:
        raise UserError(f"mlflow tracking store {uri} is not usable: {str(e).splitlines()[0]}") from None
    return mlflow, exp_id


def system_info() -> dict[str, str]:
    import torch

    info = {
        "sys.python": platform.python_version(),
        "sys.torch": torch.__version__,
        "sys.cpu_count": str(os.cpu_count()),
        "sys.torch_threads": str(torch.get_num_threads()),
        "sys.cuda": str(torch.cuda.is_available()),
    }
    if torch.cuda.is_available():
        info["sys.gpu"] = torch.cuda.get_device_name(0)
    return info


class Tracker:
    """Buffers metrics and flushes them with one `log_metrics` call (one SQLite write per call)."""

    def __init__(self, mlflow=None, flush_every_s: float = 10.0):
        self.mlflow = mlflow
        self.flush_every_s = flush_every_s
        self._buf: list = []
        self._last = time.monotonic()

    @property
    def run_id(self) -> str | None:
        run = self.mlflow.active_run() if self.mlflow else None
        return run.info.run_id if run else None

    def metrics(self, values: dict[str, float], step: int) -> None:
        if not self.mlflow:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buf += [Metric(k, float(v), now, step) for k, v in values.items()]
        if time.monotonic() - self._last > self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if self.mlflow and self._buf:
            self.mlflow.MlflowClient().log_batch(self.run_id, metrics=self._buf)
        self._buf = []
        self._last = time.monotonic()

    def params(self, values: dict) -> None:
        """Logged as strings of at most 500 characters, secrets redacted (see config.redact)."""
        if self.mlflow:
            self.mlflow.log_params({k: str(redact(k, v))[:500] for k, v in values.items()})

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.mlflow:
            p = Path(path)
            (self.mlflow.log_artifacts if p.is_dir() else self.mlflow.log_artifact)(str(p), artifact_path)


class RunClient:
    """An existing run written from another process (rank 0 of a training worker group): no active-run
    state, parameters redacted like Tracker's, each step's metrics logged exactly once across restarts."""

    def __init__(self, cfg: Config, run_id: str):
        os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
        import mlflow

        self.run_id = run_id
        self.client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
        self.logged_step: int | None = None  # the last step MLflow has (read once, on the first write)

    def params(self, values: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(redact(k, v))[:500]) for k, v in values.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_new(self, metrics: list[dict], prefix: str = "train.") -> None:
        """Log the steps MLflow does not have yet (each dict carries its "step")."""
        from mlflow.entities import Metric

        if not metrics:
            return
        if self.logged_step is None:  # a (re)started worker: what did earlier attempts log?
            history = self.client.get_metric_history(self.run_id, f"{prefix}loss")
            self.logged_step = max((m.step for m in history), default=0)
        now = int(time.time() * 1000)
        batch = [
            Metric(f"{prefix}{k}", float(v), now, int(m["step"]))
            for m in metrics
            if m["step"] > self.logged_step
            for k, v in m.items()
        ]
        for i in range(0, len(batch), 900):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 900])
        self.logged_step = max(self.logged_step, max(int(m["step"]) for m in metrics))

    def artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)


@contextmanager
def run(cfg: Config, run_name: str, run_id: str | None = None, tags: dict | None = None) -> Iterator[Tracker]:
    """An MLflow run (resumed when run_id is given), or a no-op tracker when MLflow is disabled.
    Inside another run (a pipeline such as the quickstart) it becomes that run's child."""
    if not cfg.mlflow.enabled:
        yield Tracker(None)
        return
    mlflow, exp_id = _prepare(cfg)
    with mlflow.start_run(
        run_id=run_id,
        experiment_id=None if run_id else exp_id,
        run_name=None if run_id else run_name,
        tags=tags,
        nested=mlflow.active_run() is not None,
    ):
        tracker = Tracker(mlflow)
        try:
            yield tracker
        finally:
            tracker.flush()


def _client(cfg: Config):
    os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    import mlflow

    return mlflow.MlflowClient(tracking_uri=cfg.mlflow.tracking_uri, registry_uri=cfg.mlflow.tracking_uri)


def register_drafter(cfg: Config, run_id: str, local_dir: str | Path, name: str, alias: str) -> str:
    """The drafter folder (weights, config, calibration, exports) logged into run `run_id` as "drafter"
    and registered as a new version of model `name`, `alias` moved to it. Returns models:/name/version."""
    from mlflow.exceptions import MlflowException

    client = _client(cfg)
    client.log_artifacts(run_id, str(local_dir), "drafter")
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/drafter"
    try:
        client.create_registered_model(name, description="DSpark-platform drafters (jobs/train_dspark.py)")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(name, source, run_id=run_id).version
    if alias:
        client.set_registered_model_alias(name, alias, version)
    return f"models:/{name}/{version}"


def model_source(cfg: Config, uri: str) -> str:
    """models:/NAME@ALIAS or models:/NAME/VERSION -> the storage URI of that version's files."""
    from mlflow.exceptions import MlflowException

    ref = uri[len("models:/") :]
    name, at, alias = ref.partition("@")
    if not at:
        name, _, alias = ref.rpartition("/")
    if not name or not alias:
        raise UserError(f"{uri}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    client = _client(cfg)
    try:
        mv = client.get_model_version_by_alias(name, alias) if at else client.get_model_version(name, alias)
    except MlflowException as e:
        why = e.message.splitlines()[0]
        raise UserError(f"{uri}: not in the model registry at {cfg.mlflow.tracking_uri} ({why})") from None
    return mv.source
