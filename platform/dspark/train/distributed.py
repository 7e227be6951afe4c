"""Distributed drafter training: Ray Train (TorchTrainer, V2 API) workers, each streaming its shard of
the Parquet cache through Ray Data, stepping a DeepSpeed ZeRO engine with the same loss as the
single-process loop (`dspark.train.loss.drafter_loss`).

Failure handling: DeepSpeed checkpoints (model, optimizer, scheduler, step, data position) are
reported through `ray.train.report` into RunConfig storage (object storage on a cluster); a restarted
worker group resumes from the latest one, skipping the micro-batches the epoch already consumed,
with anchors seeded by (seed, rank, step) — so step numbers continue without loss or repetition.
Rerunning the job with the same run name resumes the same way; `train.warm_start` loads weights only.
"""
from __future__ import annotations

import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from dspark.config import Config
from dspark.errors import UserError

CLIENT_STATE = "dspark_state.json"


def ds_config(tc, world: int, cuda: bool) -> dict:
    per_step = tc.micro_batch * world
    if tc.global_batch % per_step:
        raise UserError(f"train.global_batch={tc.global_batch} must be a multiple of train.micro_batch x "
                        f"train.num_workers = {per_step}")
    conf = {
        "train_micro_batch_size_per_gpu": tc.micro_batch,
        "gradient_accumulation_steps": tc.global_batch // per_step,
        "gradient_clipping": tc.grad_clip,
        "zero_optimization": {"stage": tc.zero_stage},
        "bf16": {"enabled": bool(tc.bf16 and cuda)},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if tc.optimizer != "torch_adamw":  # DeepSpeed's own optimizers (fused on CUDA, CPU Adam with offload)
        conf["optimizer"] = {"type": "AdamW", "params": {"lr": tc.lr, "betas": [0.9, 0.95], "weight_decay": tc.weight_decay}}
        if tc.optimizer == "deepspeed_cpu_adam":
            conf["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return conf


def _no_cpu_shm_build() -> None:
    """DeepSpeed's CPU backend JIT-builds a shared-memory comm op (minutes, 1.5 GB) at init; gloo
    collectives work without it, so mark it unavailable."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__ as ops

    if get_accelerator().device_name() == "cpu":
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            ops[builder.NAME] = False


def _drafter_for(cfg: Config, manifest, device):
    from dspark import target as targets
    from dspark.models import DrafterConfig, build_drafter
    from dspark.models.layers import FrozenTargetHead

    tc = cfg.train
    # the drafter trains in float32 whatever the target's dtype (bf16 mixed precision is DeepSpeed's train.bf16)
    embed, head = targets.head_weights(cfg.target.name_or_path, "float32", cfg.target.revision, cfg.target.cache_dir)
    hf = targets.hf_config(cfg.target.name_or_path, cfg.target.revision, cfg.target.cache_dir)
    dc = DrafterConfig.from_target(hf, tc.drafter, manifest.layers, _mask_id(cfg), num_layers=tc.num_layers,
                                   gamma=tc.gamma, markov=tc.markov if tc.drafter == "dspark" else "none",
                                   markov_rank=tc.markov_rank, target=manifest.target)
    return build_drafter(dc, FrozenTargetHead(embed, head)).to(device)


def _mask_id(cfg: Config) -> int:
    """The parallel drafters' block filler as the target is configured (target.mask_token, else the
    tokenizer's own or an unused special token); recorded in the drafter's config."""
    from dspark import target as targets

    tok = targets.tokenizer_from_config(cfg.target)
    if tok.mask_token_id is None:
        raise UserError(f"the tokenizer of target {cfg.target.name_or_path} has no mask token; parallel drafters need one")
    return tok.mask_token_id


def train_loop_per_worker(config: dict) -> None:
    import deepspeed
    import ray.train
    import torch.distributed as dist
    from ray.train import CheckpointConsistencyMode

    from dspark.cache.read import decode_batch
    from dspark.cache.format import Manifest
    from dspark.train.loop import lr_factor, make_optimizer
    from dspark.train.loss import LossWeights, drafter_loss

    cfg = Config.model_validate_json(config["cfg"])
    tc = cfg.train
    manifest = Manifest.from_json(config["manifest"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cuda = torch.cuda.is_available() and tc.gpus_per_worker > 0
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(tc.threads_per_worker)
    torch.manual_seed(tc.seed)
    _no_cpu_shm_build()

    drafter = _drafter_for(cfg, manifest, device)
    if tc.warm_start:  # weights only: a fresh optimizer, scheduler and step count
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as d:
            local = config["storage"].download_dir(tc.warm_start, d)
            drafter.load_state_dict(load_file(str(local / "model.safetensors")))
    total = config["total_steps"]
    conf = ds_config(tc, world, cuda)
    kwargs = {}
    if tc.optimizer == "torch_adamw":
        kwargs["optimizer"] = make_optimizer(drafter, tc.lr, tc.weight_decay)
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(kwargs["optimizer"],
                                                                   lambda s: lr_factor(s, total, tc.warmup_frac))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=drafter, config=conf,
                                                           model_parameters=[p for p in drafter.parameters() if p.requires_grad],
                                                           **kwargs)
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, tc.warmup_frac))
    # "pending": the metrics of the steps since the previous checkpoint, saved inside each checkpoint
    state = {"epoch": 0, "micro_in_epoch": 0, "step": 0, "pending": []}
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            engine.load_checkpoint(d, tag="ckpt")
            state = json.loads((Path(d) / CLIENT_STATE).read_text())
        if rank == 0:
            print(f"[train] resumed from the checkpoint of step {state['step']} (epoch {state['epoch']}, "
                  f"micro-batch {state['micro_in_epoch']})", flush=True)
    tracker = _RankZeroTracker(cfg, config["mlflow_run_id"]) if rank == 0 else None
    if tracker and state["step"] == 0:
        tracker.log_params(cfg.flat(), {"world_size": world, "total_steps": total, "cache.rows": manifest.rows})
    if tracker:  # a crash between commit and MLflow write: the checkpoint still holds those steps
        tracker.log_new(state.get("pending", []))
    state["pending"] = []

    gas = conf["gradient_accumulation_steps"]
    shard = ray.train.get_dataset_shard("train")
    acc = None
    t_step, wait = time.perf_counter(), 0.0
    while state["step"] < total:
        it = iter(shard.iter_batches(batch_size=tc.micro_batch, batch_format="numpy", drop_last=True,
                                     local_shuffle_buffer_size=4 * tc.micro_batch,
                                     local_shuffle_seed=tc.seed + state["epoch"]))
        for _ in range(state["micro_in_epoch"]):  # resume mid-epoch: skip what was consumed
            next(it, None)
        while state["step"] < total:
            t0 = time.perf_counter()
            raw = next(it, None)
            if raw is None:
                break
            batch = {k: v.to(device) for k, v in decode_batch(raw, manifest).items()}
            wait += time.perf_counter() - t0
            gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + rank * 10_007 + state["step"] * gas
                                                + state["micro_in_epoch"] % gas)
            loss_sum, w_sum, stats = drafter_loss(engine.module, batch, tc.gamma, tc.anchors_per_seq,
                                                  LossWeights.from_config(tc), gen)
            w_all = w_sum.detach().clone()
            if world > 1:
                dist.all_reduce(w_all)
            # DeepSpeed averages over ranks and micro-steps: this gives Σ_ranks loss_sum / Σ_ranks weights
            engine.backward(loss_sum * world / w_all.clamp_min(1e-9))
            engine.step()
            state["micro_in_epoch"] += 1
            stats = {**stats, "w": w_sum, "loss": loss_sum.detach()}
            acc = stats if acc is None else {k: acc[k] + v for k, v in stats.items()}
            if not engine.is_gradient_accumulation_boundary():
                continue
            state["step"] += 1
            metrics = _reduce(acc, world, dist)
            dt = time.perf_counter() - t_step
            metrics.update({"lr": scheduler.get_last_lr()[0], "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                            "tokens_per_s": metrics.pop("tokens") / dt, "data_wait_frac": wait / dt, "step_s": dt,
                            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                            "step": state["step"], "epoch": state["epoch"]})
            acc, wait, t_step = None, 0.0, time.perf_counter()
            state["pending"].append(metrics)
            if state["step"] % tc.checkpoint_every == 0 or state["step"] == total:
                _report_with_checkpoint(engine, state, metrics)
                if tracker:
                    # Steps reach MLflow only once their checkpoint is committed (a restart resumes
                    # from it: no step is logged twice) and exactly once (log_new skips logged steps).
                    ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
                    tracker.log_new(state["pending"])
                state["pending"] = []
        if state["step"] < total:
            state["epoch"] += 1
            state["micro_in_epoch"] = 0
    _export(engine, tc, rank, config)


def _reduce(acc: dict, world: int, dist) -> dict:
    from dspark.train.loss import summarize

    keys = sorted(acc)
    flat = torch.cat([torch.as_tensor(acc[k], dtype=torch.float64).reshape(-1).cpu() for k in keys])
    if world > 1:
        dist.all_reduce(flat)
    out, i = {}, 0
    for k in keys:
        n = torch.as_tensor(acc[k]).numel()
        out[k] = flat[i:i + n] if n > 1 or k.endswith("_k") else flat[i]
        i += n
    w = float(out.pop("w"))
    m = summarize(out, w)
    m["loss"] = float(out["loss"]) / w
    m["tokens"] = float(out["tokens"])
    return m


def _report_with_checkpoint(engine, state: dict, metrics: dict) -> None:
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        engine.save_checkpoint(d, tag="ckpt")
        (Path(d) / CLIENT_STATE).write_text(json.dumps(state))
        ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                         checkpoint=ray.train.Checkpoint.from_directory(d))


def _export(engine, tc, rank: int, config: dict) -> None:
    """Rank 0 writes the final drafter (HF-style folder) to out_uri; ZeRO-3 gathers the shards first."""
    import deepspeed

    from dspark.models import save_drafter

    module = engine.module
    params = list(module.parameters())
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if tc.zero_stage == 3 else _nullctx()
    with ctx:
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                save_drafter(module, d)
                config["storage"].upload_dir(d, config["out_uri"])
                if config.get("mlflow_run_id"):
                    _RankZeroTracker.artifacts(config["cfg"], config["mlflow_run_id"], d)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _RankZeroTracker:
    """MLflow from rank 0 only, into the run the driver created (one run id across restarts)."""

    def __init__(self, cfg: Config, run_id: str | None):
        self.run_id = run_id
        self.client = None
        if run_id:
            import mlflow

            self.client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
        self.logged_step: int | None = None  # the last step MLflow has (read once, on the first write)

    def log_params(self, params: dict, extra: dict) -> None:
        from mlflow.entities import Param

        if self.client:
            items = [Param(k, str(v)[:500]) for k, v in {**params, **extra}.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_new(self, metrics: list[dict]) -> None:
        """Log the steps MLflow does not have yet (each dict carries its "step")."""
        from mlflow.entities import Metric

        if not self.client or not metrics:
            return
        if self.logged_step is None:  # a (re)started worker: what did earlier attempts log?
            self.logged_step = max((m.step for m in self.client.get_metric_history(self.run_id, "train.loss")), default=0)
        now = int(time.time() * 1000)
        batch = [Metric(f"train.{k}", float(v), now, int(m["step"])) for m in metrics if m["step"] > self.logged_step
                 for k, v in m.items()]
        for i in range(0, len(batch), 900):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 900])
        self.logged_step = max(self.logged_step, max(int(m["step"]) for m in metrics))

    @staticmethod
    def artifacts(cfg_json: str, run_id: str, local_dir: str) -> None:
        import mlflow

        cfg = Config.model_validate_json(cfg_json)
        mlflow.MlflowClient(cfg.mlflow.tracking_uri).log_artifacts(run_id, local_dir, "drafter")


def total_steps(cfg: Config, rows: int) -> int:
    tc = cfg.train
    per_epoch = max(1, (rows // max(1, tc.num_workers)) // tc.micro_batch * tc.micro_batch * tc.num_workers // tc.global_batch)
    return tc.max_steps or per_epoch * tc.epochs


def run_name(cfg: Config) -> str:
    return cfg.train.run_name or f"{cfg.train.drafter}-{time.strftime('%Y%m%d-%H%M%S')}"


def fit(cfg: Config, log=print, in_memory: bool = False) -> dict:
    """Driver side: resolve the cache, create/resume the MLflow run, run the TorchTrainer.
    in_memory materialises the dataset first (a baseline for the data-wait fraction of streaming)."""
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dspark.cache.build import cache_uri
    from dspark.cache.read import check_shards, dataset, open_cache
    from dspark.cluster import quiet_ray_data
    from dspark.storage import Storage

    tc = cfg.train
    storage = Storage.from_config(cfg.storage)
    cache = open_cache(cache_uri(cfg), storage)
    shards = check_shards(cache, skip_bad=cfg.cache.skip_bad_shards)
    rows = sum(s.rows for s in shards)
    name = run_name(cfg)
    runs_uri = Storage.join(cfg.storage.root, "runs")
    out_uri = tc.out_uri or Storage.join(cfg.storage.root, "drafters", name)
    steps = total_steps(cfg, rows)
    quiet_ray_data()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the same order after a restart: exact data position
    ds = dataset(cache, shards)
    if in_memory:
        ds = ds.materialize()
    run_id = _mlflow_run(cfg, storage, runs_uri, name)
    fs, path = _run_storage(storage, runs_uri)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.model_dump_json(), "manifest": cache.manifest.to_json(), "total_steps": steps,
                           "mlflow_run_id": run_id, "out_uri": out_uri, "storage": storage},
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.gpus_per_worker > 0,
                                     resources_per_worker={"CPU": tc.cpus_per_worker,
                                                           **({"GPU": tc.gpus_per_worker} if tc.gpus_per_worker else {})}),
        run_config=RunConfig(name=name, storage_path=path, storage_filesystem=fs,
                             failure_config=FailureConfig(max_failures=tc.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints)),
        datasets={"train": ds},
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    log(f"[train] {name}: {tc.drafter} x{tc.num_layers} layers, {tc.num_workers} workers, ZeRO-{tc.zero_stage}, "
        f"{steps} steps of {tc.global_batch} sequences from {cache.uri} ({rows} rows); checkpoints in {runs_uri}/{name}")
    result = trainer.fit()
    return {"name": name, "run_id": run_id, "out_uri": out_uri, "steps": steps, "metrics": result.metrics,
            "checkpoint": str(result.checkpoint.path) if result.checkpoint else None}


def _run_storage(storage, runs_uri: str):
    """RunConfig storage: a local path, or S3 through s3fs (its retry settings survive pickling,
    unlike pyarrow's S3FileSystem retry strategy)."""
    import pyarrow.fs as pafs

    from dspark.storage import Storage

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
    from dspark import tracking
    from dspark.storage import Storage

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
