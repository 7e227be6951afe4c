"""Verification-length policies: pure functions over arrays.

Notation (paper §3.2.2): R requests, conditional confidences c_{r,j}, prefix survival
a_{r,j} = prod_{i<=j} c_{r,i}, lengths l_r in 0..gamma, verification batch B = sum_r (1 + l_r),
expected accepted tokens tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), throughput Theta = tau * SPS(B).

- `greedy_prefix` (Algorithm 1): admit candidates (r, j) in descending a_{r,j} (ties: smaller j,
  then smaller r) while Theta strictly improves; STOP at the first candidate that does not. The early
  stop is what keeps it lossless: the decision to admit x_{r,k} never looks at a_{r,k+1}, which
  depends on x_{r,k} itself (Appendix A shows the bias without it).
- `async_global`: the production variant (§5.2). Capacity K comes from an unconstrained search over
  the whole admission path on confidences from two steps earlier (they cannot depend on the current
  tokens); the current step admits the top-K candidates by fresh survival.
- Baselines: no speculation, static length, static threshold on survival.

`make_policy` turns a policy name into the callable the decoder runs each round; it is the one
name -> function table (the engine, the jobs and the benches all use it).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import numpy as np

from dspark.scheduling.sps import SPSTable


def survival(conf: np.ndarray) -> np.ndarray:
    """(R, gamma) conditional confidences -> prefix survival a_{r,j}."""
    return np.cumprod(np.asarray(conf, dtype=np.float64), axis=1)


def _order(a: np.ndarray) -> np.ndarray:
    """Candidate (r, j) indices sorted by a descending, ties by smaller j then smaller r (deterministic)."""
    R, G = a.shape
    r, j = np.meshgrid(np.arange(R), np.arange(G), indexing="ij")
    keys = np.lexsort((r.ravel(), j.ravel(), -a.ravel()))
    return np.stack([r.ravel()[keys], j.ravel()[keys]], 1)


def throughput(a: np.ndarray, lengths, sps: SPSTable) -> float:
    a = np.asarray(a, dtype=np.float64)
    lengths = np.asarray(lengths)
    tau = len(lengths) + sum(a[r, :l].sum() for r, l in enumerate(lengths))
    return float(tau * sps(int(len(lengths) + lengths.sum())))


def greedy_prefix(a: np.ndarray, sps: SPSTable, early_stop: bool = True) -> np.ndarray:
    """Algorithm 1. a: (R, gamma) prefix survival. Returns l (R,).

    early_stop=False is the retrospective global search: NOT lossless (kept for the bias test)."""
    a = np.asarray(a, dtype=np.float64)
    R = a.shape[0]
    lengths = np.zeros(R, dtype=np.int64)
    best_lengths = lengths.copy()
    B, tau = R, float(R)
    best = tau * sps(B)
    for r, j in _order(a):
        if a[r, j] <= 0:
            break
        lengths[r] = j + 1
        B += 1
        tau += a[r, j]
        theta = tau * sps(B)
        if theta > best:
            best, best_lengths = theta, lengths.copy()
        elif early_stop:
            break
    return best_lengths


def capacity(a_stale: np.ndarray, sps: SPSTable) -> int:
    """K = number of draft tokens the unconstrained search over the admission path would verify."""
    return int(greedy_prefix(a_stale, sps, early_stop=False).sum())


def admit_top_k(a: np.ndarray, k: int) -> np.ndarray:
    """Admit the K best candidates by current survival; a prefix per request because a is
    non-increasing along j and ties go to the smaller j."""
    a = np.asarray(a, dtype=np.float64)
    lengths = np.zeros(a.shape[0], dtype=np.int64)
    for r, j in _order(a)[:k]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths


def async_global(a_fresh: np.ndarray, a_stale: np.ndarray, sps: SPSTable) -> np.ndarray:
    """Production variant: capacity from two-step-old confidences, admission by fresh ones."""
    return admit_top_k(a_fresh, capacity(a_stale, sps))


def no_speculation(R: int) -> np.ndarray:
    return np.zeros(R, dtype=np.int64)


def static_length(R: int, length: int) -> np.ndarray:
    return np.full(R, length, dtype=np.int64)


def static_threshold(a: np.ndarray, threshold: float) -> np.ndarray:
    """Verify each request's drafts while the prefix survival stays >= threshold (paper Fig. 5)."""
    return (np.asarray(a) >= threshold).cumprod(axis=1).sum(axis=1).astype(np.int64)


POLICIES = ("none", "static", "threshold", "greedy", "async")

# policy(survival: (R, gamma) calibrated prefix survival or None, R, gamma) -> lengths l_r (R,)
Policy = Callable[[Optional[np.ndarray], int, int], list[int]]


class AsyncGlobal:
    """The async variant with its state: the survival matrices of the previous rounds.

    Until two earlier rounds exist (a fresh engine) there is no stale capacity to use, and a global
    search over the CURRENT confidences is exactly the retrospective search that Appendix A shows to
    be biased; those rounds run Algorithm 1 with its early stop instead."""

    def __init__(self, sps: SPSTable):
        self.sps = sps
        self.history: deque = deque(maxlen=2)  # survival of the two previous rounds, oldest first

    def __call__(self, a: np.ndarray) -> np.ndarray:
        if len(self.history) < 2:
            lengths = greedy_prefix(a, self.sps)
        else:
            lengths = async_global(a, self.history[0], self.sps)
        self.history.append(a)
        return lengths


def make_policy(name: str, sps: SPSTable, static_len: int = 4, threshold: float = 0.5) -> Policy:
    """The decoder's per-round policy. Drafters without a confidence head (DFlash, EAGLE-3) get the
    static length under every confidence-based policy."""
    if name not in POLICIES:
        raise ValueError(f"policy: {name!r} not in {POLICIES}")
    stateful = AsyncGlobal(sps) if name == "async" else None

    def policy(surv, R, gamma):
        if name == "none":
            return [0] * R
        if name == "static" or surv is None:
            return [min(static_len, gamma)] * R
        a = np.asarray(surv, dtype=np.float64)
        if name == "threshold":
            return static_threshold(a, threshold).tolist()
        if name == "greedy":
            return greedy_prefix(a, sps).tolist()
        return stateful(a).tolist()

    return policy
