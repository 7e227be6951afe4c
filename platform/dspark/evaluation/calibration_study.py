"""The calibration study of a drafter with a confidence head: STS fitted on validation rounds (what
ships with the drafter), ECE / AUROC / Brier per position on held-out rounds against the noise floor,
and the static-threshold sweep (paper Fig. 5)."""

from __future__ import annotations

import time

import numpy as np

from dspark.calibration import sts
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.evaluation.measure import prompts_for, stop_ids
from dspark.scheduling.policies import static_threshold


def calibration_rounds(
    target_model, drafter, prompts, gamma: int, max_new: int, eos: int | tuple[int, ...], seed: int, batch: int
) -> sts.Observations:
    """Rounds at T=1 with every draft verified, `batch` requests at a time (each request keeps its own
    generator, so batching changes only the wall clock): the confidence logits and the outcomes."""
    dec = SpeculativeDecoder(target_model, drafter, gamma=gamma, max_slots=batch)
    reqs = dec.run([Request(p, SamplingParams(1.0), max_new, seed + i, stop_ids(eos)) for i, p in enumerate(prompts)])
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
        return calibration_rounds(
            target.model, drafter, ps, gamma, ec.calibration_max_new_tokens, eos, seed, ec.calibration_batch
        )

    def prompts(domain: str, split: str) -> list[list[int]]:
        return prompts_for(cfg, corpus, domain, split, ec.calibration_prompts_per_domain, target.tokenizer)

    t0 = time.perf_counter()
    fit_obs = sts.Observations.concat([rounds(prompts(d, "validation"), 10_000) for d in ("code", "prose")])
    fitted = {"sts": sts.fit(fit_obs, bias=False), "sts_bias": sts.fit(fit_obs, bias=True)}
    shipped = fitted["sts_bias" if ec.calibration_bias else "sts"]
    out = {
        "calibration": shipped.to_dict(),
        "fitted": {k: v.to_dict() for k, v in fitted.items()},
        "fit_rounds": len(fit_obs.logits),
        "domains": {},
        "obs": {},
    }
    log(
        f"[eval] calibration from {len(fit_obs.logits)} validation rounds: temperatures "
        f"{[round(t, 2) for t in shipped.temps]}, offsets {[round(b, 2) for b in shipped.biases]} "
        f"({time.perf_counter() - t0:.0f}s)"
    )
    for domain in ("code", "prose"):
        ps = prompts(domain, "heldout")
        half_a, half_b = rounds(ps[0::2], 20_000), rounds(ps[1::2], 30_000)
        obs = sts.Observations.concat([half_b, half_a])
        reps = {
            "raw": sts.report(obs, sts.Calibration.identity(gamma)),
            **{name: sts.report(obs, c, floor=c is shipped) for name, c in fitted.items()},
        }
        for bias, name in ((False, "matched_sts"), (True, "matched_sts_bias")):
            reps[name] = sts.report_survival(*sts.cross_fitted(half_a, half_b, bias), floor=bias)
        out["domains"][domain] = {
            "prompts": len(ps),
            "rounds": len(obs.logits),
            "positions": [
                {
                    "k": k + 1,
                    "n": reps["raw"][k]["n"],
                    "auroc": reps["raw"][k]["auroc"],
                    "observed": reps["raw"][k]["observed"],
                    **{f"ece_{m}": r[k]["ece"] for m, r in reps.items()},
                    **{f"brier_{m}": r[k]["brier"] for m, r in reps.items()},
                    **{f"predicted_{m}": r[k]["predicted"] for m, r in reps.items()},
                    "ece_floor": reps["sts_bias" if ec.calibration_bias else "sts"][k]["ece_floor"],
                    "ece_floor_matched": reps["matched_sts_bias"][k]["ece_floor"],
                }
                for k in range(gamma)
            ],
            "threshold_sweep": threshold_sweep(obs, shipped),
        }
        out["obs"][domain] = obs
        log(
            f"[eval] {domain}: {len(obs.logits)} held-out rounds; ECE by position raw / shipped / matched (floor): "
            + ", ".join(
                f"{p['ece_raw']:.3f}/{p['ece_sts_bias' if ec.calibration_bias else 'ece_sts']:.3f}/"
                f"{p['ece_matched_sts_bias']:.3f} ({p['ece_floor_matched']:.3f})"
                for p in out["domains"][domain]["positions"][:4]
            )
            + f" ({time.perf_counter() - t0:.0f}s)"
        )
    return out


def threshold_sweep(
    obs: sts.Observations, cal: sts.Calibration, thresholds=tuple(np.round(np.arange(0.0, 0.95, 0.1), 2))
) -> list[dict]:
    """The static-threshold diagnostic (paper Fig. 5) replayed on full-length rounds: verify only the
    drafts whose calibrated prefix survival a_k >= threshold. Exact, not simulated: whether draft k is
    accepted depends only on drafts 1..k, so a round that verified all gamma and accepted n would have
    accepted min(n, l) of its first l. Threshold 0 is fixed-length verification."""
    full = obs.verified == obs.logits.shape[1]
    a, n = sts.survival(obs.logits[full], cal), obs.accepted[full]
    rows = []
    for th in thresholds:
        ell = static_threshold(a, th)  # (rounds,) verified drafts
        acc = np.minimum(n, ell)
        rows.append(
            {
                "threshold": float(th),
                "verified": float(ell.mean()),
                "accepted": float(acc.mean()),
                "rejected": float((ell - acc).mean()),
                "tokens_per_step": float(acc.mean() + 1),
                "acceptance_rate": float(acc.sum() / max(ell.sum(), 1)),
            }
        )
    return rows
