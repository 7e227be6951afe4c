"""Sampling parameters and the token distribution they define, shared by target and drafter.

The distribution the target is asked to reproduce is  p = filter_top_p(filter_top_k(softmax(z / T))).
Greedy (T = 0) is represented as the one-hot argmax distribution, so greedy requests go through the
same exact verification rule as sampled ones (accept iff the draft equals the target's argmax).

Seeded (reproducible) sampling uses the Gumbel-max trick with noise keyed by (seed, position):
    x_t = argmax_v  log p_t(v) + g_{t,v},    g_{t,v} ~ Gumbel(0, 1) iid, a function of (seed, t) only.
x_t is an exact sample of p_t, and it is a deterministic function of the seed and the prefix, so a
seeded request's output never depends on the drafter, the verification lengths or the batch. The
drafter proposes with the same noise (argmax of log q_t + g_t), so verification is "accept iff the
draft equals the target's perturbed argmax" (the greedy rule on perturbed scores).
It is computed as the equivalent exponential race: with g = -log E, E_{t,v} = -log u_{t,v} ~ Exp(1),
    x_t = argmax_v  p_t(v) / E_{t,v}   (the first of independent clocks E_v / p_v to ring),
one logarithm over the vocabulary per position instead of three, and a position's clocks are drawn once
for the drafter's proposal and the target's verification of the same position (`race_times`)."""

from __future__ import annotations

import functools
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
    # subtract the max BEFORE dividing: a tiny T then sends the others to -inf instead of inf - inf = NaN
    z = z - z.max(-1, keepdim=True).values
    if sp.temperature != 1.0:
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


def batch_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row r of logits (R, V) under params[r] -> (R, V); one `probs` call per distinct params (a batch
    usually shares one), not one per row."""
    groups: dict[SamplingParams, list[int]] = {}
    for r, sp in enumerate(params):
        groups.setdefault(sp, []).append(r)
    if len(groups) == 1:
        return probs(logits, params[0])
    out = logits.new_empty(logits.shape, dtype=torch.float32)
    for sp, rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = probs(logits[idx], sp)
    return out


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position) -> a 63-bit generator seed; distinct positions of one seed
    give distinct seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@functools.lru_cache(maxsize=128)  # a round's positions (R x (gamma + 1)), reused by its verification
def _race_time(seed: int, position: int, vocab: int) -> torch.Tensor:
    """(V,) float64 Exp(1) clocks of one output position of a seeded request (read-only: it is cached)."""
    u = torch.rand(vocab, generator=torch.Generator().manual_seed(_mix(seed, position)), dtype=torch.float64)
    return -torch.log(u)  # u = 0 gives inf: that token is never chosen (probability 2^-53)


def race_times(keys: list[tuple[int, int]], vocab: int) -> torch.Tensor:
    """(n, V) float64 Exp(1) clocks E, row i for the (seed, output position) keys[i] of a seeded request."""
    return torch.stack([_race_time(seed, position, vocab) for seed, position in keys])


def race_winner(p: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """argmax_v p_v / E_v per row, an exact sample of p (Gumbel-max, g = -log E); p (n, V), times (n, V)."""
    return (p.to("cpu", torch.float64) / times).argmax(-1)


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r of p (R, V) (non-negative, any positive total) sampled with the uniform u[r] in [0, 1):
    token i is returned iff cdf[i-1] <= u * total < cdf[i], i.e. with probability p_i / total; one-hot
    (greedy) rows return their argmax. float64 keeps the CDF's rounding far below any p_i. One uniform
    per row, where torch.multinomial draws one random number per vocabulary entry."""
    cdf = p.detach().to("cpu", torch.float64).cumsum(-1)  # (R, V)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=p.shape[-1] - 1)


class BatchSampler:
    """Samples row r of a (R, V) logits batch from request r's distribution with request r's
    generator; returns the tokens and the distributions they were drawn from. A request with a
    key (seed, first output position) is sampled by Gumbel-max with its position's noise instead;
    the k-th call of a round draws output position first + k.

    A drafter with a draft vocabulary passes only its columns: logits (R, n) scoring the increasing
    target ids `ids` (n,) of a vocabulary of `vocab`, every other token having probability 0: the same
    draw as from the scattered (R, vocab) logits with -inf elsewhere (the same CDF steps in the same
    order, the Gumbel noise read at the same ids; equal up to the float rounding of the softmax's
    normaliser) at n / vocab of the cost. The tokens come back as target ids, the distributions over
    the n columns (R, n): scattering them to (R, vocab) is left to whoever needs a whole row. When every
    request is greedy the distributions are None (each a one-hot at its token, which verification
    assumes of a proposal without q)."""

    def __init__(
        self,
        params: list[SamplingParams],
        generators: list[torch.Generator],
        keys: list[tuple[int, int] | None] | None = None,
    ):
        self.params, self.generators = params, generators
        self.keys = keys or [None] * len(params)
        self.calls = 0

    def __call__(
        self, logits: torch.Tensor, ids: torch.Tensor | None = None, vocab: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if all(sp.greedy for sp in self.params):  # every row its argmax: no distribution to return
            self.calls += 1
            toks = logits.float().argmax(-1)
            return (toks if ids is None else ids.to(toks.device)[toks]), None
        rows = batch_probs(logits, self.params)  # (R, n)
        # one uniform per request from its own generator, then ONE batched search (one multinomial call
        # per request and draft position dominated a drafting round); drawn for keyed rows too, so a
        # request's generator advances the same way whichever rows are keyed
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])  # (R,)
        keyed = [r for r, key in enumerate(self.keys) if key is not None and not self.params[r].greedy]
        if not keyed:  # the usual round: every row by its uniform, none picked out
            toks = inverse_cdf(rows, u)
        else:
            plain = [r for r in range(len(self.params)) if r not in set(keyed)]
            toks = torch.zeros(len(self.params), dtype=torch.long)
            if plain:
                toks[plain] = inverse_cdf(rows[plain], u[plain])
            # Gumbel-max with the clocks of each keyed request's output position (at the given ids)
            full = vocab if ids is not None else rows.shape[-1]
            times = race_times([(self.keys[r][0], self.keys[r][1] + self.calls) for r in keyed], full)
            toks[keyed] = race_winner(rows[keyed], times if ids is None else times[:, ids.cpu()])
        self.calls += 1
        toks = toks.to(rows.device)
        return (toks if ids is None else ids.to(rows.device)[toks]), rows
