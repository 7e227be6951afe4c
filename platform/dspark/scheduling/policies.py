"""Verification-length policies: pure functions over arrays.

Notation (paper §3.2.2): R requests, conditional confidences c_{r,j}, prefix survival
a_{r,j} = prod_{i<=j} c_{r,i}, lengths l_r in 0..gamma, verification batch B = sum_r (1 + l_r),
expected accepted tokens tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), throughput Theta = tau * SPS(B).
With the drafting round's cost t_d(R) (sps.SPSTable.draft_time) a round takes t_d + 1/SPS(B):
Theta = tau / (t_d + 1/SPS(B)); where the table profiled verification per request count, 1/SPS(B) is
t_v(R, B) (`SPSTable.verify_time`: B tokens of R requests, not B requests of one token). Inside a round
that drafted, t_d is already paid (t_d = 0 gives the paper's Theta); whether to draft at all is
`DraftGate`'s decision, made before drafting.

- `greedy_prefix` (Algorithm 1): admit candidates (r, j) in descending a_{r,j} (ties: smaller j,
  then smaller r) while Theta strictly improves; STOP at the first candidate that does not. The early
  stop is what keeps it lossless: the decision to admit x_{r,k} never looks at a_{r,k+1}, which
  depends on x_{r,k} itself (Appendix A shows the bias without it).
- `async_global`: the production variant (§5.2). Capacity K comes from an unconstrained search over
  the whole admission path on confidences from two steps earlier (they cannot depend on the current
  tokens); the current step admits the top-K candidates by fresh survival.
- `DraftGate`: draft this round or decode plain target tokens, from past rounds only: the per-position
  acceptance measured in earlier drafted rounds predicts tau of a static length, and drafting goes
  on while some length beats plain decoding, Theta_0 = R * SPS(R); once both kinds of round have been
  timed at R, their measured tokens/s decide instead of the model. A round that skips drafting is
  plain target sampling, so the output law is unchanged.
- Baselines: no speculation, static length, static threshold on survival.

`make_policy` turns a policy name into the callable the decoder runs each round; it is the one
name -> function table (the engine, the jobs and the benches all use it).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional, Sequence

import numpy as np

from dspark.scheduling.sps import SPSTable


def survival(conf: np.ndarray) -> np.ndarray:
    """(R, gamma) conditional confidences -> prefix survival a_{r,j}."""
    return np.cumprod(np.asarray(conf, dtype=np.float64), axis=1)


def _order(a: np.ndarray) -> np.ndarray:
    """Candidate (r, j) indices sorted by a descending, ties by smaller j then smaller r (deterministic)."""
    R, G = a.shape
    r, j = np.meshgrid(np.arange(R), np.arange(G), indexing="ij")
    keys = np.lexsort((r.ravel(), j.ravel(), -a.ravel()))
    return np.stack([r.ravel()[keys], j.ravel()[keys]], 1)


def rate(tau: float, B: int, sps: SPSTable, draft_s: float = 0.0, R: Optional[int] = None) -> float:
    """Theta = tau / (t_d + t_v(R, B)): tokens per second of a round that verifies B tokens of R requests
    (t_v = 1/SPS(B) where R is not given or the table has no verification profile)."""
    return tau / (draft_s + sps.verify_time(B, R))


def throughput(a: np.ndarray, lengths, sps: SPSTable, draft_s: float = 0.0) -> float:
    a = np.asarray(a, dtype=np.float64)
    lengths = np.asarray(lengths)
    tau = len(lengths) + sum(a[r, :l].sum() for r, l in enumerate(lengths))
    return float(rate(tau, int(len(lengths) + lengths.sum()), sps, draft_s, len(lengths)))


def greedy_prefix(a: np.ndarray, sps: SPSTable, early_stop: bool = True, draft_s: float = 0.0) -> np.ndarray:
    """Algorithm 1. a: (R, gamma) prefix survival; draft_s: the round's drafting time, already paid
    (verifying more of the drafts is then relatively cheaper). Returns l (R,).

    early_stop=False is the retrospective global search: NOT lossless (kept for the bias test)."""
    a = np.asarray(a, dtype=np.float64)
    R = a.shape[0]
    lengths = np.zeros(R, dtype=np.int64)
    best_lengths = lengths.copy()
    B, tau = R, float(R)
    best = rate(tau, B, sps, draft_s, R)
    for r, j in _order(a):
        if a[r, j] <= 0:
            break
        lengths[r] = j + 1
        B += 1
        tau += a[r, j]
        theta = rate(tau, B, sps, draft_s, R)
        if theta > best:
            best, best_lengths = theta, lengths.copy()
        elif early_stop:
            break
    return best_lengths


def capacity(a_stale: np.ndarray, sps: SPSTable, draft_s: float = 0.0) -> int:
    """K = number of draft tokens the unconstrained search over the admission path would verify."""
    return int(greedy_prefix(a_stale, sps, early_stop=False, draft_s=draft_s).sum())


def admit_top_k(a: np.ndarray, k: int) -> np.ndarray:
    """Admit the K best candidates by current survival; a prefix per request because a is
    non-increasing along j and ties go to the smaller j."""
    a = np.asarray(a, dtype=np.float64)
    lengths = np.zeros(a.shape[0], dtype=np.int64)
    for r, j in _order(a)[:k]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths


def async_global(a_fresh: np.ndarray, a_stale: np.ndarray, sps: SPSTable, draft_s: float = 0.0) -> np.ndarray:
    """Production variant: capacity from two-step-old confidences, admission by fresh ones."""
    return admit_top_k(a_fresh, capacity(a_stale, sps, draft_s))


def no_speculation(R: int) -> np.ndarray:
    return np.zeros(R, dtype=np.int64)


def static_length(R: int, length: int) -> np.ndarray:
    return np.full(R, length, dtype=np.int64)


def static_threshold(a: np.ndarray, threshold: float) -> np.ndarray:
    """Verify each request's drafts while the prefix survival stays >= threshold (paper Fig. 5)."""
    return (np.asarray(a) >= threshold).cumprod(axis=1).sum(axis=1).astype(np.int64)


def draft_rate(alpha: np.ndarray, R: int, sps: SPSTable, overhead_s: float = 0.0, prompt_s: float = 0.0) -> float:
    """The best Theta of drafting at R requests with one static length l = 1..gamma, predicted from the
    per-position conditional acceptance alpha (gamma,): tau = R * (1 + sum_{j<=l} prod_{i<=j} alpha_i),
    and the round takes o + t_d(R) + kappa * tau + t_v(R, R (1 + l)), o the round's cost outside the
    forward passes, kappa (`prompt_s`) the drafter's prompt reading per output token
    (`DraftGate.prompt_s_per_token`)."""
    tau = R * (1.0 + np.cumsum(np.cumprod(alpha)))  # (gamma,): l = 1..gamma
    t_d = sps.draft_time(R)
    return max(rate(float(t), R * (2 + j), sps, t_d + overhead_s + prompt_s * t, R) for j, t in enumerate(tau))


def draft_gain(alpha: np.ndarray, R: int, sps: SPSTable, overhead_s: float = 0.0, prompt_s: float = 0.0) -> float:
    """m(R): drafting's predicted tokens/s over plain target decoding's, Theta_0 = R / (o + 1/SPS(R))."""
    return draft_rate(alpha, R, sps, overhead_s, prompt_s) / rate(R, R, sps, overhead_s)


def draft_pays(alpha: np.ndarray, R: int, sps: SPSTable, overhead_s: float = 0.0, prompt_s: float = 0.0) -> bool:
    """Drafting is expected to beat plain target decoding."""
    return draft_gain(alpha, R, sps, overhead_s, prompt_s) > 1.0


def running_average(old: float, n: int, x: float, weight: float) -> float:
    """The n-th value x into an average: the running mean for the first 1 / weight values, then the
    exponential average with `weight`."""
    return old + max(weight, 1 / n) * (x - old)


def effective_count(n: int, weight: float) -> float:
    """How many values a `running_average` of n values is worth: n during the running mean, then
    (2 - weight) / weight (an exponential mean's variance is weight / (2 - weight) of one value's)."""
    return n if n <= 1 / weight else (2 - weight) / weight


class RoundTimes:
    """What rounds of one kind took: tokens t and seconds s per round, their means, mean squares and mean
    product, each the running mean for the first 1 / weight rounds, then exponential (weight). The rate
    is the ratio of the means, t̄ / s̄ (the rounds together: a short round's jitter does not weigh more),
    and its standard error the delta method's,
        se² = (var t - 2 rate cov(t, s) + rate² var s) / (s̄² n_eff),
    with n_eff the averages' `effective_count`."""

    def __init__(self, weight: float):
        self.weight, self.n = weight, 0
        self.t = self.s = self.tt = self.ss = self.ts = 0.0
        self.last = (0.0, 0.0)  # the latest round's tokens and seconds

    def add(self, tokens: float, seconds: float) -> None:
        self.n += 1
        n, w = self.n, self.weight
        self.t, self.s = running_average(self.t, n, tokens, w), running_average(self.s, n, seconds, w)
        self.tt, self.ss = running_average(self.tt, n, tokens**2, w), running_average(self.ss, n, seconds**2, w)
        self.ts = running_average(self.ts, n, tokens * seconds, w)
        self.last = (tokens, seconds)

    def charge(self, seconds: float) -> None:
        """The latest round (t, s) cost d = `seconds` more than it was timed at (a cost it left to the round
        after it): with v = max(weight, 1 / n), the weight it entered the averages with, s̄ += v d,
        mean(s²) += v ((s + d)² - s²), mean(t s) += v t d, exactly as if it had been added at s + d (before
        the next `add` only)."""
        t, s = self.last
        v = max(self.weight, 1 / self.n)
        self.s += v * seconds
        self.ss += v * ((s + seconds) ** 2 - s**2)
        self.ts += v * t * seconds
        self.last = (t, s + seconds)

    @property
    def rate(self) -> float:
        return self.t / self.s if self.n else 0.0

    def rate_se(self) -> float:
        if self.n < 2:
            return math.inf
        n_eff = effective_count(self.n, self.weight)
        bessel = n_eff / (n_eff - 1)  # the sample moments' bias
        var_t, var_s = (self.tt - self.t**2) * bessel, (self.ss - self.s**2) * bessel
        cov = (self.ts - self.t * self.s) * bessel
        r = self.rate
        return math.sqrt(max(var_t - 2 * r * cov + r * r * var_s, 0.0) / (self.s**2 * n_eff))


class DraftGate:
    """Whether a round drafts, decided before drafting from past rounds only.

    The model: alpha_j, the conditional acceptance at draft position j, is the mean over the drafted
    rounds that verified position j, exponential (`weight`) once there are more than 1 / weight of them
    (a position never verified counts as 0): one lucky first probe moves it no more than its share. A
    round drafts while `draft_pays`; otherwise it does not, except for probes that re-measure alpha after
    1, 2, 4, .. `max_interval` skipped rounds at that R (each R keeps its own count: a batch size where
    drafting pays does not restart the probes of one where it does not), and never sooner than
    `probe_gap`: a probe (the drafter's catch-up over the positions it has not read, and its drafting
    round, priced by what drafted rounds at R were measured to lose) costs at most `overhead` of the plain
    rounds before it. A drafted round that verified nothing (the policy found no draft worth its
    verification) also stops drafting until the next probe. Before any drafted round there is nothing to
    predict from: draft. Until `min_rounds` drafted rounds were timed at R, every other round at R is a
    probe, so that the measurement below, not the alpha of a few early rounds, soon decides there.
    max_interval = 0: draft every round.

    The measurement: the decoder reports what each round took (`timed`: tokens emitted, and seconds on
    its clock, the engine thread's CPU time where the round runs on that thread alone, without the part of
    the drafter's catch-up that reads positions of earlier plain rounds or new prompts, which is the
    probe's price above; reading the previous drafted round's tokens is part of drafting; `RoundTimes`,
    over the last `window` or so rounds of each kind). Reading prompts is a cost
    of drafting all the same (plain decoding never reads them), so a drafted round is charged it per
    output token instead of when it happens: kappa = t_e * P / O, the server's mean prompt P and output
    O of the requests that ended (`finished`; `prompt_s_per_token`), times the tokens it emitted; the
    model's drafted rounds too. Once `min_rounds` drafted
    and `min_rounds` plain rounds were timed at R, the measured rates decide, whatever the model predicts:
    drafting goes on unless drafted rounds emit fewer tokens per second than plain ones (by more than `z`
    standard errors of the difference: z > 0 gives drafting the benefit of the doubt); a round that would
    resume drafting after plain rounds is judged with the catch-up over their positions it pays first
    (`plain_behind`, t_e each; `measured`), which the timed rounds leave out. A profiled cost
    curve taken on another thread count or load, overheads it does not price, or a policy that verifies
    other lengths than the static ones the model assumes then cannot make drafting lose for long; a few
    unlucky drafted rounds (a drafted round emits 1 to gamma + 1 tokens per request) that stop drafting
    which pays are outvoted by the probes that follow. z = 0 by default: with 1, drafting that lost 10% per
    round at four SmolLM2 requests went on in 10% of their rounds (86 of 882: 50 on a verdict within the
    noise, 36 probes), against 3% with 0 (28 of 913: 12 and 16); on `bench/gate_sim.py` (before k was
    measured) the worst single-load case rose from 0.963 to 0.968 of the better fixed choice, the price
    being a wider tail where drafting wins by 10% (10th percentile 0.898 against 0.928).
    Until then a neighbour's verdict decides where there is one (`inferred`: drafting's gain shrinks as
    load grows, so a loss measured at the nearest R' < R holds at R, and a win at the nearest R' > R; not
    R' = 1, where one request's acceptance decides, which says more about that request than about the
    load); where neither holds, the nearest measured gain carried to R along the model's shape decides
    beyond `margin` (`scaled`: a loss measured at R' = 16 by 4x holds at R = 15 as well, though 15 < 16).
    An R with such a verdict is probed at the probes' price, not every other round: a server whose load ramps
    through many R (the tail of a burst, C = 16 falling to 1) does not draft at a loss at each while
    measuring it (at T=1 on the built-in target, drafting at R = 5-15 took 1.1 s beyond plain rounds in one
    serve_load run, against 0.7 s at R = 1-4). Else the model decides, its rounds priced with the measured cost of a
    plain round beyond the profiled forward pass (`overhead_s`). While drafting, a plain round is timed
    every other drafted round until there are `min_rounds` of them, then every `max_interval`-th (every
    other round for max_interval <= 2, before the pairs below); only a plain round after a plain one is
    timed as plain (`timed`: the one after a drafted round is slower, a switching cost charged to that
    drafted round), so there the gate takes two plain rounds in a row.

    The requests: how many drafts a round gets accepted depends on the requests more than on the
    server, so when the decoder says which requests the round is for (`own`: each one's drafted rounds
    and drafts accepted in them), the measured drafted rate is that of the requests at hand: drafted
    rounds' seconds, and tokens Σ_r (1 + â_r), with â_r the request's own accepted drafts per drafted
    round, counting the server's mean as k more rounds (`expected_tokens`). k is how far requests differ,
    measured on the requests that ended (`prior_rounds`, empirical Bayes): about 1 or less where they
    differ far beyond their rounds' noise (the built-in target at T=0: some prompts accept 6 drafts a
    round, others under 1, and a request's first 4 rounds predict the rest, correlation 0.71), tens where
    they hardly differ (T=1: 14-42) and a request's first rounds are noise, so the server's mean decides.
    A lone request (R = 1, where its acceptance alone decides), where `min_rounds` rounds of its own
    outweigh the server's mean (k <= min_rounds), has probes that wait its own price alone (`probe_gap`
    with the tokens expected of it), not the interval grown over earlier requests: a new request is
    measured over its first rounds, one whose first rounds fell short of what drafting needs, though not
    by much, is measured again soon (at T=0 on the built-in target, requests accepting 1.6 drafts a round,
    which drafting every round decodes about 15% faster than plain rounds, had stopped drafting after a
    poor start: the doubling interval left them one probe in 16-64 rounds), and a server whose first
    request drafts badly does not keep drafting off for the ones after it. Where requests are alike,
    new ones wait the interval out like any other round: probing each for its first rounds drafted at a
    loss in 2% of the rounds at T=1, 3.6-4.3% slower than plain decoding. In a batch a new request moves
    the expected tokens by about 1 / R of its acceptance, and the probes measure it: forcing rounds for
    each new request there would draft at a loss wherever drafting does not pay (at R = 8 on SmolLM2, 9%
    of rounds, each 19% slower)."""

    def __init__(
        self,
        sps: SPSTable,
        gamma: int,
        max_interval: int,
        weight=0.1,
        overhead=0.02,
        min_rounds=4,
        z=0.0,
        window=200,
        margin=0.1,
    ):
        self.sps, self.max_interval, self.weight, self.overhead = sps, max_interval, weight, overhead
        self.min_rounds, self.z, self.window, self.margin = min_rounds, z, window, margin
        self.alpha = np.zeros(gamma)
        self.rounds = np.zeros(gamma)  # drafted rounds that measured alpha_j
        self.seen = False  # a drafted round has been observed
        self.idle = False  # the latest drafted round verified nothing
        self.interval: dict[int, int] = {}  # R -> plain rounds the next probe at R waits: 1, 2, 4, .. max_interval
        self.skipped: dict[int, int] = {}  # R -> plain rounds at R since its last drafted round
        # the model's gain m(R) by R, priced with o(R) (`model_gain`) and with o = 0 (`scaled`'s shape), until
        # alpha, kappa or o(R) next changes
        self.model_gains: dict[int, float] = {}
        self.shape_gains: dict[int, float] = {}
        self.rounds_timed: dict[tuple[int, bool], RoundTimes] = {}  # (R, drafted) -> what those rounds took
        self.verdicts: dict[int, bool] = {}  # R > 1 -> the server's measured verdict there (`measured(R)`)
        self.gains: dict[int, float] = {}  # R > 1 -> measured drafted / plain tokens/s there, beside its verdict
        self.since_plain: dict[int, int] = {}  # R -> drafted rounds since a plain round was timed at R
        self.last_drafted: Optional[int] = None  # R of the latest drafted round timed
        self.totals: dict[tuple[int, bool], tuple] = {}  # (R, drafted) -> rounds, tokens, s, catch-up s
        # the server's mean accepted drafts per request and drafted round, over the last `window` or so
        self.accepted, self.request_rounds = 0.0, 0
        # per ended request drafted for n >= 2 rounds, over the last `window` or so of them:
        # its mean accepted drafts per round x, x^2, 1 / n and the variance over its rounds (`prior_rounds`)
        self.request_moments, self.ended_drafted = np.zeros(4), 0
        self.prompt_tokens, self.output_tokens, self.ended = 0.0, 0.0, 0  # mean prompt and output of ended requests

    def __call__(
        self, R: int, behind: int = 0, own: Optional[list[tuple[int, int]]] = None, plain_behind: int = 0
    ) -> bool:
        """Draft this round for R requests? `behind`: context positions the drafter has not read yet (it
        reads them first, t_e each). `own`: per request, its drafted rounds and the drafts accepted in them
        (None: the server's rounds alone decide). `plain_behind`: of those, the positions of plain rounds since each
        request's latest drafted round (what resuming drafting reads beyond steady drafting; `measured`)."""
        if self.max_interval == 0 or not self.seen:
            return True
        # a lone request, where min_rounds rounds of its own outweigh the server's mean: its own price decides
        lone = R == 1 and bool(own) and self.prior_rounds() <= self.min_rounds
        if not self.idle and self.drafting_pays(R, own, plain_behind):
            self.interval[R], self.skipped[R] = 1, 0
            timed_plain = self.speed(R, False)[1]
            if self.since_plain.get(R, 0) >= (2 if timed_plain < self.min_rounds else self.max_interval):
                return False  # a plain round, timed: what drafting is compared with
            return True
        interval, skipped = self.interval.get(R, 1), self.skipped.get(R, 0)
        if self.speed(R, True)[1] < self.min_rounds and self.inferred(R) is None:  # R unknown: every other round
            wait = 1
        elif skipped < interval and not lone:  # short of the interval: no probe, whatever its price
            wait = interval
        else:  # a probe's price; a lone request's own does not wait the interval out
            gap = self.probe_gap(R, behind, own if lone else None)
            wait = min(self.max_interval, gap if lone else max(interval, gap))
        if skipped >= wait:  # a probe
            self.interval[R], self.skipped[R] = min(2 * interval, self.max_interval), 0
            return True
        self.skipped[R] = skipped + 1
        return False

    def enough(self, R: int, drafted: bool) -> Optional[RoundTimes]:
        """What rounds of this kind at R took, once `min_rounds` of them were timed; else None."""
        times = self.rounds_timed.get((R, drafted))
        return times if times is not None and times.n >= self.min_rounds else None

    def expected_tokens(self, own: list[tuple[int, int]]) -> float:
        """Tokens a drafted round is expected to emit for these requests (drafted rounds n_r and drafts
        accepted A_r each): Σ_r 1 + (A_r + k a) / (n_r + k), with a the server's mean per request and round
        (over the last `window` or so) and k = `prior_rounds`, written a + (A_r - n_r a) / (n_r + k) (inf: a)."""
        k, a = self.prior_rounds(), self.accepted
        return sum(1 + a + ((A - n * a) / (n + k) if n else 0.0) for n, A in own)

    def prior_rounds(self) -> float:
        """k, the drafted rounds of its own that weigh as much as the server's mean in a request's expected
        acceptance: sigma^2 / tau^2, the variance of accepted drafts over one request's rounds against that
        of the requests' true means, by the method of moments (empirical Bayes) over the ended requests drafted
        for n >= 2 rounds (the variance over a request's rounds needs two): sigma^2 the mean of their variances
        over their rounds, and from the variance of their means, S = tau^2 + sigma^2 E[1/n] (E[1/n] weighs a
        short request's noisy mean). Requests that differ no more than their rounds' noise says (tau^2 <= 0):
        inf, the server's mean alone. Until `min_rounds` (and 2) of them ended: 1. A request's n depends on
        its rounds: the gate leaves requests where drafting loses drafted for few rounds (they count less
        often: tau^2 errs low, k high), and a lone request whose first rounds fell short stops drafting (its
        short mean errs low: tau^2 high, k low). Two rounds are enough to count, not `min_rounds`, so that k
        is measured where drafting loses and requests get few probes (at T=1 on the built-in target, requests
        of 64 tokens, a serve_load run counting from 4 drafted 67 rounds over about 100 requests and k stayed
        1 to its end: each new request was probed at its own price)."""
        m = effective_count(self.ended_drafted, 1 / self.window)
        if self.ended_drafted < max(self.min_rounds, 2) or m < 2:
            return 1.0
        x, xx, inv_n, sigma2 = self.request_moments
        tau2 = (xx - x * x) * m / (m - 1) - sigma2 * inv_n
        return sigma2 / tau2 if tau2 > 0 else math.inf

    def measured(self, R: int, own: Optional[list[tuple[int, int]]] = None, plain_behind: int = 0) -> bool | None:
        """Once drafted and plain rounds at R were each timed `min_rounds` times: False when drafted ones
        emit fewer tokens/s by more than `z` standard errors of the difference, else True; before, None.
        With `own`, drafted rounds emit the tokens expected for these requests in the seconds measured; with
        `plain_behind` positions of plain rounds to read first, in those seconds and their catch-up, t_e * plain_behind:
        the drafted round that resumes drafting pays it (the timed ones leave it out: in steady drafting
        there is none), so drafting that pays only in steady state is not resumed for requests at the margin
        round after round (at 16 users on the built-in target, where the gate drafted 12-27% of the rounds,
        that catch-up was 8-14% of the drafted rounds' time)."""
        drafted, plain = self.enough(R, True), self.enough(R, False)
        if drafted is None or plain is None:
            return None
        scale = 1.0 if not own else self.expected_tokens(own) / drafted.t  # tokens for these requests
        scale *= drafted.s / (drafted.s + self.sps.catch_up_time(plain_behind))  # t / (s + t_e p) = scale t / s
        se = math.hypot(scale * drafted.rate_se(), plain.rate_se())
        return scale * drafted.rate - plain.rate + self.z * se > 0

    def drafting_pays(self, R: int, own: Optional[list[tuple[int, int]]] = None, plain_behind: int = 0) -> bool:
        """The measured verdict at R where there is one (for these requests, `plain_behind` positions behind), else a
        neighbour's (`inferred`), else the model (`draft_pays` with the measured alpha)."""
        verdict = self.measured(R, own, plain_behind)
        if verdict is None:
            verdict = self.inferred(R)
        if verdict is not None:
            return verdict
        return self.model_gain(R) > 1.0

    def inferred(self, R: int) -> bool | None:
        """Drafting's verdict at R from the nearest R' > 1 with a measured one: per request, a drafted round
        verifies 1 + l tokens where a plain one verifies 1, and the cost of verifying more, like drafting
        for more requests, grows with the batch, so the gain shrinks as R grows (the paper's premise). A
        loss at the nearest R' < R: False; a win at the nearest R' > R: True; both (noise): None; neither:
        the nearest measured gain carried along the model (`scaled`)."""
        below = max((r for r in self.verdicts if r < R), default=None)
        above = min((r for r in self.verdicts if r > R), default=None)
        loses = below is not None and not self.verdicts[below]
        wins = above is not None and self.verdicts[above]
        if loses != wins:
            return wins
        return None if loses else self.scaled(R)

    def scaled(self, R: int) -> bool | None:
        """Drafting's verdict at R > 1 from the nearest R' > 1 with a measured gain g(R') (drafted / plain
        tokens/s; of two as near, the smaller), carried along the model's shape: g(R) ~ g(R') m(R) / m(R'),
        m the model's gain (`draft_gain` with the measured alpha), both loads priced without o, which the
        measured gain carries. The model errs by a factor that varies little between neighbouring loads; the
        measurement fixes the factor. Beyond `margin` of 1 it decides; within it, with nothing measured, at
        R = 1 (one request's acceptance decides there), or where the neighbour's gain and verdict disagree
        (z > 0): None."""
        if R == 1 or not self.gains:
            return None
        near = min(self.gains, key=lambda r: (abs(r - R), r))
        if (self.gains[near] > 1) != self.verdicts[near]:
            return None
        for r in (R, near):
            if r not in self.shape_gains:
                self.shape_gains[r] = draft_gain(self.alpha, r, self.sps, 0.0, self.prompt_s_per_token())
        g = self.gains[near] * self.shape_gains[R] / self.shape_gains[near]
        if g < 1 - self.margin:
            return False
        if g > 1 + self.margin:
            return True
        return None

    def model_gain(self, R: int) -> float:
        """m(R) priced with o(R), the measured alpha and kappa (> 1: `draft_pays`)."""
        if R not in self.model_gains:
            o, kappa = self.overhead_s(R), self.prompt_s_per_token()
            self.model_gains[R] = draft_gain(self.alpha, R, self.sps, o, kappa)
        return self.model_gains[R]

    def overhead_s(self, R: int) -> float:
        """o(R): what a plain round at R took beyond its profiled forward pass, 1/SPS(R), once `min_rounds`
        were timed (else 0): the engine's own work per round, which drafting spreads over more tokens."""
        plain = self.enough(R, False)
        return 0.0 if plain is None else max(plain.s - 1.0 / self.sps(R), 0.0)

    def probe_gap(self, R: int, behind: int = 0, own: Optional[list[tuple[int, int]]] = None) -> int:
        """Plain rounds a probe waits at least: its catch-up and drafting round cost at most `overhead` of
        them, t_e * behind + loss(R) <= overhead * gap * s(R), with s(R) what a plain round takes (measured,
        else 1/SPS(R)) and loss(R) what a drafted round takes beyond emitting its tokens at the plain rate,
        s_d - t_d / rate_plain (measured once both kinds were timed `min_rounds` times, else t_d(R); with
        `own`, t_d the tokens expected of these requests, `expected_tokens`)."""
        drafted, plain = self.enough(R, True), self.enough(R, False)
        round_s = 1.0 / self.sps(R) if plain is None else plain.s
        loss_s = self.sps.draft_time(R)
        if drafted is not None and plain is not None:
            tokens = drafted.t if not own else self.expected_tokens(own)
            loss_s = max(drafted.s - tokens / plain.rate, 0.0)
        return math.ceil((self.sps.catch_up_time(behind) + loss_s) / (self.overhead * round_s))

    def observe(self, verified: list[int], accepted: list[int]) -> None:
        """A drafted round: request r verified verified[r] drafts and accepted accepted[r] of them."""
        l, n = np.asarray(verified), np.asarray(accepted)
        self.seen, self.idle = True, not l.any()
        self.model_gains.clear()
        self.shape_gains.clear()
        for a in accepted:
            self.request_rounds += 1
            self.accepted = running_average(self.accepted, self.request_rounds, a, 1 / self.window)
        for j in range(len(self.alpha)):
            reached = (l > j) & (n >= j)  # position j was verified and every draft before it accepted
            if reached.any():
                self.rounds[j] += 1
                self.alpha[j] = running_average(
                    self.alpha[j], self.rounds[j], float((n[reached] > j).mean()), self.weight
                )

    def finished(self, prompt_tokens: int, output_tokens: int, accepted: Sequence[int] = ()) -> None:
        """A request that was decoded in rounds ended with `output_tokens` after a prompt of `prompt_tokens`;
        `accepted`: the drafts accepted in each round drafted for it."""
        n = len(accepted)
        if n >= 2:  # its variance over its rounds needs two
            self.ended_drafted += 1
            x = np.asarray(accepted, dtype=np.float64)
            moments = np.array([x.mean(), x.mean() ** 2, 1 / n, x.var(ddof=1)])
            self.request_moments = running_average(self.request_moments, self.ended_drafted, moments, 1 / self.window)
        self.ended += 1
        w = 1 / self.window
        self.prompt_tokens = running_average(self.prompt_tokens, self.ended, prompt_tokens, w)
        self.output_tokens = running_average(self.output_tokens, self.ended, output_tokens, w)
        self.model_gains.clear()  # the model's price of drafting moved
        self.shape_gains.clear()

    def prompt_s_per_token(self) -> float:
        """kappa = t_e * P / O: where every round drafts, the drafter reads each request's prompt once (t_e
        per position), its share per output token over the requests that ended (0 before any did)."""
        return self.sps.catch_up_time(self.prompt_tokens) / self.output_tokens if self.output_tokens else 0.0

    def timed(
        self,
        R: int,
        drafted: bool,
        tokens: int,
        seconds: float,
        catch_up_s: float = 0.0,
        after_drafted: bool = False,
    ) -> None:
        """A round of R requests emitted `tokens` in `seconds` (its catch-up excluded); drafted or plain.
        A drafted round's measured rate is charged its tokens' share of prompt reading (`prompt_s_per_token`);
        `catch_up_s`, the catch-up it excluded, is only counted in the run's totals (`state`), which hold the
        seconds the rounds took.

        A plain round right after a drafted one (`after_drafted`) is counted there too but not timed as plain:
        the target's forward after the drafter's round runs slower (in one process +4% / +12% / +12% at R = 1 /
        4 / 16), a cost of switching back that steady drafting never pays and steady plain decoding neither.
        What it took beyond the plain rounds timed at R is charged to that drafted round (`RoundTimes.charge`,
        at the drafted round's R): a probe costs its round and the switch back, and so do the gate's own
        timing pairs while drafting, one in `max_interval` drafted rounds. Its R's count of drafted rounds
        since a timed plain round stays, so while drafting pays the next round is plain again, and timed."""
        if seconds <= 0:
            return
        n, t, s, c = self.totals.get((R, drafted), (0, 0, 0.0, 0.0))
        self.totals[(R, drafted)] = (n + 1, t + tokens, s + seconds, c + catch_up_s)
        if after_drafted and not drafted:  # the switch back, charged once to the drafted round before it
            plain, drafted_R, self.last_drafted = self.enough(R, False), self.last_drafted, None
            if plain is None or drafted_R is None:
                return
            self.rounds_timed[(drafted_R, True)].charge(seconds - plain.s)
            R = drafted_R  # its verdict below
        else:
            charged = seconds + self.prompt_s_per_token() * tokens if drafted else seconds
            self.rounds_timed.setdefault((R, drafted), RoundTimes(1 / self.window)).add(tokens, charged)
            if not drafted:
                self.model_gains.pop(R, None)  # o(R) moved
            self.since_plain[R] = self.since_plain.get(R, 0) + 1 if drafted else 0
            if drafted:
                self.last_drafted = R
        if R > 1 and (verdict := self.measured(R)) is not None:  # R = 1: one request's acceptance decides
            self.verdicts[R] = verdict
            self.gains[R] = self.speed(R, True)[0] / self.speed(R, False)[0]

    def speed(self, R: int, drafted: bool) -> tuple[float, int]:
        """Measured tokens/s of drafted (or plain) rounds at R, and how many rounds were timed."""
        times = self.rounds_timed.get((R, drafted))
        return (times.rate, times.n) if times else (0.0, 0)

    def state(self) -> dict:
        """What the gate decides from (alpha, the prompt charge kappa, the measured tokens/s per R, the
        measured gains that other loads' verdicts are carried from, the server's mean's weight k) and, per R,
        what every round of each kind took over the run, the catch-up that timing leaves out included (for
        the engine's state)."""
        speeds: dict[str, dict] = {}
        for R, drafted in sorted(dict(self.rounds_timed)):  # a copy: the engine thread writes it
            speed, n = self.speed(R, drafted)
            speeds.setdefault(str(R), {})["drafted" if drafted else "plain"] = {"tokens_per_s": speed, "rounds": n}
        run: dict[str, dict] = {}
        for (R, drafted), (n, tokens, seconds, catch_up) in sorted(dict(self.totals).items()):
            run.setdefault(str(R), {})["drafted" if drafted else "plain"] = {
                "rounds": int(n),
                "tokens": int(tokens),
                "seconds": seconds,
                "catch_up_s": catch_up,
            }
        return {
            "alpha": self.alpha.round(4).tolist(),
            "prompt_s_per_token": self.prompt_s_per_token(),
            "speed": speeds,
            "gains": {str(R): g for R, g in sorted(dict(self.gains).items())},
            "prior_rounds": None if math.isinf(k := self.prior_rounds()) else k,  # None: inf
            "run": run,
        }


POLICIES = ("none", "static", "threshold", "greedy", "async")
ADAPTIVE = ("threshold", "greedy", "async")  # the policies that read the confidences

# policy(survival: (R, gamma) calibrated prefix survival or None, R, gamma) -> lengths l_r (R,);
# the adaptive ones count the round's drafting time t_d(R) from the table as paid
Policy = Callable[[Optional[np.ndarray], int, int], list[int]]


class AsyncGlobal:
    """The async variant with its state: the survival matrices of the previous rounds.

    Until two earlier rounds exist (a fresh engine) there is no stale capacity to use, and a global
    search over the CURRENT confidences is exactly the retrospective search that Appendix A shows to
    be biased; those rounds run Algorithm 1 with its early stop instead."""

    def __init__(self, sps: SPSTable):
        self.sps = sps
        self.history: deque = deque(maxlen=2)  # survival of the two previous rounds, oldest first

    def __call__(self, a: np.ndarray, draft_s: float = 0.0) -> np.ndarray:
        if len(self.history) < 2:
            lengths = greedy_prefix(a, self.sps, draft_s=draft_s)
        else:
            lengths = async_global(a, self.history[0], self.sps, draft_s)
        self.history.append(a)
        return lengths


def make_policy(name: str, sps: SPSTable, static_len: int = 4, threshold: float = 0.5) -> Policy:
    """The decoder's per-round policy. Drafters without a confidence head (DFlash, EAGLE-3) get the
    static length under every confidence-based policy."""
    if name not in POLICIES:
        raise ValueError(f"policy: {name!r} not in {POLICIES}")
    stateful = AsyncGlobal(sps) if name == "async" else None

    def policy(surv, R, gamma):
        if name == "none":
            return [0] * R
        if name == "static" or surv is None:
            return [min(static_len, gamma)] * R
        a = np.asarray(surv, dtype=np.float64)
        if name == "threshold":
            return static_threshold(a, threshold).tolist()
        if name == "greedy":
            return greedy_prefix(a, sps, draft_s=sps.draft_time(R)).tolist()
        return stateful(a, sps.draft_time(R)).tolist()

    return policy
