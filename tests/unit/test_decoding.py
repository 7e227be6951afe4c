"""Exactness of speculative decoding.

Greedy, on the built-in target: speculative output equals plain target output token for token, for
every drafter family.
Sampling: the distribution of the first three generated tokens (top-k = 2, so 8 possible
sequences whose probabilities are computed exactly with the target) matches the target under full
verification, per-request truncation l_r < gamma, Algorithm 1 and the async scheduler; a chi-square
test with enough samples to detect a 2% shift, whose power is shown by catching a broken verifier.
Exactness holds for any target weights, so full verification runs on the built-in target and the
other statistical tests (10,000 requests each) on a tiny random Qwen3, where they cost seconds.
"""

import collections
import itertools
import os
import time

import numpy as np
import pytest
import torch
from scipy import stats
from tiny_models import tiny_model, untrained_drafter

from dspark import target as targets
from dspark.decoding import speculative as spec
from dspark.decoding.runner import TargetRunner
from dspark.decoding.sampling import (
    HEAD,
    BatchSampler,
    SamplingParams,
    argmax,
    inverse_cdf,
    keyed_uniform,
    probs,
    race_winner,
)
from dspark.decoding.speculative import Request, SpeculativeDecoder
from dspark.decoding.verify import verify_sampled
from dspark.errors import UserError
from dspark.models import DrafterConfig
from dspark.models.drafter import Drafter, DraftState
from dspark.models.layers import FrozenTargetHead
from dspark.scheduling import policies
from dspark.scheduling.sps import SPSTable

TOP_K = 2
SP = SamplingParams(1.0, top_k=TOP_K)
# after it, the tiny target's 8 top-2 continuations have probabilities 0.07 .. 0.16: 10,000 samples give
# the chi-square test power 0.997 against a 2% shift
TINY_PROMPT = [1, 3, 65, 51, 63]


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


@pytest.fixture(scope="module")
def tiny():
    """(target model, prompt) for the statistical tests: the runner tests' tiny random Qwen3 (96
    tokens, 3 layers of width 64), whose forward at batch 256 costs milliseconds."""
    model = tiny_model("qwen3")
    model.lm_head.weight.mul_(0.5)  # flatter top-2 laws: the chi-square power does not hinge on the init
    model.config.bos_token_id = TINY_PROMPT[0]  # where PerturbedTarget's contexts start
    return model, TINY_PROMPT


@pytest.fixture
def all_cores():
    """The built-in target's forwards at batch 256 are compute-bound: use both CI cores (the tiny
    target's small ops gain nothing from a second thread, and lose much when the cores are busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def builtin(tgt, prompt, all_cores):
    """(target model, prompt) for the statistical tests on the built-in target."""
    return tgt.model, prompt


@pytest.fixture(scope="module")
def prompt(tgt):
    from dspark.corpus.tokenizer import encode_prompt

    return encode_prompt(tgt.tokenizer, "x = ")


def test_runner_matches_hf_forward_with_rollback(tgt, prompt):
    r = TargetRunner(tgt.model, [1, 2, 3], max_slots=3, capacity=4)  # capacity grows on demand
    seqs = [torch.tensor(prompt), torch.tensor(prompt[:5]), torch.tensor(prompt[2:] + prompt[:3])]
    slots = [r.alloc() for _ in seqs]
    out = r.forward(slots, [s[:-3] for s in seqs])
    out2 = r.forward(slots, [s[-3:] for s in seqs])
    for i, s in enumerate(seqs):
        ref = tgt.model(s[None]).logits[0]
        got = torch.cat([out.logits[i], out2.logits[i]])
        assert (got - ref).abs().max() < 1e-4
    r.truncate(slots[0], len(seqs[0]) - 2)  # roll back two tokens, then recompute them
    again = r.forward([slots[0]], [seqs[0][-2:]])
    assert (again.logits[0] - tgt.model(seqs[0][None]).logits[0, -2:]).abs().max() < 1e-4


def test_a_prefill_computes_logits_at_each_requests_last_token_alone(tgt, prompt):
    """last_only (a prefill): one logits row per request, its last new token's (where the first output token
    comes from), the same as the full forward's; the taps still at every token; any slot order."""
    full, last = (TargetRunner(tgt.model, [1, 2, 3], max_slots=2) for _ in range(2))
    seqs = [torch.tensor(prompt), torch.tensor(prompt[:5])]
    a = full.forward([full.alloc() for _ in seqs], seqs)
    slots = [last.alloc() for _ in seqs][::-1]  # slots 1, 0: the runner sorts the batch and back
    b = last.forward(slots, seqs[::-1], last_only=True)
    for i, s in enumerate(seqs[::-1]):
        want = a.logits[1 - i]
        assert b.logits[i].shape == (1, tgt.config.vocab_size)
        torch.testing.assert_close(b.logits[i], want[-1:], atol=1e-5, rtol=1e-5)
        assert b.taps[i].shape[0] == len(s) and torch.equal(b.taps[i], a.taps[1 - i])


def _drafter(tgt, kind, gamma=5, markov="vanilla"):
    """kind: dspark, dflash, eagle3, or dflash-fill-in (the fill-in block, train.sample_from_anchor=false)."""
    base = kind.removesuffix("-fill-in")
    return untrained_drafter(tgt, base, gamma, markov=markov, sample_from_anchor=base == kind)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "dflash-fill-in"])
def test_greedy_speculative_equals_greedy_target(tgt, prompt, kind):
    prompts = [prompt, prompt[:6], prompt[3:]]
    plain = SpeculativeDecoder(tgt.model, None).run([Request(p, SamplingParams(0.0), 40) for p in prompts])
    drafter = _drafter(tgt, kind)
    for policy in (spec.full_length, lambda s, R, g: [2] * R):  # full blocks and truncated l_r < gamma
        out = SpeculativeDecoder(tgt.model, drafter, gamma=5, policy=policy, max_slots=2).run(
            [Request(p, SamplingParams(0.0), 40) for p in prompts]
        )
        assert [o.out for o in out] == [p.out for p in plain]


class PerturbedTarget(Drafter):
    """A test drafter close to the target (so drafts are often accepted AND often rejected): the
    target's own logits, flattened and shifted by a fixed per-token bias; its confidence depends on
    the previously drafted token, like DSpark's Markov confidence head (the dependency that makes a
    scheduler without early stop biased). Its logits are memoised by context: every request shares
    one prompt and tokens are top-2 sampled, so a few hundred contexts cover 10,000 requests, and the
    new contexts of a drafting step are run through the target together (one forward per length), so
    the test's time goes to the decoding path under test."""

    def __init__(self, model, gamma, draft_ids=None):
        """draft_ids: a draft vocabulary (q = 0 outside it), as a drafter trained with one has."""
        V, dv = model.config.vocab_size, 0 if draft_ids is None else len(draft_ids)
        c = DrafterConfig("dflash", 1, 1, 1, 1, 1, V, 1.0, 1e-6, [], 0, gamma=gamma, draft_vocab=dv)
        super().__init__(c, FrozenTargetHead.from_target(model) if dv else None)
        if dv:
            self.set_draft_vocab(torch.as_tensor(draft_ids))
        self.target = model
        self.bos = model.config.bos_token_id
        g = torch.Generator().manual_seed(7)
        self.bias = torch.randn(model.config.vocab_size, generator=g) * 0.4
        self.conf = torch.randn(model.config.vocab_size, generator=g) * 2
        self.memo: dict[tuple, torch.Tensor] = {}

    @property
    def has_confidence(self):
        return True

    def _logits(self, ctxs: list[tuple]) -> torch.Tensor:
        """(R, V): the drafter's logits after each context."""
        new: dict[int, set] = {}  # length -> contexts not seen yet
        for c in ctxs:
            if c not in self.memo:
                new.setdefault(len(c), set()).add(c)
        for group in new.values():
            group = sorted(group)
            logits = self.target(torch.tensor(group)).logits[:, -1] / 1.3 + self.bias
            self.memo.update(zip(group, logits))
        return torch.stack([self.memo[c] for c in ctxs])

    def extend(self, states, feats, next_tokens):
        for s, t in zip(states, next_tokens):  # first call: the prompt after BOS, then the first anchor
            s.extra["ctx"] = s.extra.get("ctx", (self.bos,)) + tuple(t.tolist())
            s.length += len(t)

    def release(self, state):
        pass

    @torch.no_grad()
    def propose(self, states, anchors, gamma, sample):
        ctxs = [s.extra["ctx"] for s in states]  # committed tokens, ending with the anchor
        toks, qs, confs = [], [], []
        prev = anchors
        for k in range(gamma):
            logits = self._logits(ctxs)
            if self.draft_ids is not None:  # what a drafter with a draft vocabulary samples from: its columns
                logits = logits[:, self.draft_ids]
            tok, q = self.sample(sample, logits)
            confs.append(self.conf[prev])
            toks.append(tok)
            qs.append(q)
            ctxs = [c + (int(t),) for c, t in zip(ctxs, tok)]
            prev = tok
        return self.proposal(toks, qs, torch.stack(confs, 1))


def _exact_law(model, prompt):
    """P(t1, t2, t3) under top-k sampling, enumerated with the target."""
    law = {}
    p1 = probs(model(torch.tensor([prompt])).logits[0, -1], SP)
    for a in p1.nonzero()[:, 0].tolist():
        p2 = probs(model(torch.tensor([prompt + [a]])).logits[0, -1], SP)
        for b in p2.nonzero()[:, 0].tolist():
            p3 = probs(model(torch.tensor([prompt + [a, b]])).logits[0, -1], SP)
            for c in p3.nonzero()[:, 0].tolist():
                law[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return law


def _chi2(law, samples):
    """Chi-square over cells with expected >= 5 (the rest merged); returns (p-value, power vs a 2% shift)."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    outside = sum(c for seq, c in counts.items() if seq not in law)
    cells = sorted(law, key=law.get, reverse=True)
    big = [c for c in cells if law[c] * n >= 5]
    small = [c for c in cells if c not in big]
    exp = np.array([law[c] for c in big] + ([sum(law[c] for c in small)] if small else [])) * n
    obs = np.array([counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else []))
    exp = exp * obs.sum() / exp.sum()  # exact float agreement of the totals
    p_value = stats.chisquare(obs, exp).pvalue if outside == 0 else 0.0  # impossible sequences: rejected outright
    # power against moving 2% of the probability mass between the two most likely sequences
    shift = np.zeros_like(exp)
    shift[0], shift[1] = -0.02 * n, 0.02 * n
    lam = float((shift**2 / exp).sum())
    df = len(exp) - 1
    power = float(stats.ncx2.sf(stats.chi2.isf(1e-3, df), df, lam))
    return p_value, power


def _sample(model, prompt, drafter, policy, n, gamma=4):
    dec = SpeculativeDecoder(model, drafter, gamma=gamma, policy=policy, max_slots=256, capacity=64)
    reqs = dec.run([Request(prompt, SP, 3, seed) for seed in range(n)])
    return [tuple(r.out[:3]) for r in reqs], reqs


# knee near this test's batch (256 requests x up to 5 tokens): the schedulers keep some drafts and drop others
B = np.arange(1, 4097)
KNEE = SPSTable(B.tolist(), (100.0 / (1 + (B / 600.0) ** 1.5) ** (2 / 3)).tolist())
CATCH_UP_S = 2e-4  # t_e of the catch-up case below
RESUME_T_E = 5e-3  # t_e of the resume case: a plain round's positions of all 256 requests cost about a drafted round


def _greedy_policy(s, R, g):
    return policies.greedy_prefix(s, KNEE).tolist()


def _async_policy():
    return policies.make_policy("async", KNEE, static_len=2)


@pytest.mark.parametrize(
    "target, name, policy",
    [
        ("builtin", "full", spec.full_length),
        ("tiny", "random truncation", lambda s, R, g: np.random.default_rng(R).integers(0, g + 1, R).tolist()),
        ("tiny", "algorithm 1", _greedy_policy),
        ("tiny", "async global", "async"),
    ],
)
def test_sampling_matches_target_distribution(request, target, name, policy):
    model, prompt = request.getfixturevalue(target)
    law = _exact_law(model, prompt)
    n = 10_000
    pol = _async_policy() if policy == "async" else policy
    samples, reqs = _sample(model, prompt, PerturbedTarget(model, 4), pol, n)
    p_value, power = _chi2(law, samples)
    rounds = [r for q in reqs for r in q.rounds]
    accepted, verified = sum(r.accepted for r in rounds), sum(r.verified for r in rounds)
    truncated = sum(0 < r.verified < 4 for r in rounds) / len(rounds)
    print(
        f"[exactness] {name} ({target} target): n={n}, chi-square p={p_value:.3f}, power vs a 2% shift {power:.3f}, "
        f"mean verified {verified / len(rounds):.2f} of 4, truncated rounds {truncated:.2f}, "
        f"draft acceptance {accepted / max(verified, 1):.2f}"
    )
    assert power >= 0.9, power  # this many samples would catch a 2% shift
    assert 0.2 < accepted / max(verified, 1) < 0.95  # both the accept and the reject paths are exercised
    assert verified / len(rounds) > 0.5  # speculation really happened (not plain target sampling)
    if name != "full":
        assert truncated > 0.1  # and l_r < gamma truncations were part of it
    assert p_value > 1e-3, (name, p_value, n)


CLOCKED = ("timed", "lone", "inferred", "scaled", "resume")  # the draft gate's cases that decide from what rounds took


@pytest.mark.parametrize("kind", ["cost", "idle", "gap", "catch-up", *CLOCKED])
def test_the_draft_gate_keeps_the_target_distribution(tiny, kind):
    """The engine's adaptive path: a DraftGate decides before each round whether to draft at all, and a
    drafted round prices its lengths with the drafting time as paid. cost: drafting costs 20 target
    steps, so the gate skips whenever it has measured acceptance, probing every other round; inside a
    drafted round the sunk cost makes Algorithm 1 verify more. idle: every other drafted round verifies
    nothing, which stops drafting until the next probe. gap: as cost, but a probe also waits until its
    drafting round costs at most `overhead` of the plain rounds before it (3-4 rounds here, from R).
    catch-up: as gap, but the probe's price is mostly the drafter's catch-up over the positions it has
    not read (new requests' prompts, skipped rounds): the wait varies with the batch's history, and the
    model charges drafted rounds the prompts' reading per output token of the requests that ended.
    timed: the gate decides from what rounds took (`DraftGate.timed`), and here what a drafted round
    "took" depends on the tokens emitted so far: half a plain round's time per token until their total
    reaches 8000, then 3x; so whether a round drafts follows earlier rounds' acceptance, and the measured
    verdict goes both ways. lone: as timed, one request at a time (R = 1, the engine's first rounds for
    every request): where requests differ, each one's probes wait its own price, and the verdict reads its
    own accepted drafts, weighed against the server's mean by how far the requests that ended differ
    (`DraftGate.prior_rounds`). inferred: as timed, but R = 256 is never measured itself
    (min_rounds out of reach) and a neighbouring load's verdict decides (`DraftGate.inferred`): a loss
    below R or a win above it, whichever the parity of (tokens emitted so far) // 5 says (a plain round
    at R = 256 keeps the parity of the count itself). scaled: as inferred, but the neighbour is a loss
    above R or a win below it, where only its measured gain carried along the model's shape decides
    (`DraftGate.scaled`). resume: as timed, but drafted rounds always emit twice plain rounds' tokens per
    second, and a round that would resume drafting is judged with the catch-up over the plain rounds'
    positions it reads first (`plain_behind`, t_e each): the verdict follows how many requests last had a plain
    round, where the steady one always says draft."""
    model, prompt = tiny
    law = _exact_law(model, prompt)
    if kind in ("cost", "gap", "catch-up"):
        cost = SPSTable(KNEE.batch, KNEE.sps, draft_batch=[1, 256], draft_s=[0.2, 0.2])
        if kind == "catch-up":
            cost = SPSTable(KNEE.batch, KNEE.sps, draft_batch=[1, 256], draft_s=[0.02, 0.02], extend_s=CATCH_UP_S)
        policy = policies.make_policy("greedy", cost)
    else:
        cost, calls = KNEE, itertools.count()

        def policy(s, R, g):
            return [0] * R if next(calls) % 2 == 0 else [g] * R

    if kind in ("gap", "catch-up"):  # gap: probe_gap(R) = ceil(0.2 s x SPS(R) / 6.0): 3-4 plain rounds
        gate = policies.DraftGate(cost, 4, max_interval=4 if kind == "gap" else 8, overhead=6.0, min_rounds=0)
    elif kind in CLOCKED:
        cost, policy = KNEE, policies.make_policy("greedy", KNEE)  # the model alone: drafting always pays
        if kind == "resume":
            cost = SPSTable(KNEE.batch, KNEE.sps, extend_s=RESUME_T_E)
        gate = policies.DraftGate(
            cost, 4, max_interval=4, min_rounds=2 if kind in ("timed", "lone", "resume") else 10**9
        )
        if kind == "resume":  # the prompts' reading left out of drafting's price: only the plain rounds' positions cost
            gate.prompt_s_per_token = lambda: 0.0
        timed = gate.timed
        total = [0]  # tokens emitted so far

        def fake_timed(R, drafted, n, s, catch_up_s=0.0, after_drafted=False):  # plain: 1 s for R tokens; drafted
            total[0] += n  # 0.5 or 3 s (by `total`; resume: 0.5)
            seconds = n / R * (0.5 if total[0] < 8000 or kind == "resume" else 3.0) if drafted else 1.0
            timed(R, drafted, n, seconds, catch_up_s, after_drafted)
            if kind == "inferred":  # a loss measured at R = 2, or a win at a load above any here
                gate.verdicts = {2: False} if total[0] // 5 % 2 else {10**6: True}
            if kind == "scaled":  # a loss by 10x at a load above any here, or a win by 10x at R = 2
                gate.verdicts, gate.gains = (
                    ({10**6: False}, {10**6: 0.1}) if total[0] // 5 % 2 else ({2: True}, {2: 10.0})
                )

        gate.timed = fake_timed
        measured, verdicts, steady = gate.measured, [], []  # the measured verdicts the gate drew, and steady ones

        def record(R, own=None, plain_behind=0):
            steady.append(measured(R, own))
            verdicts.append(measured(R, own, plain_behind))
            return verdicts[-1]

        gate.measured = record
        inferred, inferences = gate.inferred, []  # the neighbours' verdicts it drew
        gate.inferred = lambda R: inferences.append(inferred(R)) or inferences[-1]
        scaled, carried = gate.scaled, []  # those drawn from a neighbour's gain
        gate.scaled = lambda R: carried.append(scaled(R)) or carried[-1]
    else:
        gate = policies.DraftGate(cost, 4, max_interval=1, min_rounds=0)
    if kind not in CLOCKED:  # the model's decisions alone (min_rounds 0): no measured round times
        gate.timed = lambda R, drafted, tokens, seconds, catch_up_s=0.0, after_drafted=False: None
    R = 1 if kind == "lone" else 256
    dec = SpeculativeDecoder(model, PerturbedTarget(model, 4), gamma=4, policy=policy, max_slots=R, gate=gate)
    behind = []  # what the gate was told before each round: positions the drafter had not read
    dec._behind = lambda reqs: behind.append(SpeculativeDecoder._behind(reqs)) or behind[-1]
    reqs = dec.run([Request(prompt, SP, 3, seed) for seed in range(10_000)])
    p_value, power = _chi2(law, [tuple(r.out[:3]) for r in reqs])
    rounds = [r for q in reqs for r in q.rounds]
    skipped = sum(not r.drafted for r in rounds) / len(rounds)
    verified = sum(r.verified for r in rounds if r.drafted) / sum(r.drafted for r in rounds)
    gaps = sorted({gate.probe_gap(256, b) for b in behind})
    print(
        f"[exactness] draft gate ({kind}): chi-square p={p_value:.3f}, power {power:.3f}, skipped rounds "
        f"{skipped:.2f}, mean verified in drafted rounds {verified:.2f} of 4, probe gaps at R=256 {gaps}, "
        f"positions behind {min(behind)}..{max(behind)}"
    )
    # lone: a new request's probes wait their price (probe_gap) once drafting was measured to lose; the
    # clocked gates time plain rounds in pairs while drafting (the first follows a drafted round)
    skipped_share = {"gap": (0.6, 0.9), "catch-up": (0.6, 0.9), **dict.fromkeys(CLOCKED, (0.2, 0.8))}
    low, high = skipped_share.get(kind, (0.2, 0.6))
    assert low < skipped < high and any(r.verified == 4 for r in rounds)  # both kinds of round happened
    assert all(r.verified == 0 and r.conf_logit is None for r in rounds if not r.drafted)
    if kind in ("cost", "gap"):  # the sunk drafting cost: Algorithm 1 verifies more than on the SPS curve alone
        assert verified > 3
    if kind == "catch-up":  # the wait followed what the drafter had not read, and drafting's price the prompts
        assert len(gaps) >= 3 and gate.prompt_s_per_token() > 0
    assert gate.ended == sum(bool(r.rounds) for r in reqs)  # every request decoded in rounds told the gate its end
    if kind == "lone":  # the weight of a request's own rounds was measured on the requests that ended
        print(f"[exactness] k = {gate.prior_rounds()} from {gate.ended_drafted} requests")
        assert gate.ended_drafted >= gate.min_rounds
    if kind == "resume":  # drafting always paid in steady state; the catch-up before resuming decided
        print(f"[exactness] (steady, resuming) verdicts: {collections.Counter(zip(steady, verdicts))}")
        assert set(steady) <= {True, None} and {True, False} <= set(verdicts)
    if kind in ("timed", "lone"):  # both kinds of round were timed at the full batch, and the measurement decided
        print(f"[exactness] measured verdicts: {collections.Counter(verdicts)}")
        assert min(gate.speed(R, drafted)[1] for drafted in (True, False)) >= 2
        assert {True, False} <= set(verdicts)  # both ways: drafting followed the emitted tokens' parity
    if kind in ("inferred", "scaled"):  # R = 256 was never measured: the neighbours decided, both ways
        print(f"[exactness] inferred verdicts: {collections.Counter(inferences)}")
        assert gate.measured(256) is None and {True, False} <= set(inferences)
        assert {True, False} <= set(carried) if kind == "scaled" else not carried
    assert power >= 0.9 and p_value > 1e-3, p_value


def test_a_draft_vocabulary_keeps_the_target_distribution(tiny):
    """A drafter with a draft vocabulary (here the even token ids) has q = 0 outside it: the target's
    tokens there are reached only through a rejection's residual, and the output law is the target's."""
    model, prompt = tiny
    law = _exact_law(model, prompt)
    draft_ids = list(range(0, model.config.vocab_size, 2))
    outside = sum(p for seq, p in law.items() if any(t % 2 for t in seq))
    samples, reqs = _sample(model, prompt, PerturbedTarget(model, 4, draft_ids), spec.full_length, 10_000)
    p_value, power = _chi2(law, samples)
    rounds = [r for q in reqs for r in q.rounds]
    accepted, verified = sum(r.accepted for r in rounds), sum(r.verified for r in rounds)
    print(
        f"[exactness] draft vocabulary of {len(draft_ids)} ids: chi-square p={p_value:.3f}, power {power:.3f}, "
        f"target mass of sequences leaving it {outside:.2f}, draft acceptance {accepted / max(verified, 1):.2f}"
    )
    assert outside > 0.3  # the draft vocabulary really misses much of what the target says
    assert 0.1 < accepted / max(verified, 1) < 0.9
    assert power >= 0.9 and p_value > 1e-3, p_value


def test_batch_sampler_draws_each_row_from_its_own_distribution():
    p = torch.tensor([0.5, 0.0, 0.3, 0.2])
    logits = p.log().expand(4000, 4)  # row 4000k+r: request r's k-th draw
    params = [SamplingParams(1.0)] * 3999 + [SamplingParams(0.0)]  # the last request is greedy
    sampler = BatchSampler(params, [torch.Generator().manual_seed(i) for i in range(4000)])
    toks = torch.cat([sampler(logits)[0] for _ in range(5)]).view(5, 4000)
    assert (toks[:, -1] == 0).all()  # greedy: the argmax, always
    freq = torch.bincount(toks[:, :-1].flatten(), minlength=4).double() / toks[:, :-1].numel()
    assert freq[1] == 0 and (freq - p.double()).abs().max() < 4 * (0.25 / toks[:, :-1].numel()) ** 0.5, freq


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, 0.9, 50), SamplingParams(0.0)])
@pytest.mark.parametrize("keyed", [False, True])
def test_sampling_a_draft_vocabulary_is_sampling_its_scattered_logits(sp, keyed):
    """BatchSampler given only a draft vocabulary's columns (ids, vocab) draws what it draws from the
    scattered full-vocabulary logits (-inf elsewhere) with the same generators and keys: the same tokens
    (target ids) and the same q (over the columns; 0 at every other id), for plain, top-k/top-p, greedy
    and seeded (Gumbel-max) requests."""
    V, R = 300, 64
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(V, generator=g)[:100].sort().values
    u = torch.randn(R, len(ids), generator=g) * 3
    full = u.new_full((R, V), float("-inf")).index_copy_(-1, ids, u)
    keys = [(seed, 5) for seed in range(R)] if keyed else None

    def sampler():
        return BatchSampler([sp] * R, [torch.Generator().manual_seed(r) for r in range(R)], keys)

    a, b = sampler(), sampler()
    for _ in range(3):  # successive draft positions: the keyed noise moves with them
        tok_full, q_full = a(full)
        tok_d, q_d = b(u, ids, V)
        assert torch.equal(tok_d, tok_full)
        assert set(tok_d.tolist()) <= set(ids.tolist())
        if sp.greedy:  # a one-hot q at each token, left implicit
            assert q_d is None and q_full is None
            continue
        assert q_d.shape == (R, len(ids)) and q_full[:, ~torch.isin(torch.arange(V), ids)].sum() == 0
        torch.testing.assert_close(q_d, q_full[:, ids], atol=1e-6, rtol=1e-5)
    assert len(set(tok_d.tolist())) > (1 if not sp.greedy else 0)  # not a degenerate draw


def test_verifying_against_q_over_a_draft_vocabulary_is_verifying_its_scatter():
    """q given over a draft vocabulary's columns (q_ids) accepts and emits exactly what the same q
    scattered to the whole vocabulary (0 elsewhere) does with the same uniforms: q_k(x_k) read at the
    draft's column, the rejected row scattered for the residual."""
    V, R, G = 200, 500, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=g)[:60].sort().values
    q = torch.softmax(torch.randn(R, G, len(ids), generator=g) * 2, -1)
    drafts = ids[torch.multinomial(q.view(-1, len(ids)), 1, generator=g).view(R, G)]
    lengths = torch.randint(0, G + 1, (R,), generator=g)
    first = (lengths + 1).cumsum(0) - (lengths + 1)
    p = torch.softmax(torch.randn(int((lengths + 1).sum()), V, generator=g) * 2, -1)
    u, v = torch.rand(R, G, generator=g, dtype=torch.float64), torch.rand(R, generator=g, dtype=torch.float64)
    full = q.new_zeros(R, G, V).index_copy_(-1, ids, q)
    n, y = verify_sampled(drafts, lengths, q, p, first, u, v, ids)
    n_full, y_full = verify_sampled(drafts, lengths, full, p, first, u, v)
    assert torch.equal(n, n_full) and torch.equal(y, y_full)
    assert 0 < (n < lengths).float().mean() < 1  # rejections (residual rows) and full acceptances both


def test_chi_square_catches_a_broken_verifier(tiny, monkeypatch):
    """Accepting every draft returns the DRAFT distribution: the same test must reject it."""
    model, prompt = tiny
    law = _exact_law(model, prompt)

    def accept_all(drafts, lengths, q, p, first, u, v, q_ids=None):
        return lengths, inverse_cdf(p[first + lengths], v)  # every draft, then the bonus token ~ p_{l+1}

    monkeypatch.setattr(spec, "verify_sampled", accept_all)
    n = 3000  # far fewer samples than the exactness tests use suffice to reject it
    samples, _ = _sample(model, prompt, PerturbedTarget(model, 4), spec.full_length, n)
    p_value, _ = _chi2(law, [s for s in samples if s in law])  # the test sees it even inside the support
    outside = sum(s not in law for s in samples)
    print(
        f"[exactness] broken verifier (accepts every draft): n={n}, {outside} samples outside the target's "
        f"support, chi-square p={p_value:.2e} on the rest"
    )
    assert outside > 0 and p_value < 1e-6


def test_drafter_failure_falls_back_to_exact_target_decoding(tgt, prompt):
    class Broken(PerturbedTarget):
        def propose(self, *a, **k):
            raise RuntimeError("drafter crashed")

    plain = SpeculativeDecoder(tgt.model, None).run([Request(prompt, SamplingParams(0.0), 20)])
    dec = SpeculativeDecoder(tgt.model, Broken(tgt.model, 4), gamma=4)
    out = dec.run([Request(prompt, SamplingParams(0.0), 20)])
    assert out[0].out == plain[0].out and dec.drafter_error == "RuntimeError: drafter crashed"


def _mixed_schedules():
    """Different verification lengths, calibration-like policy changes and batch-mates for one request."""
    return [
        spec.full_length,
        lambda s, R, g: [1] * R,
        lambda s, R, g: np.random.default_rng(R).integers(0, g + 1, R).tolist(),
    ]


def test_seeded_requests_are_reproducible_whatever_the_schedule(tiny):
    """seed => the output is a function of (prompt, seed): with or without a drafter, any l_r, any
    batch-mates, token for token (standard rejection sampling gives this only by chance). Together
    with the next test this proves the seeded speculative path exact: its output for every seed IS
    the seeded target-only output, whose law over seeds is the target's."""
    model, prompt = tiny
    drafter = PerturbedTarget(model, 4)
    seeds = range(24)
    plain = SpeculativeDecoder(model, None, max_slots=24).run(
        [Request(prompt, SP, 10, s, reproducible=True) for s in seeds]
    )
    for policy in _mixed_schedules():
        mates = [Request(prompt[:4], SP, 7, 1000 + s) for s in range(8)]  # unseeded neighbours in the same rounds
        reqs = [Request(prompt, SP, 10, s, reproducible=True) for s in seeds]
        SpeculativeDecoder(model, drafter, gamma=4, policy=policy, max_slots=12).run(reqs[:12] + mates + reqs[12:])
        assert [r.out for r in reqs] == [p.out for p in plain]
        rounds = [x for r in reqs for x in r.rounds]
        assert sum(x.accepted for x in rounds) > 0.2 * sum(x.verified for x in rounds)  # drafts were accepted


def test_seeded_sampling_matches_target_distribution(tiny):
    """Gumbel-max keyed by (seed, position): the law over seeds of target-only seeded decoding is the
    target's (the speculative path reproduces it seed by seed: the test above)."""
    model, prompt = tiny
    law = _exact_law(model, prompt)
    n = 10_000
    reqs = SpeculativeDecoder(model, None, max_slots=256, capacity=64).run(
        [Request(prompt, SP, 3, seed, reproducible=True) for seed in range(n)]
    )
    p_value, power = _chi2(law, [tuple(r.out[:3]) for r in reqs])
    print(f"[exactness] seeded (Gumbel-max) sampling: n={n}, chi-square p={p_value:.3f}, power {power:.3f}")
    assert power >= 0.9 and p_value > 1e-3, p_value


def test_keyed_uniforms_are_the_splitmix64_stream():
    """u(key, v) is output v + 1 of splitmix64 keyed by key (computed here with Python integers), 53 bits."""
    M = (1 << 64) - 1

    def reference(key, v):
        z = (key + (v + 1) * 0x9E3779B97F4A7C15) & M
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return (((z ^ (z >> 31)) >> 11) + 0.5) * 2.0**-53

    keys = [0, 1, 12345, (1 << 62) + 7, (1 << 63) - 1]
    ids = [0, 1, 2, 49151, 49152, 151_935]
    got = keyed_uniform(np.array([k for k in keys for _ in ids], dtype=np.uint64), np.array(ids * len(keys)))
    assert got.tolist() == [reference(k, v) for k in keys for v in ids]
    assert 0 < got.min() and got.max() < 1


def test_the_keyed_race_draws_p_exactly_with_a_heavy_tail():
    """race_winner over seeds is p: 3 likely tokens (0.45, 0.2, 0.1) and a tail of 0.25 spread over 29,997
    tokens each below HEAD (one shared clock, then inverse CDF), counted per head token and per tenth
    of the tail's ids; the same draws over a draft vocabulary's columns."""
    V, n = 30_000, 20_000
    g = torch.Generator().manual_seed(0)
    head = torch.tensor([17, 5000, 29_999])
    w = torch.rand(V, generator=g) + 0.5
    w[head] = 0.0
    p = w / w.sum() * 0.25
    p[head] = torch.tensor([0.45, 0.2, 0.1])
    assert p.max(-1).values > HEAD and p[p < 0.1].max() <= HEAD
    bins = torch.arange(V) * 10 // V  # tail cells: tenths of the ids
    cell = lambda tok: int((head == tok).nonzero()[0, 0]) if tok in head else 3 + int(bins[tok])  # noqa: E731
    law = {i: float(p[head[i]]) for i in range(3)}
    law.update({3 + b: float(p[(bins == b) & (w > 0)].sum()) for b in range(10)})
    draws = []
    for lo in range(0, n, 1000):
        keys = [(seed, 7) for seed in range(lo, lo + 1000)]
        draws += race_winner(p.expand(1000, V), keys).tolist()
    p_value, power = _chi2(law, [cell(t) for t in draws])
    tail = sum(t not in head for t in draws) / n
    print(
        f"[exactness] keyed race, tail 0.25 below HEAD: chi-square p={p_value:.3f}, power {power:.3f}, tail {tail:.3f}"
    )
    assert power >= 0.9 and p_value > 1e-3, p_value
    cols = torch.arange(0, V, 2).sort().values  # a draft vocabulary: every other id, q = p there, renormalised
    cols = torch.unique(torch.cat([cols, head]))
    q = p[cols] / p[cols].sum()
    full = torch.zeros(V).index_copy_(0, cols, q)
    keys = [(seed, 7) for seed in range(500)]
    assert torch.equal(cols[race_winner(q.expand(500, -1), keys, cols, V)], race_winner(full.expand(500, V), keys))


def test_tiny_temperature_is_finite_and_greedy(tgt, prompt):
    logits = tgt.model(torch.tensor([prompt])).logits[0, -1]
    p = probs(logits, SamplingParams(1e-40))
    assert torch.isfinite(p).all() and int(p.argmax()) == int(logits.argmax()) and float(p.max()) == 1.0
    out = SpeculativeDecoder(tgt.model, _drafter(tgt, "dspark")).run([Request(prompt, SamplingParams(1e-40), 12)])
    ref = SpeculativeDecoder(tgt.model, None).run([Request(prompt, SamplingParams(0.0), 12)])
    assert out[0].out == ref[0].out


def test_argmax_takes_the_first_of_tied_maxima_as_torch_argmax():
    """Greedy decoding's argmax (torch.max's indices, faster on CPU) breaks ties as torch.argmax does:
    the first index. bf16 logits tie often; rows of small integers tie in almost every row here."""
    g = torch.Generator().manual_seed(0)
    for rows, V in ((1, 7), (8, 16384), (3, 49152)):
        z = torch.randint(-3, 4, (rows, V), generator=g).float()
        z[0] = 2.0  # a row of equal values: index 0
        assert torch.equal(argmax(z), z.argmax(-1)) and int(argmax(z)[0]) == 0


def test_greedy_decoding_is_the_targets_argmax_chain(tgt, prompt):
    """Plain greedy rounds take the argmax of the target's logits, without a distribution (verify_choices)."""
    out = SpeculativeDecoder(tgt.model, None).run([Request(prompt, SamplingParams(0.0), 10)])[0].out
    ids = list(prompt)
    for _ in range(10):
        ids.append(int(tgt.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == ids[len(prompt) :]


@pytest.mark.parametrize("sp", [SamplingParams(0.0), SamplingParams(1.0)])
def test_nan_target_logits_fail_the_round(tgt, prompt, sp, monkeypatch):
    """A target whose logits turn NaN fails the round, greedy or sampled, instead of emitting a token."""
    dec = SpeculativeDecoder(tgt.model, _drafter(tgt, "dspark"), gamma=3)
    dec.add(Request(prompt, sp, 8))
    forward = dec.runner.forward

    def nan_forward(slots, tokens):
        out = forward(slots, tokens)
        out.logits[0][-1, 7] = float("nan")
        return out

    monkeypatch.setattr(dec.runner, "forward", nan_forward)
    with pytest.raises(FloatingPointError, match="not finite"):
        dec.step()


class NaNAfter(PerturbedTarget):
    """Drafts whose q is NaN from position `bad` on (a drafter that diverged)."""

    def __init__(self, model, gamma, bad):
        super().__init__(model, gamma)
        self.bad = bad

    def propose(self, states, anchors, gamma, sample):
        prop = super().propose(states, anchors, gamma, sample)
        if prop.probs is None:  # greedy: the one-hot q that the sampler leaves implicit, reported
            prop.probs = torch.nn.functional.one_hot(prop.tokens, self.c.vocab_size).float()
        prop.probs[:, self.bad :] = float("nan")
        return prop


def test_nan_draft_probabilities_only_shorten_the_verified_prefix(tiny):
    model, prompt = tiny
    plain = SpeculativeDecoder(model, None).run([Request(prompt, SamplingParams(0.0), 20)])
    for bad in (0, 2):
        dec = SpeculativeDecoder(model, NaNAfter(model, 4, bad), gamma=4)
        out = dec.run([Request(prompt, SamplingParams(0.0), 20)])
        assert out[0].out == plain[0].out and dec.drafter_error is None
        assert max(r.verified for r in out[0].rounds) == bad  # drafts before the NaN were still verified
    law = _exact_law(model, prompt)  # and the sampled law is untouched
    samples, _ = _sample(model, prompt, NaNAfter(model, 4, 2), spec.full_length, 3000)
    assert _chi2(law, samples)[0] > 1e-3


def test_a_transient_drafter_error_only_pauses_drafting(tgt, prompt):
    class Flaky(PerturbedTarget):
        calls = 0

        def propose(self, *a, **k):
            self.calls += 1
            if self.calls <= 2:
                raise RuntimeError("transient")
            return super().propose(*a, **k)

    plain = SpeculativeDecoder(tgt.model, None).run([Request(prompt, SamplingParams(0.0), 30)])
    dec = SpeculativeDecoder(tgt.model, Flaky(tgt.model, 4), gamma=4)
    out = dec.run([Request(prompt, SamplingParams(0.0), 30)])
    assert out[0].out == plain[0].out and dec.drafter_error == "RuntimeError: transient"
    assert dec.drafter is not None and out[0].rounds[-1].verified > 0  # drafting came back


def test_requests_at_the_context_limit_never_fail_their_batch(tgt, prompt):
    """prompt + max_tokens == the limit: drafts are capped to the room left, so neither the request nor
    its batch-mate fails, and outputs equal plain greedy."""
    limit = len(prompt) + 16
    reqs = lambda: [Request(prompt, SamplingParams(0.0), 16), Request(prompt[:5], SamplingParams(0.0), 16)]  # noqa: E731
    plain = SpeculativeDecoder(tgt.model, None).run(reqs())
    dec = SpeculativeDecoder(tgt.model, _drafter(tgt, "dspark"), gamma=5, max_slots=2, max_len=limit)
    out = dec.run(reqs())
    assert [o.out for o in out] == [p.out for p in plain] and all(len(o.out) == 16 for o in out)
    assert dec.runner.k[0].shape[2] <= limit  # the KV cache never grows past the configured bound
    with pytest.raises(UserError, match="context limit"):
        dec.add(Request(prompt, SamplingParams(0.0), 17))
    assert len(dec.runner.free_slots) == 2


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "dflash-fill-in"])
def test_a_drafter_that_skipped_rounds_catches_up_to_the_same_state(tgt, prompt, kind):
    """Rounds that skip drafting hand their committed positions to the drafter just before it next
    drafts, several rounds in one call: its cache then equals one built from the whole sequence at once."""
    drafter = _drafter(tgt, kind)
    calls, told = itertools.count(), []

    class EveryThird:  # a gate: draft in rounds 0, 3, 6, ..
        def __call__(self, R, behind, own, plain_behind):
            told.append(plain_behind)
            return next(calls) % 3 == 0

        def observe(self, verified, accepted):
            pass

        def timed(self, R, drafted, tokens, seconds, catch_up_s=0.0, after_drafted=False):
            pass

    dec = SpeculativeDecoder(tgt.model, drafter, gamma=4, gate=EveryThird())
    req = Request(prompt, SamplingParams(0.0), 64)
    dec.add(req)
    for _ in range(8):
        dec.step()
    assert [r.drafted for r in req.rounds] == [True, False, False] * 2 + [True, False]
    assert told == [0, 0, 1, 2, 0, 1, 2, 0]  # the gate hears the positions of plain rounds since the last drafted one
    assert len(req.pending) == 2  # rounds 6 and 7 are not handed over yet
    assert req.behind == sum(len(t) for _, t in req.pending) >= 2  # what the gate is told
    assert dec._catch_up([req]) and not req.pending and req.behind == 0
    seq = req.prompt + req.out  # the state holds every position but the last (the anchor), with its next token
    runner = TargetRunner(tgt.model, drafter.c.tap_layers, max_slots=1)
    out = runner.forward([runner.alloc()], [torch.tensor(seq[:-1])])
    fresh = DraftState()
    drafter.extend([fresh], out.taps, [torch.tensor(seq[1:])])
    assert fresh.length == req.state.length == len(seq) - 1
    for (k, v), (k2, v2) in zip(fresh.kv, req.state.kv):
        assert torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)
    for key, value in fresh.extra.items():
        if isinstance(value, torch.Tensor):
            assert torch.allclose(value, req.state.extra[key], atol=1e-5), key


def test_the_gate_hears_which_plain_rounds_follow_a_drafted_one_on_the_decoders_clock(tgt, prompt, monkeypatch):
    """Each round reaches the gate with whether the round before it drafted (a plain round right after one
    is the switch back, not plain decoding's cost), timed on the decoder's clock alone: on the CPU with one
    torch thread the thread's CPU time, which leaves out other threads' turns, else wall time."""
    told = []

    class Pattern:  # a gate: draft in rounds 0, 1, 4, 5, ..
        def __init__(self):
            self.calls = itertools.count()

        def __call__(self, R, behind, own, plain_behind):
            return next(self.calls) % 4 < 2

        def observe(self, verified, accepted):
            pass

        def timed(self, R, drafted, tokens, seconds, catch_up_s=0.0, after_drafted=False):
            told.append((drafted, after_drafted, seconds, catch_up_s))

    dec = SpeculativeDecoder(tgt.model, _drafter(tgt, "dspark"), gamma=4, gate=Pattern())
    assert torch.get_num_threads() == 1 and dec.clock is time.thread_time  # the suite runs torch on one thread
    ticks = itertools.count()
    dec.clock = lambda: float(next(ticks))  # a clock that moves one second at each reading
    dec.add(Request(prompt, SamplingParams(0.0), 64))
    for _ in range(8):
        dec.step()
    drafted = [True, True, False, False] * 2
    assert [(d, a) for d, a, _, _ in told] == list(zip(drafted, [False] + drafted[:-1]))
    # read at a round's start and end, and around a drafted round's catch-up: a drafted round after plain
    # ones (or the prompt) reads their positions, a probe's price that its seconds leave out
    assert [(s, c) for _, _, s, c in told] == [(2.0, 1.0), (2.0, 0.0), (1.0, 0.0), (1.0, 0.0)] * 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert SpeculativeDecoder(tgt.model, None).clock is time.perf_counter


def test_a_failed_prefill_frees_its_slot(tgt, prompt, monkeypatch):
    dec = SpeculativeDecoder(tgt.model, PerturbedTarget(tgt.model, 4), gamma=4, max_slots=2)

    def out_of_memory(*a, **kw):
        raise MemoryError("out of memory")

    monkeypatch.setattr(dec.runner, "forward", out_of_memory)
    for _ in range(3):  # more failures than slots
        with pytest.raises(MemoryError):
            dec.add(Request(prompt, SamplingParams(1.0), 8))
    assert len(dec.runner.free_slots) == 2 and not dec.active


def test_a_drafter_that_cannot_read_its_context_is_dropped(tgt, prompt):
    """extend fails when the drafter first reads the prompts: decoding goes on without it, exactly."""

    class BrokenExtend(PerturbedTarget):
        def extend(self, *a):
            raise RuntimeError("extend failed")

    reqs = lambda: [Request(prompt, SamplingParams(0.0), 8), Request(prompt[:5], SamplingParams(0.0), 8)]  # noqa: E731
    plain = SpeculativeDecoder(tgt.model, None).run(reqs())
    dec = SpeculativeDecoder(tgt.model, BrokenExtend(tgt.model, 4), gamma=4, max_slots=2)
    out = dec.run(reqs())
    assert [o.out for o in out] == [p.out for p in plain]
    assert dec.drafter is None and dec.drafter_error == "RuntimeError: extend failed"
    assert len(dec.runner.free_slots) == 2 and not dec.active


def test_kv_growth_is_all_or_nothing(tgt, prompt, monkeypatch):
    r = TargetRunner(tgt.model, [], max_slots=1, capacity=4)
    real, calls = torch.Tensor.new_zeros, itertools.count()

    def fail_late(self, *shape, **kw):
        if next(calls) == 5:  # the sixth new buffer (third layer's keys) runs out of memory
            raise MemoryError("out of memory")
        return real(self, *shape, **kw)

    monkeypatch.setattr(torch.Tensor, "new_zeros", fail_late)
    with pytest.raises(MemoryError):
        r._ensure(64)
    monkeypatch.undo()
    assert {t.shape[2] for t in r.k + r.v} == {4}  # every layer still has the old, whole cache
    slot = r.alloc()
    out = r.forward([slot], [torch.tensor(prompt)])
    assert (out.logits[0] - tgt.model(torch.tensor([prompt])).logits[0]).abs().max() < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_log_softmax_at_every_output_token(tgt, temperature):
    """Each output token's recorded log-probability and top-k are the target's raw log_softmax at its
    position (one full forward over prompt + output), whether the token was an accepted draft, a
    correction, the bonus token or the first token from prefill; logprobs off records nothing."""
    drafter = untrained_drafter(tgt, "dspark", 4)
    prompt = [tgt.tokenizer.bos_token_id] + tgt.tokenizer.encode("def add(a, b):\n", add_special_tokens=False)
    sp = SamplingParams(temperature)
    reqs = [Request(prompt, sp, 40, seed, logprobs=k) for seed, k in ((0, 3), (1, 0), (2, -1))]
    dec = SpeculativeDecoder(tgt.model, drafter, 4, policies.make_policy("static", SPSTable.synthetic(), 4))
    dec.run(reqs)
    for r in reqs[:2]:
        assert len(r.token_logprobs) == len(r.out) > 1
        with torch.no_grad():
            ref = torch.log_softmax(tgt.model(torch.tensor([prompt + r.out])).logits[0].float(), -1)
        rows = ref[len(prompt) - 1 : -1]  # row i predicts output token i
        chosen = rows[torch.arange(len(r.out)), torch.tensor(r.out)]
        assert torch.allclose(torch.tensor([lp for lp, _ in r.token_logprobs]), chosen, atol=1e-4)
        for (_, top), row in zip(r.token_logprobs, rows):
            values, ids = row.topk(r.logprobs)
            assert [i for i, _ in top] == ids.tolist() and torch.allclose(
                torch.tensor([v for _, v in top]), values, atol=1e-4
            )
    if temperature > 0:  # accepted drafts were among the tokens checked (an untrained drafter's, at T=1)
        assert sum(x.accepted for r in reqs for x in r.rounds) > 0
    assert reqs[2].token_logprobs == []
