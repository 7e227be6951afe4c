"""The continuous-batching engine without Ray: concurrent requests join and leave between rounds and
each still gets exactly the target's greedy output; bounded queue; cancellation; stop strings."""

import dataclasses
import threading
import time

import pytest
import torch
from tiny_models import untrained_drafter

from dspark import target as targets
from dspark.calibration.sts import Calibration
from dspark.decoding import engine as engine_module
from dspark.decoding.engine import Engine, Overloaded
from dspark.decoding.events import Done, Error, Text
from dspark.decoding.profile import envelope, profile
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.errors import UserError
from dspark.scheduling.policies import make_policy
from dspark.scheduling.sps import SPSTable


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


@pytest.fixture(scope="module")
def drafter(tgt):
    return untrained_drafter(tgt, "dspark", 4)


def engine(tgt, drafter, **settings):
    """An engine over the built-in target with gamma 4, the greedy policy and a smooth SPS curve
    unless `settings` say otherwise."""
    return Engine(
        tgt.model,
        tgt.tokenizer,
        drafter,
        **{"gamma": 4, "policy": "greedy", "sps": SPSTable.synthetic("smooth"), **settings},
    )


def collect(stream):
    text, ev = "", stream.events.get(timeout=120)
    while isinstance(ev, Text):
        text += ev.delta
        ev = stream.events.get(timeout=120)
    return text, ev


def ids_of(tgt, prompt):
    return [tgt.tokenizer.bos_token_id] + tgt.tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("policy", ["greedy", "async", "static", "threshold", "none"])
def test_concurrent_requests_get_exact_greedy_outputs(tgt, drafter, policy):
    prompts = [f"def g{i}(a):\n" for i in range(7)]
    # drafting costs 3 target steps: the adaptive policies skip drafting in some rounds, probing every 2
    cost = SPSTable([1, 16], [100.0, 90.0], draft_batch=[1], draft_s=[0.03])
    started = time.perf_counter()
    eng = engine(tgt, drafter, policy=policy, max_batch=3, max_queue=16, probe_rounds=2, sps=cost)
    if eng.decoder.gate is not None:  # the cost model decides (measured round times must not steer a test)
        eng.decoder.gate.timed = lambda R, drafted, tokens, seconds, catch_up_s=0.0, after_drafted=False: None
    try:
        streams = [eng.submit(ids_of(tgt, p), SamplingParams(0.0), 16, 0) for p in prompts]  # 7 requests, 3 slots
        outs = [collect(s) for s in streams]
        state = eng.state()
        busy = state["busy_s"]  # the engine thread's time by phase: parts of its life, each one used
        assert min(busy.values()) > 0 and sum(busy.values()) < time.perf_counter() - started
        # its own CPU time in each, read inside the phase's wall interval (two clocks: their rates may differ
        # by up to 500 ppm, NTP's slew)
        cpu = state["busy_cpu_s"]
        assert all(0 < cpu[k] <= busy[k] * 1.001 for k in busy)
        # the rounds that did not draft, by their number of requests: all of them without a drafting policy,
        # none with one that drafts every round
        undrafted = state["plain_rounds"]
        seconds = sum(s for _, s, _ in undrafted.values())
        assert all(0 < c <= s * 1.001 for _, s, c in undrafted.values())
        assert set(undrafted) <= {"1", "2", "3"} and seconds <= busy["rounds"] * (1 + 1e-9)
        if policy == "none":
            assert seconds == pytest.approx(busy["rounds"]) and sum(n for n, _, _ in undrafted.values()) > 0
        if policy == "static":
            assert undrafted == {}
    finally:
        eng.close()
    plain = SpeculativeDecoder(tgt.model, None).run(
        [Request(ids_of(tgt, p), SamplingParams(0.0), 16, 0, (tgt.tokenizer.eos_token_id,)) for p in prompts]
    )
    for (text, done), ref in zip(outs, plain):
        assert isinstance(done, Done) and text == tgt.tokenizer.decode(ref.out, skip_special_tokens=True)
        assert done.info["completion_tokens"] == len(ref.out)
        timing = done.info["timing"]  # what the server's TTFT and inter-token latency metrics record
        assert 0 < timing["ttft_s"] < 120 and (timing["itl_s"] is None or 0 < timing["itl_s"] < 120)
        spec = done.info["speculative"]
        if policy == "none":
            assert sum(spec["verified_per_position"]) == 0 and spec["drafted_rounds"] == 0
        elif policy == "static":
            assert spec["drafted_rounds"] == spec["rounds"]  # a baseline drafts every round
        elif spec["rounds"] > 3:  # an untrained drafter never pays for 3 target steps: the gate skips
            assert 0 < spec["drafted_rounds"] < spec["rounds"]


def test_queue_bound_cancel_and_stop(tgt, drafter):
    eng = engine(tgt, drafter, max_batch=1, max_queue=2)
    try:
        with pytest.raises(ValueError, match="context limit"):
            eng.submit(ids_of(tgt, "x"), SamplingParams(0.0), 10_000, 0)
        long = eng.submit(ids_of(tgt, "a = "), SamplingParams(1.0), 1500, 0)
        assert isinstance(long.events.get(timeout=60), Text)  # it holds the only slot now
        queued = [eng.submit(ids_of(tgt, "b = "), SamplingParams(1.0), 8, i) for i in range(2)]
        with pytest.raises(Overloaded):
            eng.submit(ids_of(tgt, "c = "), SamplingParams(1.0), 8, 0)
        eng.cancel(long)  # the client went away: its slot goes to the queue
        for s in queued:
            assert isinstance(collect(s)[1], Done)
        state = eng.state()
        assert state["active"] == 0 and state["waiting"] == 0
        stop = eng.submit(ids_of(tgt, "def f(x):\n"), SamplingParams(0.0), 40, 0, stop=["\n"])
        text, done = collect(stop)
        assert "\n" not in text and done.info["finish_reason"] == "stop"
    finally:
        eng.close()


def drain(stream, timeout=120):
    """Every event of a stream, up to and including its single terminal event."""
    events = [stream.events.get(timeout=timeout)]
    while isinstance(events[-1], Text):
        events.append(stream.events.get(timeout=timeout))
    return events


def test_cancelling_a_queued_request_ends_its_stream(tgt, drafter):
    eng = engine(tgt, drafter, max_batch=1, max_queue=4)
    woken = []
    try:
        busy = eng.submit(ids_of(tgt, "a = "), SamplingParams(1.0), 1500, 0)
        assert isinstance(busy.events.get(timeout=60), Text)
        queued = eng.submit(ids_of(tgt, "b = "), SamplingParams(1.0), 8, 1)
        queued.notify = lambda: woken.append(1)
        eng.cancel(queued)  # the client disconnected while waiting for a slot
        ev = queued.events.get(timeout=10)  # before the fix: no event ever came, its reader blocked forever
        assert isinstance(ev, Done) and ev.info["finish_reason"] == "cancelled" and woken == [1]
        eng.cancel(busy)
        assert isinstance(drain(busy)[-1], Done)
        assert eng.state()["free_slots"] == 1 and eng.state()["waiting"] == 0
    finally:
        eng.close()


def text_of(events):
    return "".join(e.delta for e in events if isinstance(e, Text))


def test_tiny_temperature_requests_never_leak_slots(tgt, drafter):
    """temperature=1e-40 once gave NaN at prefill and leaked the slot: after max_batch of them nothing
    was admitted again."""
    eng = engine(tgt, drafter, max_batch=2, max_queue=8)
    try:
        streams = [eng.submit(ids_of(tgt, f"x{i} = "), SamplingParams(1e-40), 6) for i in range(5)]
        runs = [drain(s) for s in streams]
        assert all(isinstance(r[-1], Done) for r in runs), [r[-1] for r in runs]
        greedy = drain(eng.submit(ids_of(tgt, "x0 = "), SamplingParams(0.0), 6))
        assert text_of(greedy) == text_of(runs[0])  # T -> 0 is greedy
        assert eng.state()["free_slots"] == 2
    finally:
        eng.close()


def test_seed_pins_the_output_and_no_seed_varies_it(tgt, drafter):
    """The same seed gives the same text whatever runs beside it and whatever calibration is in force
    (the engine's schedule changes between the two); requests without a seed are not all seed 0."""
    from dspark.calibration.sts import Calibration

    eng = engine(tgt, drafter, max_batch=3, max_queue=16)
    try:
        first = drain(eng.submit(ids_of(tgt, "def f(x):"), SamplingParams(1.0), 24, 3))
        eng.set_calibration(Calibration([1.0] * 4, [-8.0] * 4))  # almost no draft is verified from now on
        others = [eng.submit(ids_of(tgt, f"y{i} = "), SamplingParams(1.0), 24) for i in range(2)]
        second = drain(eng.submit(ids_of(tgt, "def f(x):"), SamplingParams(1.0), 24, 3))
        unseeded = [text_of(drain(s)) for s in others] + [
            text_of(drain(eng.submit(ids_of(tgt, "def f(x):"), SamplingParams(1.0), 24))) for _ in range(2)
        ]
        assert text_of(first) == text_of(second)
        assert unseeded[2] != unseeded[3]  # 24 tokens at T=1 from a high-entropy target: equal only if seeded alike
        assert first[-1].info["speculative"] != second[-1].info["speculative"]  # and the schedule did differ
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["async", "none"])
def test_warm_up_runs_every_batch_size_and_leaves_nothing_behind(tgt, drafter, policy, monkeypatch):
    """Before the first request the engine decodes synthetic requests at each batch size on its own thread:
    rounds that draft and verify every draft, then plain ones (plain only where it never drafts). After it
    every slot is free in a fresh engine's order, the gate has measured nothing, the policy is a new one, the
    observer and the engine's clocks saw nothing, and requests decode as the target does."""
    rounds, real_step = [], SpeculativeDecoder.step

    def step(self):
        R = len(self.active)
        real_step(self)
        verified = {r.rounds[-1].verified for r in self.active} if self.drafted_last else {0}
        rounds.append((R, self.drafted_last, verified, threading.get_ident()))

    policies = []

    def new_policy(*args):
        policies.append(make_policy(*args))
        return policies[-1]

    monkeypatch.setattr(engine_module, "make_policy", new_policy)
    monkeypatch.setattr(SpeculativeDecoder, "step", step)
    observed = []
    warm = engine(tgt, drafter, policy=policy, max_batch=3, warm_up_rounds=2, observer=observed.extend)
    try:
        drafts = [(True, {4}), (True, {4}), (False, {0}), (False, {0})] if policy != "none" else [(False, {0})] * 2
        assert rounds == [(R, d, v, warm.thread.ident) for R in (1, 2, 3) for d, v in drafts]
        dec, state = warm.decoder, warm.state()
        assert state["active"] == 0 and dec.runner.free_slots == [2, 1, 0] and dec.drafter_error is None
        assert len(policies) == 2 and dec.policy is policies[1]  # built anew after the warm-up
        assert state["plain_rounds"] == {} and state["busy_s"]["rounds"] == state["busy_cpu_s"]["rounds"] == 0.0
        assert state["warm_up_s"] > 0 and observed == []
        if policy == "none":
            assert dec.gate is None
        else:
            assert not dec.gate.seen and state["draft_gate"]["speed"] == state["draft_gate"]["run"] == {}
        monkeypatch.setattr(SpeculativeDecoder, "step", real_step)
        prompts = [ids_of(tgt, f"def h{i}(x):") for i in range(3)]
        outs = [collect(s) for s in [warm.submit(p, SamplingParams(0.0), 16, 0) for p in prompts]]
    finally:
        warm.close()
    eos = (tgt.tokenizer.eos_token_id,)
    plain = SpeculativeDecoder(tgt.model, None).run([Request(p, SamplingParams(0.0), 16, 0, eos) for p in prompts])
    assert [text for text, _ in outs] == [tgt.tokenizer.decode(r.out, skip_special_tokens=True) for r in plain]


def test_wrong_length_calibration_is_refused_up_front(tgt, drafter):
    with pytest.raises(UserError, match="calibration has 2 positions but gamma=4"):
        Engine(
            tgt.model, tgt.tokenizer, drafter, gamma=4, policy="greedy", calibration=Calibration([1.0, 1.0], [0.0, 0.0])
        )
    eng = engine(tgt, drafter, max_batch=1)
    try:
        with pytest.raises(UserError):
            eng.set_calibration(Calibration([1.0, 1.0], [0.0, 0.0]))
        assert isinstance(drain(eng.submit(ids_of(tgt, "z = "), SamplingParams(1.0), 8))[-1], Done)
    finally:
        eng.close()


def test_the_decoder_is_built_on_the_engine_thread(tgt, drafter, monkeypatch):
    """Its KV allocations run no OpenMP team on the caller's thread (with more OpenMP threads in the
    process than CPUs, libgomp's workers sleep between parallel regions), and what building it raises
    reaches the caller."""
    built_on = []
    real_init = SpeculativeDecoder.__init__

    def init(self, *args, **kwargs):
        built_on.append(threading.get_ident())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "__init__", init)
    eng = engine(tgt, drafter, max_batch=1)
    try:
        assert built_on == [eng.thread.ident] != [threading.get_ident()]
        assert isinstance(drain(eng.submit(ids_of(tgt, "z = "), SamplingParams(0.0), 4))[-1], Done)
    finally:
        eng.close()

    def broken(self, *args, **kwargs):
        raise UserError("no room for the KV cache")

    monkeypatch.setattr(SpeculativeDecoder, "__init__", broken)
    with pytest.raises(UserError, match="no room for the KV cache"):
        engine(tgt, drafter)


def test_errors_are_events_with_an_http_status(tgt, drafter):
    eng = engine(tgt, drafter, max_batch=2, max_len=64)
    try:
        with pytest.raises(ValueError, match="context limit of 64"):
            eng.submit(ids_of(tgt, "x"), SamplingParams(0.0), 100)
        with pytest.raises(ValueError, match="seed"):
            eng.submit(ids_of(tgt, "x"), SamplingParams(0.0), 8, 2**64)
        with pytest.raises(ValueError, match="token id 4096 is not in the target's vocabulary of 4096"):
            eng.submit([1, 4096], SamplingParams(0.0), 8)
        eng.decoder.runner.forward = None  # every prefill now fails inside the engine thread
        ev = drain(eng.submit(ids_of(tgt, "x"), SamplingParams(0.0), 8))[-1]
        assert isinstance(ev, Error) and ev.status == 500 and "prefill failed" in ev.message
        assert eng.state()["free_slots"] == 2
    finally:
        eng.close()


def test_waiting_requests_are_prefilled_together_and_a_failing_one_fails_alone(tgt, drafter):
    """Requests waiting for free slots are prefilled in one target forward, up to `prefill_tokens` prompt
    tokens padded to the longest (the first always; 0, the default: one per forward); when that forward
    fails each is prefilled alone, and only the request that cannot be fails. The outputs are each
    request's own."""
    eng = engine(tgt, drafter, max_batch=4, policy="none", prefill_tokens=2048)
    dec = eng.decoder
    batches, in_round, gate = [], threading.Event(), threading.Event()
    add_many, step, forward = dec.add_many, dec.step, dec.runner.forward

    def recording_add_many(reqs):
        batches.append(len(reqs))
        add_many(reqs)

    def paused_step():  # the engine thread waits in its round until the test has queued what it needs
        in_round.set()
        gate.wait(60)
        step()

    poison = 4095  # a prompt ending with this id cannot be prefilled (a stand-in for any per-prompt failure)

    def failing_forward(slots, tokens, last_only=False):
        if last_only and any(int(t[-1]) == poison for t in tokens):
            raise RuntimeError("this prompt cannot be prefilled")
        return forward(slots, tokens, last_only)

    dec.add_many, dec.step, dec.runner.forward = recording_add_many, paused_step, failing_forward
    prompts = [ids_of(tgt, p) for p in ("def f(a, b):", "x = [", "import os\nprint(")]
    assert all(p[-1] != poison for p in prompts)
    try:

        def queue_behind_a_round(ids):
            """Each prompt's events, all of them queued while the engine's round waits."""
            gate.clear()
            in_round.clear()
            long = eng.submit(ids_of(tgt, "while True:"), SamplingParams(0.0), 12)
            assert in_round.wait(60)  # admitted alone; its first round now waits
            streams = [eng.submit(p, SamplingParams(0.0), 12) for p in ids]
            gate.set()
            assert isinstance(drain(long)[-1], Done)
            return [drain(s) for s in streams]

        alone = []
        for p in prompts:  # the references: each request alone
            gate.set()
            alone.append(text_of(drain(eng.submit(p, SamplingParams(0.0), 12))))
        batches.clear()
        assert [text_of(e) for e in queue_behind_a_round(prompts)] == alone
        assert batches == [1, 3]  # the long request, then the three waiting ones in one forward
        eng.prefill_tokens = 2 * max(len(prompts[0]), len(prompts[1]))  # two prompts padded to the longer
        batches.clear()
        assert [text_of(e) for e in queue_behind_a_round(prompts)] == alone
        assert batches == [1, 2, 1]  # the token budget splits them; the first always goes
        eng.prefill_tokens = 0  # the default: one prompt per forward
        batches.clear()
        assert [text_of(e) for e in queue_behind_a_round(prompts)] == alone
        assert batches == [1, 1, 1, 1]
        eng.prefill_tokens = 2048
        batches.clear()
        runs = queue_behind_a_round([prompts[0], prompts[1] + [poison], prompts[2]])
        assert batches == [1, 3, 1, 1, 1]  # the shared forward failed: each alone
        assert [text_of(runs[0]), text_of(runs[2])] == [alone[0], alone[2]]
        ev = runs[1][-1]
        assert isinstance(ev, Error) and ev.status == 500 and "cannot be prefilled" in ev.message
        assert eng.state()["free_slots"] == 4 and eng.state()["waiting"] == 0
    finally:
        gate.set()
        eng.close()


def test_profile_times_the_drafting_round_per_request_count(tgt, drafter):
    table = profile(tgt.model, [1, 2, 4], context=32, repeats=1, warmup=0, max_requests=2, drafter=drafter, gamma=4)
    assert table.draft_batch == [1, 2] and all(t > 0 for t in table.draft_s)
    assert table.draft_time(4) == pytest.approx(2 * table.draft_s[1])  # past the table: proportional to R
    # a step over fewer tokens never costs more than one over more: noise at one size is cut
    assert all(1 / a <= 1 / b for a, b in zip(table.sps, table.sps[1:]))
    assert all(a <= b for a, b in zip(table.draft_s, table.draft_s[1:]))
    # and verifying gamma + 1 tokens for each of those requests
    assert table.verify_tokens == 5 and len(table.verify_s) == 2 and 0 < table.verify_s[0] <= table.verify_s[1]
    assert SPSTable(**dataclasses.asdict(table)) == table  # what an engine's state hands to other replicas


def test_envelope_cuts_a_noisy_size_to_the_least_time_above_it():
    assert envelope([0.32, 0.11, 0.10, 0.12, 0.11]).tolist() == [0.10, 0.10, 0.10, 0.11, 0.11]


def test_logprobs_go_out_with_the_text_one_entry_per_output_token(tgt, drafter):
    eng = engine(tgt, drafter, max_batch=2)
    try:
        with_lp = drain(eng.submit(ids_of(tgt, "def f(x):"), SamplingParams(1.0), 24, 5, logprobs=2))
        without = drain(eng.submit(ids_of(tgt, "def f(x):"), SamplingParams(1.0), 24, 5))
        with pytest.raises(ValueError, match="logprobs"):
            eng.submit(ids_of(tgt, "x"), SamplingParams(1.0), 4, logprobs=21)
    finally:
        eng.close()
    done = with_lp[-1]
    entries = [e for ev in with_lp[:-1] for e in ev.logprobs] + done.info["logprobs"]
    assert len(entries) == done.info["completion_tokens"]
    for e in entries:
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True) and e["logprob"] <= tops[0] + 1e-6 <= 1e-6
    assert "".join(e["token"] for e in entries).startswith(text_of(with_lp))  # the tokens spell the text
    assert text_of(without) == text_of(with_lp)  # same seed, same output: logprobs change nothing
    assert all(ev.logprobs is None for ev in without[:-1]) and without[-1].info["logprobs"] is None


def test_the_engine_thread_runs_with_its_own_torch_threads(tgt, drafter):
    """serve.num_cpus reaches the thread that decodes (torch's thread count is per thread under OpenMP);
    the caller's setting is left as it was."""
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    eng = engine(tgt, drafter, threads=wanted)
    try:
        text, ev = collect(eng.submit(ids_of(tgt, "def f(x):\n"), SamplingParams(0.0), 4, 0))
        assert isinstance(ev, Done) and eng.state()["torch_threads"] == wanted
        assert torch.get_num_threads() == before
    finally:
        eng.close()
