"""The continuous-batching engine without Ray: concurrent requests join and leave between rounds and
each still gets exactly the target's greedy output; bounded queue; cancellation; stop strings."""

import pytest
import torch

from dspark import target as targets
from dspark.decoding.engine import Engine, Overloaded
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.models import DrafterConfig, build_drafter
from dspark.scheduling.sps import SPSTable


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


@pytest.fixture(scope="module")
def drafter(tgt):
    torch.manual_seed(0)
    c = DrafterConfig.from_target(tgt.config, "dspark", [1, 2, 3], tgt.tokenizer.mask_token_id, num_layers=1, gamma=4,
                                  markov_rank=32)
    return build_drafter(c, tgt.model).eval()


def collect(stream):
    text, ev = "", stream.events.get(timeout=120)
    while ev[0] == "text":
        text += ev[1]
        ev = stream.events.get(timeout=120)
    return text, ev


def ids_of(tgt, prompt):
    return [tgt.tokenizer.bos_token_id] + tgt.tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("policy", ["greedy", "async", "static", "threshold", "none"])
def test_concurrent_requests_get_exact_greedy_outputs(tgt, drafter, policy):
    prompts = [f"def g{i}(a):\n" for i in range(7)]
    eng = Engine(tgt.model, tgt.tokenizer, drafter, 4, policy, SPSTable.synthetic("smooth"), max_batch=3, max_queue=16,
                 idle_probe=2)  # rounds that verify nothing make the next two skip the drafter
    try:
        streams = [eng.submit(ids_of(tgt, p), SamplingParams(0.0), 16, 0) for p in prompts]  # 7 requests, 3 slots
        outs = [collect(s) for s in streams]
    finally:
        eng.close()
    plain = SpeculativeDecoder(tgt.model, None).run([Request(ids_of(tgt, p), SamplingParams(0.0), 16, 0,
                                                             (tgt.tokenizer.eos_token_id,)) for p in prompts])
    for (text, done), ref in zip(outs, plain):
        assert done[0] == "done" and text == tgt.tokenizer.decode(ref.out, skip_special_tokens=True)
        assert done[1]["completion_tokens"] == len(ref.out)
        if policy == "none":
            assert sum(done[1]["speculative"]["verified_per_position"]) == 0


def test_queue_bound_cancel_and_stop(tgt, drafter):
    eng = Engine(tgt.model, tgt.tokenizer, drafter, 4, "greedy", SPSTable.synthetic("smooth"), max_batch=1, max_queue=2)
    try:
        with pytest.raises(ValueError, match="context limit"):
            eng.submit(ids_of(tgt, "x"), SamplingParams(0.0), 10_000, 0)
        long = eng.submit(ids_of(tgt, "a = "), SamplingParams(1.0), 1500, 0)
        assert long.events.get(timeout=60)[0] == "text"  # it holds the only slot now
        queued = [eng.submit(ids_of(tgt, "b = "), SamplingParams(1.0), 8, i) for i in range(2)]
        with pytest.raises(Overloaded):
            eng.submit(ids_of(tgt, "c = "), SamplingParams(1.0), 8, 0)
        eng.cancel(long)  # the client went away: its slot goes to the queue
        for s in queued:
            assert collect(s)[1][0] == "done"
        state = eng.state()
        assert state["active"] == 0 and state["waiting"] == 0
        stop = eng.submit(ids_of(tgt, "def f(x):\n"), SamplingParams(0.0), 40, 0, stop=["\n"])
        text, done = collect(stop)
        assert "\n" not in text and done[1]["finish_reason"] == "stop"
    finally:
        eng.close()
