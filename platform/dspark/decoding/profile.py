"""Profiling a round's cost on its device, saved as a scheduling.sps.SPSTable (the scheduler's cost
curves): SPS(B), the target's steps per second at a total batch of B new tokens, t_d(R), the seconds of
one drafting round for R requests, and the forward of R requests with gamma + 1 tokens each that prices
their verification (t_v). It lives next to the decoder it times, so that scheduling stays a pure leaf."""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from dspark.decoding.runner import TargetRunner
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.models.drafter import DraftState
from dspark.scheduling.sps import SPSTable


def hardware_info(device) -> dict:
    info = {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def profile(
    target_model,
    batches: list[int],
    context: int = 256,
    repeats: int = 5,
    warmup: int = 2,
    max_requests: int = 64,
    drafter=None,
    gamma: int = 0,
) -> SPSTable:
    """Measure verification steps/s for total batch B tokens, spread over min(B, max_requests) requests
    that each already hold `context` tokens of KV cache (the median of `repeats` timed steps); with a
    drafter, also its drafting round at each R = B <= max_requests (`draft_time`) and the verification of
    gamma + 1 tokens for each of those R requests (`SPSTable.verify_time`)."""
    out = []
    for B in batches:
        R = min(B, max_requests)
        out.append(
            forward_time(target_model, [B // R + (1 if r < B % R else 0) for r in range(R)], context, repeats, warmup)
        )
    table = SPSTable(
        list(batches), (1.0 / envelope(out)).tolist(), hardware_info(next(target_model.parameters()).device)
    )
    if drafter is not None:
        add_draft_times(
            table, target_model, drafter, [R for R in batches if R <= max_requests], gamma, context, repeats, warmup
        )
    return table


def forward_time(target_model, per: list[int], context: int = 256, repeats: int = 5, warmup: int = 2) -> float:
    """Seconds of one target forward of len(per) requests with per[r] new tokens each, every request
    already holding `context` tokens of KV cache: the median of `repeats` timed forwards."""
    vocab = target_model.config.vocab_size
    runner = TargetRunner(target_model, [], max_slots=len(per), capacity=context + max(per) + 1)
    slots = [runner.alloc() for _ in per]
    runner.forward(slots, [torch.randint(0, vocab, (context,)) for _ in slots], last_only=True)
    cuda = str(runner.device).startswith("cuda")
    times = []
    for i in range(warmup + repeats):
        toks = [torch.randint(0, vocab, (n,)) for n in per]
        if cuda:
            torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        runner.forward(slots, toks)
        if cuda:
            torch.cuda.synchronize(runner.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        for s in slots:
            runner.truncate(s, context)
    return float(np.median(times))


def add_draft_times(
    table: SPSTable,
    target_model,
    drafter,
    requests: list[int],
    gamma: int,
    context: int = 256,
    repeats: int = 5,
    warmup: int = 2,
) -> None:
    """Fill the table's t_d(R) at each R of `requests` (increasing), the verification of gamma + 1 tokens for
    each of R requests there, and its catch-up cost t_e."""
    table.draft_batch = list(requests)
    table.draft_s = envelope(
        [draft_time(target_model, drafter, R, gamma, context, repeats, warmup) for R in requests]
    ).tolist()
    if gamma:
        table.verify_tokens = gamma + 1
        table.verify_s = envelope(
            [forward_time(target_model, [gamma + 1] * R, context, repeats, warmup) for R in requests]
        ).tolist()
    table.extend_s = extend_time(target_model, drafter, context, repeats, warmup)


def envelope(seconds: list[float]) -> np.ndarray:
    """Times measured at increasing sizes, each cut to the least time measured at any larger size: a
    step over fewer tokens (requests) never costs more than over more, it could be padded to them; a
    spell of noise at one size (another process on the cores) must not make verifying more look free."""
    return np.minimum.accumulate(np.asarray(seconds, dtype=np.float64)[::-1])[::-1]


def extend_time(target_model, drafter, context: int = 256, repeats: int = 5, warmup: int = 2) -> float:
    """t_e: seconds per position of the drafter reading `context` positions of one request's context at
    once (what it does before drafting for a new request, or after rounds it skipped); the median of
    `repeats` reads into fresh caches."""
    dec = SpeculativeDecoder(target_model, drafter, 1, max_slots=1, capacity=context + 2)
    req = Request(torch.randint(0, target_model.config.vocab_size, (context,)).tolist(), SamplingParams(1.0), 2)
    dec.add_many([req])  # the target's features of the prompt, as the drafter would read them
    features, tokens = req.pending_context()
    times = []
    for i in range(warmup + repeats):
        state = DraftState()
        t0 = time.perf_counter()
        drafter.extend([state], [features], [tokens])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        drafter.release(state)
    dec.cancel(req)
    return float(np.median(times)) / context


def draft_time(
    target_model, drafter, R: int, gamma: int, context: int = 256, repeats: int = 5, warmup: int = 2
) -> float:
    """Seconds of one drafting round (gamma drafts sampled at T=1, the policy included) for R requests
    that each hold `context` tokens: the median of `repeats` rounds of the decoder itself."""
    vocab = target_model.config.vocab_size
    new = (warmup + repeats) * (gamma + 1) + 1  # every round commits at most gamma + 1 tokens
    dec = SpeculativeDecoder(target_model, drafter, gamma, max_slots=R, capacity=context + new + 1)
    reqs = [Request(torch.randint(0, vocab, (context,)).tolist(), SamplingParams(1.0), new, seed=r) for r in range(R)]
    dec.add_many(reqs)
    times = []
    for i in range(warmup + repeats):
        before = sum(r.draft_s for r in reqs)  # the decoder books each round's drafting time over its requests
        dec.step()
        if i >= warmup:
            times.append(sum(r.draft_s for r in reqs) - before)
    for r in list(dec.active):
        dec.cancel(r)
    return float(np.median(times))
