"""How far an ideal parallel drafter could go on this target, per prompt set and temperature: the
conditional acceptance alpha_k of the target's own marginals at each draft position and the tau bound
(evaluation/oracle.py has the math). It needs no drafter: run it for a new target before training one.
Every `jobs/evaluate.py` / training evaluation also reports this bound beside each drafter's tau.

    python bench/oracle.py                                         # built-in target, held-out code/prose
    python bench/oracle.py --config configs/smollm2.yaml --gamma 7 --set eval.oracle_paths=64
"""

from __future__ import annotations

import argparse

from dspark import evaluation
from dspark import target as targets
from dspark.config import add_config_args, config_from_args, run_main
from dspark.corpus.sources import Corpus
from dspark.decoding.sampling import SamplingParams


def main(argv=None):
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--gamma", type=int, default=7, help="draft positions (default 7, the paper's)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    ec = cfg.eval
    tgt = targets.load_from_config(cfg.target)
    law = evaluation.training_law(cfg)
    print(
        f"target {tgt.path}; training law {evaluation.law_name(law)}; {ec.oracle_paths} paths, "
        f"{ec.oracle_drafts} draft samples per context, a context every {ec.oracle_stride} response tokens\n"
    )
    print("| prompts | T | contexts | tau bound | alpha by position |\n|---|---|---|---|---|")
    for name, prompts in evaluation.eval_prompts(cfg, tgt, Corpus.load(cfg.corpus)).items():
        for t in ec.temperatures:
            sp = SamplingParams(t)
            reqs = evaluation.decode(tgt.model, None, prompts, sp, 0, ec.max_new_tokens, tgt.eos_token_ids, ec.seed)
            alpha, tau, n = evaluation.oracle_bound(cfg, tgt.model, reqs, sp, args.gamma, law)
            print(
                f"| {name} | {t:g} | {n} | {tau:.2f} | {' '.join(f'{a:.2f}' for a in alpha)} |",
                flush=True,
            )


if __name__ == "__main__":
    run_main(main)
