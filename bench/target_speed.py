"""What the target costs on this machine, with the decoding runner every drafter is measured against:
load time (GGUF conversion and the converted copy), target-only decoding tokens/s at batch 1 and 16,
and the cost of verifying k = 2, 4, 8 new tokens relative to one (batch 1, the paper's regime: when
k tokens cost about one, speculation pays). Prints what it measured (medians), never asserts.

    python bench/target_speed.py --config configs/smollm2.yaml [--dtypes float32,bfloat16] [--context 256]
    python bench/target_speed.py --config configs/smollm2.yaml --dtypes bfloat16 --skip-load --threads 1,2
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import threading
import time

import torch

from dspark import evaluation
from dspark import target as targets
from dspark.config import Config, add_config_args, config_from_args, run_main
from dspark.corpus.conversations import load_jsonl, spread
from dspark.corpus.sources import Corpus
from dspark.corpus.tokenizer import chat_ids
from dspark.decoding.profile import profile
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.storage import Storage


def load_times(cfg) -> None:
    """A GGUF target: conversion into a fresh folder, then a load of the converted copy."""
    name = cfg.target.name_or_path
    if not (name.endswith(".gguf") or name.startswith("pkg://")):
        return
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        path = targets.resolve(name, cache_dir=d)
        t1 = time.perf_counter()
        targets.load(path)
        t2 = time.perf_counter()
    print(f"load: GGUF -> safetensors conversion {t1 - t0:.1f} s; load of the converted copy {t2 - t1:.1f} s\n")


def first_turns(cfg, tgt, n: int) -> list[list[int]]:
    """The first user turn of each conversation of eval.prompt_sets, in the target's chat template
    (the built-in corpus's held-out prompts when no set is named)."""
    if not cfg.eval.prompt_sets:
        corpus = Corpus.load(cfg.corpus)
        return [
            q for d in ("code", "prose") for q in evaluation.prompts_for(cfg, corpus, d, "heldout", n, tgt.tokenizer)
        ]
    storage = Storage.from_config(cfg.storage)
    convs = [c for uri in cfg.eval.prompt_sets.values() for c in load_jsonl(uri, storage).conversations]
    return [
        chat_ids(tgt.tokenizer, c.messages([]), chat_template_kwargs=cfg.target.chat_template_kwargs)
        for c in spread(convs, n)
    ]


def decode_tps(model, prompts: list[list[int]], batch: int, max_new: int, eos) -> float:
    """Target-only greedy decoding of `batch` requests at once (continuous batching, no drafter):
    generated tokens per second of wall time, prefill included."""
    dec = SpeculativeDecoder(model, None, gamma=0, max_slots=batch)
    reqs = [Request(p, SamplingParams(0.0), max_new, i, ()) for i, p in enumerate(prompts[:batch])]
    t0 = time.perf_counter()
    dec.run(reqs)
    dt = time.perf_counter() - t0
    return sum(len(r.out) for r in reqs) / dt


THREAD_CASES = {  # where a fresh process decodes at batch 1 (the engine replica's situation is "engine")
    "main": "on the main thread",
    "engine": "on a second thread; the main thread ran no parallel torch op (the engine replica)",
    "shared": "on a second thread after the main thread decoded with the same threads (the replica before)",
}


def thread_tps(cfg_json: str, threads: int, case: str, max_new: int) -> float:
    """decode_tps at batch 1 with `threads` torch threads in this (fresh) process, in one of THREAD_CASES.
    Torch's OpenMP pool belongs to the thread that runs a parallel op and lives as long as it: a pool
    left on the main thread slows a second thread's decoding, hence one process per measurement."""
    cfg = Config.model_validate_json(cfg_json)
    torch.set_num_threads(threads)
    tgt = targets.load_from_config(cfg.target.model_copy(update={"threads": threads}))
    prompt, out = first_turns(cfg, tgt, 1)[0], []
    if case == "main":
        decode_tps(tgt.model, [prompt], 1, 4, ())  # warm-up
        return decode_tps(tgt.model, [prompt], 1, max_new, ())
    if case == "shared":
        decode_tps(tgt.model, [prompt], 1, 4, ())

    def run():
        torch.set_num_threads(threads)
        decode_tps(tgt.model, [prompt], 1, 4, ())
        out.append(decode_tps(tgt.model, [prompt], 1, max_new, ()))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return out[0]


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-new", type=int, default=64, help="tokens generated per request")
    p.add_argument("--context", type=int, default=256, help="context length for the verify-cost forwards")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-load", action="store_true", help="do not time the GGUF conversion")
    p.add_argument(
        "--threads",
        default="",
        help="also decode at batch 1 with these torch thread counts (e.g. 1,2), each in a fresh process: "
        "on the main thread, on a second thread as the serving engine does, and on a second thread beside "
        "a main-thread OpenMP pool",
    )
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    if not args.skip_load:
        load_times(cfg)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [1, 2, 4, 8]
    print(
        f"torch threads {torch.get_num_threads()}; {args.max_new} new tokens per request; "
        f"verify cost at a {args.context}-token context, median of {args.repeats}\n"
    )
    print(
        "| dtype | "
        + " | ".join(f"tok/s batch {b}" for b in batches)
        + " | "
        + " | ".join(f"verify {k} / verify 1" for k in ks[1:])
        + " | verify 1 ms |"
    )
    print("|---" * (len(batches) + len(ks) + 1) + "|")
    for dtype in [targets.resolve_dtype(d, cfg.target.device) for d in args.dtypes.split(",")]:
        cfg.target.dtype = dtype
        tgt = targets.load_from_config(cfg.target)
        prompts = first_turns(cfg, tgt, max(batches))
        prompts = (prompts * (max(batches) // len(prompts) + 1))[: max(batches)]
        decode_tps(tgt.model, prompts, 1, 4, ())  # warm-up
        tps = [decode_tps(tgt.model, prompts, b, args.max_new, ()) for b in batches]
        sps = profile(tgt.model, ks, context=args.context, repeats=args.repeats, max_requests=1)  # batch 1
        cost = {k: 1 / sps(k) for k in ks}  # seconds per forward of k new tokens
        print(
            f"| {dtype} | "
            + " | ".join(f"{x:.1f}" for x in tps)
            + " | "
            + " | ".join(f"{cost[k] / cost[1]:.2f}" for k in ks[1:])
            + f" | {1000 * cost[1]:.1f} |",
            flush=True,
        )
        spawn = multiprocessing.get_context("spawn")
        for n in [int(x) for x in args.threads.split(",") if x]:
            runs: dict = {case: [] for case in THREAD_CASES}
            for _ in range(3):  # interleaved: a slow spell of the machine falls on every case
                for case in runs:
                    with spawn.Pool(1) as pool:
                        runs[case].append(pool.apply(thread_tps, (cfg.model_dump_json(), n, case, args.max_new)))
            for case, what in THREAD_CASES.items():
                print(
                    f"  {dtype}, {n} torch threads, batch 1, {what}: "
                    f"{statistics.median(runs[case]):.1f} tok/s (median of 3)",
                    flush=True,
                )
        del tgt


if __name__ == "__main__":
    run_main(main)
