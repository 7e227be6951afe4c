"""Scheduling policies as pure functions: invariants on random CPU arrays, the issue's known vector,
and the paper's Appendix A counterexample (the early stop is what keeps Algorithm 1 lossless)."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dspark.decoding.sampling import SamplingParams, probs
from dspark.decoding.verify import verify_sampled
from dspark.errors import UserError
from dspark.scheduling.policies import (
    DraftGate,
    RoundTimes,
    admit_top_k,
    async_global,
    capacity,
    draft_gain,
    draft_pays,
    greedy_prefix,
    make_policy,
    static_threshold,
    survival,
    throughput,
)
from dspark.scheduling.sps import SPSTable

SMOOTH, CLIFF = SPSTable.synthetic("smooth", 512), SPSTable.synthetic("cliff", 512)


def test_known_vector_stops_at_one():
    sps = SPSTable([1, 2, 3, 4], [1.0, 0.95, 0.52, 0.48])
    a = survival([[0.8, 0.7, 0.3]])
    thetas = [throughput(a, [l], sps) for l in range(3)]
    assert np.allclose(thetas, [1.00, 1.71, 1.2272])
    assert greedy_prefix(a, sps).tolist() == [1]
    assert throughput(a, [3], sps) < thetas[1]  # verifying all three drafts would lower Theta


conf = st.integers(1, 12).flatmap(
    lambda R: st.integers(1, 8).flatmap(
        lambda G: st.lists(st.lists(st.floats(0.0, 1.0), min_size=G, max_size=G), min_size=R, max_size=R)
    )
)


@settings(max_examples=200, deadline=None)
@given(conf, st.sampled_from([SMOOTH, CLIFF]))
def test_invariants(c, sps):
    a = survival(np.array(c))
    R, G = a.shape
    for lengths in (greedy_prefix(a, sps), greedy_prefix(a, sps, early_stop=False), async_global(a, a, sps)):
        assert lengths.shape == (R,) and ((0 <= lengths) & (lengths <= G)).all()
        assert throughput(a, lengths, sps) >= throughput(a, np.zeros(R, int), sps) - 1e-12
        # determinism: same input, same output
    assert (greedy_prefix(a, sps) == greedy_prefix(a.copy(), sps)).all()
    # the unconstrained search finds at least what the early-stopping one finds
    assert (
        throughput(a, greedy_prefix(a, sps, early_stop=False), sps) >= throughput(a, greedy_prefix(a, sps), sps) - 1e-12
    )
    for k in range(R * G + 2):  # top-K admission: exactly K tokens (budget) and a prefix per request
        lengths = admit_top_k(a, k)
        assert lengths.sum() == min(k, R * G)
        admitted = a[np.arange(G)[None, :] < lengths[:, None]]
        rejected = a[np.arange(G)[None, :] >= lengths[:, None]]
        if admitted.size and rejected.size:
            assert admitted.min() >= rejected.max()
    assert capacity(a, sps) == greedy_prefix(a, sps, early_stop=False).sum()
    thr = static_threshold(a, 0.5)
    assert all((a[r, : thr[r]] >= 0.5).all() and (thr[r] == G or a[r, thr[r]] < 0.5) for r in range(R))


def test_ties_break_deterministically_toward_smaller_positions():
    a = np.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])
    assert admit_top_k(a, 3).tolist() == [2, 1]  # (0,0) (1,0) (0,1) in that order
    assert admit_top_k(a, 1).tolist() == [1, 0]


def test_budget_shrinks_as_load_grows():
    rng = np.random.default_rng(0)
    per_req = []
    for R in (1, 4, 16, 64, 256):
        a = survival(rng.uniform(0.6, 0.95, size=(R, 7)))
        per_req.append(greedy_prefix(a, SMOOTH).mean())
    assert per_req[0] >= 4 and per_req[-1] < per_req[0] and all(x >= y for x, y in zip(per_req, per_req[1:]))


APPENDIX_SPS = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])


def _appendix_a_output(choose, n: int, seed: int = 0) -> np.ndarray:
    """R=1, gamma=2, SPS(1,2,3) = (1, 0.5, 0.45), p_t = (0.7, 0.3), q = (0.5, 0.5), c_1 = 0.8,
    c_2 = 0.9 if x_1 = A else 0. choose(a (1, 2)) -> l. Returns the first emitted token of n rounds,
    each round chosen on its own and all of them verified in one batch."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    p = probs(torch.log(torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.5, 0.5]])), SamplingParams(1.0))  # p_1..p_3
    x = torch.multinomial(q[0], 2 * n, replacement=True, generator=gen).view(n, 2)  # x_1, x_2 ~ q per round
    l = torch.tensor([int(choose(np.array([[0.8, 0.8 * (0.9 if x1 == 0 else 0.0)]]))) for x1 in x[:, 0].tolist()])
    # round i's target distributions p_1 .. p_{l_i + 1} are rows first[i] .. of one (T, 2) batch
    first = (l + 1).cumsum(0) - (l + 1)
    rows = p[torch.cat([torch.arange(k + 1) for k in l.tolist()])]
    u, v = torch.rand(n, 2, generator=gen, dtype=torch.float64), torch.rand(n, generator=gen, dtype=torch.float64)
    accepted, y = verify_sampled(x, l, q.expand(n, 2, 2), rows, first, u, v)
    return torch.where(accepted >= 1, x[:, 0], y).numpy()  # l = 0: y ~ p_1, plain target sampling


def _p_a(name: str, first: np.ndarray) -> tuple[float, float]:
    n = len(first)
    p_a = float((first == 0).mean())
    p_value = stats.binomtest(int((first == 0).sum()), n, 0.70).pvalue
    print(
        f"[appendix A] {name}: P(A) = {p_a:.4f} ± {1.96 * np.sqrt(p_a * (1 - p_a) / n):.4f} "
        f"(95% CI, n={n}); target P(A) = 0.70, binomial p = {p_value:.2e}"
    )
    return p_a, p_value


@pytest.mark.parametrize("early_stop, expected", [(True, 0.70), (False, 0.85)])
def test_appendix_a_counterexample(early_stop, expected):
    n = 20_000
    p_a, p_value = _p_a(
        f"early stop {early_stop}",
        _appendix_a_output(lambda a: greedy_prefix(a, APPENDIX_SPS, early_stop=early_stop)[0], n),
    )
    assert abs(p_a - expected) < 4 * np.sqrt(expected * (1 - expected) / n), (p_a, expected)
    if early_stop:
        assert p_value > 1e-3  # consistent with the target's P(A) = 0.7
    else:
        assert p_value < 1e-12  # the test has the power to see the retrospective search's bias


@pytest.mark.parametrize("history", [0, 1])
def test_async_policy_is_unbiased_in_its_first_rounds(history):
    """The engine's async policy from a fresh state (every engine start, 0 earlier rounds) and after one
    round: with fewer than two stale rounds it must not search over the current confidences (that is
    the retrospective search, P(A) = 0.85); a policy built per sample puts every sample in that round."""

    def first_rounds(a):
        policy = make_policy("async", APPENDIX_SPS)
        for _ in range(history):
            policy(np.array([[0.5, 0.25]]), 1, 2)
        return policy(a, 1, 2)[0]

    p_a, p_value = _p_a(f"async policy after {history} rounds", _appendix_a_output(first_rounds, 20_000))
    assert p_value > 1e-3, p_a


# the same target and drafts, verification priced by its requests: 1, 1.61, 2.22 s for 0, 1, 2 drafts of one
APPENDIX_PROFILED = SPSTable(
    [1, 2, 3], [1.0, 0.5, 0.45], draft_batch=[1], draft_s=[0.0], verify_s=[1 / 0.45], verify_tokens=3
)


@pytest.mark.parametrize("policy", ["greedy", "async"])
def test_verification_priced_by_its_requests_keeps_the_output_law(policy):
    """With t_v(R, B) verifying x_1 pays, and x_2 too where x_1 = A (a_2 = 0.72, else 0): Algorithm 1 and the
    async policy's first round (a fresh policy per sample) admit x_2 looking at a_2, never at a survival beyond
    the draft they admit, so the first emitted token is still distributed as p_1, P(A) = 0.7."""

    def choose(a):
        return make_policy(policy, APPENDIX_PROFILED)(a, 1, 2)[0]

    # the profile changes the decision: priced at SPS(B) alone, neither round verifies a draft
    assert [choose(np.array([[0.8, a2]])) for a2 in (0.72, 0.0)] == [2, 1]
    assert [make_policy(policy, APPENDIX_SPS)(np.array([[0.8, a2]]), 1, 2)[0] for a2 in (0.72, 0.0)] == [0, 0]
    p_a, p_value = _p_a(f"{policy}, priced by requests", _appendix_a_output(choose, 20_000))
    assert p_value > 1e-3, p_a


def test_async_policy_uses_two_round_old_capacity_once_it_has_it():
    policy = make_policy("async", SMOOTH)
    high, low = survival([[0.99] * 7] * 4), survival([[0.01] * 7] * 4)
    policy(high, 4, 7)
    policy(low, 4, 7)
    # third round: capacity from the first (high) round's survival, admission by the current one
    assert sum(policy(low, 4, 7)) == capacity(high, SMOOTH) > 0


@settings(max_examples=200, deadline=None)
@given(conf, st.sampled_from([SMOOTH, CLIFF]), st.floats(0.0, 1.0))
def test_a_paid_draft_makes_verifying_more_of_it_worth_it(c, sps, draft_s):
    """Theta = tau / (t_d + 1/SPS(B)): with the drafting time t_d already paid, every request verifies
    at least the drafts it would on the SPS curve alone, and t_d = 0 is the paper's Theta."""
    a = survival(np.array(c))
    base, paid = greedy_prefix(a, sps), greedy_prefix(a, sps, draft_s=draft_s)
    assert (paid >= base).all()
    assert throughput(a, paid, sps, draft_s) >= throughput(a, np.zeros(len(a), int), sps, draft_s) - 1e-12
    assert throughput(a, base, sps, 0.0) == pytest.approx(throughput(a, base, sps))


def test_draft_time_table():
    t = SPSTable([1, 8], [100.0, 80.0], draft_batch=[1, 4], draft_s=[0.01, 0.02])
    assert [t.draft_time(R) for R in (1, 2, 4, 8)] == pytest.approx([0.01, 0.01 + 0.01 / 3, 0.02, 0.04])
    assert SPSTable([1], [1.0]).draft_time(16) == 0.0  # no drafter timings: drafting counts as free
    with pytest.raises(UserError, match="draft_batch"):
        SPSTable([1], [1.0], draft_batch=[2, 1], draft_s=[0.1, 0.1])


def test_verification_is_priced_by_its_requests_where_the_table_profiled_them():
    """t_v(R, B) runs from 1/SPS(R) (one token each) to the profiled forward of R requests with k tokens each,
    linearly in the B - R drafts; proportional to R past the profiled R; 1/SPS(B) without R or profile."""
    t = SPSTable([1, 8, 16], [200.0, 100.0, 50.0], draft_batch=[1, 2], draft_s=[0.01, 0.012])
    assert t.verify_time(8, 1) == t.verify_time(8) == pytest.approx(0.01)  # not profiled per request
    t = SPSTable(
        [1, 2, 8, 16],
        [200.0, 190.0, 100.0, 50.0],
        draft_batch=[1, 2],
        draft_s=[0.01, 0.012],
        verify_s=[0.006, 0.008],
        verify_tokens=5,
    )
    assert t.verify_time(1, 1) == pytest.approx(0.005)  # plain: 1/SPS(1)
    assert t.verify_time(5, 1) == pytest.approx(0.006)  # one request, 5 tokens: its profiled forward
    assert t.verify_time(3, 1) == pytest.approx(0.0055)  # 2 of its 4 drafts
    assert t.verify_time(5, 1) < t.verify_time(5) == pytest.approx(1 / 145)  # not 5 requests' 1/SPS(5)
    assert t.verify_time(10, 2) == pytest.approx(0.008) and t.verify_time(2, 2) == pytest.approx(1 / 190)
    assert t.verify_time(4 * 5, 4) == pytest.approx(0.016)  # past the profiled R: proportional to R
    flat = SPSTable([1, 2], [200.0, 100.0], draft_batch=[1], draft_s=[0.01], verify_s=[0.004], verify_tokens=2)
    assert flat.verify_time(2, 1) == pytest.approx(0.005)  # faster than one token (noise): no cheaper than it
    with pytest.raises(UserError, match="verify_s"):
        SPSTable([1], [1.0], draft_batch=[1, 2], draft_s=[0.1, 0.1], verify_s=[0.1], verify_tokens=5)
    # Algorithm 1 verifies a lone request's drafts that the curve over requests would cut: 8 requests of one
    # token cost twice one token, 8 tokens of one request 10% more
    a = survival([[0.6] * 7])
    curve = SPSTable([1, 8], [100.0, 50.0], draft_batch=[1], draft_s=[0.01])
    profiled = SPSTable([1, 8], [100.0, 50.0], draft_batch=[1], draft_s=[0.01], verify_s=[0.011], verify_tokens=8)
    assert greedy_prefix(a, curve, draft_s=0.01).sum() < greedy_prefix(a, profiled, draft_s=0.01).sum() == 7
    # and the gate's model prices drafting with it: verifying 8 tokens costs 1.1 steps, not 2
    alpha = np.full(7, 0.6)
    assert draft_gain(alpha, 1, profiled) > draft_gain(alpha, 1, curve)
    assert throughput(a, [7], profiled) > throughput(a, [7], curve)
    # between profiled request counts: interpolated (R = 2 of 1 and 4: a third of the way)
    spread = SPSTable(
        [1, 64], [100.0, 100.0], draft_batch=[1, 4], draft_s=[0.01, 0.02], verify_s=[0.013, 0.019], verify_tokens=4
    )
    assert spread.verify_time(8, 2) == pytest.approx(0.015)


def test_the_draft_gate_follows_what_rounds_took_over_its_model():
    """Once drafted and plain rounds were timed at R, their tokens/s decide, whichever way the model errs;
    while drafting, plain rounds are timed every other round until there are enough, then every
    max_interval-th; each R is measured on its own."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.001])  # the model: drafting is cheap
    gate = DraftGate(sps, gamma=4, max_interval=8, overhead=math.inf, min_rounds=2)
    gate.observe([4], [4])  # every draft accepted: the model says draft
    decisions = []
    for _ in range(6):  # drafted rounds really emit 120 tokens/s, plain ones 100
        decisions.append(gate(1))
        gate.timed(1, decisions[-1], 3 if decisions[-1] else 1, 0.025 if decisions[-1] else 0.01)
    assert decisions == [True, True, False, True, True, False]  # a timed plain round after every 2 drafted
    assert gate.drafting_pays(1) and gate.speed(1, True) == (pytest.approx(120.0), 4)
    assert [gate(1) for _ in range(3)] == [True] * 3  # enough plain rounds: the next one after 8 drafted
    for _ in range(4):  # a drafted round now takes 0.06 s: 50 tokens/s, half what a plain round emits
        gate.timed(1, True, 3, 0.06)
    assert not gate.drafting_pays(1) and draft_pays(gate.alpha, 1, sps, gate.overhead_s(1))  # overruled: the model
    assert [gate(1) for _ in range(3)] == [False, True, False]  # plain rounds, probes after 1, 2, .. skipped
    # R = 2 has not been timed, and R = 1's loss is one request's, which says nothing of a load: the model
    assert gate.drafting_pays(2) and gate.inferred(2) is None and gate.verdicts == {}
    # the other way: the model says plain decoding wins (drafting costs 10 steps), drafted rounds are faster
    slow = DraftGate(SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.1]), 4, 8, min_rounds=2)
    slow.observe([4], [1])
    assert not slow.drafting_pays(1)
    for drafted, tokens, seconds in [(False, 1, 0.01)] * 2 + [(True, 4, 0.02)] * 2:
        slow.timed(1, drafted, tokens, seconds, catch_up_s=0.005 if drafted else 0.0)  # the catch-up: not timed
    assert slow.drafting_pays(1) and slow(1)
    assert slow.state()["speed"]["1"] == {
        "drafted": {"tokens_per_s": pytest.approx(200.0), "rounds": 2},
        "plain": {"tokens_per_s": pytest.approx(100.0), "rounds": 2},
    }
    assert slow.state()["run"]["1"] == {  # the run's totals count it
        "drafted": {"rounds": 2, "tokens": 8, "seconds": pytest.approx(0.04), "catch_up_s": pytest.approx(0.01)},
        "plain": {"rounds": 2, "tokens": 2, "seconds": pytest.approx(0.02), "catch_up_s": 0.0},
    }


def test_a_plain_round_right_after_a_drafted_one_is_charged_to_it():
    """The target's forward right after the drafter's round runs slower (a switching cost that steady
    drafting never pays, nor steady plain decoding): such a plain round is not timed as plain, what it took
    beyond the plain rounds timed is charged to the drafted round before it, and the gate asks for a second
    plain round and times that. So drafting that loses to steady plain decoding stops, though it beats plain
    rounds that follow drafted ones, and its probes are priced with the switch back."""

    def serve(gate, tell: bool, rounds=24):
        decisions, last = [], False
        for _ in range(rounds):
            draft = gate(1)
            decisions.append(draft)
            # drafted: 3 tokens in 32 ms (94 tokens/s); plain: 10 ms, 14 ms right after a drafted round (71)
            seconds = 0.032 if draft else 0.014 if last else 0.01
            gate.timed(1, draft, 3 if draft else 1, seconds, after_drafted=tell and last)
            last = draft
        return decisions

    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.001])  # the model: drafting is cheap
    gate = DraftGate(sps, gamma=4, max_interval=8, overhead=math.inf, min_rounds=2)
    gate.observe([4], [4])
    decisions = serve(gate, tell=True)
    assert decisions[:8] == [True, True, False, False, True, True, False, False]  # the second plain round timed
    switches = [i for i in range(len(decisions) - 1) if decisions[i] and not decisions[i + 1]]
    plain = gate.state()["run"]["1"]["plain"]  # every plain round counted, those after drafted ones untimed
    assert gate.speed(1, False) == (pytest.approx(100.0), plain["rounds"] - len(switches)) and len(switches) >= 4
    # the switches back once min_rounds plain rounds were timed (rounds 3 and 7) cost their drafted round 4 ms
    charged = 0.004 * sum(i >= 7 for i in switches)
    assert gate.speed(1, True) == (
        pytest.approx(3 * sum(decisions) / (0.032 * sum(decisions) + charged)),
        sum(decisions),
    )
    assert not gate.drafting_pays(1) and decisions[8] is False  # steady plain decoding wins
    assert sum(decisions[8:]) <= 3  # probes only
    # the switch back at another R (a request ended): charged once, to the drafted round's R
    moved = DraftGate(sps, gamma=4, max_interval=8, min_rounds=2)
    for _ in range(2):
        moved.timed(3, False, 3, 0.01)
    moved.timed(4, True, 8, 0.04)
    moved.timed(3, False, 3, 0.015, after_drafted=True)  # 5 ms beyond R = 3's plain rounds
    moved.timed(3, False, 3, 0.015, after_drafted=True)  # no drafted round left to charge
    assert moved.speed(4, True) == (pytest.approx(8 / 0.045), 1) and moved.speed(3, False)[1] == 2
    # told nothing, the gate times plain rounds after drafted ones and drafts on at a loss
    blind = DraftGate(sps, gamma=4, max_interval=8, overhead=math.inf, min_rounds=2)
    blind.observe([4], [4])
    assert sum(serve(blind, tell=False)[8:]) >= 12 and blind.drafting_pays(1)


def test_round_times_charge_their_latest_round():
    """Charging the latest round moves every average as if it had been timed at its full cost."""
    rounds = [(3, 0.03), (1, 0.01), (4, 0.05)] * 5  # 15 rounds: past the running mean of weight 0.1
    charged, direct = RoundTimes(0.1), RoundTimes(0.1)
    for k, (t, s) in enumerate(rounds):
        charged.add(t, s)
        direct.add(t, s + (0.02 if k % 4 == 1 else 0.0))
        if k % 4 == 1:
            charged.charge(0.02)
    for field in ("t", "s", "tt", "ss", "ts"):
        assert getattr(charged, field) == pytest.approx(getattr(direct, field))
    assert charged.rate_se() == pytest.approx(direct.rate_se())


def test_where_r_was_not_measured_the_nearest_measured_load_decides():
    """Drafting's gain shrinks as load grows: a loss measured at the nearest R' < R holds at R, and such an R
    is probed at the probes' price instead of drafting every other round until measured; a win at the
    nearest R' > R holds at R; both (noise): the model; neither: the nearest measured gain, carried along
    the model's shape (the next test). R's own measurement then decides."""

    def timed(gate, R, drafted_tokens, drafted_s, n=2):  # n plain rounds (R tokens in 10 ms) and n drafted
        for drafted, tokens, seconds in [(False, R, 0.01)] * n + [(True, drafted_tokens, drafted_s)] * n:
            gate.timed(R, drafted, tokens, seconds)

    cheap = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.001])  # the model: drafting pays
    gate = DraftGate(cheap, gamma=4, max_interval=8, min_rounds=2)
    gate.observe([4] * 2, [4] * 2)
    assert gate.drafting_pays(8) and gate.inferred(8) is None
    timed(gate, 2, 4, 0.03)  # at R = 2: 133 tokens/s drafted against 200 plain
    assert gate.verdicts == {2: False} and gate.inferred(8) is False and not gate.drafting_pays(8)
    assert gate.gains == {2: pytest.approx(2 / 3)}
    # below the loss the order of loads says nothing, and R = 2's gain is not carried to R = 1, where one
    # request's acceptance decides: the model says draft
    assert gate.inferred(1) is None and gate.drafting_pays(1)
    # R = 8 is probed at its price: a drafting round for 8 requests (8 ms) is 2% of 40 plain rounds of 10 ms,
    # capped at max_interval: after 8 of them (not every other round, as an R that nothing is known of)
    assert [gate(8) for _ in range(9)] == [False] * 8 + [True]
    timed(gate, 8, 24, 0.02)  # R = 8's own measurement: 1200 tokens/s against 800, drafting wins there
    assert gate.measured(8) is True and gate.drafting_pays(8) and gate(8)
    assert gate.inferred(4) is None  # a loss below (R = 2) and a win above (R = 8): the model
    # the other way: the model says drafting loses (10 steps a round), a win measured at R = 8 holds at R = 4
    slow = DraftGate(SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.1]), 4, 8, min_rounds=2)
    slow.observe([4] * 8, [1] * 8)
    assert not slow.drafting_pays(4)
    timed(slow, 8, 24, 0.02)
    assert slow.inferred(4) is True and slow.drafting_pays(4) and slow(4)
    timed(slow, 6, 6, 0.02)  # a loss at R = 6: the nearest measured load above R = 4 now loses, below none
    assert slow.inferred(4) is False and not slow.drafting_pays(4)  # R = 6's gain, 0.5, carried to R = 4
    assert slow.inferred(7) is None  # a loss at 6 below a win at 8: noise, the model
    assert slow.inferred(9) is True  # a win below: the order says nothing, R = 8's gain (1.5) carries


def test_a_measured_gain_carries_to_loads_not_measured_along_the_models_shape():
    """Where the order of loads says nothing (a loss above R, a win below it), the gain g = drafted / plain
    tokens/s measured at the nearest R' carries to R as g(R') m(R) / m(R'), m the model's gain (priced
    without o at both loads): the model's error, a factor that varies little between neighbouring loads,
    is fixed by the measurement.
    Beyond 10% of 1 it decides, within it the model and the probes do. Here drafting costs t_d = 1 ms at
    R = 1 to 50 ms at 16 and every draft is accepted: the model's gain falls from 4.5 at R = 1 to 0.83 at
    16, where drafting is measured at half the plain rate (the model was 1.7x too hopeful)."""
    sps = SPSTable([1, 128], [100.0, 100.0], draft_batch=[1, 16], draft_s=[0.001, 0.05])
    gate = DraftGate(sps, gamma=4, max_interval=8, min_rounds=2)
    gate.observe([4], [4])
    for drafted, tokens, seconds in [(False, 16, 0.01)] * 2 + [(True, 40, 0.05)] * 2:  # 800 tokens/s against 1600
        gate.timed(16, drafted, tokens, seconds)
    assert gate.verdicts == {16: False} and gate.state()["gains"] == {"16": pytest.approx(0.5)}
    assert gate.model_gain(16) == pytest.approx(80 / 0.06 / 1600)
    assert gate.model_gain(15) / gate.model_gain(16) == pytest.approx(1.057, abs=1e-3)
    assert gate.inferred(15) is False and not gate.drafting_pays(15)  # 0.53: the loss holds one request down
    assert gate.model_gain(7) / gate.model_gain(16) == pytest.approx(1.961, abs=1e-3)
    assert gate.inferred(7) is None  # 0.98: within the margin, the model decides (it says draft)
    assert gate.drafting_pays(7)
    assert gate.inferred(2) is True  # 2.1: drafting pays at two requests
    # R = 15 is probed at the probes' price, not every other round as an R nothing is known of
    assert not any(gate(15) for _ in range(8))
    # a margin of 0: every carried gain decides
    gate.margin = 0.0
    assert gate.inferred(7) is False
    assert gate.inferred(1) is None  # but never at one request, where that request's acceptance decides
    assert gate.inferred(17) is False  # above a loss: the order of loads
    gate.verdicts[16] = True  # a win by the benefit of the doubt (z > 0) with a gain below 1: nothing to carry
    assert gate.inferred(17) is None


def test_drafted_rounds_are_charged_the_prompt_reading_per_output_token():
    """Plain decoding never reads a prompt into the drafter, drafting reads each request's once (t_e per
    position): a drafted round's rate carries kappa = t_e * P / O per token it emitted (P and O the mean
    prompt and output of the requests that ended), in the measurement and in the model; the run's totals
    keep the seconds the rounds took. Drafted rounds at 120 tokens/s against plain ones at 100 win
    uncharged and lose once prompts of 300 positions at 1 ms each are spread over outputs of 100 tokens
    (3 ms per token: 1 / (1/120 + 0.003) = 88 tokens/s)."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.001], extend_s=0.001)
    gate = DraftGate(sps, gamma=4, max_interval=8, min_rounds=2)
    gate.observe([4], [1])
    gate.observe([4], [0])  # alpha = (0.5, 0, 0, 0)
    assert gate.prompt_s_per_token() == 0.0 and gate.drafting_pays(1)  # no request ended: nothing to charge
    for drafted, tokens, seconds in [(False, 1, 0.01)] * 2 + [(True, 3, 0.025)] * 2:
        gate.timed(1, drafted, tokens, seconds)
    assert gate.speed(1, True)[0] == pytest.approx(120.0) and gate.measured(1) is True
    fresh = DraftGate(sps, gamma=4, max_interval=8, min_rounds=2)
    fresh.observe([4], [1])
    fresh.observe([4], [0])
    for prompt, output in [(200, 50), (400, 150)]:
        fresh.finished(prompt, output)
    assert fresh.prompt_s_per_token() == pytest.approx(0.003)
    # the model: 1.5 tokens in 10 + 1 ms (136 tokens/s) uncharged, in 10 + 1 + 4.5 ms (97) charged
    assert not fresh.drafting_pays(1)
    assert draft_pays(fresh.alpha, 1, sps) and not draft_pays(fresh.alpha, 1, sps, prompt_s=0.003)
    for drafted, tokens, seconds in [(False, 1, 0.01)] * 2 + [(True, 3, 0.025)] * 2:
        fresh.timed(1, drafted, tokens, seconds)
    assert fresh.speed(1, True)[0] == pytest.approx(1 / (1 / 120 + 0.003)) and fresh.measured(1) is False
    assert fresh.state()["run"]["1"]["drafted"]["seconds"] == pytest.approx(0.05)
    assert fresh.state()["prompt_s_per_token"] == pytest.approx(0.003)


def test_drafting_goes_on_unless_the_measurement_shows_it_loses():
    """Once both kinds of round were timed, drafting goes on, whatever the model says, unless drafted rounds
    emit fewer tokens/s (by more than `z` standard errors of the difference: with z > 0, a few unlucky
    drafted rounds, each emitting 1 to gamma + 1 tokens per request, do not stop drafting)."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.01])  # drafting costs a whole step
    gate = DraftGate(sps, gamma=7, max_interval=8, overhead=math.inf, min_rounds=4, z=1.0)
    gate.observe([7], [0])
    assert not gate.drafting_pays(1)  # the model: alpha 0, drafting never pays
    for _ in range(4):
        gate.timed(1, False, 1, 0.01)  # plain rounds: 100 tokens/s
    for tokens in (1, 4, 1, 1):
        gate.timed(1, True, tokens, 0.02)  # drafted: 87.5 tokens/s, from rounds of 1 to 4 tokens
    assert gate.speed(1, True) == (pytest.approx(87.5), 4)
    assert gate.measured(1) is True and gate.drafting_pays(1) and gate(1)  # within the noise: it drafts
    point = DraftGate(sps, gamma=7, max_interval=8, overhead=math.inf, min_rounds=4)  # z = 0: the rates decide
    for drafted, tokens in [(False, 1)] * 4 + [(True, t) for t in (1, 4, 1, 1)]:
        point.timed(1, drafted, tokens, 0.02 if drafted else 0.01)
    assert point.measured(1) is False and not point.drafting_pays(1)  # 87.5 tokens/s against 100
    for _ in range(6):
        gate.timed(1, True, 1, 0.02)  # round after round of 50 tokens/s
    assert gate.speed(1, True) == (pytest.approx(65.0), 10)
    assert gate.measured(1) is False and not gate.drafting_pays(1)
    steady = DraftGate(sps, gamma=7, max_interval=8, min_rounds=4)  # no noise: any loss shows
    for drafted, tokens, seconds in [(False, 1, 0.01)] * 4 + [(True, 2, 0.0201)] * 4:
        steady.timed(1, drafted, tokens, seconds)
    assert steady.measured(1) is False


def test_the_model_prices_the_measured_cost_of_a_round_beyond_its_forward_pass():
    """A round costs the engine's own work o beside its forward passes; drafting spreads it over more
    tokens. Forward 10 ms, drafting 5 ms, alpha 0.4: without o a drafted round emits 1.4 tokens in 15 ms
    (93 tokens/s) against 100 plain; plain rounds timed at 30 ms give o = 20 ms, and then drafting pays
    (1.4 tokens in 35 ms: 40 tokens/s against 33)."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.005])
    assert not draft_pays(np.array([0.4, 0.0]), 1, sps) and draft_pays(np.array([0.4, 0.0]), 1, sps, 0.02)
    gate = DraftGate(sps, gamma=2, max_interval=8, min_rounds=4)
    gate.observe([2], [1])
    gate.observe([2], [0])
    assert gate.alpha.tolist() == [0.5, 0.0] and gate.overhead_s(1) == 0.0 and not gate.drafting_pays(1)
    gate.observe([2], [1])  # alpha_1 = 2/3, then 0.4 after two more rejections
    gate.observe([2], [0])
    gate.observe([2], [0])
    for _ in range(4):
        gate.timed(1, False, 1, 0.03)
    assert gate.alpha[0] == pytest.approx(0.4) and gate.overhead_s(1) == pytest.approx(0.02)
    assert gate.measured(1) is None and gate.drafting_pays(1)  # no drafted rounds timed: the model, with o


def drafted_rounds_timed(gate: DraftGate, R: int) -> None:
    """`min_rounds` drafted rounds timed at R (plain ones not): the model decides, and probes follow their
    schedule rather than every other round; no timed plain round is due yet."""
    for _ in range(gate.min_rounds):
        gate.timed(R, True, 2 * R, 0.04)
    gate.since_plain[R] = 0


def test_until_drafted_rounds_were_timed_at_r_every_other_round_drafts():
    """However little the model expects of drafting, a batch size gets its `min_rounds` timed drafted rounds
    at once (every other round), so that the measurement, not a few early rounds' alpha, decides; then the
    probes wait their price."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.03])  # the model: drafting does not pay
    gate = DraftGate(sps, gamma=4, max_interval=1000, overhead=0.02)
    gate.observe([4], [1])
    assert not gate.drafting_pays(1) and gate.probe_gap(1) == 150
    decisions = []
    for _ in range(60):
        decisions.append(gate(1))
        gate.timed(1, decisions[-1], 2 if decisions[-1] else 1, 0.04 if decisions[-1] else 0.01)
    # 4 drafted rounds at 50 tokens/s against 100: shown to lose; the next probe waits 0.02 s / (2% of 0.01 s)
    assert decisions[:8] == [False, True] * 4 and not any(decisions[8:]) and gate.probe_gap(1) == 100


def test_resuming_drafting_is_judged_with_its_catch_up():
    """Drafted rounds measured at twice plain rounds' tokens/s (timed without catch-up: steady drafting has
    none) still lose a round that must first read the plain rounds' positions since its requests' latest
    drafted round, once that catch-up (t_e each) outweighs the gain: 8 tokens in 0.04 s + t_e k against 100
    tokens/s, so with t_e = 1 ms drafting pays while k < 40; the recorded verdict stays the steady one."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.01], extend_s=0.001)
    gate = DraftGate(sps, gamma=4, max_interval=256, min_rounds=4)
    gate.observe([4] * 4, [1] * 4)
    for _ in range(4):
        gate.timed(4, True, 8, 0.04)
        gate.timed(4, False, 4, 0.04)
    assert gate.measured(4) and gate.measured(4, None, 39) and not gate.measured(4, None, 40)
    assert gate.drafting_pays(4, None, 39) and not gate.drafting_pays(4, None, 41) and gate.verdicts[4]


def test_a_new_request_is_judged_by_its_own_drafts():
    """A first request whose drafts are never accepted stops drafting, but for probes at its own price (no
    request ended: k = 1, its own rounds weigh). A new lone request is probed at its own price too,
    and a request whose drafts are accepted then goes on drafting, while one like the first would not, from
    the same measurements of the server's rounds. Blind to the requests, the gate would go on skipping."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.01])
    gate = DraftGate(sps, gamma=4, max_interval=256, overhead=0.5, min_rounds=4)

    def serve(own: list[int], accepted: int, rounds: int) -> list[bool]:
        """`rounds` rounds of one request (its drafted rounds and accepted drafts in `own`)."""
        decisions = []
        for _ in range(rounds):
            decisions.append(gate(1, 0, [tuple(own)]))
            if decisions[-1]:
                gate.observe([4], [accepted])
                own[0], own[1] = own[0] + 1, own[1] + accepted
            gate.timed(1, decisions[-1], 1 + (accepted if decisions[-1] else 0), 0.02 if decisions[-1] else 0.01)
        return decisions

    first = serve([0, 0], 0, 40)  # drafted: 50 tokens/s against 100
    # measured, then, a lone request, probed at its own price: a drafted round loses 0.01 s, worth 2 plain
    # rounds at overhead 0.5 (not after 4, 8, 16 rounds, the interval grown over the server's rounds)
    assert first[:8] == [True, False] * 4 and first[8:] == [False] + [True, False, False] * 10 + [True]
    assert gate.measured(1, [(6, 0)]) is False and gate.measured(1, None) is False
    blind = copy.deepcopy(gate)
    assert not any(blind(1, 0, None) for _ in range(20))
    second = serve([0, 0], 3, 4)  # 4 tokens in 20 ms: 200 tokens/s
    # new traffic, probed at its own price (2 plain rounds since the first's last probe); its own accepted
    # drafts then keep it drafting
    assert second == [False, False, True, True]
    # the same server measurements, two requests: the one whose drafts are accepted drafts, the first would not
    assert gate.measured(1, [(2, 6)]) is True and gate.measured(1, [(6, 0)]) is False
    assert gate(1, 0, [(2, 6)])
    for _ in range(4):  # at R = 2 drafting is measured to lose: new requests there wait for the probes
        gate.timed(2, True, 2, 0.04)
        gate.timed(2, False, 2, 0.02)
    assert [gate(2, 0, [(0, 0), (0, 0)]) for _ in range(3)] == [False, False, True]  # probe_gap(2) = 2
    assert gate.expected_tokens([(2, 6)]) == pytest.approx(1 + (6 + gate.accepted) / 3)


def test_new_traffic_is_probed_at_its_price():
    """Where a drafted round costs several plain rounds (a drafter as slow as its target), new lone requests
    are not each forced to draft their first rounds: their probes wait what a probe costs (2% of the plain
    rounds before it), so that serving requests of 64 tokens one at a time stays within a few percent of
    never drafting; where it costs little beyond its tokens, a new request drafts soon."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.015])

    def serve(gate: DraftGate, requests: int, drafted_s: float) -> list[int]:
        """Drafted rounds per request of 64 rounds, one request at a time, none of its drafts accepted."""
        out = []
        for _ in range(requests):
            n = 0
            for _ in range(64):
                draft = gate(1, 0, [(n, 0)])
                if draft:
                    gate.observe([4], [0])
                    n += 1
                gate.timed(1, draft, 1, drafted_s if draft else 0.01)
            out.append(n)
        return out

    slow = serve(DraftGate(sps, gamma=4, max_interval=256, overhead=0.02), 8, 0.025)
    # the first request measures (4 drafted rounds and probes); a probe then costs 0.015 s beyond its token,
    # worth 75 plain rounds at 2%: the later requests draft about once each
    assert slow[0] >= 4 and sum(slow[1:]) <= 7, slow
    cheap = serve(DraftGate(sps, gamma=4, max_interval=256, overhead=0.02), 8, 0.0102)
    assert all(n >= 4 for n in cheap[1:]), cheap  # 0.2 ms beyond its token: every new request is measured


def test_a_requests_own_rounds_weigh_as_far_as_requests_differ():
    """A request's expected acceptance counts the server's mean as k of its own drafted rounds, k = sigma^2 /
    tau^2 measured over the requests that ended (empirical Bayes): 1 until `min_rounds` of them were drafted
    for; where requests accept alike, large or inf (their first rounds are noise: the server's mean decides,
    and a new lone request is not measured for its own sake); where they differ far beyond their rounds'
    noise, near 0 (its own rounds decide, and each new request is measured)."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.015])
    rng = np.random.default_rng(0)

    def serve(gate: DraftGate, means: list[float], rounds: int = 20) -> None:
        """Requests of `rounds` drafted rounds, accepted drafts per round ~ Poisson(mean) up to 4."""
        for mu in means:
            accepted = np.minimum(rng.poisson(mu, rounds), 4)
            for a in accepted:
                gate.observe([4], [int(a)])
            gate.finished(16, rounds, accepted.tolist())

    alike = DraftGate(sps, gamma=4, max_interval=256)
    serve(alike, [1.5] * 3)
    assert alike.prior_rounds() == 1.0  # 3 ended requests < min_rounds: the earlier rule's single round
    serve(alike, [1.5] * 60)
    assert alike.prior_rounds() > 10
    # a request that accepted nothing in 2 rounds is still expected at about the server's mean
    assert alike.expected_tokens([(2, 0)]) > 1 + 0.8 * alike.accepted
    differ = DraftGate(sps, gamma=4, max_interval=256)
    serve(differ, [0.1, 3.5] * 30)
    assert differ.prior_rounds() < 0.5
    assert differ.expected_tokens([(10, 0)]) < 1.1  # its own rounds decide
    assert alike.expected_tokens([(10, 0)]) > 1 + 0.6 * alike.accepted
    json.dumps(alike.state())  # inf is written None
    short = DraftGate(sps, gamma=4, max_interval=256)
    serve(short, [1.5] * 40, rounds=1)
    assert short.ended_drafted == 0 and short.prior_rounds() == 1.0  # one round: no variance over its rounds
    serve(short, [1.5] * 100, rounds=2)  # alike requests drafted twice each are enough to measure k
    assert short.ended_drafted == 100 and short.prior_rounds() > 4

    def new_requests_drafted(means: list[float]) -> list[int]:
        """Rounds drafted for each lone request of 64 rounds (all its drafts accepted where its mean is 4,
        none where it is 0), where a drafted round costs 0.2 ms beyond its token and the model says
        drafting loses (alpha 0 after the first request)."""
        gate, out = DraftGate(sps, gamma=4, max_interval=256, overhead=0.02), []
        for mu in means:
            accepted = []
            for _ in range(64):
                draft = gate(1, 0, [(len(accepted), sum(accepted))])
                if draft:
                    gate.observe([4], [int(mu)])
                    accepted.append(int(mu))
                gate.timed(1, draft, 1 + int(mu) if draft else 1, 0.0102 if draft else 0.01)
            gate.finished(16, 64, accepted)
            out.append(len(accepted))
        return out

    same = new_requests_drafted([0] * 12)
    # alike (none accepts anything): after min_rounds requests ended, new ones wait the interval out
    assert all(n >= 4 for n in same[:3]) and sum(same[6:]) < 6, same
    # requests that accept everything after them: the server's probes find them, then each drafts nearly
    # every round; the first ones, not probed for their own sake among alike requests, can be missed
    shift = new_requests_drafted([0] * 6 + [4] * 6)
    assert all(n >= 48 for n in shift[8:]) and min(shift[6:8]) == 0, shift


def test_each_batch_size_keeps_its_probes_and_prices_them_by_what_drafting_lost():
    """Where drafting does not pay, probes wait 1, 2, 4, .. max_interval skipped rounds at that R, also when
    rounds at another R, where it pays, come between; once both kinds of round were timed at R, a probe
    is priced by what a drafted round took beyond emitting its tokens at the plain rate."""
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1, 2], draft_s=[0.0001, 0.03])
    gate = DraftGate(sps, gamma=4, max_interval=8, overhead=math.inf)
    gate.observe([4], [1])  # alpha = (1, 0, ..): drafting pays at R = 1 (cheap), not at R = 2 (3 steps)
    drafted_rounds_timed(gate, 2)
    decisions = []
    for _ in range(16):
        decisions.append(gate(2))
        assert gate(1)  # a round of one request between: it drafts
    assert decisions == [False, True, False, False, True] + [False] * 4 + [True] + [False] * 6
    priced = DraftGate(SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.01]), 4, 1000, overhead=0.5)
    priced.observe([4], [0])
    assert priced.probe_gap(1) == 2  # the profile: t_d = 10 ms over half of a 10 ms plain round
    for _ in range(4):
        priced.timed(1, False, 1, 0.25)  # plain rounds: 4 tokens/s
        priced.timed(1, True, 2, 1.5)  # drafted ones: 2 tokens in 1.5 s, 1 s more than at the plain rate
    assert priced.probe_gap(1) == 8  # 1 s over half of 0.25 s


def test_drafting_pays_at_low_load_and_not_at_high_load():
    """Verification is flat up to B = 16 then bandwidth-bound; a drafting round costs one target step.
    Acceptance 0.8 per position: at R = 1 drafting pays; at R = 64 every verified token costs its
    full price and the draft comes on top: plain decoding wins."""
    B = np.arange(1, 1025)
    sps = SPSTable(B.tolist(), (100.0 * np.minimum(1.0, 16.0 / B)).tolist(), draft_batch=[1, 64], draft_s=[0.01, 0.04])
    alpha = np.full(4, 0.8)
    assert draft_pays(alpha, 1, sps) and not draft_pays(alpha, 64, sps)
    assert not draft_pays(np.zeros(4), 1, sps)  # nothing accepted: never
    free = SPSTable(sps.batch, sps.sps)  # a free drafter at low acceptance still pays where verifying is free
    assert draft_pays(np.full(4, 0.1), 1, free)


def test_draft_gate_skips_probes_and_resumes():
    sps = SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.03])  # drafting: 3 target steps
    gate = DraftGate(sps, gamma=4, max_interval=4, overhead=math.inf)  # probes not held back by their cost
    assert gate(1)  # nothing measured yet: draft
    gate.observe([4], [1])  # alpha = (1, 0, ..): tau 2 for 4 step-times of work
    drafted_rounds_timed(gate, 1)
    decisions = [gate(1) for _ in range(16)]
    # probes after 1, 2, 4, 4, .. skipped rounds
    assert decisions[:13] == [False, True, False, False, True] + [False] * 4 + [True] + [False] * 3
    assert gate.alpha[0] == 1.0 and gate.alpha[1] == 0.0 and gate.rounds.tolist() == [1, 1, 0, 0]
    for _ in range(100):  # a better drafter: every probe sees all drafts accepted; alpha climbs
        if gate(1):
            gate.observe([4], [4])
    assert all(gate(1) for _ in range(5))  # tau near 5 for 4 step-times: drafting pays, every round drafts
    gate.observe([0], [0])  # the policy verified nothing: stop drafting until the next probe
    assert not gate(1) and gate(1)
    # a probe's drafting round costs at most `overhead` of the plain rounds before it: 3 steps / 2% = 150
    bounded = DraftGate(sps, gamma=4, max_interval=1000, overhead=0.02)
    assert bounded(1) and bounded.probe_gap(1) == 150
    bounded.observe([4], [1])
    drafted_rounds_timed(bounded, 1)
    assert [bounded(1) for _ in range(151)] == [False] * 150 + [True]
    cheap = DraftGate(SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.0001]), 4, 1000)
    cheap.observe([4], [0])
    drafted_rounds_timed(cheap, 1)
    assert [cheap(1) for _ in range(5)] == [False, True, False, False, True]  # a cheap probe: 1, 2, 4, ..
    # a lucky first round counts as one of two, not as the truth: the mean until 1 / weight rounds, then EMA
    lucky = DraftGate(sps, 4, 1000)
    lucky.observe([4], [4])
    lucky.observe([4], [0])
    assert lucky.alpha[0] == 0.5 and lucky.alpha[1] == 1.0  # position 2 was reached once
    for _ in range(18):
        lucky.observe([4], [0])
    assert lucky.alpha[0] == pytest.approx(0.1 * 0.9**10)  # mean 1/10 after 10 rounds, then 10 EMA steps to 0
    # the catch-up is part of a probe's price: 200 positions behind at t_e = 0.1 ms add 2 steps (100 rounds)
    behind = DraftGate(SPSTable([1, 64], [100.0, 100.0], draft_batch=[1], draft_s=[0.03], extend_s=1e-4), 4, 1000)
    assert behind.probe_gap(1, 0) == 150 and behind.probe_gap(1, 200) == 250
    behind.observe([4], [1])
    drafted_rounds_timed(behind, 1)
    assert [behind(1, 200) for _ in range(251)] == [False] * 250 + [True]
    always = DraftGate(sps, gamma=4, max_interval=0)
    always.observe([0], [0])
    assert all(always(1) for _ in range(4))  # max_interval 0: draft every round
