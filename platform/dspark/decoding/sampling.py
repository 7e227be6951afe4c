"""Sampling parameters and the token distribution they define, shared by target and drafter.

The distribution the target is asked to reproduce is  p = filter_top_p(filter_top_k(softmax(z / T))).
Greedy (T = 0) is represented as the one-hot argmax distribution, so greedy requests go through the
same exact verification rule as sampled ones (accept iff the draft equals the target's argmax)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature: must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p: must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise UserError(f"top_k: must be >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> the processed distribution (..., V) in float32."""
    z = logits.float()
    if sp.greedy:
        return torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).float()
    z = z / sp.temperature
    if sp.top_k and sp.top_k < z.shape[-1]:
        kth = z.topk(sp.top_k, -1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, -1)
    if sp.top_p < 1.0:
        sp_sorted, idx = p.sort(-1, descending=True)
        before = sp_sorted.cumsum(-1) - sp_sorted  # mass strictly before each token
        keep_sorted = before < sp.top_p  # smallest prefix reaching top_p (the first token always kept)
        keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
        p = p * keep
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of p (R, V) with the row's own generator semantics kept by the caller."""
    return torch.multinomial(p, 1, generator=generator)[..., 0]


class BatchSampler:
    """Samples row r of a (R, V) logits batch from request r's distribution with request r's
    generator; returns the tokens and the distributions they were drawn from."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator]):
        self.params, self.generators = params, generators

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([probs(logits[r], sp) for r, sp in enumerate(self.params)])  # (R, V)
        # Inverse-CDF sampling: one uniform per request from its own generator, then ONE batched search
        # (one multinomial call per request and draft position dominated a drafting round). Token i is
        # returned iff cdf[i-1] <= u * total < cdf[i], i.e. with probability p_i; greedy rows are
        # one-hot, so they return their argmax. float64 keeps the CDF's rounding far below any p_i.
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])  # (R,)
        cdf = rows.detach().to("cpu", torch.float64).cumsum(-1)  # (R, V)
        toks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=rows.shape[-1] - 1)
        return toks.to(logits.device), rows
