"""Ray Serve application: an OpenAI-compatible ingress, speculative-decoding engine replicas with
continuous batching, and one calibration deployment per model pair.

    serve run serving/config.yaml                     # or: python jobs/serve.py
    curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 32}'

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as SSE),
GET /v1/models, GET /health, GET /v1/calibration (the calibration actor's statistics),
GET /v1/engine (engine replica state). With serve.api_key set, every route but /health needs
"Authorization: Bearer <key>".
"""

# The deployments import torch and the decoding engine inside their constructors: the ingress replica
# (and `serve run`'s import of this module) never loads them.
import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.decoding.events import Done, Error, Event, Text, coalesce, position_counts
from serving.api import (
    ChatRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    error_body,
    logprobs_body,
    usage_body,
)

# Ray Serve configures the "ray.serve" logger in every replica (its level, its file under the session's
# logs/serve/): records of any other logger never reach the replica's log
log = logging.getLogger("ray.serve")
api = FastAPI(title="dspark")


def _cfg(cfg_json: str):
    from dspark.config import Config

    return Config.model_validate_json(cfg_json)


# The calibration actor and the engine: one replica each (serve.num_replicas scales the engine at
# build), requests queue in the engine rather than in Serve, no access log per request.
ONE_REPLICA = dict(num_replicas=1, max_ongoing_requests=1000, logging_config={"enable_access_log": False})


@serve.deployment(**ONE_REPLICA, ray_actor_options={"num_cpus": 0})
class CalibrationActor:
    """Named per model pair (deployment `calibration-<model>`): aggregates per-position acceptance
    outcomes from every engine replica, refits the STS calibration, hands it back to the engines.
    Serve runs these sync methods on a thread pool: one lock keeps add/refit and the reads apart."""

    def __init__(self, cfg_json: str, gamma: int, start: dict | None):
        from dspark.calibration.online import OnlineCalibrator
        from dspark.calibration.sts import Calibration as STS

        sc = _cfg(cfg_json).serve
        self.cal = OnlineCalibrator(
            gamma,
            STS.from_dict(start) if start else None,
            bias=sc.calibration_bias,
            half_life=sc.calibration_half_life,
            min_rounds=sc.calibration_min_rounds,
            refit_every=sc.calibration_refit_every,
        )
        self.lock = threading.Lock()

    def add(self, rounds: list) -> int:
        with self.lock:
            self.cal.add(rounds)
            return self.cal.version

    def current(self) -> dict:
        """What the engines poll every second: the calibration in force and the live error (cheap: the
        recent window only; `stats` reports over every held round)."""
        with self.lock:
            err = self.cal.live_error()
            return {
                "version": self.cal.version,
                **self.cal.cal.to_dict(),
                "live_error": None if math.isnan(err) else err,
            }

    def stats(self) -> dict:
        with self.lock:
            return self.cal.stats()


class EngineMetrics:
    """Prometheus metrics through Ray Serve (exported by Ray's metrics agent)."""

    def __init__(self, gamma: int):
        from ray.serve.metrics import Counter, Gauge, Histogram

        self.gamma = gamma
        self.rounds = Counter("dspark_rounds", "speculative rounds (one target verification each)")
        self.drafts = Counter("dspark_drafts", "requests that received a draft in a round")
        self.draft_tokens = Counter("dspark_draft_tokens", "draft tokens sent to verification")
        self.accepted = Counter("dspark_accepted_tokens", "accepted draft tokens", tag_keys=("position",))
        self.verified = Counter("dspark_verified_tokens", "verified draft tokens", tag_keys=("position",))
        self.budget = Gauge("dspark_verification_budget", "mean verification length per request, last round")
        self.batch = Gauge("dspark_batch_size", "requests in the last round")
        self.queue = Gauge("dspark_queue_depth", "requests waiting for a slot")
        self.ece = Gauge("dspark_calibration_error", "live calibration error of predicted prefix survival")
        self.latency = Histogram(
            "dspark_round_seconds", "round latency", boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1]
        )
        self.drafted = Counter(
            "dspark_drafted_rounds", "rounds in which the drafter proposed drafts (the rest skipped it)"
        )
        self.tokens = Counter("dspark_generation_tokens", "output tokens of finished requests")
        self.ttft = Histogram(
            "dspark_time_to_first_token_seconds",
            "submission to first streamed text",
            boundaries=[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        )
        self.itl = Histogram(
            "dspark_inter_token_latency_seconds",
            "per request: mean time between output tokens after the first",
            boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1],
        )

    def round(self, rounds, batch: int, waiting: int, seconds: float) -> None:
        self.rounds.inc()
        self.batch.set(batch)
        self.queue.set(waiting)
        self.latency.observe(seconds)
        if rounds:
            self.budget.set(sum(r.verified for r in rounds) / len(rounds))
            if any(r.drafted for r in rounds):
                self.drafted.inc()
        verified, accepted = position_counts(rounds)
        if not verified:  # no request verified a draft
            return
        self.drafts.inc(verified[0])  # the requests that verified x_1: those that verified any draft
        self.draft_tokens.inc(sum(verified))
        # one call per position, not per request and position (a drafted round of 16 requests made up to 224)
        for k, (l_k, n_k) in enumerate(zip(verified, accepted), 1):
            self.verified.inc(l_k, tags={"position": str(k)})
            if n_k:  # a Prometheus counter only takes increments > 0
                self.accepted.inc(n_k, tags={"position": str(k)})

    def request(self, tokens: int, ttft_s: float | None, itl_s: float | None) -> None:
        if tokens:  # a Prometheus counter only takes increments > 0
            self.tokens.inc(tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if itl_s is not None:
            self.itl.observe(itl_s)


def stream_interval(base_s: float, streams: int, messages_per_s: float) -> float:
    """Seconds a stream holds its new text after a message: at least base_s, and long enough that
    `streams` streams together send at most messages_per_s messages a second (0: no such cap)."""
    return max(base_s, streams / messages_per_s) if messages_per_s > 0 else base_s


def on_own_thread(fn):
    """fn() on a thread of its own, which then exits; its result, or its error raised here.

    Torch's OpenMP pool belongs to the thread that runs a parallel op, and lives as long as that thread;
    with more OpenMP threads in the process than CPUs, libgomp's workers sleep between parallel regions
    instead of spinning: with a pool left on the replica's main thread, the engine thread decoded SmolLM2
    with 2 torch threads at 14 tok/s against 31 without one (bench/target_speed.py --threads 1,2). So the
    replica runs its torch work (loading, profiling) on a thread that goes away before the engine thread
    starts, and the engine builds its decoder (the KV cache's allocation) on its own thread."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-setup") as pool:
        return pool.submit(fn).result()


@serve.deployment(**ONE_REPLICA, ray_actor_options={"num_cpus": 1})
class SpeculativeEngine:
    def __init__(self, cfg_json: str, calibration=None):
        from dspark import target as targets
        from dspark.artifacts import download_drafter
        from dspark.calibration import sts
        from dspark.decoding.engine import Engine
        from dspark.decoding.profile import add_draft_times, profile
        from dspark.models import load_drafter
        from dspark.scheduling.policies import ADAPTIVE
        from dspark.scheduling.sps import SPSTable

        cfg = _cfg(cfg_json)
        sc = cfg.serve

        def setup():  # torch threads: the replica's CPUs (serve.num_cpus), not the jobs' target.threads
            tgt = targets.load_from_config(cfg.target.model_copy(update={"threads": sc.num_cpus}))
            drafter, start = None, None
            if sc.drafter_uri:
                import tempfile

                with tempfile.TemporaryDirectory(prefix="drafter-") as d:  # weights are in memory once loaded
                    local = download_drafter(cfg, sc.drafter_uri, d)
                    drafter = load_drafter(local, tgt.model, tgt.weights_sha256)
                    start = sts.load(local)
            gamma = sc.gamma or (drafter.c.gamma if drafter is not None else 1)
            t0 = time.perf_counter()
            if sc.sps_table:
                sps = SPSTable.load(sc.sps_table)
            else:
                sps = profile(tgt.model, sc.sps_batches, repeats=3, max_requests=sc.max_batch)
            if drafter is not None and sc.policy != "none" and not sps.draft_batch:  # t_d(R) on this device
                requests = sorted({R for R in sc.sps_batches if R < sc.max_batch} | {sc.max_batch})
                add_draft_times(sps, tgt.model, drafter, requests, gamma, repeats=3)
            if drafter is not None and sc.policy in ADAPTIVE and not sps.verify_s:  # the policies that price it
                log.warning("cost table without a verification profile: verification priced at 1/SPS(B)")
            log.info(
                "cost tables ready in %.1fs: SPS(B) %s, t_d(R) %s, verifying gamma + 1 tokens for R requests %s",
                time.perf_counter() - t0,
                sps.sps,
                sps.draft_s,
                sps.verify_s,
            )
            return tgt, drafter, start, gamma, sps

        tgt, drafter, start, self.gamma, sps = on_own_thread(setup)
        self.calibration = calibration if (sc.calibration and drafter is not None and drafter.has_confidence) else None
        self.metrics = EngineMetrics(self.gamma)
        self.pending: list = []
        self.plock = threading.Lock()
        self.engine = Engine(
            tgt.model,
            tgt.tokenizer,
            drafter,
            gamma=self.gamma,
            policy=sc.policy,
            sps=sps,
            max_batch=sc.max_batch,
            max_queue=sc.max_queue,
            prefill_tokens=sc.prefill_tokens,
            warm_up_rounds=sc.warm_up_rounds,
            static_len=sc.static_len,
            threshold=sc.threshold,
            calibration=start,
            metrics=self.metrics,
            observer=self._observe if self.calibration else None,
            probe_rounds=sc.draft_probe_rounds,
            max_len=sc.max_len,
            stop_ids=tgt.eos_token_ids,
            threads=sc.num_cpus,
        )
        self.chat_template_kwargs = cfg.target.chat_template_kwargs
        self.sps, self.tokenizer, self.model_name = sps, tgt.tokenizer, sc.model_name
        self.stream_interval_s, self.stream_messages_per_s = sc.stream_interval_s, sc.stream_messages_per_s
        self.sending = 0  # streams that sent their first text and have not ended (this replica's event loop)
        self.cal_version = -1
        if self.calibration:
            threading.Thread(target=self._sync_calibration, daemon=True).start()

    # -- calibration traffic (engine thread -> actor, batched; actor -> engine, polled)
    def _observe(self, rounds: list) -> None:
        with self.plock:
            self.pending.extend(rounds)

    def _sync_calibration(self) -> None:
        from dspark.calibration.sts import Calibration as STS

        while True:
            time.sleep(1.0)
            try:
                with self.plock:
                    batch, self.pending = self.pending, []
                if batch:
                    self.calibration.add.remote(batch).result(timeout_s=30)
                c = self.calibration.current.remote().result(timeout_s=30)
                if c["version"] != self.cal_version:
                    self.engine.set_calibration(STS.from_dict(c))
                    self.cal_version = c["version"]
                self.metrics.ece.set(c["live_error"] or 0.0)
            except Exception as e:  # the engine keeps serving with its current calibration
                log.warning("calibration sync failed: %s", e)

    # -- requests
    def encode(self, body: dict) -> list[int]:
        """Chat: the target's own chat template. Completions: the raw text after BOS (when the target has one)."""
        from dspark.corpus.tokenizer import chat_ids

        if "messages" in body:
            return chat_ids(self.tokenizer, body["messages"], chat_template_kwargs=self.chat_template_kwargs)
        bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        return bos + self.tokenizer.encode(body["prompt"], add_special_tokens=False)

    async def generate(self, body: dict) -> AsyncIterator[list[Event]]:
        """Streams lists of events: Text events, then one Done or Error. Each list is what the engine put
        out since the previous one, adjacent texts merged, sent at most every `stream_interval` (the first
        text and the end at once): every message costs CPU in this replica, the ingress and the proxy,
        which on a small machine is taken from the engine."""
        from dspark.decoding.engine import Overloaded
        from dspark.decoding.sampling import SamplingParams
        from dspark.errors import UserError

        try:
            ids = self.encode(body)
            sp = SamplingParams(body["temperature"], body["top_p"], body["top_k"])
            stream = self.engine.submit(
                ids, sp, body["max_tokens"], body.get("seed"), body.get("stop") or [], body.get("logprobs")
            )
        except Overloaded as e:
            yield [Error(str(e), 429)]
            return
        except (ValueError, UserError) as e:
            yield [Error(str(e), 400)]
            return
        # The engine thread wakes this coroutine after each event: no executor thread ever blocks on a
        # stream (a pool of blocked threads once starved every other stream of the replica).
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        stream.notify = lambda: loop.call_soon_threadsafe(wake.set)
        batch, due, end = [], 0.0, False  # events not sent yet; when the next message may go; Done/Error drained
        sending = False  # counted in self.sending
        try:
            while True:
                wake.clear()  # before draining: an event put after the drain wakes the wait below
                while not end:
                    try:
                        batch.append(stream.events.get_nowait())
                    except queue.Empty:
                        break
                    end = isinstance(batch[-1], (Done, Error))
                if batch and (end or loop.time() >= due):
                    yield coalesce(batch)
                    if end:
                        return
                    if not sending:
                        sending, self.sending = True, self.sending + 1
                    wait = stream_interval(self.stream_interval_s, self.sending, self.stream_messages_per_s)
                    batch, due = [], loop.time() + wait
                    continue
                try:  # the next event, or (holding text) the end of the interval
                    await asyncio.wait_for(wake.wait(), due - loop.time() if batch else None)
                except TimeoutError:
                    pass
        finally:
            if sending:
                self.sending -= 1
            if stream.finish_reason is None:  # the client went away: free the slot (or the queue place)
                self.engine.cancel(stream)

    def state(self) -> dict:
        return {
            **self.engine.state(),
            "sps": dataclasses.asdict(self.sps),
        }


# The ingress calls the engine over Serve's direct gRPC channel with plain pickle (its events are plain
# dataclasses), not through Ray object references: fewer CPU per streamed message (docs/serving.md).
STREAM = {"stream": True, "_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}
OPEN_PATHS = ("/health",)  # every other route needs the key when serve.api_key is set
UNAVAILABLE = (RayActorError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)


def _kind(status: int) -> str:
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, _kind(status)), status_code=status)


def authorized(headers: list[tuple[bytes, bytes]], key: str | None) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time; no key configured: open."""
    if key is None:
        return True
    return hmac.compare_digest(dict(headers).get(b"authorization", b""), b"Bearer " + key.encode())


class Auth:
    """ASGI middleware: the key is checked before any route reads the body, so an unauthenticated
    request gets a 401 whatever it sends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].removeprefix(scope.get("root_path", "")) not in OPEN_PATHS:
            key = serve.get_replica_context().servable_object.sc.api_key
            if not authorized(scope["headers"], key):
                await _error(401, "missing or wrong API key (Authorization: Bearer ...)")(scope, receive, send)
                return
        await self.app(scope, receive, send)


api.add_middleware(Auth)


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    if first.get("type") == "json_invalid":
        return _error(400, "request body is not valid JSON")
    field = ".".join(loc) or (first.get("ctx") or {}).get("field")  # ctx: a model-level check naming its field
    if field is None:
        return _error(400, "request body must be a JSON object (Content-Type: application/json)")
    msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid value")
    return _error(400, f"{field}: {msg}", field)


@api.exception_handler(StarletteHTTPException)
async def _http(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail))


@api.exception_handler(Exception)
async def _internal(request: Request, exc: Exception):
    log.error("unhandled error in %s %s: %r", request.method, request.url.path, exc)  # the server logs the trace
    return _error(503 if isinstance(exc, UNAVAILABLE) else 500, f"internal error ({type(exc).__name__})")


async def _events(gen) -> AsyncIterator[Event]:
    """The engine's stream (lists of events) as Text events, then exactly one Done or Error, also when the
    engine's stream ends early or the call itself fails (e.g. the replica died)."""
    try:
        async for batch in gen:
            for ev in batch:
                yield ev
                if isinstance(ev, (Done, Error)):
                    return
    except UNAVAILABLE as e:
        log.warning("engine unavailable: %s", e)
        yield Error(f"the engine is unavailable ({type(e).__name__}); retry later", 503)
        return
    except Exception as e:
        log.exception("engine call failed")
        yield Error(f"internal error in the engine ({type(e).__name__})", 500)
        return
    yield Error("the engine's stream ended without a result", 500)


async def _collect(ev: Event, events: AsyncIterator[Event]) -> tuple[str, list | None, Done | Error]:
    """A whole answer: its text, its logprobs entries (None: not asked for) and the final Done or Error."""
    text, entries = "", []
    while isinstance(ev, Text):
        text += ev.delta
        entries.extend(ev.logprobs or [])
        ev = await anext(events)
    rest = ev.info.get("logprobs") if isinstance(ev, Done) else None  # None: not asked for
    return text, None if rest is None else entries + rest, ev


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _sse(
    ev: Event, events: AsyncIterator[Event], gen, rid: str, model: str, chat: bool, usage_chunk: bool = False
) -> AsyncIterator[str]:
    """Server-sent events: chunks, a last chunk with the finish reason and usage (with `usage_chunk`,
    stream_options.include_usage, the usage moves to one more chunk with no choices), then [DONE]. An error
    after the stream has started is sent as an OpenAI-style error event that ends it: never [DONE]
    after a cut-short answer. With logprobs, each chunk carries those of the tokens it adds (the last one,
    those of tokens that added no text, such as the end of sequence)."""
    offset = 0  # completions' text_offset: characters of the tokens sent so far

    def logprobs(entries):
        nonlocal offset
        body = logprobs_body(entries, chat, offset)
        offset += sum(len(e["token"]) for e in entries or [])
        return body

    try:
        if chat:
            role = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
            yield _data({**chunk_body(rid, model, "", None, chat), "choices": [role]})
        while isinstance(ev, Text):
            yield _data(chunk_body(rid, model, ev.delta, None, chat, logprobs(ev.logprobs)))
            ev = await anext(events)
        if isinstance(ev, Error):
            yield _data(error_body(ev.message, kind=_kind(ev.status)))
            return
        info = ev.info
        yield _data(
            {
                **chunk_body(rid, model, "", info["finish_reason"], chat, logprobs(info.get("logprobs"))),
                "speculative": info["speculative"],
                "timing": info["timing"],
                "usage": None if usage_chunk else usage_body(info),  # with the usage chunk: only there
            }
        )
        if usage_chunk:
            yield _data({**chunk_body(rid, model, "", None, chat), "choices": [], "usage": usage_body(info)})
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel()  # a disconnected client cancels the engine-side stream, which frees the slot


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, cfg_json: str, engine, calibration=None):
        self.sc = _cfg(cfg_json).serve
        self.engine, self.calibration = engine, calibration

    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.sc.model_name, "object": "model", "owned_by": "dspark"}]}

    @api.get("/v1/engine")
    async def engine_state(self):
        return await self.engine.state.remote()

    @api.get("/v1/calibration")
    async def calibration_stats(self):
        if self.calibration is None:
            return _error(404, "online calibration is off for this deployment")
        return await self.calibration.stats.remote()

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._run(body, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest):
        return await self._run(body, chat=True)

    async def _run(self, body, chat: bool):
        if body.model and body.model != self.sc.model_name:
            return _error(404, f"model: unknown model {body.model!r} (serving {self.sc.model_name!r})", "model")
        params = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
            "stop": body.stops(),
            "max_tokens": body.limit() or self.sc.max_tokens_default,
            "logprobs": body.n_logprobs(),
        }
        params.update({"messages": [m.for_template() for m in body.messages]} if chat else {"prompt": body.prompt})
        gen = self.engine.options(**STREAM).generate.remote(params)
        events, rid, model = _events(gen), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.sc.model_name
        streaming = False
        try:
            first = await anext(events)
            if isinstance(first, Error):
                return _error(first.status, first.message)
            if body.stream:
                streaming = True  # the stream owns the engine call from here
                usage_chunk = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    _sse(first, events, gen, rid, model, chat, usage_chunk), media_type="text/event-stream"
                )
            text, logprobs, last = await _collect(first, events)
            if isinstance(last, Error):
                return _error(last.status, last.message)
            return completion_body(rid, model, text, last.info, chat, logprobs)
        finally:
            if not streaming:
                gen.cancel()  # finished, failed, or the client went away: the engine frees the slot


def build(args: dict) -> serve.Application:
    """App builder for `serve run` / RayService: args = {"overrides": ["serve.drafter_uri=...", ...],
    "config": optional YAML path}, or {"config_json": a resolved Config as JSON}."""
    from dspark.config import Config, load_config

    if "config_json" in args:
        cfg = Config.model_validate_json(args["config_json"])
    else:
        cfg = load_config(args.get("config"), list(args.get("overrides", [])))
    cfg_json = cfg.model_dump_json()
    calibration = None
    if cfg.serve.drafter_uri:  # a missing drafter or an unreachable store fails here, not in every replica
        gamma, start = _drafter_calibration(cfg)
        if cfg.serve.calibration:
            calibration = CalibrationActor.options(name=f"calibration-{cfg.serve.model_name}").bind(
                cfg_json, gamma, start.to_dict() if start else None
            )
    engine = SpeculativeEngine.options(**engine_options(cfg)).bind(cfg_json, calibration)
    return Ingress.bind(cfg_json, engine, calibration)


def engine_options(cfg) -> dict:
    """Serve options of the engine deployment: one GPU per replica when the target runs on CUDA; a fixed
    number of replicas, or autoscaling on ongoing requests (serve.autoscaling.max_replicas > 0)."""
    sc, a = cfg.serve, cfg.serve.autoscaling
    gpus = 1 if cfg.target.device.startswith("cuda") else 0
    opts: dict = {"ray_actor_options": {"num_cpus": sc.num_cpus, "num_gpus": gpus}}
    if not a.max_replicas:
        return {**opts, "num_replicas": sc.num_replicas}
    if a.min_replicas > a.max_replicas:
        from dspark.errors import UserError

        raise UserError(f"serve.autoscaling.min_replicas={a.min_replicas} exceeds max_replicas={a.max_replicas}")
    target = a.target_ongoing_requests or sc.max_batch
    scaling = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas, "target_ongoing_requests": target}
    return {**opts, "num_replicas": None, "autoscaling_config": scaling}


def _drafter_calibration(cfg):
    """(gamma served, the drafter's shipped calibration or None), read before anything is deployed: a
    drafter that is not there, a store that cannot be reached (one line naming its endpoint) and a
    calibration of another length are refused here."""
    import tempfile

    from dspark.artifacts import download_drafter
    from dspark.calibration import sts
    from dspark.errors import UserError
    from dspark.models import CONFIG_FILE, DrafterConfig
    from dspark.storage import Storage

    Storage.from_config(cfg.storage).check(cfg.serve.drafter_uri)  # one quick try (models:/ and paths: none)
    with tempfile.TemporaryDirectory(prefix="drafter-") as d:  # the two small files, not the weights
        local = download_drafter(cfg, cfg.serve.drafter_uri, d, only=(CONFIG_FILE, sts.FILE))
        if not (local / CONFIG_FILE).is_file():
            raise UserError(f"serve.drafter_uri: no drafter at {cfg.serve.drafter_uri} (no {CONFIG_FILE})")
        gamma = cfg.serve.gamma or DrafterConfig.load(local / CONFIG_FILE).gamma
        start = sts.load(local)
    return gamma, start.check(gamma) if start else None


def run_local(cfg, name: str = "dspark", route_prefix: str = "/") -> str:
    """Start (or replace) the application `name` at `route_prefix` on the connected (or a new local) Ray;
    returns its base URL."""
    from ray.serve.context import _get_global_client

    from dspark.cluster import init_ray
    from dspark.errors import UserError

    init_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    running = _get_global_client().http_config.port  # a running Serve keeps its port, ignoring ours
    if running != cfg.serve.port:
        raise UserError(
            f"serve.port={cfg.serve.port}: Serve already listens on port {running} in this Ray "
            f"cluster; use serve.port={running} or shut that Serve down first"
        )
    serve.run(build({"config_json": cfg.model_dump_json()}), name=name, route_prefix=route_prefix)
    return f"http://{cfg.serve.host}:{cfg.serve.port}{route_prefix.rstrip('/')}"
