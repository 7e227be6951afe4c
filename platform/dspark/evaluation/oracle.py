"""The ideal parallel drafter: what a drafter that proposes all gamma positions at once could reach on
this target, estimated from the target alone. Evaluations report it beside every drafter's tau.

A parallel drafter (DFlash's backbone) proposes slot k from the context c without the tokens drafted
before it. Trained to match the target's distribution on the target's own responses (sampled with the
cache's law S: temperature / top_p / top_k, which a drafter records as `cache_law`), its best possible
slot-k output is the target's marginal over those responses:

    q_k(v) = E_{x_{<k} ~ S} [ p(v | c, x_{<k}) ]           p = the target at the evaluated temperature T
                                                           (at T = 0: argmax of the T=1 marginal)

estimated with `paths` sampled continuations. Verified against the target with speculative sampling,
its drafts d_k ~ q_k (independent per slot) give, for the prefix d_{<k} accepted so far,

    A_k = Σ_v min(q_k(v), p_T(v | c, d_{<k}))              P(slot k accepted | d_{<k} accepted)
    S_k = Π_{j<=k} min(1, p_T(d_j | c, d_{<j}) / q_j(d_j))  P(d_1..d_k all accepted)

and the conditional acceptance the evaluation reports (paper Fig. 2), pooled over contexts and `drafts`
draft samples each (Rao-Blackwellised: A_k is the exact expectation over d_k):

    alpha_k = Σ S_{k-1} A_k / Σ S_{k-1},     tau bound = 1 + Σ_k Π_{j<=k} alpha_j.

Slot 1 is always 1.0 (q_1 = p); the decay after it is the target's own uncertainty about the tokens in
between. DSpark's Markov head conditions slot k on d_{k-1}, so it may exceed this bound; DFlash may not.
"""

from __future__ import annotations

import copy

import torch

from dspark.decoding.sampling import SamplingParams, probs


@torch.no_grad()
def context_sums(
    model,
    ctx: list[int],
    gamma: int,
    sp: SamplingParams,
    law: SamplingParams,
    paths: int,
    drafts: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One context (its last token is the round's anchor) -> (Σ S_{k-1} A_k, Σ S_{k-1}), each (gamma,)."""
    dev = next(model.parameters()).device
    prefix = model(input_ids=torch.tensor([ctx[:-1]], device=dev), use_cache=True).cache
    anchor = torch.tensor([[ctx[-1]]], device=dev)

    # 1. q_k: the mean of the target's distributions along `paths` continuations sampled from S
    cache = copy.deepcopy(prefix)
    cache.batch_repeat_interleave(paths)
    tok, q = anchor.expand(paths, 1), []
    for _ in range(gamma):
        z = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1]  # (M, V)
        q.append(probs(z, sp if not sp.greedy else SamplingParams(1.0)).mean(0))
        tok = torch.multinomial(probs(z, law), 1, generator=generator)  # (M, 1)
    q = torch.stack(q)  # (G, V)
    if sp.greedy:
        q = torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1]).float()
        drafts = 1  # deterministic drafts

    # 2. drafts d ~ q (independent slots), verified by one target forward over [anchor, d_1..d_{G-1}]
    d = torch.multinomial(q, drafts, replacement=True, generator=generator).T  # (D, G)
    cache = prefix
    cache.batch_repeat_interleave(drafts)
    inp = torch.cat([anchor.expand(drafts, 1), d[:, :-1]], 1)  # (D, G)
    p = probs(model(input_ids=inp, cache=cache, use_cache=True).logits, sp)  # (D, G, V)
    A = torch.minimum(q[None], p).sum(-1)  # (D, G)
    qd = q.gather(1, d.T).T  # (D, G)   q_k(d_k)
    pd = p.gather(2, d[..., None])[..., 0]  # (D, G)   p_T(d_k | c, d_{<k})
    S = torch.cumprod(torch.clamp(pd / qd, max=1.0), 1)  # (D, G)   S_k
    S_prev = torch.cat([torch.ones_like(S[:, :1]), S[:, :-1]], 1)  # S_{k-1}
    return (S_prev * A).sum(0), S_prev.sum(0)


def contexts(prompt: list[int], out: list[int], gamma: int, stride: int) -> list[list[int]]:
    """Round anchors along one target response: prompt + out[:j] for j = 1, 1+stride, ... (the first
    output token comes from prefill, so every round's anchor is a committed response token)."""
    return [prompt + out[:j] for j in range(1, max(len(out) - 1, 1) + 1, stride)]


def bound(
    model,
    responses: list[tuple[list[int], list[int]]],
    gamma: int,
    sp: SamplingParams,
    law: SamplingParams,
    paths: int = 32,
    drafts: int = 16,
    stride: int = 8,
    seed: int = 0,
) -> tuple[list[float], float, int]:
    """(prompt, target response) pairs -> per-slot conditional acceptance alpha_1..alpha_gamma of the
    ideal parallel drafter, its tau bound, and the number of contexts."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    num, den, n = torch.zeros(gamma), torch.zeros(gamma), 0
    for prompt, out in responses:
        for ctx in contexts(prompt, out, gamma, stride):
            a, b = context_sums(model, ctx, gamma, sp, law, paths, drafts, gen)
            num, den, n = num + a.float().cpu(), den + b.float().cpu(), n + 1
    alpha = (num / den.clamp_min(1e-12)).tolist()
    return alpha, tau_of(alpha), n


def tau_of(alpha: list[float]) -> float:
    """Expected tokens per round (bonus included) from conditional acceptances: 1 + Σ_k Π_{j<=k} alpha_j."""
    tau, surv = 1.0, 1.0
    for a in alpha:
        surv *= a
        tau += surv
    return tau
