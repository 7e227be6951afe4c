"""Train the small built-in target model (a transformers Qwen3ForCausalLM) on the built-in corpora.

    python jobs/train_target.py --set target_train.minutes=60
    python jobs/train_target.py --set target_train.out_dir=platform/dspark/target/builtin

Resumes from <out_dir>/checkpoint.pt when present. Saves HF format (safetensors, config, tokenizer)
and target_card.json (recipe, corpus hash, training tokens, held-out quality vs a unigram baseline).
"""

import argparse

import _bootstrap  # noqa: F401  (makes `dspark` importable from a plain checkout)

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main


def main(argv=None):
    args = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    cfg = config_from_args(args)
    from dspark.target.train import train_target

    train_target(cfg)


if __name__ == "__main__":
    run_main(main)
