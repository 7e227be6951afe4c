"""Offline evaluation of drafters on held-out prompts: tau, conditional acceptance and prefix survival,
draft / verify latency and wall-clock speedup over plain target decoding with the same runner
(`measure`), beside the ideal parallel drafter's bound from the target alone (`oracle`); confidence
calibration (ECE/AUROC/Brier, STS) for drafters with a confidence head (`calibration_study`);
JSON + markdown + PNG + MLflow (`report`). `evaluate` runs them all.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from dspark.calibration import sts
from dspark.decoding.sampling import SamplingParams
from dspark.errors import UserError
from dspark.evaluation import oracle
from dspark.evaluation.calibration_study import (
    calibration_rounds,
    calibration_study,
    threshold_sweep,
)
from dspark.evaluation.measure import (
    RunResult,
    acceptance,
    decode,
    decoder,
    eval_prompts,
    interleaved,
    prompts_for,
    set_prompts,
    summarize,
)
from dspark.evaluation.report import (
    calibration_markdown,
    log_results,
    markdown,
    plot_acceptance,
    plot_reliability,
    plot_sweep,
)
from dspark.models import CONFIG_FILE, DrafterConfig
from dspark.scheduling.policies import make_policy
from dspark.scheduling.sps import SPSTable

__all__ = [
    "RunResult",
    "acceptance",
    "calibration_rounds",
    "calibration_study",
    "decode",
    "decoder",
    "eval_prompts",
    "evaluate",
    "interleaved",
    "log_results",
    "prompts_for",
    "save_calibrations",
    "set_prompts",
    "summarize",
    "threshold_sweep",
]


def evaluate(cfg, target, drafters: dict, corpus, out_dir: Path, calibrate: bool = True, log=print) -> dict:
    """Evaluate each named drafter (and plain target decoding) per held-out domain or named prompt set
    (eval.prompt_sets) and temperature."""
    ec = cfg.eval
    # eval.policy: each drafter with a confidence head is also decoded with that prefix policy (calibrated by
    # this evaluation's study; raw confidences without one), priced by the device's profiled round costs
    policy = None
    if ec.policy != "static":
        if not ec.sps_table:
            raise UserError(
                f"eval.policy={ec.policy} prices its prefixes with eval.sps_table: set it to a table of "
                "jobs/profile_sps.py"
            )
        policy = make_policy(ec.policy, SPSTable.load(ec.sps_table))
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = target.eos_token_ids
    results: list[RunResult] = []
    cal_by: dict = {}  # name -> the calibration study (JSON)
    shipped: dict = {}  # name -> the Calibration saved with the drafter
    for name, drafter in drafters.items():
        if calibrate and drafter.has_confidence:
            cal = cal_by[name] = calibration_study(cfg, target, drafter, corpus, log)
            shipped[name] = sts.Calibration.from_dict(cal["calibration"])
            plot_reliability(
                {f"{name} ({d})": o for d, o in cal.pop("obs").items()},
                shipped[name],
                out_dir / f"reliability_{name}.png",
            )
            plot_sweep(
                {f"{name} ({d})": v["threshold_sweep"] for d, v in cal["domains"].items()},
                out_dir / f"threshold_sweep_{name}.png",
            )
    sets = eval_prompts(cfg, target, corpus, log)
    laws = {name: training_law(cfg, d) for name, d in drafters.items()}  # the law of the answers each learned
    bar = tqdm(total=len(sets) * len(ec.temperatures), unit="set", desc="eval", mininterval=10)
    for domain, prompts in sets.items():
        for t in ec.temperatures:
            bar.set_postfix_str(f"{domain} T={t:g}")
            sp = SamplingParams(t)
            t0 = time.perf_counter()
            # plain decoding, each drafter at its gamma and, where it has a confidence head, with the prefix
            # policy: every run answers a prompt before any answers the next, so that all share the host's drift
            runs, scheduled = {"target": decoder(target.model)}, set()
            for name, drafter in drafters.items():
                gamma = ec.gamma or drafter.c.gamma
                runs[name] = decoder(target.model, drafter, gamma)
                if policy is not None and drafter.has_confidence:
                    scheduled.add(f"{name}-{ec.policy}")
                    runs[f"{name}-{ec.policy}"] = decoder(target.model, drafter, gamma, shipped.get(name), policy)
            reqs = interleaved(runs, prompts, sp, ec.max_new_tokens, eos, ec.seed)
            plain = summarize("target", domain, sp, 0, reqs["target"])
            plain.speedup = 1.0
            first = len(results)
            results.append(plain)
            # the bound of each law the drafters learned from (one oracle run per law, at the longest gamma)
            alpha: dict[SamplingParams, list[float]] = {}
            if ec.oracle_paths:
                for law in set(laws.values()):
                    gamma_max = max(ec.gamma or drafters[k].c.gamma for k, x in laws.items() if x == law)
                    alpha[law] = oracle_bound(cfg, target.model, reqs["target"], sp, gamma_max, law)[0]
            for name, dec in list(runs.items())[1:]:
                r = summarize(name, domain, sp, dec.gamma, reqs[name])
                r.speedup = r.tokens_per_s / plain.tokens_per_s
                if alpha and name not in scheduled:  # the bound is for every draft verified: none for shorter rounds
                    law = laws[name]
                    r.bound_accept = alpha[law][: dec.gamma]
                    r.tau_bound = oracle.tau_of(r.bound_accept)
                    r.bound_law = law_name(law)
                results.append(r)
            log(
                f"[eval] {domain} T={t:g}: "
                + ", ".join(
                    f"{r.drafter} tau {r.tau:.2f}"
                    + (f" (bound {r.tau_bound:.2f}, {r.bound_law} answers)" if r.bound_accept else "")
                    for r in results[first:]
                )
                + f" ({time.perf_counter() - t0:.0f}s)"
            )
            bar.update()
    bar.close()
    (out_dir / "results.json").write_text(
        json.dumps({"results": [asdict(r) for r in results], "calibration": cal_by}, indent=2) + "\n"
    )
    (out_dir / "results.md").write_text(markdown(results) + ("\n" + calibration_markdown(cal_by) if cal_by else ""))
    plot_acceptance(results, out_dir / "conditional_acceptance.png")
    return {"results": results, "calibrations": shipped, "calibration": cal_by}


def training_law(cfg, drafter=None) -> SamplingParams:
    """The law of the cached answers a drafter learned from: the one its config records, else (a drafter
    saved before drafters recorded it, or none) the configured cache's (cache.temperature, top_p, top_k).
    Greedy laws are one law, whatever their top-p / top-k."""
    law = drafter.c.cache_law if drafter is not None else {}
    t, top_p, top_k = (
        (law["temperature"], law["top_p"], law["top_k"])
        if law
        else (cfg.cache.temperature, cfg.cache.top_p, cfg.cache.top_k)
    )
    return SamplingParams(0.0) if t == 0 else SamplingParams(t, top_p, top_k)


def law_name(law: SamplingParams) -> str:
    """A law as reports print it: "T=0", "T=0.8 top-p 0.95", "T=1 top-k 50"."""
    parts = [f"T={law.temperature:g}"]
    if law.top_p < 1:
        parts.append(f"top-p {law.top_p:g}")
    if law.top_k:
        parts.append(f"top-k {law.top_k}")
    return " ".join(parts)


def oracle_bound(
    cfg, model, reqs: list, sp: SamplingParams, gamma: int, law: SamplingParams | None = None
) -> tuple[list[float], float, int]:
    """The ideal parallel drafter's (alpha_1..alpha_gamma, tau bound, contexts) on the contexts of `reqs`
    (target-only decodes at `sp`) for a drafter trained on answers sampled with `law` (None: the configured
    cache's, `training_law`)."""
    ec = cfg.eval
    law = law or training_law(cfg)
    responses = [(q.prompt, q.out) for q in reqs]
    return oracle.bound(model, responses, gamma, sp, law, ec.oracle_paths, ec.oracle_drafts, ec.oracle_stride, ec.seed)


def save_calibrations(res: dict, folders: dict[str, Path], extra: dict | None = None) -> list[str]:
    """Each STS calibration `evaluate` fitted, into its drafter's folder (`folders`: name -> local folder),
    except one fitted at another gamma than the drafter was trained at (its folder's config.json): that one
    would stop the drafter being served at its gamma. Returns the names not saved for that reason."""
    kept = []
    for name, cal in res["calibrations"].items():
        if len(cal.temps) != DrafterConfig.load(folders[name] / CONFIG_FILE).gamma:
            kept.append(name)
            continue
        sts.save(folders[name], cal, {"fitted_on": "validation split, T=1", **(extra or {})})
    return kept
