"""What reproducible (seeded) sampling costs in accepted drafts: the same drafter and held-out prompts at
T=1, full-length verification, decoded once with standard rejection sampling (requests without a seed)
and once with Gumbel-max sampling keyed by (seed, position) (requests with a seed). Prints tau and the
conditional acceptance per position for both; prints, never asserts.

    python bench/seeded_sampling.py --drafter URI [--prompts 16] [--max-new 96] [--set target.dtype=bfloat16]
"""

from __future__ import annotations

import argparse

from dspark import evaluation
from dspark import target as targets
from dspark.config import add_config_args, config_from_args, run_main
from dspark.corpus.sources import Corpus
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.models import fetch_drafter


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--drafter", required=True, help="drafter folder or URI")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per domain")
    p.add_argument("--max-new", type=int, default=96)
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    tgt = targets.load_from_config(cfg.target)
    drafter = fetch_drafter(cfg, args.drafter, tgt)
    gamma = cfg.eval.gamma or drafter.c.gamma
    corpus = Corpus.load(cfg.corpus)
    print("| domain | sampling | rounds | tau | conditional acceptance by position |\n|---|---|---|---|---|")
    for domain in ("code", "prose"):
        prompts = evaluation.prompts_for(cfg, corpus, domain, "heldout", args.prompts, tgt.tokenizer)
        for name, reproducible in (("rejection", False), ("seeded (Gumbel-max)", True)):
            dec = SpeculativeDecoder(tgt.model, drafter, gamma=gamma, max_slots=1)
            reqs = dec.run(
                [
                    Request(q, SamplingParams(1.0), args.max_new, i, tgt.eos_token_ids, reproducible=reproducible)
                    for i, q in enumerate(prompts)
                ]
            )
            cond, _ = evaluation.acceptance(reqs, gamma)
            rounds = sum(len(r.rounds) for r in reqs)
            tau = sum(x.accepted + 1 for r in reqs for x in r.rounds) / rounds
            print(f"| {domain} | {name} | {rounds} | {tau:.3f} | {' '.join(f'{c:.2f}' for c in cond)} |")


if __name__ == "__main__":
    run_main(main)
