"""Bounded HTTP fuzz of the real Ray Serve application on 127.0.0.1: random fields and values (NaN,
inf, huge, negative, empty, unicode, wrong types, unknown and unsupported OpenAI fields), invalid JSON,
huge bodies, missing or wrong keys, streaming, and clients that disconnect mid-stream or while queued.

    python bench/http_fuzz.py --requests 2000 --concurrency 8 --seed 0
    python bench/http_fuzz.py --config configs/smollm2.yaml --requests 200 [--set serve.max_batch=2]

It starts the application itself: the configured target (the built-in one by default) and an
untrained DSpark drafter, with the fuzz's serving settings (app_overrides: a small serve.max_batch
and serve.max_queue so that requests queue, an API key, quick calibration refits) over the --config
file's and --set over both. Then it prints a histogram of outcomes and these checks; the exit code
is non-zero when one fails:
- no unintended 5xx (a 503 from the engine saying a request cannot fit now is intended; an
  unavailable engine, a 500, a stream cut short without an error event or a timeout are not), and
  no request got past a missing or wrong API key;
- afterwards the engine is idle: 0 active, 0 waiting, every KV slot free;
- a greedy request still equals target-only greedy decoding.
Bounded: --requests in all, each with a 120 s timeout; no new request after --seconds, or once
--concurrency requests have timed out (the server is stuck).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ray
import torch
from ray import serve

from dspark import target as targets
from dspark.config import ServeConfig, add_config_args, config_from_args, load_config, run_main
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.models import DrafterConfig, build_drafter, save_drafter
from dspark.services import free_port
from serving.app import OPEN_PATHS, run_local

KEY = "fuzz-key"
MODEL = ServeConfig().model_name  # the name clients pass as `model` unless serve.model_name says otherwise
MAX_BATCH, MAX_QUEUE = 4, 8
GREEDY_PROMPT = "def add(a, b):\n"


# -- the application


def app_overrides(
    folder: Path, key: str = KEY, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE, max_tokens_default: int = 128
) -> list[str]:
    """The fuzz's serving settings: the drafter that start_app writes into `folder`, a free loopback port,
    a small batch and queue (requests queue), an API key, calibration refits after few rounds, and
    `max_tokens_default` tokens for requests that name no max_tokens."""
    return [
        f"serve.drafter_uri={folder}",
        f"serve.port={free_port()}",
        "serve.gamma=4",
        f"serve.max_batch={max_batch}",
        f"serve.max_queue={max_queue}",
        f"serve.api_key={key}",
        "serve.sps_batches=[1,2,4,8,16]",
        "ray.num_cpus=2",
        "serve.calibration_min_rounds=20",
        "serve.calibration_refit_every=20",
        f"serve.max_tokens_default={max_tokens_default}",
    ]


def start_app(
    tgt,
    folder: Path,
    key: str = KEY,
    max_batch: int = MAX_BATCH,
    max_queue: int = MAX_QUEUE,
    max_tokens_default: int = 128,
    cfg=None,
) -> str:
    """The real application on a free loopback port, an untrained DSpark drafter (gamma 4) next to the
    target: exactness does not depend on the drafter's quality, and the scheduler sees real confidences.
    `cfg`: the application's configuration (default: the built-in target with app_overrides(folder, key,
    max_batch, max_queue, max_tokens_default)); its serve.drafter_uri must be `folder`. Returns its base URL."""
    torch.manual_seed(0)
    c = DrafterConfig.from_target(
        tgt.config,
        "dspark",
        [1, 2, 3],
        tgt.mask_token_id,
        num_layers=1,
        gamma=4,
        markov_rank=32,
        target={"weights_sha256": tgt.weights_sha256},
    )
    save_drafter(build_drafter(c, tgt.model), folder)
    return run_local(cfg or load_config(overrides=app_overrides(folder, key, max_batch, max_queue, max_tokens_default)))


def prompt_ids(tgt, text: str) -> list[int]:
    """A completion prompt's token ids, as the server encodes them: BOS (when the tokenizer has one) and the text."""
    bos = [] if tgt.bos_token_id is None else [tgt.bos_token_id]
    return bos + tgt.tokenizer.encode(text, add_special_tokens=False)


def plain_greedy(tgt, ids: list[int], n: int) -> str:
    """Target-only greedy decoding of n tokens: what a greedy request must return, drafter or not."""
    req = Request(ids, SamplingParams(0.0), n, 0, tgt.eos_token_ids)
    out = SpeculativeDecoder(tgt.model, None).run([req])
    return tgt.tokenizer.decode(out[0].out, skip_special_tokens=True)


# -- random requests

TEXTS = [
    "def f(x):\n    return x",
    "x = ",
    "import os\n",
    "",
    " ",
    "héllo wörld ✓ 你好 🙂",
    "\u202eabc\u0301\u200b",
    "\x00\x01\x7f",
    "\ud800 lone surrogate",
    "a" * 3000,
    "def g():\n" * 400,
]
NUMBERS = [
    0,
    1,
    -1,
    0.5,
    1e-40,
    1e-8,
    2.0,
    7,
    1e308,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    2**70,
    -(2**63),
    float("nan"),
    float("inf"),
    float("-inf"),
    "1",
    "",
    None,
    True,
    False,
    [],
    {},
]
UNSUPPORTED = {
    "logprobs": [True, 5],
    "top_logprobs": [2],
    "presence_penalty": [0.5],
    "frequency_penalty": [-1.0],
    "logit_bias": [{"1": 5}],
    "response_format": [{"type": "json_object"}],
    "tools": [[{"type": "function"}]],
    "best_of": [2],
    "echo": [True],
    "suffix": ["}"],
    "n": [2, 0, 1.5],
}


def pick(rng: random.Random, good: list, p_bad: float = 0.08):
    """A good value most of the time, else anything from NUMBERS or TEXTS."""
    return rng.choice(good) if rng.random() > p_bad else rng.choice(NUMBERS + TEXTS[:6])


def random_fields(rng: random.Random, chat: bool, model: str = MODEL) -> dict:
    body: dict = {}
    if chat:
        msg = {
            "role": pick(rng, ["user", "system", "developer", "assistant"], 0.1),
            "content": pick(rng, TEXTS[:6], 0.1),
        }
        body["messages"] = pick(rng, [[msg], [msg, {"role": "user", "content": "x"}]], 0.1)
    else:
        body["prompt"] = pick(rng, TEXTS, 0.1)
    options = {
        "max_tokens": [1, 4, 16, 32],
        "temperature": [0, 0.7, 1.0, 2.0, 1e-40, 1e-6],
        "top_p": [1.0, 0.9, 0.5, 1e-9],
        "top_k": [0, 1, 5, 50, 10**9],
        "seed": [0, 1, 42, 2**63 - 1],
        "stop": ["\n", ["\n\n", "def"], [""], "x"],
        "model": [model] * 4 + ["gpt-4"],
        "max_completion_tokens": [8],
        "user": ["u-1"],
        "metadata": [{"a": "b"}],
    }
    for name, good in options.items():
        if rng.random() < 0.4:
            body[name] = pick(rng, good)
    if rng.random() < 0.1:
        name = rng.choice(list(UNSUPPORTED))
        body[name] = rng.choice(UNSUPPORTED[name] + [None, 0, False])
    if rng.random() < 0.05:
        body[rng.choice(["frobnicate", "", "prompt ", "MAX_TOKENS", "ünïcode"])] = rng.choice(NUMBERS)
    return body


@dataclass
class Case:
    method: str = "POST"
    path: str = "/v1/completions"
    headers: dict = field(default_factory=dict)
    content: bytes | None = None
    drop: str = ""  # "stream": disconnect after the first event; "queued": give up before any answer
    key_ok: bool = True


def random_case(rng: random.Random, key: str = KEY, model: str = MODEL) -> Case:
    """One random request; `rng` alone decides it (reproducible per --seed and index)."""
    case = Case(headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    if rng.random() < 0.05:
        case.key_ok = False
        case.headers["Authorization"] = rng.choice(
            ["", "Bearer", f"Bearer {key}x", f"bearer {key}", key, "Bearer " + "k" * len(key), b"Bearer \xff\xfe"]
        )
    if rng.random() < 0.05:
        case.method, case.path = rng.choice(
            [
                ("GET", "/v1/models"),
                ("GET", "/v1/engine"),
                ("GET", "/health"),
                ("GET", "/v1/calibration"),
                ("GET", "/v1/nothing"),
                ("GET", "/v1/completions"),
                ("POST", "/v1/models"),
                ("DELETE", "/v1/chat/completions"),
            ]
        )
        return case
    chat = rng.random() < 0.4
    case.path = "/v1/chat/completions" if chat else "/v1/completions"
    shape = rng.random()
    if shape < 0.04:
        case.content = rng.choice(
            [
                b"{not json",
                b"",
                b"[]",
                b"null",
                b'"x"',
                b"{}",
                b"\xff\xfe\x00",
                b'{"prompt": "x"',
                b'{"prompt": NaN}',
                b'{"max_tokens": Infinity, "prompt": "x"}',
            ]
        )
    elif shape < 0.06:
        case.content = json.dumps({"prompt": "x" * rng.choice([2**16, 2**20]), "max_tokens": 1}).encode()  # huge
    elif shape < 0.08:
        case.headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
        case.content = json.dumps({"prompt": "x"}).encode()
    else:
        body = random_fields(rng, chat, model)
        body["stream"] = rng.random() < 0.3 if rng.random() < 0.95 else rng.choice(["yes", 1, None, "x"])
        case.content = json.dumps(body).encode()  # NaN and Infinity as Python writes them
        drop = rng.random()
        case.drop = "stream" if body["stream"] is True and drop < 0.3 else "queued" if drop < 0.06 else ""
    return case


# -- sending and judging


async def send(client: httpx.AsyncClient, url: str, case: Case, rng: random.Random) -> str:
    """The outcome as a short label: the status, then for streams how they ended, or how the client left."""
    try:
        if case.drop == "queued":  # give up after a moment: usually while the request still waits for a slot
            try:
                r = await client.request(
                    case.method,
                    url + case.path,
                    headers=case.headers,
                    content=case.content,
                    timeout=rng.uniform(0.01, 0.3),
                )
                return label(r)
            except httpx.TimeoutException:
                return "client gave up"
        async with client.stream(case.method, url + case.path, headers=case.headers, content=case.content) as r:
            if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
                await r.aread()
                return label(r)
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if case.drop == "stream":
                        return "stream dropped"
            return stream_label(events)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.TransportError as e:
        return f"transport error {type(e).__name__}"


def label(r: httpx.Response) -> str:
    try:
        body = r.json()
        message = body["error"]["message"] if r.status_code >= 400 else ""
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} non-JSON"
    if r.status_code == 503 and message.startswith("the engine is unavailable"):
        return "503 engine unavailable"
    return str(r.status_code)


def stream_label(events: list[str]) -> str:
    if events and events[-1] == "[DONE]":
        return "200 stream done"
    try:
        err = json.loads(events[-1])["error"] if events else None
    except (ValueError, KeyError, TypeError):
        err = None
    if err is None:
        return "200 stream cut short"
    return f"200 stream error ({err['type']})"


def unintended(outcome: str, case: Case) -> bool:
    """A 5xx other than the engine's "cannot fit now" 503, a broken response, or a request that got past
    a missing or wrong API key."""
    if not case.key_ok and case.path not in OPEN_PATHS and outcome not in ("401", "client gave up"):
        return True
    return (
        (outcome[0] == "5" and outcome != "503")
        or outcome in ("200 stream cut short", "timeout")
        or "non-JSON" in outcome
        or "server_error" in outcome
        or outcome.startswith("transport")
    )


async def fuzz(
    url: str, key: str, requests: int, concurrency: int, seed: int, seconds: float, model: str = MODEL
) -> tuple[Counter, list]:
    """`requests` random requests, `concurrency` at a time; none is started after `seconds`.
    Returns the outcome histogram and the unintended outcomes as (index, outcome, case)."""
    hist: Counter = Counter()
    bad: list = []
    todo = iter(range(requests))
    deadline = time.monotonic() + seconds

    async def worker(client):
        for i in todo:
            if time.monotonic() > deadline or hist["timeout"] >= concurrency:  # out of time, or the server is stuck
                hist["not sent"] += 1
                continue
            rng = random.Random(seed * 1_000_003 + i)
            case = random_case(rng, key, model)
            outcome = await send(client, url, case, rng)
            hist[outcome] += 1
            if unintended(outcome, case):
                bad.append((i, outcome, case))

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return hist, bad


def engine_idle(url: str, key: str, timeout: float = 120.0) -> tuple[bool, dict]:
    """Waits (bounded) until the engine has no active or waiting request and every KV slot is free."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = httpx.get(url + "/v1/engine", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        except (httpx.HTTPError, ValueError):
            state = {}
        # free_slots/max_batch: engines that report them (others count as free)
        idle = (state.get("active"), state.get("waiting"), state.get("free_slots")) == (0, 0, state.get("max_batch"))
        if idle or time.monotonic() > deadline:
            return idle, state
        time.sleep(1.0)


def greedy_matches(url: str, tgt, key: str, n: int = 24) -> bool:
    try:
        r = httpx.post(
            url + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            json={"prompt": GREEDY_PROMPT, "max_tokens": n, "temperature": 0},
        )
    except httpx.TimeoutException:
        return False
    expected = plain_greedy(tgt, prompt_ids(tgt, GREEDY_PROMPT), n)
    return r.status_code == 200 and r.json()["choices"][0]["text"] == expected


def run_checks(
    url: str, tgt, key: str, requests: int, concurrency: int, seed: int, seconds: float, model: str = MODEL
) -> dict[str, bool]:
    """The fuzz run and the checks after it (`model`: the served model name); prints the histogram and
    each check."""
    t0 = time.monotonic()
    hist, bad = asyncio.run(fuzz(url, key, requests, concurrency, seed, seconds, model))
    print(f"{sum(hist.values())} requests at concurrency {concurrency} in {time.monotonic() - t0:.0f}s; outcomes:")
    for outcome, n in sorted(hist.items(), key=lambda kv: -kv[1]):
        print(f"  {n:6d}  {outcome}")
    for i, outcome, case in bad[:20]:
        print(f"  unintended #{i}: {outcome}: {case.method} {case.path} {(case.content or b'')[:200]!r}")
    idle, state = engine_idle(url, key)
    checks = {
        "all requests sent": hist["not sent"] == 0,
        "no unintended 5xx or auth bypass": not bad,
        "engine idle, every KV slot free": idle,
        "greedy == target-only greedy": greedy_matches(url, tgt, key),
    }
    print(f"engine state: { {k: state.get(k) for k in ('active', 'waiting', 'free_slots', 'max_batch')} }")
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return checks


def main(argv=None) -> int:
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=1800, help="no new request after this long")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-drafter-") as folder:
        args.overrides = app_overrides(Path(folder)) + args.overrides
        cfg = config_from_args(args)
        tgt = targets.load_from_config(cfg.target)
        url = start_app(tgt, Path(folder), cfg=cfg)
        try:
            checks = run_checks(
                url,
                tgt,
                cfg.serve.api_key,
                args.requests,
                args.concurrency,
                args.seed,
                args.seconds,
                cfg.serve.model_name,
            )
        finally:
            serve.shutdown()
            ray.shutdown()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    run_main(lambda argv: sys.exit(main(argv)))  # the exit code says whether every check passed
