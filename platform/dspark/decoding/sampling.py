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
It is computed as the equivalent exponential race: with g = -log E, E_{t,v} ~ Exp(1) a function of
(seed, t, v) (`keyed_uniform`, a counter-based hash),
    x_t = argmax_v  p_t(v) / E_{t,v}   (the first of independent clocks E_v / p_v to ring),
with the unlikely tokens (p_t(v) <= HEAD) sharing one clock of rate p_t(tail) and, when it rings first,
x_t drawn within the tail by inverse CDF (`race_winner`): still exactly p_t, at the cost of the likely
tokens' clocks instead of one per vocabulary entry. Each clock depends on its key and token alone, so
the drafter and the target read the same clock for the same token of the same position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


def argmax(z: torch.Tensor) -> torch.Tensor:
    """z (..., V) -> each row's argmax, the first index on ties, as torch.argmax: torch.max's indices,
    which on this project's CPU take a third of argmax's time (float32, 8 x 49,152: 95 against 282 us)."""
    return z.max(-1).indices


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> the processed distribution (..., V) in float32."""
    z = logits.float()
    if sp.greedy:
        return torch.nn.functional.one_hot(argmax(z), z.shape[-1]).float()
    if sp.temperature != 1.0:
        # subtract the max BEFORE dividing: a tiny T then sends the others to -inf instead of inf - inf = NaN
        z = (z - z.max(-1, keepdim=True).values) / sp.temperature
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
HEAD = 2.0**-16  # tokens more likely than this race with clocks of their own; the rest share one


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position) -> a 63-bit key; distinct positions of one seed give distinct keys."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def keyed_uniform(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(m,) float64 uniforms in (0, 1), element i a function of (keys[i], ids[i]) alone: output ids[i] + 1 of
    the splitmix64 stream keyed by keys[i] (uint64 arithmetic wraps modulo 2^64), 53 bits. No generator
    state: a token's clock costs the same whichever other tokens are read."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + (ids.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def race_winner(
    p: torch.Tensor, keys: list[tuple[int, int]], ids: torch.Tensor | None = None, vocab: int = 0
) -> torch.Tensor:
    """The column of each row of p (n, C) whose clock rings first, an exact sample of the row; row i keyed by
    the (seed, output position) keys[i]. Columns score target ids `ids` (C,) of a vocabulary of `vocab`
    (None: column = id, vocab = C).
        head H = {v : p_v > HEAD}:  clock E_v / p_v,  E_v = -log u(key, v) ~ Exp(1)
        tail T = the rest:          one clock E_T / p(T),  E_T = -log u(key, vocab)
    Independent exponentials with rates p_v (v in H) and p(T): each rings first with probability equal to
    its rate, so v in H wins with p_v and T with p(T); T's winner is then drawn from p restricted to T by
    inverse CDF with the uniform u(key, vocab + 1). The draw is p's exactly, and H and T depend on p alone.
    A token's clock is the same for every distribution it races in (the drafter's q and the target's p of
    one position): the Gumbel-max coupling on the likely tokens, at the cost of those tokens only."""
    n, C = p.shape
    vocab = vocab or C
    key = np.array([_mix(seed, t) for seed, t in keys], dtype=np.uint64)  # (n,)
    P = p.detach().to("cpu", torch.float32).numpy()  # (n, C)
    head = P > HEAD
    r, c = np.divmod(np.flatnonzero(head), C)  # (m,) each, row-major: row r's entries are one run
    tid = c if ids is None else ids.cpu().numpy()[c]
    score = P[r, c] / -np.log(keyed_uniform(key[r], tid))  # p_v / E_v, float64
    col, best = np.zeros(n, dtype=np.int64), np.zeros(n)  # best 0: a row without head entries
    if len(r):
        starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])  # where each row's run begins
        rows = r[starts]
        best[rows] = np.maximum.reduceat(score, starts)
        won = np.flatnonzero(score == best[r])  # increasing: the first of each row is its first winner
        first = np.flatnonzero(np.r_[True, r[won][1:] != r[won][:-1]])
        col[r[won][first]] = c[won][first]
    mass = (P * ~head).sum(-1).astype(np.float64)  # p(T), summed in p's own precision
    tail_won = np.flatnonzero(mass / -np.log(keyed_uniform(key, np.full(n, vocab))) > best)
    if len(tail_won):
        t = torch.from_numpy(tail_won)
        u = torch.from_numpy(keyed_uniform(key[tail_won], np.full(len(tail_won), vocab + 1)))
        col[tail_won] = inverse_cdf(p.detach().cpu()[t].masked_fill(torch.from_numpy(head[tail_won]), 0.0), u).numpy()
    return torch.from_numpy(col)


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
            toks = argmax(logits.float())
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
            # the race of each keyed request's output position, its clocks read at the given ids
            at = [(self.keys[r][0], self.keys[r][1] + self.calls) for r in keyed]
            toks[keyed] = race_winner(rows[keyed], at, ids, vocab)
        self.calls += 1
        toks = toks.to(rows.device)
        return (toks if ids is None else ids.to(rows.device)[toks]), rows
