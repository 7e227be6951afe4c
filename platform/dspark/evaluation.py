"""Offline evaluation of drafters on held-out prompts (paper protocol: batch 1, fixed gamma, every
draft verified): accepted length tau (bonus token included), position-wise CONDITIONAL acceptance
and prefix survival, draft / verify latency per round, and wall-clock speedup over plain target
decoding with the same runner. Confidence calibration (ECE/AUROC/Brier, STS) for drafters with a
confidence head. Results: JSON + markdown table + PNG plots.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dspark import plots
from dspark.calibration import sts
from dspark.cache.build import regenerate
from dspark.corpus.conversations import load_jsonl, spread
from dspark.corpus.examples import split_examples
from dspark.corpus.tokenizer import chat_ids
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder, full_length
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


def prompts_for(cfg, corpus, domain: str, split: str, n: int, tokenizer) -> list[list[int]]:
    """Built-in corpus prompts, rendered with the target's chat template (spread over the split instead
    of the first file's functions)."""
    exs = spread(split_examples(corpus, domain, split, cfg.corpus), n)
    return [chat_ids(tokenizer, e.prompt, True, cfg.target.chat_template_kwargs) for e in exs]


def set_prompts(cfg, target, uri: str) -> list[list[int]]:
    """A named prompt set (JSONL, any cache.sources format), eval.prompts_per_domain conversations: one
    prompt per user turn, the paper's multi-turn protocol. Turn t follows the target's own greedy answers
    to turns 1..t-1, generated once here so that every drafter (and plain decoding) sees the same context."""
    ec = cfg.eval
    convs = spread(load_jsonl(uri, Storage.from_config(cfg.storage)).conversations, ec.prompts_per_domain)
    cc = cfg.cache.model_copy(update={"temperature": 0.0, "max_new_tokens": ec.max_new_tokens})
    turns = regenerate(target.model, target.tokenizer, convs, cc, ec.seed, target.eos_token_ids,
                       cfg.target.chat_template_kwargs, answer_last=False)
    return [p for ts in turns for p, _ in ts]


def eval_prompts(cfg, target, corpus) -> dict[str, list[list[int]]]:
    """Prompts per evaluated set: eval.prompt_sets by name, else the built-in corpus's held-out domains."""
    ec = cfg.eval
    if ec.prompt_sets:
        return {name: set_prompts(cfg, target, uri) for name, uri in ec.prompt_sets.items()}
    return {d: prompts_for(cfg, corpus, d, "heldout", ec.prompts_per_domain, target.tokenizer) for d in ("code", "prose")}


def decode(target_model, drafter, prompts: list[list[int]], sp: SamplingParams, gamma: int, max_new: int,
           eos: int | tuple[int, ...], seed: int = 0, calibration=None, policy=full_length) -> list[Request]:
    """Batch 1, one prompt after another (the paper's offline protocol); `eos`: the id(s) that end a response."""
    dec = SpeculativeDecoder(target_model, drafter, gamma=gamma, policy=policy, max_slots=1, calibration=calibration)
    return dec.run([Request(p, sp, max_new, seed + i, _stop(eos)) for i, p in enumerate(prompts)])


def _stop(eos: int | tuple[int, ...]) -> tuple[int, ...]:
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
    return RunResult(name, domain, sp.temperature, gamma, len(reqs), rounds, tokens,
                     tokens / max(rounds, 1), cond, surv, 1e3 * sum(q.draft_s for q in reqs) / max(rounds, 1),
                     1e3 * sum(q.verify_s for q in reqs) / max(rounds, 1), tokens / max(decode_s, 1e-9))


def calibration_rounds(target_model, drafter, prompts, gamma: int, max_new: int, eos: int | tuple[int, ...],
                       seed: int, batch: int) -> sts.Observations:
    """Rounds at T=1 with every draft verified, `batch` requests at a time (each request keeps its own
    generator, so batching changes only the wall clock): the confidence logits and the outcomes."""
    dec = SpeculativeDecoder(target_model, drafter, gamma=gamma, max_slots=batch)
    reqs = dec.run([Request(p, SamplingParams(1.0), max_new, seed + i, _stop(eos)) for i, p in enumerate(prompts)])
    return sts.Observations.from_rounds([r for q in reqs for r in q.rounds])


def calibration_study(cfg, target, drafter, corpus, log=print) -> dict:
    """Calibration of the prefix survival a_k. Fitted on validation rounds of both domains (what ships
    with the drafter: STS, with offsets unless eval.calibration_bias=false) and reported per held-out
    domain for raw logits, STS (temperatures only, the paper's) and STS with offsets; "matched" fits
    on half of the domain's held-out prompts and reports on the other half (two-fold), i.e. what the
    online calibration actor converges to when traffic is that domain. Plus the threshold sweep."""
    ec = cfg.eval
    eos = target.eos_token_ids
    gamma = ec.gamma or drafter.c.gamma

    def rounds(ps: list[list[int]], seed: int) -> sts.Observations:
        return calibration_rounds(target.model, drafter, ps, gamma, ec.calibration_max_new_tokens, eos, seed,
                                  ec.calibration_batch)

    def prompts(domain: str, split: str) -> list[list[int]]:
        return prompts_for(cfg, corpus, domain, split, ec.calibration_prompts_per_domain, target.tokenizer)

    t0 = time.perf_counter()
    fit_obs = sts.Observations.concat([rounds(prompts(d, "validation"), 10_000) for d in ("code", "prose")])
    fitted = {"sts": sts.fit(fit_obs, bias=False), "sts_bias": sts.fit(fit_obs, bias=True)}
    shipped = fitted["sts_bias" if ec.calibration_bias else "sts"]
    out = {"calibration": shipped.to_dict(), "fitted": {k: v.to_dict() for k, v in fitted.items()},
           "fit_rounds": len(fit_obs.logits), "domains": {}, "obs": {}}
    log(f"[eval] calibration from {len(fit_obs.logits)} validation rounds: temperatures "
        f"{[round(t, 2) for t in shipped.temps]}, offsets {[round(b, 2) for b in shipped.biases]} ({time.perf_counter() - t0:.0f}s)")
    for domain in ("code", "prose"):
        ps = prompts(domain, "heldout")
        half_a, half_b = rounds(ps[0::2], 20_000), rounds(ps[1::2], 30_000)
        obs = sts.Observations.concat([half_b, half_a])
        reps = {"raw": sts.report(obs, sts.Calibration.identity(gamma)),
                **{name: sts.report(obs, c, floor=c is shipped) for name, c in fitted.items()}}
        for bias, name in ((False, "matched_sts"), (True, "matched_sts_bias")):
            reps[name] = sts.report_survival(*sts.cross_fitted(half_a, half_b, bias), floor=bias)
        out["domains"][domain] = {
            "prompts": len(ps), "rounds": len(obs.logits),
            "positions": [{"k": k + 1, "n": reps["raw"][k]["n"], "auroc": reps["raw"][k]["auroc"],
                           "observed": reps["raw"][k]["observed"],
                           **{f"ece_{m}": r[k]["ece"] for m, r in reps.items()},
                           **{f"brier_{m}": r[k]["brier"] for m, r in reps.items()},
                           **{f"predicted_{m}": r[k]["predicted"] for m, r in reps.items()},
                           "ece_floor": reps["sts_bias" if ec.calibration_bias else "sts"][k]["ece_floor"],
                           "ece_floor_matched": reps["matched_sts_bias"][k]["ece_floor"]} for k in range(gamma)],
            "threshold_sweep": sts.threshold_sweep(obs, shipped)}
        out["obs"][domain] = obs
        log(f"[eval] {domain}: {len(obs.logits)} held-out rounds; ECE by position raw / shipped / matched (floor): "
            + ", ".join(f"{p['ece_raw']:.3f}/{p['ece_sts_bias' if ec.calibration_bias else 'ece_sts']:.3f}/"
                        f"{p['ece_matched_sts_bias']:.3f} ({p['ece_floor_matched']:.3f})"
                        for p in out["domains"][domain]["positions"][:4]) + f" ({time.perf_counter() - t0:.0f}s)")
    return out


def calibration_markdown(cal_by: dict) -> str:
    rows = ["| drafter | domain | rounds | k | observed | ECE raw | STS | STS+offset | matched STS | matched STS+offset "
            "| floor | AUROC | Brier raw / STS+offset |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    for name, cal in cal_by.items():
        for dom, d in cal["domains"].items():
            rows += [f"| {name} | {dom} | {d['rounds']} | {p['k']} | {p['observed']:.3f} | {pct(p['ece_raw'])} | "
                     f"{pct(p['ece_sts'])} | {pct(p['ece_sts_bias'])} | {pct(p['ece_matched_sts'])} | "
                     f"{pct(p['ece_matched_sts_bias'])} | {pct(p['ece_floor_matched'])} | {p['auroc']:.3f} | "
                     f"{p['brier_raw']:.4f} / {p['brier_sts_bias']:.4f} |" for p in d["positions"]]
    rows += ["", "| drafter | domain | threshold | verified/step | accepted/step | rejected/step | acceptance rate |",
             "|---|---|---|---|---|---|---|"]
    for name, cal in cal_by.items():
        for dom, d in cal["domains"].items():
            rows += [f"| {name} | {dom} | {r['threshold']:.1f} | {r['verified']:.2f} | {r['accepted']:.2f} | "
                     f"{r['rejected']:.2f} | {100 * r['acceptance_rate']:.1f}% |" for r in d["threshold_sweep"]]
    return "\n".join(rows) + "\n"


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


def plot_reliability(obs_by: dict, cal: sts.Calibration, path: Path, bins: int = 20) -> None:
    """Reliability diagrams of prefix survival a_k (paper Fig. 6): one row per held-out domain, one
    column per position, raw vs calibrated, with the ECE of each and the bin counts shaded."""
    from dspark.calibration.metrics import ece, reliability

    gamma = next(iter(obs_by.values())).logits.shape[1]
    ks = list(range(1, min(gamma, 4) + 1))  # later positions hold almost no survival mass at this scale
    fig, axes = plots.figure(len(obs_by), len(ks), (3.6 * len(ks), 3.4 * len(obs_by)))
    for row, (label, obs) in zip(axes, obs_by.items()):
        raw, fitted = sts.survival(obs.logits, sts.Calibration.identity(gamma)), sts.survival(obs.logits, cal)
        for ax, k in zip(row, ks):
            sel, y, _ = obs.at(k)
            counts = np.bincount(np.minimum((fitted[sel, k - 1] * bins).astype(int), bins - 1), minlength=bins)
            ax.bar((np.arange(bins) + 0.5) / bins, counts / max(counts.max(), 1), width=1 / bins, color="0.9")
            for name, a, style in (("raw", raw, "rs-"), ("STS", fitted, "bo-")):
                pts = reliability(a[sel, k - 1], y, bins)
                ax.plot([p for p, _, _ in pts], [o for _, o, _ in pts], style, ms=3,
                        label=f"{name} ECE {100 * ece(a[sel, k - 1], y, bins):.1f}%")
            ax.plot([0, 1], [0, 1], "k--", lw=0.8)
            ax.set_title(f"{label}, position {k} (n={int(sel.sum())})", fontsize=9)
            ax.set_xlabel("predicted a_k")
            ax.set_ylabel("observed")
            ax.legend(fontsize=7)
    plots.finish(fig, path, [])


def plot_sweep(sweeps: dict, path: Path) -> None:
    """Threshold sweep (paper Fig. 5): accepted and rejected drafts per step (bars), acceptance rate (line)."""
    fig, axes = plots.figure(1, len(sweeps), (4.5 * len(sweeps), 3.6))
    for ax, (label, rows) in zip(axes[0], sweeps.items()):
        th = np.array([r["threshold"] for r in rows])
        acc, rej = np.array([r["accepted"] for r in rows]), np.array([r["rejected"] for r in rows])
        ax.bar(th, acc, width=0.07, label="accepted")
        ax.bar(th, rej, width=0.07, bottom=acc, hatch="//", fill=False, label="rejected")
        ax.set_xlabel("confidence threshold on a_k")
        ax.set_ylabel("drafts verified per step")
        ax.set_title(label)
        ax.legend(fontsize=7, loc="upper right")
        ax2 = ax.twinx()
        ax2.plot(th, [100 * r["acceptance_rate"] for r in rows], "k-o", ms=3)
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("acceptance rate (%)")
    plots.finish(fig, path, [])


def evaluate(cfg, target, drafters: dict, corpus, out_dir: Path, calibrate: bool = True, log=print) -> dict:
    """Evaluate each named drafter (and plain target decoding) per held-out domain or named prompt set
    (eval.prompt_sets) and temperature."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ec = cfg.eval
    eos = target.eos_token_ids
    results: list[RunResult] = []
    cal_by: dict = {}  # name -> the calibration study (JSON)
    shipped: dict = {}  # name -> the Calibration saved with the drafter
    for name, drafter in drafters.items():
        if calibrate and drafter.has_confidence:
            cal = cal_by[name] = calibration_study(cfg, target, drafter, corpus, log)
            shipped[name] = sts.Calibration.from_dict(cal["calibration"])
            plot_reliability({f"{name} ({d})": o for d, o in cal.pop("obs").items()}, shipped[name],
                             out_dir / f"reliability_{name}.png")
            plot_sweep({f"{name} ({d})": v["threshold_sweep"] for d, v in cal["domains"].items()},
                       out_dir / f"threshold_sweep_{name}.png")
    for domain, prompts in eval_prompts(cfg, target, corpus).items():
        for t in ec.temperatures:
            sp = SamplingParams(t)
            t0 = time.perf_counter()
            plain = summarize("target", domain, sp, 0, decode(target.model, None, prompts, sp, 0, ec.max_new_tokens, eos, ec.seed))
            plain.speedup = 1.0
            results.append(plain)
            for name, drafter in drafters.items():
                gamma = ec.gamma or drafter.c.gamma
                reqs = decode(target.model, drafter, prompts, sp, gamma, ec.max_new_tokens, eos, ec.seed)
                r = summarize(name, domain, sp, gamma, reqs)
                r.speedup = r.tokens_per_s / plain.tokens_per_s
                results.append(r)
            log(f"[eval] {domain} T={t:g}: " + ", ".join(f"{r.drafter} tau {r.tau:.2f}" for r in results[-len(drafters) - 1:])
                + f" ({time.perf_counter() - t0:.0f}s)")
    (out_dir / "results.json").write_text(json.dumps({"results": [asdict(r) for r in results], "calibration": cal_by},
                                                     indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown(results) + ("\n" + calibration_markdown(cal_by) if cal_by else ""))
    plot_acceptance(results, out_dir / "conditional_acceptance.png")
    return {"results": results, "calibrations": shipped, "calibration": cal_by}


def save_calibrations(res: dict, folders: dict[str, Path], extra: dict | None = None) -> None:
    """Each STS calibration `evaluate` fitted, into its drafter's folder (`folders`: name -> local folder)."""
    for name, cal in res["calibrations"].items():
        sts.save(folders[name], cal, {"fitted_on": "validation split, T=1", **(extra or {})})


def log_results(tracker, res: dict, out_dir: Path, prefix: str = "", artifact_path: str | None = None) -> None:
    """MLflow: tau and speedup per drafter/domain/T, calibration (ECE raw/STS, AUROC) per position,
    and every JSON/markdown/PNG the evaluation wrote."""
    for r in res["results"]:
        key = f"{prefix}{r.drafter}.{r.domain}.T{r.temperature:g}"
        tracker.metrics({f"{key}.tau": r.tau, f"{key}.speedup": r.speedup}, 0)
    for name, cal in res["calibration"].items():
        for dom, d in cal["domains"].items():
            for p in d["positions"]:
                tracker.metrics({f"{prefix}{name}.{dom}.calibration.{m}": p[m] for m in
                                 ("ece_raw", "ece_sts", "ece_sts_bias", "ece_matched_sts_bias", "ece_floor", "auroc")}, p["k"])
    for f in sorted(out_dir.iterdir()):
        if f.suffix in (".json", ".md", ".png"):
            tracker.artifact(f, artifact_path)

