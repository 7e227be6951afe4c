"""The HTTP ingress against a scripted engine (no Ray): engine errors (first or mid-stream, with or
without a status, or the engine call itself failing) become JSON errors or an SSE error event, seeds
and OpenAI fields are checked, and the API key guards every route but /health before the body is read."""

import asyncio
import json
import queue
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from ray import serve
from ray.exceptions import RayActorError

from dspark.config import load_config
from dspark.decoding.events import Done, Error, Text, coalesce, position_counts
from dspark.errors import UserError
from serving import app as serving

KEY = "k-123"
DONE = Done(
    {
        "finish_reason": "length",
        "completion_tokens": 2,
        "prompt_tokens": 3,
        "speculative": {"rounds": 1},
        "timing": {"ttft_s": 0.1, "itl_s": 0.02},
    }
)


class Call:
    """What `engine.options(stream=True).generate.remote(body)` returns (like Ray's
    DeploymentResponseGenerator): an async iterator of lists of events (here one each), then `fail`
    raised if given."""

    def __init__(self, events, fail):
        self.events, self.fail, self.cancelled = iter(events), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        for ev in self.events:
            return [ev]
        raise self.fail or StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class Engine:
    """A scripted engine deployment handle: every request gets `events`, then `fail` is raised."""

    def __init__(self, *events, fail=None):
        self.events, self.fail, self.bodies, self.calls = list(events), fail, [], []
        self.generate = SimpleNamespace(remote=self._generate)
        self.state = SimpleNamespace(remote=self._state)

    def options(self, **handle_options):
        assert handle_options["stream"]
        return self

    def _generate(self, body):
        self.bodies.append(body)
        self.calls.append(Call(self.events, self.fail))
        return self.calls[-1]

    async def _state(self):
        return {"active": 0, "waiting": 0}


def client(monkeypatch, engine, *overrides):
    """The real FastAPI app, routed to an Ingress whose engine is `engine` (as in a Serve replica)."""
    cfg = load_config(overrides=list(overrides))
    ingress = serving.Ingress.func_or_class.__bases__[0](cfg.model_dump_json(), engine)  # the class as written
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=ingress))
    return TestClient(serving.api, raise_server_exceptions=False)


def sse(r) -> list:
    return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    "events, fail, status, message",
    [
        ([Error("4 requests already waiting", 429)], None, 429, "already waiting"),
        ([Error("KV cache full")], None, 500, "KV cache full"),  # an error with the default status
        ([Text("ab"), Error("round failed")], None, 500, "round failed"),  # mid-answer
        ([Text("ab"), Error("cannot fit now", 503)], None, 503, "cannot fit"),
        ([], RayActorError(), 503, "unavailable"),  # the replica died
        ([Text("ab")], RuntimeError("lost"), 500, "RuntimeError"),
        ([Text("ab")], None, 500, "without a result"),  # the stream ended without done or error
    ],
)
def test_engine_errors_become_json_errors_with_their_status(monkeypatch, events, fail, status, message):
    engine = Engine(*events, fail=fail)
    r = client(monkeypatch, engine).post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert engine.calls[0].cancelled  # the engine-side call is released


@pytest.mark.parametrize(
    "events, fail, status, message",
    [
        ([Text("ab"), Error("round failed")], None, 500, "round failed"),
        ([Text("ab"), Error("cannot fit now", 503)], None, 503, "cannot fit"),
        ([Text("ab")], RayActorError(), 503, "unavailable"),
    ],
)
@pytest.mark.parametrize("chat", [False, True])
def test_error_mid_stream_is_an_error_event_never_done(monkeypatch, events, fail, status, message, chat):
    engine = Engine(*events, fail=fail)
    route, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        if chat
        else ("/v1/completions", {"prompt": "x"})
    )
    with client(monkeypatch, engine).stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = sse(r)
    assert "[DONE]" not in data  # a cut-short answer never looks complete
    err = json.loads(data[-1])["error"]
    assert message in err["message"] and err["type"] == "server_error"
    texts = [
        json.loads(d)["choices"][0].get("text") or json.loads(d)["choices"][0]["delta"].get("content")
        for d in data[:-1]
    ]
    assert "ab" in texts and engine.calls[0].cancelled


def test_stream_that_completes_ends_with_usage_and_done(monkeypatch):
    engine = Engine(Text("ab"), DONE)
    with client(monkeypatch, engine).stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        data = sse(r)
    assert data[-1] == "[DONE]" and json.loads(data[-2])["usage"]["total_tokens"] == 5


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_adds_a_chunk_without_choices_before_done(monkeypatch, chat):
    engine = Engine(Text("ab"), DONE)
    route, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        if chat
        else (
            "/v1/completions",
            {"prompt": "x"},
        )
    )
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client(monkeypatch, engine).stream("POST", route, json=body) as r:
        data = sse(r)
    finish, usage = json.loads(data[-3]), json.loads(data[-2])
    assert data[-1] == "[DONE]" and finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5 and usage["id"] == finish["id"]


def test_developer_role_and_text_parts_reach_the_template_as_system_and_one_string(monkeypatch):
    engine = Engine(Text("ab"), DONE)
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
    ]
    assert client(monkeypatch, engine).post("/v1/chat/completions", json={"messages": msgs}).status_code == 200
    assert engine.bodies[0]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = client(monkeypatch, engine).post("/v1/chat/completions", json={"messages": image})
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"]


def test_seed_none_passes_through_and_out_of_range_seeds_are_400(monkeypatch):
    engine = Engine(Text("ab"), DONE)
    c = client(monkeypatch, engine)
    assert c.post("/v1/completions", json={"prompt": "x", "temperature": 1}).status_code == 200
    assert engine.bodies[-1]["seed"] is None  # the engine picks a fresh seed, not 0 for everyone
    assert c.post("/v1/completions", json={"prompt": "x", "seed": None, "temperature": None}).status_code == 200
    assert engine.bodies[-1]["seed"] is None and engine.bodies[-1]["temperature"] == 1.0  # null: unset
    assert c.post("/v1/completions", json={"prompt": "x", "seed": 2**63 - 1}).status_code == 200
    for seed in (2**63, 2**64, -1):
        r = c.post("/v1/completions", json={"prompt": "x", "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert len(engine.bodies) == 3


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"logprobs": 21}, "logprobs"),  # the completions API: an integer 0..20
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"42": 100}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"suffix": "}"}, "suffix"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_completion_tokens": 4}, "max_completion_tokens"),  # chat only
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_unsupported_and_unknown_fields_are_400_naming_them(monkeypatch, extra, named):
    engine = Engine(Text("ab"), DONE)
    content = json.dumps({"prompt": "x", **extra})  # NaN and Infinity as Python's json writes them
    r = client(monkeypatch, engine).post(
        "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == named and r.json()["error"]["message"].startswith(f"{named}:")
    assert engine.bodies == []


@pytest.mark.parametrize(
    "extra",
    [
        {"presence_penalty": 0},
        {"frequency_penalty": 0.0},
        {"logit_bias": {}},
        {"response_format": {"type": "text"}},
        {"tools": []},
        {"n": 1},
        {"best_of": 1},
        {"echo": False},
        {
            "user": "u-1",
            "metadata": {"a": "b"},
            "store": False,
            "service_tier": "auto",
        },
        {"stream_options": {"include_usage": False}},
    ],
)
def test_neutral_values_and_metadata_are_accepted(monkeypatch, extra):
    engine = Engine(Text("ab"), DONE)
    r = client(monkeypatch, engine).post("/v1/completions", json={"prompt": "x", **extra})
    assert r.status_code == 200, r.text
    assert not set(extra) & set(engine.bodies[0])


def test_max_completion_tokens_sets_the_chat_limit(monkeypatch):
    engine = Engine(Text("ab"), DONE)
    c = client(monkeypatch, engine)
    msgs = [{"role": "user", "content": "x"}]
    assert c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 7}).status_code == 200
    assert c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5}).status_code == 200
    assert [b["max_tokens"] for b in engine.bodies] == [7, 5]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_api_key_guards_every_route_but_health_before_the_body_is_read(monkeypatch):
    compared = []
    monkeypatch.setattr(serving.hmac, "compare_digest", lambda a, b: compared.append(1) or a == b)
    engine = Engine(Text("ab"), DONE)
    c = client(monkeypatch, engine, f"serve.api_key={KEY}")
    good, wrong = {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer k-124"}
    assert c.get("/health").status_code == 200
    for path in ("/v1/models", "/v1/engine", "/v1/calibration"):
        assert c.get(path).status_code == 401 and c.get(path, headers=wrong).status_code == 401, path
        assert c.get(path, headers=good).status_code in (200, 404), path  # 404: calibration off here
    json_headers = {"Content-Type": "application/json"}
    for body in (b"{not json", b"[]", b'{"prompt": "x", "seed": -1}', b'{"prompt": "x"}'):
        r = c.post("/v1/completions", content=body, headers=json_headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", body
    r = c.post("/v1/completions", content=b"{}", headers={**json_headers, "Authorization": b"Bearer \xff\xfe"})
    assert r.status_code == 401  # not a crash on a non-ASCII header
    assert c.post("/v1/completions", json={"prompt": "x"}, headers=good).status_code == 200
    assert engine.bodies == [{**engine.bodies[0], "prompt": "x"}] and compared  # constant-time compare


def test_bad_bodies_are_400_without_a_key(monkeypatch):
    c = client(monkeypatch, Engine(Text("ab"), DONE))
    for body, named in (
        (b"{not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b"null", "JSON object"),
        (b'{"prompt": 3}', "prompt"),
        (b'{"messages": []}', "messages"),
        (b'{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate: no tokenizer takes it
        (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages.0.content"),
    ):
        route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = c.post(route, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and named in r.json()["error"]["message"], (body, r.text)


def test_engine_deployment_reserves_a_gpu_on_cuda_and_autoscales_when_asked():
    cpu = serving.engine_options(load_config(overrides=["serve.num_replicas=2"]))
    assert cpu == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0}, "num_replicas": 2}
    cfg = load_config(
        overrides=[
            "target.device=cuda",
            "serve.max_batch=64",
            "serve.autoscaling.max_replicas=4",
            "serve.num_replicas=3",
        ]
    )
    opts = serving.engine_options(cfg)
    assert opts["ray_actor_options"]["num_gpus"] == 1
    # one replica's KV slots is the load it scales on, unless set
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64}
    d = serving.SpeculativeEngine.options(**opts)  # what Serve accepts: no fixed count beside autoscaling
    assert d.ray_actor_options["num_gpus"] == 1
    with pytest.raises(Exception, match="min_replicas=5 exceeds max_replicas=4"):
        serving.engine_options(
            load_config(overrides=["serve.autoscaling.min_replicas=5", "serve.autoscaling.max_replicas=4"])
        )


LP = [
    {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}, {"token": "é", "logprob": -1.5}]},
    {"token": "b", "logprob": -2.0, "top_logprobs": [{"token": "c", "logprob": -0.1}, {"token": "b", "logprob": -2.0}]},
]
END = {
    "token": "</s>",
    "logprob": -0.2,
    "top_logprobs": [{"token": "</s>", "logprob": -0.2}, {"token": "d", "logprob": -3.0}],
}
DONE_LP = Done({**DONE.info, "completion_tokens": 3, "logprobs": [END]})


def test_logprobs_reach_the_engine_and_come_back_in_openai_shapes(monkeypatch):
    engine = Engine(Text("a", LP[:1]), Text("b", LP[1:]), DONE_LP)
    c = client(monkeypatch, engine)
    r = c.post("/v1/completions", json={"prompt": "x", "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert engine.bodies[-1]["logprobs"] == 2
    assert lp["tokens"] == ["a", "b", "</s>"] and lp["token_logprobs"] == [-0.5, -2.0, -0.2]
    assert lp["top_logprobs"][1] == {"c": -0.1, "b": -2.0} and lp["text_offset"] == [0, 1, 2]
    msgs = [{"role": "user", "content": "hi"}]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert engine.bodies[-1]["logprobs"] == 2 and [e["token"] for e in content] == ["a", "b", "</s>"]
    assert content[0]["top_logprobs"][1] == {"token": "é", "logprob": -1.5, "bytes": [195, 169]}
    r = c.post("/v1/chat/completions", json={"messages": msgs, "logprobs": True})
    assert engine.bodies[-1]["logprobs"] == 0 and r.status_code == 200  # the tokens' own logprobs, no alternatives
    r = c.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2})  # without logprobs: true
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    stream = c.post(
        "/v1/chat/completions", json={"messages": msgs, "logprobs": True, "top_logprobs": 2, "stream": True}
    )
    chunks = [json.loads(x) for x in sse(stream) if x != "[DONE]"]
    streamed = [
        e["token"]
        for ch in chunks
        for choice in ch["choices"]
        for e in (choice.get("logprobs") or {}).get("content", [])
    ]
    assert streamed == ["a", "b", "</s>"]  # the end-of-sequence entry rides on the finishing chunk
    stream = c.post("/v1/completions", json={"prompt": "x", "logprobs": 1, "stream": True})
    offsets = [
        o
        for ch in map(json.loads, sse(stream)[:-1])
        for o in (ch["choices"][0]["logprobs"] or {}).get("text_offset", [])
    ]
    assert offsets == [0, 1, 2]
    plain = Engine(Text("a"), Text("b"), DONE)  # not asked for: the engine sends none
    r = client(monkeypatch, plain).post("/v1/chat/completions", json={"messages": msgs})
    assert plain.bodies[-1]["logprobs"] is None and r.json()["choices"][0]["logprobs"] is None


def test_coalesce_merges_adjacent_texts_and_their_logprobs_only():
    merged = coalesce([Text("a", LP[:1]), Text("b", LP[1:]), Text("", [END]), DONE_LP])
    assert merged == [Text("ab", LP + [END]), DONE_LP]
    assert coalesce([Text("a"), Text("b")]) == [Text("ab")]  # no logprobs asked for: still None
    assert coalesce([Error("x")]) == [Error("x")] and coalesce([]) == []


def test_position_counts_count_the_rounds_that_verified_and_accepted_each_draft():
    """What a request's Done statistics and the server's per-position counters add up (l, n per round)."""
    rounds = [SimpleNamespace(verified=l, accepted=n) for l, n in [(3, 1), (0, 0), (2, 2), (4, 0)]]
    assert position_counts(rounds) == ([3, 3, 2, 1], [2, 1, 0, 0])
    assert position_counts([]) == ([], []) and position_counts(rounds[1:2]) == ([], [])


class Feed:
    """A scripted engine under the replica's `generate`: the test puts the stream's events."""

    def __init__(self):
        self.stream, self.cancelled = None, []

    def submit(self, ids, sp, max_tokens, seed, stop, logprobs):
        self.stream = SimpleNamespace(events=queue.Queue(), notify=None, finish_reason=None)
        return self.stream

    def put(self, *events):
        for ev in events:
            self.stream.events.put(ev)
            self.stream.notify()

    def cancel(self, stream):
        self.cancelled.append(stream)


async def started(interval: float, messages_per_s: float = 0):
    """The engine replica as written, over a Feed (`replica.engine`), with its first `generate` call running."""
    replica = serving.SpeculativeEngine.func_or_class.__new__(serving.SpeculativeEngine.func_or_class)
    replica.engine, replica.stream_interval_s, replica.stream_messages_per_s = Feed(), interval, messages_per_s
    replica.sending = 0
    replica.tokenizer, replica.chat_template_kwargs = SimpleNamespace(bos_token_id=None, encode=lambda t, **kw: [1]), {}
    gen = replica.generate({"prompt": "x", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8})
    first = asyncio.ensure_future(anext(gen))
    while replica.engine.stream is None or replica.engine.stream.notify is None:
        await asyncio.sleep(0)
    return replica, gen, first


def test_the_replica_sends_the_first_text_at_once_then_holds_text_for_the_interval_but_not_the_end():
    async def run():
        replica, gen, first = await started(interval=3600)
        feed = replica.engine
        feed.put(Text("a", LP[:1]))
        assert await asyncio.wait_for(first, 30) == [Text("a", LP[:1])]  # the first text: not held
        nxt = asyncio.ensure_future(anext(gen))
        feed.put(Text("b", LP[1:]), Text("c", []))
        await asyncio.sleep(0.05)
        assert not nxt.done()  # held: the interval has not passed
        feed.put(DONE_LP)
        assert await asyncio.wait_for(nxt, 30) == [Text("bc", LP[1:]), DONE_LP]  # the end goes at once, with it
        assert feed.cancelled == []  # the stream finished: nothing to cancel

    asyncio.run(run())


def test_a_streams_interval_grows_with_the_streams_sending_under_the_message_cap():
    assert serving.stream_interval(0.05, 1, 40) == 0.05  # one stream: the base interval
    assert serving.stream_interval(0.05, 8, 40) == 0.2  # eight: 40 messages a second in all
    assert serving.stream_interval(0.05, 8, 0) == 0.05  # no cap

    async def run():
        replica, gen, first = await started(interval=0, messages_per_s=1 / 3600)
        feed = replica.engine
        assert replica.sending == 0  # nothing sent yet
        feed.put(Text("a"))
        assert await asyncio.wait_for(first, 30) == [Text("a")]  # the first text at once
        nxt = asyncio.ensure_future(anext(gen))
        feed.put(Text("b"))
        await asyncio.sleep(0.05)
        assert replica.sending == 1 and not nxt.done()  # one stream sending: held for 3600 s, not sent each round
        feed.put(DONE)
        assert await asyncio.wait_for(nxt, 30) == [Text("b"), DONE]  # the end at once
        await gen.aclose()
        assert replica.sending == 0  # the ended stream no longer counts

    asyncio.run(run())


def test_the_replica_sends_every_round_with_no_interval_and_cancels_a_stream_left_early():
    async def run():
        replica, gen, first = await started(interval=0)
        feed = replica.engine
        feed.put(Text("a"))
        assert await asyncio.wait_for(first, 30) == [Text("a")]
        nxt = asyncio.ensure_future(anext(gen))
        feed.put(Text("b"))
        assert await asyncio.wait_for(nxt, 30) == [Text("b")]
        await gen.aclose()  # the consumer went away before the end: the engine frees the slot
        assert feed.cancelled == [feed.stream]

    asyncio.run(run())


def test_a_drafter_that_cannot_be_read_is_refused_before_anything_is_deployed(tmp_path):
    """The app's builder reads the drafter's config in the driver, calibration or not: an unreachable
    store is one line naming its endpoint (not a replica that fails to start, retried for minutes), and a
    folder without a drafter is named."""
    base = ["serve.calibration=false", "mlflow.enabled=false"]
    unreachable = ["serve.drafter_uri=s3://dspark/drafters/x", "storage.endpoint_url=http://127.0.0.1:9"]
    with pytest.raises(UserError, match="object store http://127.0.0.1:9 is unreachable for s3://dspark/drafters/x"):
        serving.build({"overrides": [*base, *unreachable]})
    with pytest.raises(UserError, match=f"no drafter at {tmp_path}"):
        serving.build({"overrides": [*base, f"serve.drafter_uri={tmp_path}"]})
