"""One Ray Train worker of distributed drafter training: streams its shard of the Parquet cache through
Ray Data and steps a DeepSpeed ZeRO engine with the same loss as the single-process loop
(`dspark.train.loss.drafter_loss`). The driver (`dspark.train.distributed.fit`) starts the workers.

Failure handling: DeepSpeed checkpoints (model, optimizer, scheduler, step, data position) are
reported through `ray.train.report` into RunConfig storage (object storage on a cluster); a restarted
worker group resumes from the latest one, skipping the micro-batches the epoch already consumed,
with anchors seeded by (seed, rank, step) — so step numbers continue without loss or repetition.
Metrics reach MLflow (rank 0) only once their checkpoint is committed, exactly once.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import deepspeed
import ray.train
import torch
import torch.distributed as dist
from ray.train import CheckpointConsistencyMode

from dspark import target as targets
from dspark import tracking
from dspark.cache.format import Manifest
from dspark.cache.read import decode_batch
from dspark.config import Config
from dspark.errors import UserError
from dspark.models import DrafterConfig, build_drafter, init_from_target, save_drafter, warm_start
from dspark.models.layers import FrozenTargetHead
from dspark.train.loop import autocast, lr_factor, make_optimizer
from dspark.train.loss import LossWeights, drafter_loss, summarize

CLIENT_STATE = "dspark_state.json"  # the data position and the not-yet-logged metrics, inside each checkpoint


@dataclass
class Position:
    """Where training is: saved in every checkpoint, so a restart continues exactly here."""

    epoch: int = 0
    micro_in_epoch: int = 0  # micro-batches of this epoch already consumed
    step: int = 0  # optimizer steps done
    pending: list[dict] = field(default_factory=list)  # metrics of the steps since the last commit


def ds_config(tc, world: int) -> dict:
    per_step = tc.micro_batch * world
    if tc.global_batch % per_step:
        raise UserError(
            f"train.global_batch={tc.global_batch} must be a multiple of train.micro_batch x "
            f"train.num_workers = {per_step}"
        )
    conf = {
        "train_micro_batch_size_per_gpu": tc.micro_batch,
        "gradient_accumulation_steps": tc.global_batch // per_step,
        "gradient_clipping": tc.grad_clip,
        "zero_optimization": {"stage": tc.zero_stage},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if tc.optimizer != "torch_adamw":  # DeepSpeed's own optimizers (fused on CUDA, CPU Adam with offload)
        conf["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": tc.lr, "betas": list(tc.adam_betas), "weight_decay": tc.weight_decay},
        }
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


def mask_id(cfg: Config) -> int:
    """The parallel drafters' block filler as the target is configured (target.mask_token, else the
    tokenizer's own or an unused special token); recorded in the drafter's config."""
    tok = targets.tokenizer_from_config(cfg.target)
    if tok.mask_token_id is None:
        raise UserError(
            f"the tokenizer of target {cfg.target.name_or_path} has no mask token; parallel drafters need one"
        )
    return tok.mask_token_id


def drafter_for(
    cfg: Config,
    layers: list[int],
    target: dict,
    device,
    draft_ids: list[int] | None = None,
    cache_law: dict | None = None,
):
    """A fresh drafter reading the target's tapped `layers` (`target`: the cache's name and weights hash
    of it), in float32 whatever the target's dtype (bf16 mixed precision is DeepSpeed's train.bf16);
    `draft_ids` its draft vocabulary (None: all V); `cache_law` the cache answers' sampling law it records."""
    tc = cfg.train
    embed, head = targets.head_weights(cfg.target.name_or_path, "float32", cfg.target.revision, cfg.target.cache_dir)
    hf = targets.hf_config(cfg.target.name_or_path, cfg.target.revision, cfg.target.cache_dir)
    dc = DrafterConfig.from_target(
        hf,
        tc.drafter,
        layers,
        mask_id(cfg),
        num_layers=tc.num_layers,
        gamma=tc.gamma,
        markov=tc.markov if tc.drafter == "dspark" else "none",
        markov_rank=tc.markov_rank,
        sample_from_anchor=tc.sample_from_anchor,
        draft_vocab=len(draft_ids) if draft_ids else 0,
        target=target,
        cache_law=cache_law or {},
    )
    drafter = build_drafter(dc, FrozenTargetHead(embed, head))
    if draft_ids:
        drafter.set_draft_vocab(torch.tensor(draft_ids))
    return drafter.to(device)


def _engine(cfg: Config, drafter, world: int, total: int):
    """DeepSpeed engine and LR schedule (linear warmup, cosine decay over `total` steps)."""
    tc = cfg.train
    conf = ds_config(tc, world)
    kwargs = {}
    if tc.optimizer == "torch_adamw":
        kwargs["optimizer"] = make_optimizer(drafter, tc)
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            kwargs["optimizer"], lambda s: lr_factor(s, total, tc.warmup_frac)
        )
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=drafter, config=conf, model_parameters=[p for p in drafter.parameters() if p.requires_grad], **kwargs
    )
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, tc.warmup_frac))
    return engine, scheduler


def _resume(engine) -> Position:
    """The latest committed checkpoint of this run (after a worker failure or a resubmitted job), if any."""
    ckpt = ray.train.get_checkpoint()
    if not ckpt:
        return Position()
    with ckpt.as_directory() as d:
        engine.load_checkpoint(d, tag="ckpt")
        return Position(**json.loads((Path(d) / CLIENT_STATE).read_text()))


def _micro_batches(shard, tc, pos: Position, manifest: Manifest, device):
    """This rank's micro-batches from the data position on, epoch after epoch: (batch, seconds waited
    for it). The caller counts pos.micro_in_epoch; an exhausted epoch starts the next one."""
    while True:
        it = iter(
            shard.iter_batches(
                batch_size=tc.micro_batch,
                batch_format="numpy",
                drop_last=True,
                local_shuffle_buffer_size=4 * tc.micro_batch,
                local_shuffle_seed=tc.seed + pos.epoch,
            )
        )
        for _ in range(pos.micro_in_epoch):  # resume mid-epoch: skip what was consumed
            next(it, None)
        while True:
            t0 = time.perf_counter()
            raw = next(it, None)
            if raw is None:
                break
            batch = {k: v.to(device) for k, v in decode_batch(raw, manifest).items()}
            yield batch, time.perf_counter() - t0
        pos.epoch += 1
        pos.micro_in_epoch = 0


def _micro_step(engine, batch: dict, tc, gen: torch.Generator, world: int) -> tuple[dict, bool]:
    """Forward + backward of one micro-batch: its summed statistics (weights "w", "loss") and whether
    it ended an optimizer step (DeepSpeed steps the optimizer on every gradient-accumulation-th call)."""
    # train.bf16 is autocast on every device: float32 weights, gradients and optimizer state. (DeepSpeed's
    # own bf16 mode keeps bf16 weights, which the cache's float32 features and the target's head do not meet)
    with autocast(tc, batch["input_ids"].device):
        loss_sum, w_sum, stats = drafter_loss(
            engine.module, batch, tc.gamma, tc.anchors_per_seq, LossWeights.from_config(tc), gen
        )
    w_all = w_sum.detach().clone()
    if world > 1:
        dist.all_reduce(w_all)
    # DeepSpeed averages over ranks and micro-steps: this gives Σ_ranks loss_sum / Σ_ranks weights
    engine.backward(loss_sum * world / w_all.clamp_min(1e-9))
    # asked before step(), which advances DeepSpeed's micro-step counter: afterwards the answer is the
    # next micro-batch's (with 2 micro-batches per step, steps were counted after micro-batches 1, 3, 5)
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    return {**stats, "w": w_sum, "loss": loss_sum.detach()}, boundary


def _reduce(acc: dict, world: int) -> dict:
    """The step's statistics summed over ranks, then normalised by the summed weights."""
    keys = sorted(acc)
    flat = torch.cat([torch.as_tensor(acc[k], dtype=torch.float64).reshape(-1).cpu() for k in keys])
    if world > 1:
        dist.all_reduce(flat)
    out, i = {}, 0
    for k in keys:
        n = torch.as_tensor(acc[k]).numel()
        out[k] = flat[i : i + n] if n > 1 or k.endswith("_k") else flat[i]
        i += n
    w = float(out.pop("w"))
    m = summarize(out, w)
    m["loss"] = float(out["loss"]) / w
    m["tokens"] = float(out["tokens"])
    return m


def _checkpoint(engine, pos: Position, metrics: dict, run: tracking.RunClient | None) -> None:
    """Report a checkpoint holding the position and the pending metrics; once it is committed, rank 0
    logs those metrics (a restart resumes from that checkpoint: no step is logged twice)."""
    with tempfile.TemporaryDirectory() as d:
        engine.save_checkpoint(d, tag="ckpt")
        (Path(d) / CLIENT_STATE).write_text(json.dumps(asdict(pos)))
        ray.train.report(
            {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            checkpoint=ray.train.Checkpoint.from_directory(d),
        )
    if run:
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
        run.log_new(pos.pending)
    pos.pending = []


def _export(engine, tc, rank: int, config: dict, run: tracking.RunClient | None) -> None:
    """Rank 0 writes the final drafter (HF-style folder) to out_uri; ZeRO-3 gathers the shards first."""
    params = list(engine.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if tc.zero_stage == 3 else nullcontext()
    with gathered:
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                save_drafter(engine.module, d)
                config["storage"].upload_dir(d, config["out_uri"])
                if run:
                    run.artifacts(d, "drafter")


def _say(line: str) -> None:
    """A line on the worker's stdout, once: Ray Train patches print() in its workers to log through the
    root logger and also echo to the redirected stdout, so printed lines reached the driver twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def progress(metrics: dict, total: int, eta_s: float) -> str:
    """Rank 0's line every train.log_every steps: step, loss, the expected tau of the step's drafts,
    tokens/s, the share of the step spent waiting for data, and the time left at this pace."""
    m, nan = metrics, float("nan")
    return (
        f"[train] step {m['step']}/{total} | loss {m.get('loss', nan):.4f} | expected tau "
        f"{m.get('expected_tau', nan):.3f} | {m['tokens_per_s']:.0f} tokens/s | data wait "
        f"{100 * m['data_wait_frac']:.0f}% | ETA {eta_s / 60:.1f} min"
    )


def train_loop_per_worker(config: dict) -> None:
    cfg = Config.model_validate_json(config["cfg"])
    tc, total = cfg.train, config["total_steps"]
    manifest = Manifest.from_json(config["manifest"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cuda = torch.cuda.is_available() and tc.gpus_per_worker > 0
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(tc.threads_per_worker)
    torch.manual_seed(tc.seed)
    _no_cpu_shm_build()

    drafter = drafter_for(cfg, manifest.layers, manifest.target, device, config.get("draft_ids"), manifest.law)
    init_from_target(cfg, drafter)
    warm_start(cfg, drafter)  # weights only: a fresh optimizer, scheduler and step count
    engine, scheduler = _engine(cfg, drafter, world, total)
    pos = _resume(engine)
    if rank == 0 and pos.step:
        _say(
            f"[train] resumed from the checkpoint of step {pos.step} (epoch {pos.epoch}, "
            f"micro-batch {pos.micro_in_epoch})"
        )
    if rank == 0 and tc.bf16:
        native = targets.native_bf16(str(device))
        _say(f"[train] train.bf16: {'bfloat16 autocast' if native else 'float32 (no native bf16 here)'} on {device}")
    run = tracking.RunClient(cfg, config["mlflow_run_id"]) if rank == 0 and config["mlflow_run_id"] else None
    if run and pos.step == 0:
        run.params({**cfg.flat(), "world_size": world, "total_steps": total, "cache.rows": manifest.rows})
    if run:  # a crash between commit and MLflow write: the checkpoint still holds those steps
        run.log_new(pos.pending)
    pos.pending = []

    gas = engine.gradient_accumulation_steps()
    acc, wait, t_step = None, 0.0, time.perf_counter()
    t_start, start_step = t_step, pos.step  # this attempt's pace gives the ETA
    batches = _micro_batches(ray.train.get_dataset_shard("train"), tc, pos, manifest, device)
    while pos.step < total:
        batch, waited = next(batches)
        wait += waited
        # anchors seeded by (seed, rank, step, micro-step): a resumed run draws what it would have
        gen = torch.Generator().manual_seed(
            tc.seed * 1_000_003 + rank * 10_007 + pos.step * gas + pos.micro_in_epoch % gas
        )
        stats, boundary = _micro_step(engine, batch, tc, gen, world)
        pos.micro_in_epoch += 1
        acc = stats if acc is None else {k: acc[k] + v for k, v in stats.items()}
        if not boundary:
            continue
        pos.step += 1
        metrics, dt = _reduce(acc, world), time.perf_counter() - t_step
        metrics.update(
            {
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                "tokens_per_s": metrics.pop("tokens") / dt,
                "data_wait_frac": wait / dt,
                "step_s": dt,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "step": pos.step,
                "epoch": pos.epoch,
            }
        )
        acc, wait, t_step = None, 0.0, time.perf_counter()
        pos.pending.append(metrics)
        if rank == 0 and (pos.step % tc.log_every == 0 or pos.step == total):
            pace = (time.perf_counter() - t_start) / (pos.step - start_step)
            _say(progress(metrics, total, pace * (total - pos.step)))
        if pos.step % tc.checkpoint_every == 0 or pos.step == total:
            _checkpoint(engine, pos, metrics, run)
    _export(engine, tc, rank, config, run)
