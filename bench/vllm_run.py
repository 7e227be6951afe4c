"""Run vLLM (CPU or GPU build, its own venv) on the prompts bench/vllm_compare.py wrote, target-only and
with an exported drafter; writes vllm.json next to them: tokens/s at batch 1 and at batch B, and the
drafter's acceptance per draft position (vLLM's spec-decode counters). Imports nothing from this
project (vLLM pins its own torch and transformers).

    VLLM_PY bench/vllm_run.py OUT_DIR          # OUT_DIR/prompts.json from bench/vllm_compare.py
"""

import json
import sys
import time
from pathlib import Path

from vllm import LLM, SamplingParams, TokensPrompt


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int) -> float:
    """Decode tokens/s with `batch` prompts in flight (greedy), prompts taken in order."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, seconds = 0, 0.0
    for i in range(0, len(prompts), batch):
        chunk = [TokensPrompt(prompt_token_ids=p) for p in prompts[i : i + batch]]
        t0 = time.perf_counter()
        outs = llm.generate(chunk, sp, use_tqdm=False)
        seconds += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds


def spec_counters(llm: LLM) -> tuple[int, list[int]]:
    drafts, per_pos = 0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in m.values]
    return drafts, per_pos


def main():
    out = Path(sys.argv[1])
    job = json.loads((out / "prompts.json").read_text())
    prompts = [p for ps in job["prompts"].values() for p in ps]
    common = dict(
        model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True, seed=0
    )
    res: dict = {}
    llm = LLM(**common)
    run(llm, prompts[:1], 8, 1)  # warm-up
    res["target_only"] = {f"batch{b}": run(llm, prompts, job["max_tokens"], b) for b in (1, job["batch"])}
    del llm
    spec = {"model": job["export"], "method": job["method"], "num_speculative_tokens": job["gamma"]}
    llm = LLM(**common, speculative_config=spec, disable_log_stats=False)
    run(llm, prompts[:1], 8, 1)
    d0, p0 = spec_counters(llm)
    res["speculative"] = {"batch1": run(llm, prompts, job["max_tokens"], 1)}
    drafts, per_pos = spec_counters(llm)
    per_pos = [a - b for a, b in zip(per_pos, p0 or [0] * len(per_pos))]
    res["drafts"] = drafts - d0
    res["survival"] = [a / max(1, drafts - d0) for a in per_pos]  # P(positions 1..k all accepted)
    res["speculative"][f"batch{job['batch']}"] = run(llm, prompts, job["max_tokens"], job["batch"])
    (out / "vllm.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
