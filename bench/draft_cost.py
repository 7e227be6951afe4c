"""What a drafting round costs against a target step, and how much of it the vocabulary is: the round
time t_d(R) of fresh (untrained) drafters shaped as the config trains them, with the full vocabulary
and with draft vocabularies of V_d tokens (train.draft_vocab), DSpark beside DFlash (the Markov
head's overhead), against the target's own step for R requests and its verification of gamma + 1
tokens per request. Timing does not depend on the weights or on which V_d ids are kept, so no cache
or training is needed. Prints medians, never asserts.

    python bench/draft_cost.py --config configs/smollm2.yaml --draft-vocab 0,32768,16384,8192 --requests 1,8
"""

from __future__ import annotations

import argparse

import torch

from dspark import target as targets
from dspark.config import add_config_args, config_from_args, run_main
from dspark.decoding.profile import draft_time, profile
from dspark.models import count_params
from dspark.target.taps import default_layers
from dspark.train.worker import drafter_for


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--draft-vocab", default="0,32768,16384,8192", help="V_d values to time (0: the full vocabulary)")
    p.add_argument("--requests", default="1,8", help="R: requests drafted for in one round")
    p.add_argument("--context", type=int, default=256, help="tokens each request already holds")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    torch.manual_seed(0)
    tgt = targets.load_from_config(cfg.target)
    L, V = tgt.model.config.num_hidden_layers, tgt.model.config.vocab_size
    taps = list(cfg.cache.layers) or default_layers(L, cfg.cache.num_layers)
    t, gamma = cfg.train, cfg.train.gamma
    requests = [int(r) for r in args.requests.split(",")]
    print(f"target {cfg.target.name_or_path} ({tgt.model.dtype}, {torch.get_num_threads()} threads): {L} layers V={V}")
    print(f"drafter {t.drafter} x{t.num_layers} layers, taps {taps}, gamma {gamma}, context {args.context}")
    step_ms = {}  # R -> the target's step for R requests of one token each
    for R in requests:  # over R requests: B = R tokens (a step), then B = R * (gamma + 1) (a verification)
        table = profile(tgt.model, [R, R * (gamma + 1)], args.context, args.repeats, max_requests=R)
        step_ms[R], verify = (1000 / s for s in table.sps)
        print(f"R={R}: target step {step_ms[R]:.1f} ms; verify {gamma + 1} tokens each {verify:.1f} ms")
    # DSpark's Markov overhead: the same backbone as DFlash (the confidence head is one linear layer)
    kinds = [t.drafter] + (["dflash"] if t.drafter == "dspark" else [])
    print("\n| drafter | V_d | params | " + " | ".join(f"round R={R} (ms) | / target step" for R in requests) + " |")
    print("|---|---|---|" + "---|---|" * len(requests))
    for kind in kinds:
        for vd in [int(v) for v in args.draft_vocab.split(",")]:
            c = cfg.model_copy(deep=True)
            c.train.drafter = kind
            ids = list(range(vd)) if 0 < vd < V else None
            drafter = drafter_for(c, taps, {"name": cfg.target.name_or_path}, "cpu", ids).eval()
            drafter.to(next(tgt.model.parameters()).dtype).pack_like(tgt.model)  # as load_drafter serves it
            cells = []
            for R in requests:
                ms = 1000 * draft_time(tgt.model, drafter, R, gamma, args.context, args.repeats)
                cells.append(f"{ms:.1f} | {ms / step_ms[R]:.2f}")
            label = vd if 0 < vd < V else f"{V} (full)"
            print(f"| {kind} | {label} | {count_params(drafter) / 1e6:.1f} M | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    run_main(main)
