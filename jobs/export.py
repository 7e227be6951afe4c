"""Export a trained drafter for other engines: the `speculators` layout that vLLM documents, or DeepSpec's
checkpoint layout that SGLang reads (config.json + bf16 model.safetensors each; dspark.export.speculators
and dspark.export.deepspec give the key and convention mapping).

    python jobs/export.py --drafter s3://dspark/main/drafters/run1 --out exports/run1
    python jobs/export.py --config configs/smollm2.yaml --drafter .local/store/drafters/smollm2-dspark \\
        --out exports/smollm2-dspark --reference
    vllm serve TARGET --speculative-config '{"model": "exports/run1", "method": "dspark", "num_speculative_tokens": 7}'
    python jobs/export.py --drafter s3://dspark/main/drafters/run1 --out exports/run1-deepspec --layout deepspec

The target (target.*) must be the one the drafter was trained for: its lm_head rows become the
drafter's, and the verifier named in config.json is `--verifier` (default: the target's hub id, or
its local folder). `--reference` also writes reference.safetensors: one block's inputs and our draft
and confidence logits, which bench/speculators_check.py reproduces with the speculators package and
bench/deepspec_check.py with DeepSpec's model classes.
"""

import argparse
import tempfile

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main

REFERENCE_TEXT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--drafter", required=True, help="drafter folder or storage URI")
    p.add_argument("--out", required=True, help="local folder to write the export into")
    p.add_argument("--verifier", default="", help="verifier name_or_path written into config.json")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--layout", default="speculators", choices=["speculators", "deepspec"])
    p.add_argument("--reference", action="store_true", help="also write reference.safetensors (one block)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    import torch
    from safetensors.torch import save_file

    from dspark import export
    from dspark import target as targets
    from dspark.artifacts import download_drafter
    from dspark.models import load_drafter

    tgt = targets.load_from_config(cfg.target)
    verifier = args.verifier or export.default_verifier(tgt)
    with tempfile.TemporaryDirectory(prefix="drafter-") as d:
        local = download_drafter(cfg, args.drafter, d)
        drafter = load_drafter(local, tgt.model, tgt.weights_sha256)
        write = export.export_deepspec if args.layout == "deepspec" else export.export_speculators
        out = write(drafter, tgt, args.out, verifier, getattr(torch, args.dtype), local)
    c = drafter.c
    if args.layout == "deepspec":
        what = f"DeepSpec {c.kind}{f' ({c.markov} Markov head)' if c.kind == 'dspark' else ''}"
        layers = f"target_layer_ids {c.tap_layers} = our taps"
    else:
        what = f"speculators {export.algorithm(drafter)}"
        layers = f"aux hidden-state ids {export.aux_layer_ids(c.tap_layers)} = our taps {c.tap_layers} + 1"
    print(f"[export] {args.drafter} -> {out} ({what}, {args.dtype}; verifier {verifier}; {layers})")
    if args.reference:
        ids = tgt.tokenizer(REFERENCE_TEXT)["input_ids"]
        p = len(ids) // 2
        save_file(export.reference(drafter, tgt, ids, p), str(out / "reference.safetensors"))
        print(f"[export] reference block at position {p} of {len(ids)} tokens -> {out / 'reference.safetensors'}")


if __name__ == "__main__":
    run_main(main)
