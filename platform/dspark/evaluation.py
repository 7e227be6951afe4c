"""Offline evaluation of drafters on held-out prompts (paper protocol: batch 1, fixed gamma, every
draft verified): accepted length tau (bonus token included), position-wise CONDITIONAL acceptance
and prefix survival, draft / verify latency per round, and wall-clock speedup over plain target
decoding with the same runner. Confidence calibration (ECE/AUROC/Brier, STS) for drafters with a
confidence head. Results: JSON + markdown table + PNG plots.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dspark import plots
from dspark.calibration import sts
from dspark.corpus.examples import split_examples
from dspark.corpus.tokenizer import encode_prompt
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder, full_length


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
    calibration: list[dict] = field(default_factory=list)


def prompts_for(cfg, corpus, domain: str, split: str, n: int, tokenizer) -> list[list[int]]:
    exs = split_examples(corpus, domain, split, cfg.corpus)
    step = max(1, len(exs) // n)  # spread over the split instead of the first file's functions
    return [encode_prompt(tokenizer, e.prompt) for e in exs[::step][:n]]


def decode(target_model, drafter, prompts: list[list[int]], sp: SamplingParams, gamma: int, max_new: int,
           eos: int, seed: int = 0, temperatures=None, policy=full_length) -> list[Request]:
    """Batch 1, one prompt after another (the paper's offline protocol)."""
    dec = SpeculativeDecoder(target_model, drafter, gamma=gamma, policy=policy, max_slots=1, temperatures=temperatures)
    return dec.run([Request(p, sp, max_new, seed + i, (eos,)) for i, p in enumerate(prompts)])


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
    return RunResult(name, domain, sp.temperature, gamma, len(reqs), rounds, tokens,
                     tokens / max(rounds, 1), cond, surv, 1e3 * sum(q.draft_s for q in reqs) / max(rounds, 1),
                     1e3 * sum(q.verify_s for q in reqs) / max(rounds, 1), tokens / max(decode_s, 1e-9))


def fit_calibration(target_model, drafter, prompts, gamma, max_new, eos) -> tuple[list[float], sts.Observations]:
    """STS temperatures from rounds on the validation split (T=1, full-length verification)."""
    reqs = decode(target_model, drafter, prompts, SamplingParams(1.0), gamma, max_new, eos, seed=10_000)
    obs = sts.Observations.from_rounds([r for q in reqs for r in q.rounds])
    return sts.fit(obs), obs


def markdown(results: list[RunResult]) -> str:
    head = "| drafter | domain | T | gamma | tau | speedup | draft ms | verify ms | cond. acceptance by position |\n" \
           "|---|---|---|---|---|---|---|---|---|\n"
    rows = [f"| {r.drafter} | {r.domain} | {r.temperature:g} | {r.gamma} | {r.tau:.3f} | {r.speedup:.2f}x | "
            f"{r.draft_ms:.1f} | {r.verify_ms:.1f} | {' '.join(f'{a:.2f}' for a in r.cond_accept)} |" for r in results]
    return head + "\n".join(rows) + "\n"


def plot_acceptance(results: list[RunResult], path: Path) -> None:
    panels = sorted({(r.domain, r.temperature) for r in results if r.gamma})
    fig, axes = plots.figure(1, len(panels), (4.5 * len(panels), 3.6))
    for ax, (dom, t) in zip(axes[0], panels):
        for r in results:
            if r.domain == dom and r.temperature == t and r.gamma:
                ax.plot(range(1, r.gamma + 1), r.cond_accept, marker="o", label=f"{r.drafter} (tau {r.tau:.2f})")
        ax.set_title(f"{dom}, T={t:g}")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_ylim(0, 1)
    plots.finish(fig, path, axes[0])


def plot_reliability(obs_before: dict, temps: dict, path: Path, bins: int = 20) -> None:
    """Reliability diagrams of prefix survival a_k, raw vs STS-calibrated, one panel per drafter."""
    from dspark.calibration.metrics import reliability

    fig, axes = plots.figure(1, len(obs_before), (4.5 * len(obs_before), 4))
    for ax, (name, obs) in zip(axes[0], obs_before.items()):
        for label, t in (("raw", [1.0] * obs.logits.shape[1]), ("STS", temps[name])):
            a = sts.survival(obs.logits, t)
            pts = []
            for k in range(1, obs.logits.shape[1] + 1):
                sel, y, _ = obs.at(k)
                pts += reliability(a[sel, k - 1], y, bins)
            pts.sort()
            ax.plot([p for p, _, _ in pts], [o for _, o, _ in pts], ".", label=label, alpha=0.6)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_title(f"{name}: prefix survival")
        ax.set_xlabel("predicted a_k")
        ax.set_ylabel("observed")
    plots.finish(fig, path, axes[0])


def evaluate(cfg, target, drafters: dict, corpus, out_dir: Path, calibrate: bool = True, log=print) -> dict:
    """Evaluate each named drafter (and plain target decoding) per held-out domain and temperature."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ec = cfg.eval
    eos = target.tokenizer.eos_token_id
    results: list[RunResult] = []
    temps_by: dict = {}
    obs_by: dict = {}
    for name, drafter in drafters.items():
        if calibrate and drafter.has_confidence:
            val = [p for d in ("code", "prose")
                   for p in prompts_for(cfg, corpus, d, "validation", max(4, ec.prompts_per_domain // 2), target.tokenizer)]
            temps_by[name], _ = fit_calibration(target.model, drafter, val, ec.gamma, ec.max_new_tokens, eos)
            log(f"[eval] {name}: STS temperatures {[round(t, 2) for t in temps_by[name]]}")
    for domain in ("code", "prose"):
        prompts = prompts_for(cfg, corpus, domain, "heldout", ec.prompts_per_domain, target.tokenizer)
        for t in ec.temperatures:
            sp = SamplingParams(t)
            t0 = time.perf_counter()
            plain = summarize("target", domain, sp, 0, decode(target.model, None, prompts, sp, 0, ec.max_new_tokens, eos, ec.seed))
            plain.speedup = 1.0
            results.append(plain)
            for name, drafter in drafters.items():
                reqs = decode(target.model, drafter, prompts, sp, ec.gamma, ec.max_new_tokens, eos, ec.seed)
                r = summarize(name, domain, sp, ec.gamma, reqs)
                r.speedup = r.tokens_per_s / plain.tokens_per_s
                if name in temps_by:
                    obs = sts.Observations.from_rounds([x for q in reqs for x in q.rounds])
                    r.calibration = [{"k": a["k"], "n": a["n"], "ece_raw": a["ece"], "auroc": a["auroc"],
                                      "brier_raw": a["brier"], "ece_sts": b["ece"], "brier_sts": b["brier"],
                                      "ece_floor_sts": b["ece_floor"]}
                                     for a, b in zip(sts.report(obs, [1.0] * ec.gamma), sts.report(obs, temps_by[name], floor=True))]
                    if t == 1.0:
                        obs_by[f"{name} ({domain})"] = obs
                results.append(r)
            log(f"[eval] {domain} T={t:g}: " + ", ".join(f"{r.drafter} tau {r.tau:.2f}" for r in results[-len(drafters) - 1:])
                + f" ({time.perf_counter() - t0:.0f}s)")
    (out_dir / "results.json").write_text(json.dumps({"results": [asdict(r) for r in results],
                                                      "sts_temperatures": temps_by}, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown(results))
    plot_acceptance(results, out_dir / "conditional_acceptance.png")
    if obs_by:
        plot_reliability(obs_by, {k: temps_by[k.split(" (")[0]] for k in obs_by}, out_dir / "reliability.png")
    return {"results": results, "sts_temperatures": temps_by}
