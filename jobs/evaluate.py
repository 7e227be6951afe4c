"""Offline evaluation: held-out prompts per domain -> tau, conditional acceptance, prefix survival,
draft/verify latency and speedup over plain target decoding; confidence calibration (STS) for
drafters with a confidence head. Writes JSON + markdown + PNG to eval.out_dir and MLflow.

    python jobs/evaluate.py --drafter dspark=results/drafters/dspark --drafter dflash=results/drafters/dflash
    python jobs/evaluate.py --drafter d=s3://dspark/main/drafters/run1 --set eval.temperatures=[1.0]

A drafter given by URI is copied locally first (a few MB); calibration.json is written next to a
local drafter when STS is fitted (`--no-calibrate` skips it).
"""

import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument(
        "--drafter", action="append", default=[], metavar="NAME=PATH", help="drafter to evaluate (repeatable)"
    )
    p.add_argument("--no-calibrate", action="store_true", help="do not fit STS temperatures")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    from dspark import evaluation, tracking
    from dspark import target as targets
    from dspark.artifacts import download_drafter
    from dspark.calibration import sts
    from dspark.corpus.sources import Corpus
    from dspark.errors import UserError
    from dspark.models import load_drafter

    if not args.drafter:
        raise UserError("--drafter NAME=PATH: give at least one drafter to evaluate")
    tgt = targets.load_from_config(cfg.target)
    drafters, paths = {}, {}
    for spec in args.drafter:
        name, sep, path = spec.partition("=")
        if not sep:
            raise UserError(f"--drafter {spec!r}: expected NAME=PATH")
        local = download_drafter(cfg, path, Path(cfg.eval.out_dir) / "drafters" / name)
        drafters[name] = load_drafter(local, tgt.model, tgt.weights_sha256)
        paths[name] = local
        if sts.load(local):
            print(f"[eval] {name}: has a {sts.FILE}; refitting it on validation prompts")
    out = Path(cfg.eval.out_dir)
    with tracking.run(cfg, "evaluate") as tracker:
        tracker.params(
            {
                **{k: v for k, v in cfg.flat().items() if k.startswith(("eval.", "target."))},
                **{f"drafter.{k}": v for k, v in paths.items()},
            }
        )
        res = evaluation.evaluate(cfg, tgt, drafters, Corpus.load(cfg.corpus), out, calibrate=not args.no_calibrate)
        for name in evaluation.save_calibrations(res, paths):
            print(
                f"[eval] {name}: calibration fitted at gamma {cfg.eval.gamma}, trained at {drafters[name].c.gamma}: "
                "not saved with the drafter (it is in results.json)"
            )
        evaluation.log_results(tracker, res, out)
    sys.stdout.write((out / "results.md").read_text())
    print(
        f"[eval] results in {out} (results.json, results.md, conditional acceptance, reliability and "
        "threshold-sweep PNGs)"
    )


if __name__ == "__main__":
    run_main(main)
