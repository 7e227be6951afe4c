"""Lossless verification (speculative sampling, Leviathan et al. / Chen et al.).

For one request with drafts x_1..x_l drawn from q_1..q_l, and target distributions p_1..p_{l+1}
from ONE target forward over [x_0, x_1..x_l]:

    for k = 1..l:
        accept x_k with probability min(1, p_k(x_k) / q_k(x_k))
        on the first rejection: emit y ~ norm(max(0, p_k - q_k)) and stop
    if all l were accepted: emit the bonus y ~ p_{l+1}

Every emitted token is distributed exactly as the target's p, whatever q is, and l may be chosen
per request (the scheduler) as long as the choice does not look at x_k itself before admitting it.
Greedy is the one-hot case: accept iff x_k == argmax p_k, and y = argmax of the first mismatch.
"""
from __future__ import annotations

import torch

from dspark.decoding.sampling import SamplingParams, draw, probs


def verify_one(drafts: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor, sp: SamplingParams,
               generator: torch.Generator | None) -> tuple[int, int]:
    """drafts (l,), q (l, V), target_logits (l+1, V) -> (n accepted, the emitted next token)."""
    p = probs(target_logits, sp)  # (l+1, V)
    l = drafts.shape[0]
    for k in range(l):
        x = int(drafts[k])
        px, qx = float(p[k, x]), float(q[k, x])
        u = torch.rand((), generator=generator).item()
        if u * qx < px:  # accept with probability min(1, px / qx)
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        if residual.sum() <= 0:  # only reachable through rounding when p == q
            residual = p[k]
        return k, int(draw((residual / residual.sum()).cpu()[None], generator)[0])
    return l, int(draw(p[l].cpu()[None], generator)[0]) if not sp.greedy else int(p[l].argmax())


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy fast path: no randomness; n = matching prefix length, next = the target's argmax there."""
    best = target_logits.argmax(-1)  # (l+1,)
    l = drafts.shape[0]
    miss = (drafts != best[:l]).nonzero()
    n = int(miss[0]) if len(miss) else l
    return n, int(best[n])
