"""Scheduler simulator: record per-round traces from the real drafter + target, replay them for R
concurrent requests through every verification policy with an SPS(B) table.

    python bench/scheduler_sim.py --drafter results/comparison/dspark [--sps results/sps.json]
    python bench/scheduler_sim.py --config configs/smollm2.yaml --drafter DRAFTER --gamma 4 [--prompts 8]

1. Trace: speculative decoding of the built-in corpus's held-out code and prose prompts on the
   configured target (the built-in one by default; the drafter must have been trained for it; T=1,
   every draft verified) with the drafter's calibrated confidences; per round the prefix survival
   a_1..a_gamma and how many drafts the target accepted (n). Verifying only l drafts of such a round
   accepts min(n, l) and emits one more token (the acceptance process is sequential, so truncation
   is exact).
2. Replay: R request slots, each drawing rounds from the trace; per step every policy chooses l_r,
   the step takes t_v(R, sum(1 + l_r)) seconds (1 / SPS(B) for a table without a verification profile:
   `SPSTable.verify_time`) and yields sum(min(n_r, l_r) + 1) tokens. The async
   variant sizes its capacity from the survival of two steps earlier.
3. Tables: the SPS table of the configured target measured on this machine (or --sps), and
   synthetic smooth / cliff tables. The target is loaded only to record a trace or to measure SPS.
Prints accepted tokens/s, mean verification budget per request and verified-token waste for
R = 1, 2, 4, ..., 256 and every policy, and writes a PNG of throughput and budget vs R.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dspark import evaluation, plots
from dspark import target as targets
from dspark.calibration import sts
from dspark.config import add_config_args, config_from_args, run_main
from dspark.corpus.sources import Corpus
from dspark.decoding.profile import profile
from dspark.decoding.sampling import SamplingParams
from dspark.models import load_drafter
from dspark.scheduling import policies
from dspark.scheduling.sps import SPSTable


def record(cfg, tgt, drafter_path: str, prompts_per_domain: int, max_new: int, gamma: int) -> dict:
    drafter = load_drafter(drafter_path, tgt.model, tgt.weights_sha256)
    cal = sts.load(drafter_path)
    corpus = Corpus.load(cfg.corpus)
    out = {}
    for dom in ("code", "prose"):
        prompts = evaluation.prompts_for(cfg, corpus, dom, "heldout", prompts_per_domain, tgt.tokenizer)
        reqs = evaluation.decode(
            tgt.model, drafter, prompts, SamplingParams(1.0), gamma, max_new, tgt.eos_token_ids, seed=0, calibration=cal
        )
        rounds = [r for q in reqs for r in q.rounds if r.survival is not None]
        out[dom] = {"survival": [r.survival for r in rounds], "accepted": [r.accepted for r in rounds]}
    out["calibration"] = cal.to_dict() if cal else None
    return out


def replay(
    trace: dict, R: int, sps: SPSTable, policy: str, steps: int, seed: int = 0, static: int = 0, threshold: float = 0.5
) -> dict:
    a_all = np.array(trace["survival"])
    n_all = np.array(trace["accepted"])
    rng = np.random.default_rng(seed)  # the same rounds for every policy (common random numbers)
    gamma = a_all.shape[1]
    choose = policies.make_policy(policy, sps, static, threshold)
    tokens = time_s = verified = wasted = 0.0
    for _ in range(steps):
        idx = rng.integers(0, len(a_all), R)
        a, n = a_all[idx], n_all[idx]
        ell = np.asarray(choose(a, R, gamma))
        ell = np.minimum(ell, gamma)
        acc = np.minimum(n, ell)
        tokens += float((acc + 1).sum())
        time_s += sps.verify_time(int(R + ell.sum()), R)  # 1/SPS(B) unless the table profiled verification
        verified += float(ell.sum())
        wasted += float((ell - acc).sum())
    return {
        "throughput": tokens / time_s,
        "budget": verified / (steps * R),
        "waste": wasted / verified if verified else 0.0,
        "tokens_per_step": tokens / steps,
    }


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--drafter", default="results/comparison/dspark")
    p.add_argument("--trace", default="", help="a trace JSON saved by an earlier run (skips recording)")
    p.add_argument("--sps", default="", help="measured SPS table JSON (default: profile the configured target now)")
    p.add_argument("--out", default="results/scheduler_sim")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--gamma", type=int, default=7)
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = None if args.trace and args.sps else targets.load_from_config(cfg.target)
    if args.trace:
        trace = json.loads(Path(args.trace).read_text())
    else:
        trace = record(cfg, tgt, args.drafter, args.prompts, args.max_new, args.gamma)
        (out / "trace.json").write_text(json.dumps(trace))
    if args.sps:
        measured = SPSTable.load(args.sps)
    else:
        measured = profile(tgt.model, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], repeats=5)
        measured.save(out / "sps_measured.json")
    tables = {"measured": measured, "smooth": SPSTable.synthetic("smooth"), "cliff": SPSTable.synthetic("cliff")}
    pooled = {
        "survival": trace["code"]["survival"] + trace["prose"]["survival"],
        "accepted": trace["code"]["accepted"] + trace["prose"]["accepted"],
    }
    Rs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    names = (
        ["none"]
        + [f"static{ell}" for ell in range(1, args.gamma + 1)]
        + ["threshold0.3", "threshold0.5", "greedy", "async"]
    )
    results: dict = {}
    print(
        f"scheduler_sim: {len(pooled['accepted'])} recorded rounds (code {len(trace['code']['accepted'])}, prose "
        f"{len(trace['prose']['accepted'])}), gamma {args.gamma}, {args.steps} steps per point, accepted tokens/s = "
        f"sum(min(n, l) + 1) / t_v(R, B)"
    )
    for tname, sps in tables.items():
        results[tname] = {}
        print(f"\n== SPS table: {tname} (SPS(1) = {sps(1):.1f}, SPS(64) = {sps(64):.1f}, SPS(256) = {sps(256):.1f})")
        print(
            "| R | "
            + " | ".join(["none", "best static", "thr 0.5", "greedy (Alg. 1)", "async"])
            + " | greedy/best static | async/best static | budget greedy | budget async | waste greedy |"
        )
        print("|---|" + "---|" * 10)
        for R in Rs:
            row = {}
            for name in names:
                kw = {}
                pol = name
                if name.startswith("static"):
                    pol, kw = "static", {"static": int(name[6:])}
                elif name.startswith("threshold"):
                    pol, kw = "threshold", {"threshold": float(name[9:])}
                row[name] = replay(pooled, R, sps, pol, args.steps, **kw)
            best = max((n for n in names if n.startswith("static")), key=lambda n: row[n]["throughput"])
            results[tname][R] = {**row, "best_static": best}
            th = {k: v["throughput"] for k, v in row.items()}
            print(
                f"| {R} | {th['none']:.1f} | {th[best]:.1f} ({best}) | {th['threshold0.5']:.1f} | "
                f"{th['greedy']:.1f} | {th['async']:.1f} | {th['greedy'] / th[best]:.3f} | "
                f"{th['async'] / th[best]:.3f} | "
                f"{row['greedy']['budget']:.2f} | {row['async']['budget']:.2f} | {row['greedy']['waste']:.2f} |"
            )
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, Rs, out / "scheduler_sim.png")
    print(f"\n[sim] {out}/results.json, {out}/scheduler_sim.png")


def plot(results: dict, Rs: list[int], path: Path) -> None:
    fig, axes = plots.figure(2, len(results), (5 * len(results), 7))
    for col, (tname, res) in enumerate(results.items()):
        for name, style in (("none", "k:"), ("greedy", "b-o"), ("async", "g-s"), ("threshold0.5", "m--")):
            axes[0][col].plot(Rs, [res[R][name]["throughput"] for R in Rs], style, label=name, ms=3)
            axes[1][col].plot(Rs, [res[R][name]["budget"] for R in Rs], style, label=name, ms=3)
        best = [res[R][res[R]["best_static"]]["throughput"] for R in Rs]
        axes[0][col].plot(Rs, best, "r-^", label="best static", ms=3)
        axes[0][col].set_title(f"SPS: {tname}")
        for ax, lab in ((axes[0][col], "accepted tokens / s"), (axes[1][col], "verification budget / request")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests R")
            ax.set_ylabel(lab)
    plots.finish(fig, path, [ax for row in axes for ax in row])


if __name__ == "__main__":
    run_main(main)
