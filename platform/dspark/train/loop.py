"""Single-process drafter training: used directly by tests and the offline evaluation, and by the
distributed trainer through `drafter_loss` and `lr_factor` (the same step, inside DeepSpeed).

One optimizer step accumulates micro-batches up to the global batch and normalises the summed slot
losses by the summed slot weights, so the result does not depend on how the batch was split."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator

import torch

from dspark.cache.format import ShardStats
from dspark.cache.read import Cache, token_counts
from dspark.models.drafter import select_draft_vocab
from dspark.target import native_bf16
from dspark.train.loss import LossWeights, drafter_loss, summarize


def draft_vocabulary(cache: Cache, shards: list[ShardStats], size: int) -> tuple[torch.Tensor, float]:
    """train.draft_vocab's ids: the `size` most frequent response tokens of `shards` (ties: the lower id),
    and the share of the shards' response tokens they cover."""
    counts = token_counts(cache, shards, int(cache.manifest.target["vocab_size"]))
    ids = select_draft_vocab(counts, size)
    return ids, float(counts[ids].sum()) / max(int(counts.sum()), 1)


def lr_factor(step: int, total: int, warmup_frac: float) -> float:
    """Linear warmup over warmup_frac of the steps, then cosine to zero."""
    warm = max(1, int(round(warmup_frac * total)))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def autocast(tc, device: torch.device | str = "cpu"):
    """train.bf16 as a context for the loss's forward: bfloat16 autocast where `device` multiplies bf16
    natively (weights, gradients and optimizer stay float32), else nothing (float32)."""
    device = torch.device(device)
    if not (tc.bf16 and native_bf16(str(device))):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def make_optimizer(drafter, tc) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters with train.lr, train.adam_betas and train.weight_decay."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)


def fit(
    drafter,
    batches: Callable[[], Iterator[dict]],
    tc,
    steps: int,
    log: Callable[[int, dict], None] | None = None,
    seed: int | None = None,
) -> list[dict]:
    """Train for `steps` optimizer steps. `batches()` yields micro-batches of decoded cache rows and
    is called again at the end of each epoch. `tc` is a TrainConfig. Returns per-step metrics."""
    torch.manual_seed(tc.seed if seed is None else seed)
    gen = torch.Generator().manual_seed(tc.seed if seed is None else seed)
    opt = make_optimizer(drafter, tc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, tc.warmup_frac))
    accum = max(1, tc.global_batch // tc.micro_batch)
    lw = LossWeights.from_config(tc)
    drafter.train()
    history: list[dict] = []
    it = batches()
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total_w, stats_sum, loss_total, tokens = 0.0, None, 0.0, 0
        for _ in range(accum):
            batch = next(it, None)
            if batch is None:
                it = batches()
                batch = next(it)
            with autocast(tc, batch["input_ids"].device):
                loss_sum, w_sum, stats = drafter_loss(drafter, batch, tc.gamma, tc.anchors_per_seq, lw, gen)
            loss_sum.backward()
            total_w += float(w_sum)
            loss_total += float(loss_sum.detach())
            tokens += int(stats["tokens"])
            stats_sum = stats if stats_sum is None else {k: stats_sum[k] + v for k, v in stats.items()}
        for p in drafter.parameters():  # normalise by the global slot-weight total
            if p.grad is not None:
                p.grad /= max(total_w, 1e-9)
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        opt.step()
        sched.step()
        m = {
            "loss": loss_total / max(total_w, 1e-9),
            "grad_norm": float(gnorm),
            "lr": sched.get_last_lr()[0],
            "tokens_per_s": tokens / (time.perf_counter() - t0),
            **summarize(stats_sum, max(total_w, 1e-9)),
        }
        history.append(m)
        if log:
            log(step, m)
    drafter.eval()
    return history
