"""Profiling the target on its device: SPS(B), the verification steps per second at a total batch of B
new tokens (the scheduler's cost curve, saved as a scheduling.sps.SPSTable). It lives next to the runner
it times, so that scheduling stays a pure leaf."""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from dspark.decoding.runner import TargetRunner
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
    target_model, batches: list[int], context: int = 256, repeats: int = 5, warmup: int = 2, max_requests: int = 64
) -> SPSTable:
    """Measure verification steps/s for total batch B tokens, spread over min(B, max_requests) requests
    that each already hold `context` tokens of KV cache (the median of `repeats` timed steps)."""
    vocab = target_model.config.vocab_size
    out = []
    for B in batches:
        R = min(B, max_requests)
        per = [B // R + (1 if r < B % R else 0) for r in range(R)]
        runner = TargetRunner(target_model, [], max_slots=R, capacity=context + max(per) + 1)
        slots = [runner.alloc() for _ in range(R)]
        runner.forward(slots, [torch.randint(0, vocab, (context,)) for _ in slots])
        times = []
        for i in range(warmup + repeats):
            toks = [torch.randint(0, vocab, (n,)) for n in per]
            if str(runner.device).startswith("cuda"):
                torch.cuda.synchronize(runner.device)
            t0 = time.perf_counter()
            runner.forward(slots, toks)
            if str(runner.device).startswith("cuda"):
                torch.cuda.synchronize(runner.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            for s in slots:
                runner.truncate(s, context)
        out.append(1.0 / float(np.median(times)))
    return SPSTable(list(batches), out, hardware_info(next(target_model.parameters()).device))
