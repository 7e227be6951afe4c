"""The Ray Serve application over HTTP on 127.0.0.1: the official openai client (streaming and not),
greedy output equal to target-only greedy decoding, concurrent requests interleaving correctly,
and the error paths (400 naming the field, 401, 404, 429) leaving the server healthy."""

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from conftest import wait_for

from dspark import target as targets
from dspark.services import RayHead

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from http_fuzz import plain_greedy, run_checks, start_app  # noqa: E402

pytestmark = pytest.mark.integration
KEY = "test-key"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


@pytest.fixture(scope="module")
def server(tgt, tmp_path_factory, ray_driver):
    """The real application (serve.max_batch=4, serve.max_queue=8) on the session's Ray head: an
    untrained DSpark drafter next to the built-in target. Exactness does not depend on the drafter's
    quality; the scheduler sees real confidences. Requests without max_tokens (most of the fuzz's)
    get 32 tokens (serve.max_tokens_default): every request here that needs more asks for it."""
    from ray import serve

    yield start_app(tgt, tmp_path_factory.mktemp("drafter"), key=KEY, max_tokens_default=32)
    serve.shutdown()


def test_openai_client_completions_and_chat(server, tgt):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["dspark-builtin"]
    r = client.completions.create(model="dspark-builtin", prompt="def add(a, b):\n", max_tokens=24, temperature=0)
    ids = [tgt.tokenizer.bos_token_id] + tgt.tokenizer.encode("def add(a, b):\n", add_special_tokens=False)
    assert r.choices[0].text == plain_greedy(tgt, ids, 24)  # greedy over HTTP == target-only greedy
    assert r.usage.completion_tokens <= 24 and r.choices[0].finish_reason in ("stop", "length")
    spec = r.model_extra["speculative"]
    assert spec["rounds"] >= 1 and len(spec["verified_per_position"]) <= 4
    timing = r.model_extra["timing"]
    assert timing["ttft_s"] > 0 and (timing["itl_s"] is None or timing["itl_s"] > 0)
    streamed = client.completions.create(
        model="dspark-builtin", prompt="def add(a, b):\n", max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    msgs = [{"role": "user", "content": "import os\n"}]
    chat = client.chat.completions.create(model="dspark-builtin", messages=msgs, max_tokens=16, temperature=0)
    chat_ids = tgt.tokenizer.encode(
        tgt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert chat.choices[0].message.content == plain_greedy(tgt, chat_ids, 16)
    chunks = client.chat.completions.create(
        model="dspark-builtin", messages=msgs, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    lp = client.chat.completions.create(
        model="dspark-builtin", messages=msgs, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content  # greedy: each token is the target's most likely one
    assert (
        len(content) == lp.usage.completion_tokens and lp.choices[0].message.content == chat.choices[0].message.content
    )
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob <= 0 for e in content)
    sampled = client.completions.create(model="dspark-builtin", prompt="x = ", max_tokens=8, temperature=1.0, seed=3)
    again = client.completions.create(model="dspark-builtin", prompt="x = ", max_tokens=8, temperature=1.0, seed=3)
    assert sampled.choices[0].text == again.choices[0].text  # a seed makes sampling reproducible


def test_concurrent_requests_interleave_correctly(server, tgt):
    prompts = [f"def f{i}(x):\n    return x" for i in range(10)]  # more than max_batch: they queue and join

    async def one(client, p):
        r = await client.post(
            server + "/v1/completions", headers=H, json={"prompt": p, "max_tokens": 20, "temperature": 0}
        )
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts[:8]))

    got = asyncio.run(main())
    for p, text in zip(prompts, got):
        ids = [tgt.tokenizer.bos_token_id] + tgt.tokenizer.encode(p, add_special_tokens=False)
        assert text == plain_greedy(tgt, ids, 20)


@pytest.mark.parametrize(
    "body, status, named",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": 7}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 4000}, 400, "context limit"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ],
)
def test_bad_requests_are_rejected_naming_the_problem(server, body, status, named):
    kw = (
        {"content": body, "headers": {**H, "Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body, "headers": H}
    )
    r = httpx.post(server + "/v1/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    assert named in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_auth_overload_and_disconnect_leave_the_server_healthy(server):
    assert httpx.post(server + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.post(server + "/v1/completions", content=b"{not json").status_code == 401  # auth before parsing
    assert [httpx.get(server + p).status_code for p in ("/v1/models", "/v1/engine", "/v1/calibration", "/health")] == [
        401,
        401,
        401,
        200,
    ]

    async def flood():
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(
                *(
                    client.post(
                        server + "/v1/completions",
                        headers=H,
                        json={"prompt": f"y{i} = ", "max_tokens": 200, "temperature": 1},
                    )
                    for i in range(24)
                )
            )
            return [r.status_code for r in rs]

    codes = asyncio.run(flood())
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}  # a bounded queue, not unbounded memory
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        headers=H,
        timeout=60,
        json={"prompt": "z = ", "max_tokens": 1500, "temperature": 1, "stream": True},
    ) as r:
        next(r.iter_lines())  # read one event, then drop the connection
    wait_for(
        lambda: (st := httpx.get(server + "/v1/engine", headers=H).json())["active"] == 0 and st["waiting"] == 0,
        30,
        "free slot after the client left",
    )
    r = httpx.post(server + "/v1/completions", headers=H, json={"prompt": "x = ", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


def test_the_replica_log_holds_the_applications_records(server, services_dir):
    """What the application logs (here the cost tables, at replica start) reaches the replica's log file
    under the Ray session of the head it runs on."""
    logs = Path(RayHead(services_dir).temp_dir()) / "session_latest" / "logs" / "serve"
    wait_for(
        lambda: any("cost tables ready in" in f.read_text(errors="replace") for f in logs.glob("replica_*.log")),
        30,
        f"'cost tables ready' in a replica log under {logs}",
    )


def test_calibration_actor_collects_live_outcomes(server):
    async def traffic():
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(
                *(
                    client.post(server + "/v1/completions", headers=H, json={"prompt": f"v{i} = ", "max_tokens": 48})
                    for i in range(6)
                )
            )
            return [r.status_code for r in rs]

    assert asyncio.run(traffic()) == [200] * 6
    stats = wait_for(
        lambda: (st := httpx.get(server + "/v1/calibration", headers=H).json())["rounds_total"] > 0 and st,
        30,
        "calibration rounds",
    )  # the engines send their outcomes every second
    assert len(stats["temperatures"]) == len(stats["biases"]) == 4
    assert json.dumps(stats)  # JSON-safe


@pytest.mark.timeout(1200)
def test_short_http_fuzz_leaves_the_server_healthy(server, tgt):
    """bench/http_fuzz.py, short: random and hostile requests, disconnects mid-stream and while queued;
    then no unintended 5xx, the engine idle with every KV slot free, greedy still exact."""
    checks = run_checks(server, tgt, KEY, requests=150, concurrency=8, seed=0, seconds=900)
    assert all(checks.values()), checks
