"""Ray Serve application: an OpenAI-compatible ingress, speculative-decoding engine replicas with
continuous batching, and one calibration deployment per model pair.

    serve run serving/config.yaml                     # or: python jobs/serve.py
    curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 32}'

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as SSE),
GET /v1/models, GET /health, GET /v1/calibration (the calibration actor's statistics),
GET /v1/engine (engine replica state).
"""
import asyncio
import json
import logging
import math
import queue
import threading
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import ChatRequest, CompletionRequest, chunk_body, completion_body, error_body

log = logging.getLogger("dspark.serving")
api = FastAPI(title="dspark")


def _cfg(cfg_json: str):
    from dspark.config import Config

    return Config.model_validate_json(cfg_json)


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class Calibration:
    """Named per model pair (deployment `calibration-<model>`): aggregates per-position acceptance
    outcomes from every engine replica, refits the STS calibration, hands it back to the engines."""

    def __init__(self, cfg_json: str, gamma: int, start: dict | None):
        from dspark.calibration.online import OnlineCalibrator
        from dspark.calibration.sts import Calibration as STS

        sc = _cfg(cfg_json).serve
        self.cal = OnlineCalibrator(gamma, STS.from_dict(start) if start else None, bias=sc.calibration_bias,
                                    half_life=sc.calibration_half_life, min_rounds=sc.calibration_min_rounds,
                                    refit_every=sc.calibration_refit_every)

    def add(self, rounds: list) -> int:
        self.cal.add(rounds)
        return self.cal.version

    def current(self) -> dict:
        """What the engines poll every second: the calibration in force and the live error (cheap: the
        recent window only; `stats` reports over every held round)."""
        err = self.cal.live_error()
        return {"version": self.cal.version, **self.cal.cal.to_dict(), "live_error": None if math.isnan(err) else err}

    def stats(self) -> dict:
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
        self.latency = Histogram("dspark_round_seconds", "round latency", boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1])

    def round(self, rounds, batch: int, waiting: int, seconds: float) -> None:
        self.rounds.inc()
        self.batch.set(batch)
        self.queue.set(waiting)
        self.latency.observe(seconds)
        if rounds:
            self.budget.set(sum(r.verified for r in rounds) / len(rounds))
        for r in rounds:
            if r.verified:
                self.drafts.inc()
                self.draft_tokens.inc(r.verified)
            for k in range(1, r.verified + 1):
                self.verified.inc(tags={"position": str(k)})
                if r.accepted >= k:
                    self.accepted.inc(tags={"position": str(k)})


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 1},
                  logging_config={"enable_access_log": False})
class SpeculativeEngine:
    def __init__(self, cfg_json: str, calibration=None):
        import torch

        from dspark import target as targets
        from dspark.calibration import sts
        from dspark.decoding.engine import Engine
        from dspark.models import load_drafter
        from dspark.scheduling.sps import SPSTable, profile
        from dspark.storage import Storage

        cfg = _cfg(cfg_json)
        sc = cfg.serve
        if cfg.target.threads:
            torch.set_num_threads(cfg.target.threads)
        tgt = targets.load_from_config(cfg.target)
        drafter, start = None, None
        if sc.drafter_uri:
            import tempfile

            local = Storage.from_config(cfg.storage).download_dir(sc.drafter_uri, tempfile.mkdtemp(prefix="drafter-"))
            drafter = load_drafter(local, tgt.model, tgt.weights_sha256)
            start = sts.load(local / "calibration.json")
        t0 = time.perf_counter()
        sps = SPSTable.load(sc.sps_table) if sc.sps_table else profile(tgt.model, sc.sps_batches, repeats=3)
        log.info("SPS table ready in %.1fs: %s", time.perf_counter() - t0, sps.sps)
        self.gamma = sc.gamma or (drafter.c.gamma if drafter is not None else 1)
        self.calibration = calibration if (sc.calibration and drafter is not None and drafter.has_confidence) else None
        self.metrics = EngineMetrics(self.gamma)
        self.pending: list = []
        self.plock = threading.Lock()
        self.engine = Engine(tgt.model, tgt.tokenizer, drafter, self.gamma, sc.policy, sps, sc.max_batch, sc.max_queue,
                             sc.static_len, sc.threshold, start, observer=self._observe if self.calibration else None,
                             metrics=self.metrics, idle_probe=sc.idle_probe_rounds, max_len=sc.max_len,
                             stop_ids=tgt.eos_token_ids)
        self.chat_template_kwargs = cfg.target.chat_template_kwargs
        self.sps, self.tokenizer, self.model_name = sps, tgt.tokenizer, sc.model_name
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

    async def generate(self, body: dict) -> AsyncIterator[tuple]:
        """Streams ("text", delta) events, then ("done", info) or ("error", message, status)."""
        from dspark.decoding.engine import Overloaded
        from dspark.decoding.sampling import SamplingParams
        from dspark.errors import UserError

        try:
            ids = self.encode(body)
            sp = SamplingParams(body["temperature"], body["top_p"], body["top_k"])
            stream = self.engine.submit(ids, sp, body["max_tokens"], body.get("seed"), body.get("stop") or [])
        except Overloaded as e:
            yield ("error", str(e), 429)
            return
        except (ValueError, UserError) as e:
            yield ("error", str(e), 400)
            return
        # The engine thread wakes this coroutine after each event: no executor thread ever blocks on a
        # stream (a pool of blocked threads once starved every other stream of the replica).
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        stream.notify = lambda: loop.call_soon_threadsafe(wake.set)
        try:
            while True:
                try:
                    ev = stream.events.get_nowait()
                except queue.Empty:
                    await wake.wait()
                    wake.clear()
                    continue
                yield ev
                if ev[0] in ("done", "error"):
                    return
        finally:
            if stream.finish_reason is None:  # the client went away: free the slot (or the queue place)
                self.engine.cancel(stream)

    def state(self) -> dict:
        return {**self.engine.state(), "sps": {"batch": self.sps.batch, "sps": self.sps.sps, "hardware": self.sps.hardware}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 429: "rate_limit_error", 503: "server_error"}.get(status, "invalid_request_error")
    return JSONResponse(error_body(message, param, kind), status_code=status)


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    if first.get("type") == "json_invalid":
        return _error(400, "request body is not valid JSON")
    if loc == [] and first.get("type") in ("model_attributes_type", "dict_type"):
        return _error(400, "request body must be a JSON object (Content-Type: application/json)")
    field = ".".join(loc) or None
    return _error(400, f"{field}: {first.get('msg', 'invalid value')}" if field else first.get("msg", "invalid request"), field)


@api.exception_handler(StarletteHTTPException)
async def _http(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail))


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, cfg_json: str, engine, calibration=None):
        self.sc = _cfg(cfg_json).serve
        self.engine, self.calibration = engine, calibration

    def _auth(self, request: Request) -> JSONResponse | None:
        if self.sc.api_key and request.headers.get("authorization", "") != f"Bearer {self.sc.api_key}":
            return _error(401, "missing or wrong API key (Authorization: Bearer ...)")
        return None

    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        return self._auth(request) or {"object": "list", "data": [{"id": self.sc.model_name, "object": "model",
                                                                  "owned_by": "dspark"}]}

    @api.get("/v1/engine")
    async def engine_state(self):
        return await self.engine.state.remote()

    @api.get("/v1/calibration")
    async def calibration_stats(self):
        if self.calibration is None:
            return _error(404, "online calibration is off for this deployment")
        return await self.calibration.stats.remote()

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._run(body, request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest, request: Request):
        return await self._run(body, request, chat=True)

    async def _run(self, body, request: Request, chat: bool):
        denied = self._auth(request)
        if denied:
            return denied
        if body.model and body.model != self.sc.model_name:
            return _error(404, f"model: unknown model {body.model!r} (serving {self.sc.model_name!r})", "model")
        params = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                  "stop": body.stops(), "max_tokens": body.max_tokens or self.sc.max_tokens_default}
        params.update({"messages": [m.model_dump() for m in body.messages]} if chat else {"prompt": body.prompt})
        gen = self.engine.options(stream=True).generate.remote(params)
        first = await gen.__anext__()
        if first[0] == "error":
            return _error(first[2], first[1], "prompt" if first[2] == 400 else None)
        model = self.sc.model_name
        if not body.stream:
            text, ev = "", first
            while ev[0] == "text":
                text += ev[1]
                ev = await gen.__anext__()
            if ev[0] == "error":
                return _error(500, ev[1])
            return completion_body(f"cmpl-{id(gen)}", model, text, ev[1], chat)

        async def sse():
            ev, rid = first, f"cmpl-{id(gen)}"
            try:
                if chat:
                    yield f"data: {json.dumps({**chunk_body(rid, model, '', None, chat), 'choices': [{'index': 0, 'delta': {'role': 'assistant'}, 'finish_reason': None}]})}\n\n"
                while ev[0] == "text":
                    yield f"data: {json.dumps(chunk_body(rid, model, ev[1], None, chat))}\n\n"
                    ev = await gen.__anext__()
                if ev[0] == "done":
                    last = {**chunk_body(rid, model, "", ev[1]["finish_reason"], chat), "speculative": ev[1]["speculative"],
                            "usage": {"prompt_tokens": ev[1]["prompt_tokens"], "completion_tokens": ev[1]["completion_tokens"]}}
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                gen.cancel()  # a disconnected client cancels the engine-side stream, which frees the slot

        return StreamingResponse(sse(), media_type="text/event-stream")


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
    if cfg.serve.calibration and cfg.serve.drafter_uri:
        gamma, start = _drafter_calibration(cfg)
        calibration = Calibration.options(name=f"calibration-{cfg.serve.model_name}").bind(
            cfg_json, gamma, start.to_dict() if start else None)
    engine = SpeculativeEngine.options(num_replicas=cfg.serve.num_replicas).bind(cfg_json, calibration)
    return Ingress.bind(cfg_json, engine, calibration)


def _drafter_calibration(cfg):
    """(gamma served, the drafter's shipped calibration or None); a calibration of another length is
    refused here, before anything is deployed."""
    import tempfile

    from dspark.calibration import sts
    from dspark.models import DrafterConfig
    from dspark.storage import Storage

    local = Storage.from_config(cfg.storage).download_dir(cfg.serve.drafter_uri, tempfile.mkdtemp(prefix="drafter-"))
    gamma = cfg.serve.gamma or DrafterConfig.load(local / "config.json").gamma
    start = sts.load(local / "calibration.json")
    return gamma, start.check(gamma) if start else None


def run_local(cfg) -> str:
    """Start (or replace) the application on the connected (or a new local) Ray; returns its base URL."""
    from dspark.cluster import init_ray

    from ray.serve.context import _get_global_client

    from dspark.errors import UserError

    init_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    running = _get_global_client().http_config.port  # a running Serve keeps its port, ignoring ours
    if running != cfg.serve.port:
        raise UserError(f"serve.port={cfg.serve.port}: Serve already listens on port {running} in this Ray "
                        f"cluster; use serve.port={running} or shut that Serve down first")
    serve.run(build({"config_json": cfg.model_dump_json()}), name="dspark", route_prefix="/")
    return f"http://{cfg.serve.host}:{cfg.serve.port}"
