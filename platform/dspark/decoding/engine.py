"""Continuous-batching engine for serving: a background thread runs speculative-decoding rounds for
all active requests; requests join and leave between rounds; tokens stream out as they commit.

Per round: drafts for all active requests -> the scheduling policy picks l_r from the calibrated
survival and the SPS table -> one flattened target forward verifies everything -> rejection
sampling. Acceptance outcomes go to an observer (the calibration actor) and a fresh STS calibration
can be installed between rounds. The waiting queue is bounded: beyond it `submit` raises Overloaded.

Every stream ends with exactly one Done(info) or Error(message, http_status) event, also when
it is cancelled while queued; `Stream.notify` (optional) is called after each event, so an asyncio
consumer needs no thread blocked on the queue. A request's failure never takes a slot with it.
"""

from __future__ import annotations

import functools
import itertools
import queue
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from dspark.calibration.sts import Calibration
from dspark.decoding.detok import Detokenizer
from dspark.decoding.events import MAX_LOGPROBS, Done, Error, Event, Text, position_counts
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder, full_length
from dspark.errors import UserError
from dspark.scheduling.policies import ADAPTIVE, POLICIES, DraftGate, make_policy
from dspark.scheduling.sps import SPSTable

MAX_SEED = 2**63  # seeds are 0 .. 2^63 - 1


class Overloaded(Exception):
    """The waiting queue is full: answer 429 rather than growing memory."""


@dataclass
class Stream:
    """One request as the engine sees it, plus the queue its events are delivered to."""

    req: Request
    stop: list[str]
    detok: Detokenizer
    events: "queue.Queue" = field(default_factory=queue.Queue)
    id: str = ""
    sent_text: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None  # when the first text went out
    first_tokens: int = 0  # output tokens committed by then
    sent_logprobs: int = 0  # output tokens whose logprobs went out
    finish_reason: Optional[str] = None
    notify: Optional[Callable[[], None]] = None  # called after every event (from the engine thread)

    def put(self, event: Event) -> None:
        self.events.put(event)
        if self.notify is not None:
            self.notify()

    def fail(self, message: str, status: int) -> None:
        self.finish_reason = "error"
        self.put(Error(message, status))

    def timing(self) -> dict:
        """Seconds from submission to the first text (TTFT; None when no text went out) and the mean
        time per output token committed after it (inter-token latency; None when none was)."""
        later = len(self.req.out) - self.first_tokens
        ttft = None if self.first_token is None else self.first_token - self.submitted
        itl = None if self.first_token is None or later <= 0 else (time.perf_counter() - self.first_token) / later
        return {"ttft_s": ttft, "itl_s": itl}

    def stats(self) -> dict:
        verified, accepted = position_counts(self.req.rounds)
        return {
            "rounds": len(self.req.rounds),
            "drafted_rounds": sum(r.drafted for r in self.req.rounds),
            "mean_tau": self.req.tau,
            "verified_per_position": verified,
            "accepted_per_position": accepted,
            "mean_verify_len": float(np.mean([r.verified for r in self.req.rounds])) if self.req.rounds else 0.0,
        }


class _ForcedGate:
    """The warm-up's stand-in for the draft gate: drafts as `draft` says, measures nothing."""

    draft = True

    def __call__(self, R: int, behind: int = 0, own=None, plain_behind: int = 0) -> bool:
        return self.draft

    def observe(self, *_) -> None:
        pass

    def finished(self, *_) -> None:
        pass

    def timed(self, *_) -> None:
        pass


class Engine:
    def __init__(
        self,
        target_model,
        tokenizer,
        drafter=None,
        *,
        gamma: int = 7,
        policy: str = "greedy",
        sps: Optional[SPSTable] = None,
        max_batch: int = 8,
        max_queue: int = 32,
        static_len: int = 4,
        threshold: float = 0.5,
        calibration: Optional[Calibration] = None,
        observer: Optional[Callable[[list], None]] = None,
        metrics=None,
        probe_rounds: int = 0,
        max_len: int = 0,
        stop_ids: tuple[int, ...] = (),
        threads: int = 0,
        prefill_tokens: int = 0,
        warm_up_rounds: int = 0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} not in {POLICIES}")
        drafting = drafter is not None and policy != "none"
        if calibration is not None and drafting:
            calibration.check(gamma)
        self.tok = tokenizer
        self.vocab_size = target_model.get_input_embeddings().num_embeddings
        self.stop_ids = tuple(stop_ids) or (tokenizer.eos_token_id,)  # every EOS id of the target
        self.sps = sps or SPSTable.synthetic("smooth")
        self.policy_name = policy
        self.max_batch = max_batch
        self._new_policy = functools.partial(make_policy, policy, self.sps, static_len, threshold)
        decoder = functools.partial(  # built on the engine thread (see _loop)
            SpeculativeDecoder,
            target_model,
            drafter if drafting else None,
            gamma,
            self._new_policy(),
            max_slots=max_batch,
            calibration=calibration,
            # adaptive policies also decide whether to draft at all (static ones are the baselines)
            gate=DraftGate(self.sps, gamma, probe_rounds) if drafting and policy in ADAPTIVE else None,
            max_len=max_len,
        )
        self.max_queue = max_queue
        self.prefill_tokens = prefill_tokens  # prompt tokens one admission prefills together (see _admit)
        self.observer, self.metrics = observer, metrics
        self.waiting: deque[Stream] = deque()
        self.streams: dict[int, Stream] = {}  # id(req) -> stream, for active requests
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.ids = itertools.count()
        # seconds the engine thread spent admitting requests (their prefill and first token), in rounds, and
        # turning rounds' tokens into text events, since it started (state(): where a server's time goes), on
        # the wall clock and in the thread's own CPU time (`busy_cpu_s`; what it leaves out is time spent
        # waiting for the GIL or a core, or in torch's other threads where it has several)
        self.busy_s = {"prefill": 0.0, "rounds": 0.0, "emit": 0.0}
        self.busy_cpu_s = dict(self.busy_s)
        # R -> (rounds, seconds, CPU seconds) of the rounds that did not draft: in a replica that seldom
        # drafts, about the work of a target-only one's rounds at R (a bench compares replicas with them)
        self.plain_rounds: dict[int, tuple[int, float, float]] = {}
        self.running = True
        self.warm_up_rounds = warm_up_rounds  # per kind of round and batch size, before the first request
        self.warm_up_s = 0.0  # what it took
        self.threads = threads  # torch intra-op threads of the engine thread (0 = torch's setting)
        self.torch_threads = 0  # what the engine thread runs with, once started
        ready: Future = Future()
        self.thread = threading.Thread(target=self._loop, args=(decoder, ready), name="dspark-engine", daemon=True)
        self.thread.start()
        ready.result()  # raises what building the decoder raised

    # -- API (any thread)
    def submit(
        self,
        prompt_ids: list[int],
        sp: SamplingParams,
        max_tokens: int,
        seed: Optional[int] = None,
        stop: list[str] | None = None,
        logprobs: Optional[int] = None,
    ) -> Stream:
        """seed given: the output is a function of (prompt, seed) alone, whatever else the engine runs
        (Gumbel-max sampling keyed by position). seed None: a fresh random seed and standard rejection
        sampling, which accepts the most drafts. logprobs k: each output token's log-probability under the
        target and its k most likely tokens go out with the text. Raises ValueError or Overloaded."""
        if not prompt_ids:
            raise ValueError("prompt: at least one token is needed")
        if bad := [t for t in prompt_ids if not 0 <= t < self.vocab_size]:
            raise ValueError(f"prompt: token id {bad[0]} is not in the target's vocabulary of {self.vocab_size}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1 (got {max_tokens})")
        if len(prompt_ids) + max_tokens > self.decoder.max_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the context "
                f"limit of {self.decoder.max_len} tokens"
            )
        if seed is not None and not 0 <= seed < MAX_SEED:
            raise ValueError(f"seed: must be in [0, 2^63) (got {seed})")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: must be in 0..{MAX_LOGPROBS} (got {logprobs})")
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise Overloaded(f"{len(self.waiting)} requests already waiting (max_queue={self.max_queue})")
            req = Request(
                list(prompt_ids),
                sp,
                max_tokens,
                secrets.randbelow(MAX_SEED) if seed is None else seed,
                self.stop_ids,
                reproducible=seed is not None,
                logprobs=-1 if logprobs is None else logprobs,
            )
            s = Stream(req, stop or [], Detokenizer(self.tok), id=f"cmpl-{next(self.ids)}")
            self.waiting.append(s)
        self.wake.set()
        return s

    def cancel(self, s: Stream) -> None:
        """Client gone: drop it from the queue (its stream ends at once) or free its slot between rounds."""
        with self.lock:
            s.finish_reason = s.finish_reason or "cancelled"
            queued = s in self.waiting
            if queued:
                self.waiting.remove(s)
        if queued:
            self._finish(s)
        self.wake.set()

    def set_calibration(self, cal: Calibration) -> None:
        if self.decoder.gamma:
            cal.check(self.decoder.gamma)
        self.decoder.calibration = cal  # swapped whole between rounds: a round never mixes two

    def state(self) -> dict:
        runner = self.decoder.runner
        return {
            "active": len(self.decoder.active),
            "waiting": len(self.waiting),
            "policy": self.policy_name,
            "max_batch": self.max_batch,
            "free_slots": len(runner.free_slots),
            "max_len": self.decoder.max_len,
            "kv_capacity": runner.k[0].shape[2] if runner.k else 0,
            "drafter": self.decoder.drafter is not None,
            "drafter_error": self.decoder.drafter_error,
            "torch_threads": self.torch_threads,
            "warm_up_s": self.warm_up_s,
            "calibration": self.decoder.calibration.to_dict() if self.decoder.calibration else None,
            "draft_gate": self.decoder.gate.state() if self.decoder.gate is not None else None,
            # copied in the reverse of the order the engine thread adds to them (a round's wall time, its CPU
            # time, then its entry in plain_rounds), so that what one copy holds the ones after it hold too
            "plain_rounds": {str(R): list(v) for R, v in sorted(dict(self.plain_rounds).items())},
            "busy_cpu_s": dict(self.busy_cpu_s),
            "busy_s": dict(self.busy_s),
        }

    def close(self) -> None:
        self.running = False
        self.wake.set()
        self.thread.join(timeout=10)

    # -- engine thread
    def _loop(self, decoder: Callable[[], SpeculativeDecoder], ready: Future) -> None:
        # Every torch op of the engine runs on this thread, the decoder's allocations included: an OpenMP
        # team started on another thread (e.g. by a large torch.zeros) stays alive with that thread, and
        # with more OpenMP threads in the process than CPUs, libgomp's workers stop spinning between
        # parallel regions and sleep: SmolLM2 at batch 1 with 2 threads decoded 22 tok/s that way against
        # 39 (and 25 with 1 thread).
        if self.threads:
            torch.set_num_threads(self.threads)
        self.torch_threads = torch.get_num_threads()
        try:
            self.decoder = decoder()
            try:
                self._warm_up(self.warm_up_rounds)
            except Exception as e:
                raise RuntimeError(f"engine warm-up failed: {type(e).__name__}: {e}") from e
        except BaseException as e:
            ready.set_exception(e)
            return
        ready.set_result(None)
        while self.running:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._admit()
            self._spent("prefill", t0, c0)
            dec = self.decoder
            for s in [self.streams[id(r)] for r in dec.active if self.streams[id(r)].finish_reason == "cancelled"]:
                dec.cancel(s.req)
                self._finish(s)
            if not dec.active:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            batch = list(dec.active)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                dec.step()
            except Exception as e:  # a broken round must not take the server down: fail its requests
                for r in batch:
                    dec.cancel(r)
                    self.streams.pop(id(r)).fail(f"round failed: {type(e).__name__}: {e}", 500)
                continue
            wall, cpu = self._spent("rounds", t0, c0)
            if not dec.drafted_last:
                n, s, c = self.plain_rounds.get(len(batch), (0, 0.0, 0.0))
                self.plain_rounds[len(batch)] = (n + 1, s + wall, c + cpu)  # one store: state() reads it whole
            t0, c0 = time.perf_counter(), time.thread_time()
            self._observe(batch, wall)
            for r in batch:
                self._emit_or_fail(self.streams[id(r)])
            self._spent("emit", t0, c0)

    def _warm_up(self, rounds: int) -> None:
        """Before the first request: at R = 1..max_batch synthetic requests in turn (one joins per R, and one
        that ended is replaced; 16 random prompt tokens each, greedy, sampled and seeded in turn: the three ways a
        round samples), `rounds` rounds that draft and verify every draft (where the engine drafts), then `rounds`
        plain ones, so that a fresh process's first rounds of each shape (the kernels' first calls and their
        caches, the allocator; on a GPU the libraries' lazy setup) are neither the first requests' nor what the
        draft gate first measures (docs/serving.md, "Warm-up at replica start"). The gate stands aside, the
        policy is built anew after it (its history), the slots go back in a fresh engine's order, and the
        metrics, the observer and the engine's clocks see none of it. A drafter that fails here fails the start."""
        if not rounds:
            return
        t0 = time.perf_counter()
        dec, gen, forced = self.decoder, torch.Generator().manual_seed(0), _ForcedGate()
        gate, dec.gate, dec.policy = dec.gate, forced, full_length
        kinds = (True, False) if dec.gamma else (False,)
        prompt = min(16, dec.max_len - 1)
        # every token the warm-up's rounds could commit, room allowing: a request outlasts it unless max_len cuts it
        new = min(self.max_batch * len(kinds) * rounds * (dec.gamma + 1), dec.max_len - prompt)
        made = 0
        for R in range(1, self.max_batch + 1):
            for draft in kinds:
                forced.draft = draft
                for _ in range(rounds):
                    while len(dec.active) < R:
                        ids = torch.randint(self.vocab_size, (prompt,), generator=gen).tolist()
                        sp = SamplingParams(0.0 if made % 3 == 0 else 1.0)
                        dec.add(Request(ids, sp, new, made, reproducible=made % 3 == 2))
                        made += 1
                    dec.step()
        for r in list(dec.active):
            dec.cancel(r)
        dec.runner.free_slots.sort(reverse=True)  # the lowest slot first, as in a fresh engine
        dec.gate, dec.policy = gate, self._new_policy()
        if dec.drafter_error is not None:
            raise RuntimeError(f"the drafter failed on the warm-up's requests: {dec.drafter_error}")
        self.warm_up_s = time.perf_counter() - t0

    def _spent(self, phase: str, t0: float, c0: float) -> tuple[float, float]:
        """The engine thread spent the time since perf_counter t0 and thread_time c0 (read after t0) in `phase`:
        added to busy_s, then its CPU time to busy_cpu_s, the CPU clock read before the wall clock, so that it
        falls inside the wall interval. Returns both (wall, CPU)."""
        cpu = time.thread_time() - c0
        wall = time.perf_counter() - t0
        self.busy_s[phase] += wall
        self.busy_cpu_s[phase] += cpu
        return wall, cpu

    def _admit(self) -> None:
        """Prefill every waiting request that finds a free slot, before the next round. Prompts go in one
        target forward while their number times the longest is at most `prefill_tokens` (the first prompt
        always; 0: one prompt per forward), which pays where a prefill costs about one pass over the weights
        or a forward's fixed overhead (a GPU; short prompts; a small target);
        if that forward fails, each of its requests is prefilled alone, so a request that cannot be fails by
        itself (400 for what it asked, 500 otherwise) and no slot leaks."""
        dec = self.decoder
        while True:
            with self.lock:
                batch, longest = [], 0
                while self.waiting and len(batch) < len(dec.runner.free_slots):
                    n = max(longest, len(self.waiting[0].req.prompt))
                    if batch and (len(batch) + 1) * n > self.prefill_tokens:  # attention pads to the longest
                        break
                    batch.append(self.waiting.popleft())
                    longest = n
            if not batch:
                return
            together = len(batch) > 1 and self._admit_together(batch)
            admitted = batch if together else [s for s in batch if self._admit_alone(s)]
            for s in admitted:
                self.streams[id(s.req)] = s
                self._emit_or_fail(s)

    def _admit_together(self, batch: list[Stream]) -> bool:
        """Prefill several requests in one forward; False: it failed and took nothing (each is tried alone)."""
        try:
            self.decoder.add_many([s.req for s in batch])  # frees what it took if it fails
        except Exception:
            return False
        return True

    def _admit_alone(self, s: Stream) -> bool:
        """Prefill one request; False: it failed (its stream got the error, its slot is free)."""
        try:
            self.decoder.add(s.req)
        except UserError as e:
            s.fail(str(e), 400)
            return False
        except Exception as e:
            s.fail(f"prefill failed: {type(e).__name__}: {e}", 500)
            return False
        return True

    def _emit_or_fail(self, s: Stream) -> None:
        """A request whose output cannot be turned into text fails alone; the engine goes on."""
        try:
            self._emit(s)
        except Exception as e:
            if not s.req.done:
                self.decoder.cancel(s.req)
            self.streams.pop(id(s.req), None)
            s.fail(f"detokenization failed: {type(e).__name__}: {e}", 500)

    def _emit(self, s: Stream) -> None:
        out = s.req.out
        text = s.detok.final(out) if s.req.done else s.detok.update(out)
        stopped = min((i for i in (text.find(x) for x in s.stop if x) if i >= 0), default=None)  # the earliest stop
        if stopped is not None:
            text = text[:stopped]
            s.finish_reason = "stop"
        if len(text) > len(s.sent_text) and text.startswith(s.sent_text) and not text.endswith("\ufffd"):
            self._send(s, text)
        if s.req.done or s.finish_reason == "stop":
            if s.finish_reason is None:
                s.finish_reason = "stop" if out and out[-1] in self.stop_ids else "length"
            if s.finish_reason == "stop" and not s.req.done:
                self.decoder.cancel(s.req)
            if len(text) > len(s.sent_text):
                self._send(s, text)
            self._finish(s)

    def _logprobs(self, s: Stream) -> Optional[list[dict]]:
        """The logprobs entries of the tokens committed since the last ones sent (None: not asked for)."""
        if s.req.logprobs < 0:
            return None
        start, s.sent_logprobs = s.sent_logprobs, len(s.req.token_logprobs)
        new, ids = s.req.token_logprobs[start:], s.req.out[start : s.sent_logprobs]
        words = self.tok.batch_decode([[i] for i in ids + [j for _, top in new for j, _ in top]])
        tops = iter(words[len(ids) :])
        return [
            {"token": w, "logprob": lp, "top_logprobs": [{"token": next(tops), "logprob": v} for _, v in top]}
            for w, (lp, top) in zip(words, new)
        ]

    def _send(self, s: Stream, text: str) -> None:
        """Stream what `text` adds to what was sent; the first text starts the request's token clock."""
        s.put(Text(text[len(s.sent_text) :], self._logprobs(s)))
        s.sent_text = text
        if s.first_token is None:
            s.first_token, s.first_tokens = time.perf_counter(), len(s.req.out)

    def _finish(self, s: Stream) -> None:
        self.streams.pop(id(s.req), None)
        timing = s.timing()
        s.put(
            Done(
                {
                    "finish_reason": s.finish_reason,
                    "completion_tokens": len(s.req.out),
                    "prompt_tokens": len(s.req.prompt),
                    "speculative": s.stats(),
                    "timing": timing,
                    "logprobs": self._logprobs(s),
                }
            )
        )
        if self.metrics:
            self.metrics.request(len(s.req.out), **timing)

    def _observe(self, batch: list[Request], seconds: float) -> None:
        rounds = [r.rounds[-1] for r in batch if r.rounds]
        if self.metrics:
            self.metrics.round(rounds, len(batch), len(self.waiting), seconds)
        if self.observer:
            obs = [x for x in rounds if x.conf_logit is not None]  # drafted rounds
            if obs:
                self.observer(obs)
