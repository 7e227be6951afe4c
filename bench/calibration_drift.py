"""Calibration drift: traffic switches from code to prose; the engine fed by the online calibrator
(the calibration actor's logic: decayed unbiased outcomes, clamped STS refits) recovers its live
calibration error, an engine without it stays miscalibrated.

    python bench/calibration_drift.py --drafter results/comparison/dspark
    python bench/calibration_drift.py --config configs/smollm2.yaml --drafter DRAFTER [--before 32 --after 64]

Both engines start from an STS calibration fitted on CODE validation rounds, then serve the same
request stream: --before code requests, then --after prose requests (T=1, batches of --batch
concurrent requests; the built-in corpus's prompts in the configured target's chat template, ended
by its EOS ids). The drafter must have been trained for the configured target. Live error = mean over
positions of |mean predicted prefix survival (with the calibration in force) - observed survival|
over the last --window rounds. Prints the error after each batch and how many prose requests it took
to return to the pre-shift level.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dspark import evaluation, plots
from dspark import target as targets
from dspark.calibration import sts
from dspark.calibration.online import OnlineCalibrator
from dspark.config import add_config_args, config_from_args, run_main
from dspark.corpus.sources import Corpus
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.models import load_drafter


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--drafter", default="results/comparison/dspark")
    p.add_argument("--before", type=int, default=96)
    p.add_argument("--after", type=int, default=192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--window", type=int, default=300)
    p.add_argument("--temperatures-only", action="store_true", help="the paper's STS: no per-position offsets")
    p.add_argument(
        "--fit-prompts", type=int, default=96, help="code validation prompts the starting calibration is fitted on"
    )
    p.add_argument("--out", default="results/calibration_drift")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    tgt = targets.load_from_config(cfg.target)
    drafter = load_drafter(args.drafter, tgt.model, tgt.weights_sha256)
    gamma = drafter.c.gamma
    corpus = Corpus.load(cfg.corpus)
    eos = tgt.eos_token_ids
    val = evaluation.prompts_for(cfg, corpus, "code", "validation", args.fit_prompts, tgt.tokenizer)
    fit_obs = evaluation.calibration_rounds(tgt.model, drafter, val, gamma, args.max_new, eos, 99, args.batch)
    code_cal = sts.fit(fit_obs, bias=not args.temperatures_only)
    print(
        f"[drift] STS fitted on {len(fit_obs.logits)} code validation rounds: temperatures "
        f"{[round(t, 2) for t in code_cal.temps]}, offsets {[round(b, 2) for b in code_cal.biases]}"
    )
    stream = [
        (domain, q)
        for domain, n in (("code", args.before), ("prose", args.after))
        for q in evaluation.prompts_for(cfg, corpus, domain, "heldout", n, tgt.tokenizer)
    ]
    engines = {}
    for name, refit in (("with calibration actor", 100), ("without", 10**12)):
        cal = OnlineCalibrator(
            gamma,
            code_cal,
            half_life=1500,
            min_rounds=200,
            refit_every=refit,
            window=args.window,
            bias=not args.temperatures_only,
        )
        dec = SpeculativeDecoder(tgt.model, drafter, gamma, max_slots=args.batch, calibration=code_cal)
        engines[name] = (cal, dec)
    curves = {name: [] for name in engines}
    for i in range(0, len(stream), args.batch):
        chunk = stream[i : i + args.batch]
        for name, (cal, dec) in engines.items():
            out = dec.run([Request(q, SamplingParams(1.0), args.max_new, i + j, eos) for j, (_, q) in enumerate(chunk)])
            rounds = [r for q in out for r in q.rounds if r.conf_logit is not None]
            if cal.add(rounds):
                dec.calibration = cal.cal  # what the engine replica does when the actor publishes
            curves[name].append(
                {
                    "requests": i + len(chunk),
                    "domain": chunk[-1][0],
                    "live_error": cal.live_error(),
                    **dec.calibration.to_dict(),
                }
            )
        print(
            f"[drift] {i + len(chunk):4d} requests ({chunk[-1][0]:5s}): "
            + ", ".join(f"{n}: error {c[-1]['live_error']:.3f}" for n, c in curves.items()),
            flush=True,
        )
    pre = [c["live_error"] for c in curves["with calibration actor"] if c["domain"] == "code"][-3:]
    level = float(np.mean(pre))
    recovered = next(
        (
            c["requests"] - args.before
            for c in curves["with calibration actor"]
            if c["domain"] == "prose"
            and c["requests"] - args.before > args.window // args.max_new
            and c["live_error"] <= level * 1.25 + 0.01
        ),
        None,
    )
    final = {n: c[-1]["live_error"] for n, c in curves.items()}
    print(
        f"[drift] pre-shift live error {level:.3f}; with the actor it returned within 1.25x+0.01 after "
        f"{recovered} prose requests; final errors {json.dumps({k: round(v, 3) for k, v in final.items()})}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drift.json").write_text(
        json.dumps(
            {
                "code_calibration": code_cal.to_dict(),
                "curves": curves,
                "pre_shift": level,
                "recovered_after_requests": recovered,
            },
            indent=1,
        )
    )
    plot(curves, args.before, out / "drift.png")


def plot(curves, shift, path):
    fig, axes = plots.figure(size=(7, 4))
    ax = axes[0][0]
    for name, c in curves.items():
        ax.plot([x["requests"] for x in c], [x["live_error"] for x in c], "-o", ms=3, label=name)
    ax.axvline(shift, color="k", ls="--", lw=0.8)
    ax.text(shift, ax.get_ylim()[1] * 0.95, " code -> prose", fontsize=8)
    ax.set_xlabel("requests served")
    ax.set_ylabel("live calibration error")
    plots.finish(fig, path, [ax])


if __name__ == "__main__":
    run_main(main)
