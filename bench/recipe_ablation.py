"""What each difference between this project's DSpark training recipe and the paper's / DeepSpec's is
worth in held-out tau (the drafters issue's "recipe deviations").

Every row trains the same DSpark drafter (2 layers, vanilla Markov head, gamma 7) for --steps optimizer
steps with ONE setting changed, through bench/drafter_comparison.py's `train_variant` (the same cache
rows in the same order, the same initialisation), and reports the held-out expected tau (teacher-forced,
T=1: the training loss's own acceptance estimate, on the rows --heldout keeps out) beside the recipe
row's. A second seed of the recipe row is the noise floor: a difference below it is not a finding.

    python jobs/build_cache.py --set cache.name=builtin-l12345 --set "cache.layers=[1,2,3,4,5]" \\
        --set cache.max_examples=1024 --set cache.shard_rows=128 --set cache.max_new_tokens=96
    python jobs/build_cache.py --set cache.name=builtin-l135 --set "cache.layers=[1,3,5]" \\
        --set cache.source_uri=.local/store/caches/builtin-l12345     # and [1,2,3] into builtin-l123
    python bench/recipe_ablation.py --cache .local/store/caches/builtin-l135 \\
        --taps-cache .local/store/caches/builtin-l123 --steps 600 --out results/recipe_ablation

Rows (--rows picks some; the recipe row is this project's defaults):
  seed43      the recipe again with another initialisation and data order (the noise floor)
  betas       Adam betas (0.9, 0.999): DeepSpec's AdamW keeps torch's default (the recipe: 0.95)
  decay4      slot weight exp(-k/4), DeepSpec's configs (the recipe, as the paper: exp(-k/gamma))
  anchors128  the paper / DeepSpec sample 512 anchors per sequence: about every response position of
              these rows (the recipe: 32, for the cost of a CPU step)
  lr1e-3      the comparison bench's learning rate (the recipe and DeepSpec: 6e-4)
  taps123     taps [1, 2, 3], the earlier default: the target's lowest layers (the recipe and the paper:
              spread over the whole depth); needs --taps-cache, a cache of the same rows with those taps
  kl          KL(p_t || p_d) as the distribution term (the paper: L1 = 2 TV)
  top         draft layers start as the target's top layers (configs/smollm2.yaml's setting; neither
              reference does it: their drafters start from random weights, as the recipe does)
Equal steps, not equal time (a row's seconds, in results.json, depend on what else ran). Writes
results.json and results.md into --out; each row's drafter is kept there, so a rerun reuses it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafter_comparison import train_variant  # the sibling script (bench/ is on sys.path when run)

from dspark import target as targets
from dspark.cache.read import open_cache
from dspark.config import add_config_args, config_from_args, load_config, run_main
from dspark.errors import UserError
from dspark.storage import Storage

# row id -> (variant, --set overrides over the recipe, trained on --taps-cache, what the reference does)
ROWS = {
    "recipe": ("dspark", [], False, "this project's defaults"),
    "seed43": ("dspark", ["train.seed=43"], False, "noise floor"),
    "betas": ("dspark", ["train.adam_betas=[0.9,0.999]"], False, "DeepSpec's AdamW"),
    "decay4": ("dspark", ["train.slot_decay=4"], False, "DeepSpec's configs"),
    "anchors128": ("dspark", ["train.anchors_per_seq=128"], False, "paper / DeepSpec: 512"),
    "lr1e-3": ("dspark", ["train.lr=1e-3"], False, "the comparison bench"),
    "taps123": ("dspark", [], True, "the earlier default"),
    "kl": ("dspark_kl", [], False, "an ablation of the paper's L1"),
    "top": ("dspark", ["train.init_layers=target_top"], False, "neither: random weights"),
}
# a CPU-sized batch; everything else is the config's train.* (the project's recipe)
BENCH_DEFAULTS = ["train.global_batch=16", "train.micro_batch=8"]


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--cache", required=True, help="the recipe's cache (taps spread over the depth)")
    p.add_argument("--taps-cache", default="", help="the same rows tapped at the target's lowest layers")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--heldout", type=float, default=0.1, help="fraction of cache rows held out")
    p.add_argument("--rows", default="", help="only these rows (comma-separated names; default all)")
    p.add_argument("--out", default="results/recipe_ablation")
    args = p.parse_args(argv)
    args.overrides = BENCH_DEFAULTS + args.overrides
    cfg = config_from_args(args)
    picked = args.rows.split(",") if args.rows else list(ROWS)
    if unknown := set(picked) - set(ROWS):
        raise UserError(f"--rows: unknown {sorted(unknown)} (rows: {', '.join(ROWS)})")
    rows = {n: r for n, r in ROWS.items() if n in picked}
    if any(r[2] for r in rows.values()) and not args.taps_cache:
        rows = {n: r for n, r in rows.items() if not r[2]}
        print("[ablation] no --taps-cache: the taps row is left out")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = targets.load_from_config(cfg.target)
    storage = Storage.from_config(cfg.storage)
    same_target = {"target.weights_sha256": tgt.weights_sha256}
    caches = {False: open_cache(args.cache, storage, same_target)}
    if args.taps_cache:
        caches[True] = open_cache(args.taps_cache, storage, same_target)
    done = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    for name, (variant, overrides, taps, _) in rows.items():
        if name in done and done[name]["steps"] == args.steps:
            continue
        rcfg = load_config(args.config, [*args.overrides, *overrides])
        _, info = train_variant(
            variant, tgt, caches[taps], rcfg, args.steps, out / name, print, args.steps, args.heldout
        )
        end = info["curve"][-1]
        done[name] = {
            "steps": args.steps,
            "tokens": info["tokens"],
            "train_s": info["train_s"],
            "layers": caches[taps].manifest.layers,
            "overrides": overrides,
            **{k: end[k] for k in end if k == "expected_tau" or k.startswith("accept_")},
        }
        (out / "results.json").write_text(json.dumps(done, indent=1) + "\n")
    base = done.get("recipe", {}).get("expected_tau")
    lines = [
        f"held-out expected tau (T=1, teacher-forced) after {args.steps} steps, cache {args.cache}",
        "",
        "| row | reference | setting | taps | held-out tau | vs recipe | accept 1 / 2 / 3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (variant, overrides, taps, ref) in ROWS.items():
        if name not in done:
            continue
        r = done[name]
        setting = ", ".join(overrides) or ("dist_loss=kl" if variant.endswith("_kl") else "-")
        delta = f"{r['expected_tau'] - base:+.3f}" if base is not None else "-"
        acc = " / ".join(f"{r[f'accept_{k}']:.3f}" for k in (1, 2, 3))
        lines.append(f"| {name} | {ref} | {setting} | {r['layers']} | {r['expected_tau']:.3f} | {delta} | {acc} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_main(main)
