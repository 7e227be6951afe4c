"""What one evaluation run measures (paper protocol: batch 1, fixed gamma, every draft verified): the
prompts, the decoding, accepted length tau (bonus token included), position-wise CONDITIONAL acceptance
and prefix survival, draft / verify latency per round and tokens/s."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.cache.build import context_of, regenerate, skipped_turns
from dspark.corpus.conversations import load_jsonl, spread
from dspark.corpus.examples import split_examples
from dspark.corpus.tokenizer import chat_ids
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder, full_length
from dspark.errors import UserError
from dspark.storage import Storage


@dataclass
class RunResult:
    drafter: str
    domain: str
    temperature: float
    gamma: int
    prompts: int
    rounds: int
    tokens: int
    tau: float  # mean tokens per round, bonus included
    cond_accept: list[float]  # P(x_k accepted | x_1..x_{k-1} accepted)
    survival: list[float]  # P(x_1..x_k all accepted)
    draft_ms: float  # per round
    verify_ms: float  # per round
    tokens_per_s: float  # decode phase
    speedup: float = float("nan")  # tokens_per_s / plain target tokens_per_s
    tau_bound: float = float("nan")  # the ideal parallel drafter's tau at this gamma (evaluation.oracle)
    bound_accept: list[float] = field(default_factory=list)  # its conditional acceptance by position
    bound_law: str = ""  # the law of the cached answers that ideal drafter learned from, e.g. "T=0"


def prompts_for(cfg, corpus, domain: str, split: str, n: int, tokenizer) -> list[list[int]]:
    """Built-in corpus prompts, rendered with the target's chat template (spread over the split instead
    of the first file's functions)."""
    exs = spread(split_examples(corpus, domain, split, cfg.corpus), n)
    return [chat_ids(tokenizer, e.prompt, True, cfg.target.chat_template_kwargs) for e in exs]


def set_prompts(cfg, target, uri: str, name: str = "", log=print) -> list[list[int]]:
    """A named prompt set (JSONL, any cache.sources format), eval.prompts_per_domain conversations: one
    prompt per user turn, the paper's multi-turn protocol. Turn t follows the target's own greedy answers
    to turns 1..t-1, generated once here so that every drafter (and plain decoding) sees the same context.
    A conversation ends before a turn whose prompt leaves no room for eval.max_new_tokens in the target's
    context (as a cache build ends it; logged with their count); a set with no turn left is an error."""
    ec = cfg.eval
    convs = spread(load_jsonl(uri, Storage.from_config(cfg.storage)).conversations, ec.prompts_per_domain)
    cc = cfg.cache.model_copy(update={"temperature": 0.0, "max_new_tokens": ec.max_new_tokens})
    context = context_of(target.model)
    what = f"eval.prompt_sets {name or uri}"
    turns = regenerate(
        target.model,
        target.tokenizer,
        convs,
        cc,
        ec.seed,
        target.eos_token_ids,
        cfg.target.chat_template_kwargs,
        answer_last=False,
        max_len=context,
        room=ec.max_new_tokens,  # a prompt of at most context - max_new_tokens tokens is kept
    )
    prompts = [p for ts in turns for p, _ in ts]
    skipped = skipped_turns(convs, turns)
    if not prompts:
        raise UserError(
            f"{what}: no user turn of {uri} leaves room for eval.max_new_tokens={ec.max_new_tokens} "
            f"in the target's {context}-token context"
        )
    if skipped:
        log(
            f"[eval] {what}: {skipped} of {skipped + len(prompts)} user turns skipped: their prompts leave no "
            f"room for eval.max_new_tokens={ec.max_new_tokens} in the target's {context}-token context"
        )
    return prompts


def eval_prompts(cfg, target, corpus, log=print) -> dict[str, list[list[int]]]:
    """Prompts per evaluated set: eval.prompt_sets by name, else the built-in corpus's held-out domains."""
    ec = cfg.eval
    if ec.prompt_sets:
        return {name: set_prompts(cfg, target, uri, name, log) for name, uri in ec.prompt_sets.items()}
    return {
        d: prompts_for(cfg, corpus, d, "heldout", ec.prompts_per_domain, target.tokenizer) for d in ("code", "prose")
    }


def decoder(target_model, drafter=None, gamma: int = 0, calibration=None, policy=full_length) -> SpeculativeDecoder:
    """A batch-1 decoder (the paper's offline protocol): plain target decoding when `drafter` is None."""
    return SpeculativeDecoder(target_model, drafter, gamma=gamma, policy=policy, max_slots=1, calibration=calibration)


def decode(
    target_model,
    drafter,
    prompts: list[list[int]],
    sp: SamplingParams,
    gamma: int,
    max_new: int,
    eos: int | tuple[int, ...],
    seed: int = 0,
    calibration=None,
    policy=full_length,
) -> list[Request]:
    """Batch 1, one prompt after another; `eos`: the id(s) that end a response."""
    dec = decoder(target_model, drafter, gamma, calibration, policy)
    return interleaved({"": dec}, prompts, sp, max_new, eos, seed)[""]


def interleaved(
    decoders: dict[str, SpeculativeDecoder],
    prompts: list[list[int]],
    sp: SamplingParams,
    max_new: int,
    eos: int | tuple[int, ...],
    seed: int = 0,
) -> dict[str, list[Request]]:
    """Each decoder's requests for the prompts, prompt i answered by every decoder in turn before prompt i+1
    by any: a host whose speed drifts within a run (~10% over minutes on a shared CPU) then slows every
    decoder alike, and tokens/s ratios between them hold. Prompt i's request is seeded seed + i in each."""
    out: dict[str, list[Request]] = {k: [] for k in decoders}
    for i, p in enumerate(prompts):
        for k, dec in decoders.items():
            out[k] += dec.run([Request(p, sp, max_new, seed + i, stop_ids(eos))])
    return out


def stop_ids(eos: int | tuple[int, ...]) -> tuple[int, ...]:
    return (eos,) if isinstance(eos, int) else tuple(eos)


def acceptance(requests: list[Request], gamma: int) -> tuple[list[float], list[float]]:
    ell = np.array([r.verified for q in requests for r in q.rounds])
    n = np.array([r.accepted for q in requests for r in q.rounds])
    cond, surv = [], []
    for k in range(1, gamma + 1):
        reached = (ell >= k) & (n >= k - 1)
        cond.append(float((n[reached] >= k).mean()) if reached.any() else float("nan"))
        surv.append(float((n[ell >= k] >= k).mean()) if (ell >= k).any() else float("nan"))
    return cond, surv


def summarize(name: str, domain: str, sp: SamplingParams, gamma: int, reqs: list[Request]) -> RunResult:
    rounds = sum(len(q.rounds) for q in reqs)
    tokens = sum(len(q.out) - 1 for q in reqs)  # the first token comes from prefill
    decode_s = sum(q.draft_s + q.verify_s for q in reqs)
    cond, surv = acceptance(reqs, gamma) if gamma else ([], [])
    return RunResult(
        name,
        domain,
        sp.temperature,
        gamma,
        len(reqs),
        rounds,
        tokens,
        tokens / max(rounds, 1),
        cond,
        surv,
        1e3 * sum(q.draft_s for q in reqs) / max(rounds, 1),
        1e3 * sum(q.verify_s for q in reqs) / max(rounds, 1),
        tokens / max(decode_s, 1e-9),
    )
