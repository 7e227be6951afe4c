"""Profile SPS(B), the target's steps per second at a total batch of B tokens (over up to --max-requests
requests), on this device, and with --drafter also t_d(R), the drafter's round time at R requests, and the
verification of gamma + 1 tokens for each of R requests (t_v); save the table (with hardware info) for the
scheduler:

    python jobs/profile_sps.py --out results/sps.json --batches 1,2,4,8,16,32,64 --context 256
    python jobs/profile_sps.py --config configs/smollm2.yaml --drafter s3://BUCKET/drafters/NAME --out sps.json
    python jobs/profile_sps.py --set target.name_or_path=Qwen/Qwen3-4B --set target.device=cuda \\
        --set target.dtype=bfloat16 --out sps-h200.json

Serving loads such a table with --set serve.sps_table=FILE (production hardware profiled elsewhere).
"""

import argparse
import json

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,2,4,8,12,16,24,32,48,64,96,128")
    p.add_argument("--context", type=int, default=256, help="KV-cache tokens each request already holds")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--drafter", default="", help="drafter URI: also profile its drafting round per request count")
    p.add_argument("--max-requests", type=int, default=64, help="requests a batch is spread over (at most)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    from dspark import target as targets
    from dspark.decoding.profile import profile
    from dspark.models import fetch_drafter

    tgt = targets.load_from_config(cfg.target)
    drafter = fetch_drafter(cfg, args.drafter, tgt) if args.drafter else None
    table = profile(
        tgt.model,
        [int(b) for b in args.batches.split(",")],
        context=args.context,
        repeats=args.repeats,
        max_requests=args.max_requests,
        drafter=drafter,
        gamma=drafter.c.gamma if drafter is not None else 0,
    )
    table.hardware.update({"target": cfg.target.name_or_path, "context": args.context, "repeats": args.repeats})
    table.hardware.update({"drafter": args.drafter} if args.drafter else {})
    table.save(args.out)
    for b, s in zip(table.batch, table.sps):
        print(f"B={b:4d}  {s:8.2f} steps/s  {b * s:9.0f} tokens/s  forward {1000 / s:7.1f} ms")
    for r, t in zip(table.draft_batch, table.draft_s):
        print(f"R={r:4d}  drafting round {1000 * t:7.1f} ms")
    for r, t in zip(table.draft_batch, table.verify_s):
        print(f"R={r:4d}  verify {table.verify_tokens} tokens each {1000 * t:7.1f} ms")
    print(f"[sps] saved {args.out}: {json.dumps(table.hardware)}")


if __name__ == "__main__":
    run_main(main)
