"""Distributed drafter training, the driver: resolves the cache, creates (or finds again) the run's
MLflow run, and starts Ray Train (TorchTrainer, V2 API) workers running `dspark.train.worker`.

Rerunning the job with the same run name resumes from the run's latest checkpoint (see the worker for
what a checkpoint holds); `train.warm_start` loads weights only.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import ray
from ray.train import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
)
from ray.train.torch import TorchTrainer

from dspark import artifacts, tracking
from dspark.cache.read import check_shards, dataset, open_cache
from dspark.cluster import quiet_ray_data
from dspark.config import Config
from dspark.storage import Storage
from dspark.train.loop import draft_vocabulary
from dspark.train.worker import train_loop_per_worker


def total_steps(cfg: Config, rows: int) -> int:
    tc = cfg.train
    per_epoch = max(
        1, (rows // max(1, tc.num_workers)) // tc.micro_batch * tc.micro_batch * tc.num_workers // tc.global_batch
    )
    return tc.max_steps or per_epoch * tc.epochs


def summary(res: dict) -> str:
    """The line a job prints about a finished run of fit()."""
    m, nan = res["metrics"] or {}, float("nan")
    return (
        f"[train] {res['name']}: {res['steps']} steps, final loss {m.get('loss', nan):.4f}, expected tau "
        f"{m.get('expected_tau', nan):.3f}; drafter at {res['out_uri']} (MLflow run {res['run_id']})"
    )


def fit(cfg: Config, log=print, in_memory: bool = False) -> dict:
    """Driver side: resolve the cache, create/resume the MLflow run, run the TorchTrainer.
    in_memory materialises the dataset first (a baseline for the data-wait fraction of streaming)."""
    tc = cfg.train
    storage = Storage.from_config(cfg.storage)
    cache = open_cache(artifacts.cache_uri(cfg), storage)
    shards = check_shards(cache, skip_bad=cfg.cache.skip_bad_shards)
    rows = sum(s.rows for s in shards)
    name = artifacts.run_name(cfg)
    runs_uri, out_uri = artifacts.runs_uri(cfg), artifacts.drafter_uri(cfg, name)
    steps = total_steps(cfg, rows)
    quiet_ray_data()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the same order after a restart: exact data position
    ds = dataset(cache, shards)
    if in_memory:
        ds = ds.materialize()
    draft_ids = None  # the draft vocabulary: the cache's most frequent response tokens
    if tc.draft_vocab:
        ids, covered = draft_vocabulary(cache, shards, tc.draft_vocab)
        draft_ids = ids.tolist()
        log(f"[train] draft vocabulary: {tc.draft_vocab} tokens cover {covered:.1%} of the cache's response tokens")
    run_id = _mlflow_run(cfg, storage, runs_uri, name)
    fs, path = _run_storage(storage, runs_uri)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "cfg": cfg.model_dump_json(),
            "manifest": cache.manifest.to_json(),
            "total_steps": steps,
            "mlflow_run_id": run_id,
            "out_uri": out_uri,
            "storage": storage,
            "draft_ids": draft_ids,
        },
        scaling_config=ScalingConfig(
            num_workers=tc.num_workers,
            use_gpu=tc.gpus_per_worker > 0,
            resources_per_worker={
                "CPU": tc.cpus_per_worker,
                **({"GPU": tc.gpus_per_worker} if tc.gpus_per_worker else {}),
            },
        ),
        run_config=RunConfig(
            name=name,
            storage_path=path,
            storage_filesystem=fs,
            failure_config=FailureConfig(max_failures=tc.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints),
        ),
        datasets={"train": ds},
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    log(
        f"[train] {name}: {tc.drafter} x{tc.num_layers} layers, {tc.num_workers} worker{'s' * (tc.num_workers > 1)}, "
        f"ZeRO-{tc.zero_stage}, "
        f"{steps} steps of {tc.global_batch} sequences from {cache.uri} ({rows} rows); checkpoints in {runs_uri}/{name}"
    )
    result = trainer.fit()
    return {
        "name": name,
        "run_id": run_id,
        "out_uri": out_uri,
        "steps": steps,
        "metrics": result.metrics,
        "checkpoint": str(result.checkpoint.path) if result.checkpoint else None,
    }


def _run_storage(storage, runs_uri: str):
    """RunConfig storage: a local path, or S3 through s3fs (its retry settings survive pickling,
    unlike pyarrow's S3FileSystem retry strategy)."""
    if not Storage.is_remote(runs_uri):
        Path(Storage.path_of(runs_uri)).mkdir(parents=True, exist_ok=True)
        return None, Storage.path_of(runs_uri)
    fs, path = storage.fsspec_fs(runs_uri)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _mlflow_run(cfg: Config, storage, runs_uri: str, name: str) -> str | None:
    """One MLflow run per training run name: created once, its id kept next to the checkpoints so a
    resubmitted job (same run name) continues the same run."""
    if not cfg.mlflow.enabled:
        return None
    fs, path = storage.pyarrow_fs(Storage.join(runs_uri, name, "mlflow_run_id"))
    info = fs.get_file_info(path)
    if info.type.name == "File":
        with fs.open_input_stream(path) as f:
            return f.read().decode().strip()
    with tracking.run(cfg, name, tags={"dspark.kind": "train-drafter"}) as t:
        run_id = t.run_id
        t.params(tracking.system_info())
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(run_id.encode())
    return run_id
