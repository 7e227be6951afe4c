"""Where each artifact of a run lives: the one owner of the URIs derived from the configuration.

    <storage.root>/caches/<cache.name>      the target cache                       (cache.uri overrides)
    <storage.root>/runs/<run name>/         Ray Train checkpoints, the MLflow run id
    <storage.root>/drafters/<run name>/     the exported drafter (+ calibration.json) (train.out_uri overrides)
    models:/<name>@<alias>                  a drafter registered in MLflow (mlflow.registered_model), which
                                            every job and the server accept as a drafter URI

A run's name is train.run_name, or the drafter kind and the start time when none is given: compute it
once (`run_name`) and pass it on, since two calls a second apart differ.
"""

from __future__ import annotations

import time
from pathlib import Path

from dspark import tracking
from dspark.config import Config
from dspark.storage import Storage


def cache_uri(cfg: Config) -> str:
    return cfg.cache.uri or Storage.join(cfg.storage.root, "caches", cfg.cache.name)


def run_name(cfg: Config) -> str:
    return cfg.train.run_name or f"{cfg.train.drafter}-{time.strftime('%Y%m%d-%H%M%S')}"


def runs_uri(cfg: Config) -> str:
    """The folder of every run's checkpoints (Ray Train's storage_path)."""
    return Storage.join(cfg.storage.root, "runs")


def drafter_uri(cfg: Config, name: str | None = None) -> str:
    """The exported drafter of run `name` (default: train.run_name, which must then be set)."""
    if cfg.train.out_uri:
        return cfg.train.out_uri
    name = name or cfg.train.run_name
    if not name:
        raise ValueError("drafter_uri: no run name (set train.run_name or pass the name run_name() gave)")
    return Storage.join(cfg.storage.root, "drafters", name)


def registered_model(cfg: Config) -> str:
    """The registered model a training run's drafter becomes a version of ("" = none)."""
    if cfg.mlflow.registered_model is not None:
        return cfg.mlflow.registered_model
    return f"{cfg.cache.name}-{cfg.train.drafter}" if cfg.mlflow.enabled else ""


def download_drafter(cfg: Config, uri: str, dest: str | Path, only: tuple[str, ...] = ()) -> Path:
    """A local folder with the drafter at `uri`: a storage URI or folder, or models:/NAME@ALIAS (or
    /VERSION) from the MLflow model registry (`only`: just these files)."""
    if uri.startswith("models:/"):
        uri = tracking.model_source(cfg, uri)
    return Storage.from_config(cfg.storage).download_dir(uri, dest, only)
