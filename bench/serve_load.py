"""HTTP load on the Ray Serve application (loopback only, bounded in requests and time): aggregate
tokens/s, per-user tokens/s, p50/p99 latency, time to first token, mean verification budget and the
share of rounds that drafted, at each concurrency, for target-only decoding, static lengths, and
DSpark's adaptive policy (Algorithm 1 priced with the drafting round's time, and the draft gate that
skips drafting when it does not pay), also with the gate off (drafting every round).

    python bench/serve_load.py --drafter s3://dspark/quickstart/drafters/quickstart [--concurrency 1,4,16]
    python bench/serve_load.py --config configs/smollm2.yaml --drafter DRAFTER --concurrency 1,4,8

Serves the configured target (the built-in one by default; the drafter must have been trained for
it) on 127.0.0.1 with the bench's settings per mode (drafter, port, serve.max_batch = the largest
concurrency, no online calibration, the mode's policy) over the --config file's; --set goes over
both. Prompts: the first user turn of each eval.prompt_sets conversation, sent as chat (the SmolLM2
config), else the built-in corpus's held-out code and prose prompts as plain text. Each user sends
them one after another (T=1, max_tokens 64) for --seconds or --requests per user, whichever ends
first. Every mode of one run sees the same prompts. Writes a table and a throughput vs per-user
speed PNG (the paper's Fig. 7 axes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from ray import serve

from dspark import plots
from dspark.config import add_config_args, config_from_args, load_config, run_main
from dspark.corpus.conversations import load_jsonl, spread
from dspark.corpus.examples import split_examples
from dspark.corpus.sources import Corpus
from dspark.errors import UserError
from dspark.services import free_port
from dspark.storage import Storage
from serving.app import run_local


def bench_prompts(cfg) -> list[dict]:
    """Request bodies without sampling fields: chat turns from eval.prompt_sets, else completions of the
    built-in corpus's held-out code and prose."""
    if cfg.eval.prompt_sets:
        storage = Storage.from_config(cfg.storage)
        convs = [c for uri in cfg.eval.prompt_sets.values() for c in load_jsonl(uri, storage).conversations]
        return [{"messages": [{"role": "user", "content": c.turns[0]}]} for c in convs]
    corpus = Corpus.load(cfg.corpus)
    return [
        {"prompt": e.prompt}
        for d in ("code", "prose")
        for e in spread(split_examples(corpus, d, "heldout", cfg.corpus), 32)
    ]


async def user(client, url, prompts, deadline, max_requests, max_tokens, out):
    i = 0
    while time.perf_counter() < deadline and i < max_requests:
        body = {**prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 1.0, "seed": i}
        t0 = time.perf_counter()
        r = await client.post(url + ("/v1/chat/completions" if "messages" in body else "/v1/completions"), json=body)
        dt = time.perf_counter() - t0
        if r.status_code == 200:
            b = r.json()
            spec = b["speculative"]
            drafted = spec["drafted_rounds"] / max(1, spec["rounds"])
            out.append((dt, b["usage"]["completion_tokens"], spec["mean_verify_len"], b["timing"]["ttft_s"], drafted))
        i += 1


async def load(url, prompts, users, seconds, max_requests, max_tokens):
    out: list = []
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                user(client, url, prompts[u::users] or prompts, t0 + seconds, max_requests, max_tokens, out)
                for u in range(users)
            )
        )
        wall = time.perf_counter() - t0
    lat = sorted(x[0] for x in out)
    return {
        "requests": len(out),
        "tok_s": sum(x[1] for x in out) / wall,
        "per_user_tok_s": statistics.mean(x[1] / x[0] for x in out),
        "p50": lat[len(lat) // 2],
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "budget": statistics.mean(x[2] for x in out),
        "ttft_p50": statistics.median(x[3] for x in out if x[3] is not None),
        "drafting_share": statistics.mean(x[4] for x in out),
    }


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--drafter", default="results/comparison/dspark")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--requests", type=int, default=8, help="per user, per point")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--static", default="1,2,4", help="static lengths to compare")
    p.add_argument("--modes", default="", help="only these modes (comma-separated names; default all)")
    p.add_argument("--out", default="results/serve_load")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    prompts = bench_prompts(cfg)
    conc = [int(c) for c in args.concurrency.split(",")]
    modes = {
        "target-only": ["serve.policy=none"],
        **{f"static {k}": ["serve.policy=static", f"serve.static_len={k}"] for k in args.static.split(",") if k},
        "adaptive": ["serve.policy=greedy"],
        "adaptive, drafting every round": ["serve.policy=greedy", "serve.draft_probe_rounds=0"],
    }
    if args.modes:
        unknown = set(args.modes.split(",")) - set(modes)
        if unknown:
            raise UserError(f"--modes: unknown {sorted(unknown)} (modes: {', '.join(modes)})")
        modes = {m: v for m, v in modes.items() if m in args.modes.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    port = free_port()  # Serve's HTTP proxy keeps the port it started with: one port for every mode
    for mode, extra in modes.items():
        ov = [
            f"serve.drafter_uri={args.drafter}",
            f"serve.port={port}",
            f"serve.max_batch={max(conc)}",
            f"serve.max_queue={2 * max(conc)}",
            "serve.calibration=false",
            "ray.num_cpus=2",
            *extra,
        ]
        url = run_local(load_config(args.config, [*ov, *args.overrides]))  # the user's --set over the mode's
        asyncio.run(load(url, prompts, 1, 5, 2, 16))  # warm-up
        results[mode] = {}
        for c in conc:
            results[mode][c] = asyncio.run(load(url, prompts, c, args.seconds, args.requests, args.max_tokens))
            r = results[mode][c]
            print(
                f"{mode:30s} C={c:3d}: {r['tok_s']:7.1f} tok/s total, {r['per_user_tok_s']:6.1f} tok/s per user, "
                f"p50 {r['p50']:.2f}s p99 {r['p99']:.2f}s, TTFT {r['ttft_p50']:.2f}s, budget {r['budget']:.2f}, "
                f"drafting {r['drafting_share']:.2f} ({r['requests']} requests)",
                flush=True,
            )
        serve.delete("dspark")
    serve.shutdown()
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        "\n| mode | C | tok/s | tok/s per user | p50 s | p99 s | TTFT p50 s | mean budget | drafting share |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    for mode, rows in results.items():
        for c, r in rows.items():
            print(
                f"| {mode} | {c} | {r['tok_s']:.1f} | {r['per_user_tok_s']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | "
                f"{r['ttft_p50']:.2f} | {r['budget']:.2f} | {r['drafting_share']:.2f} |"
            )
    fixed = [m for m in results if m.startswith(("target-only", "static"))]
    for c in (
        conc if fixed and "adaptive" in results else []
    ):  # the goal: adaptive >= 0.97 x the best of target-only and the static lengths
        best = max(fixed, key=lambda m: results[m][c]["tok_s"])
        ratio = results["adaptive"][c]["tok_s"] / results[best][c]["tok_s"]
        print(f"C={c}: adaptive / best fixed mode ({best}) = {ratio:.3f}")
    plot(results, out / "serve_load.png")
    print(f"\n[load] {out}/results.json, {out}/serve_load.png; loopback HTTP, T=1, max_tokens {args.max_tokens}")


def plot(results, path):
    fig, axes = plots.figure(size=(6, 4.5))
    ax = axes[0][0]
    for mode, rows in results.items():
        xs = [r["per_user_tok_s"] for r in rows.values()]
        ys = [r["tok_s"] for r in rows.values()]
        ax.plot(xs, ys, "-o", label=mode)
        for c, x, y in zip(rows, xs, ys):
            ax.annotate(str(c), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("throughput vs per-user speed (labels: concurrency)")
    plots.finish(fig, path, [ax])


if __name__ == "__main__":
    run_main(main)
