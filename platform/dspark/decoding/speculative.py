"""Speculative decoding over a batch of requests (continuous batching: requests join and leave
between rounds).

One round, for every active request r with anchor x_0 (the last committed token):
    1. draft:    the drafter proposes x_1..x_gamma (+ confidences)           one drafter call
    2. schedule: the policy picks l_r in 0..gamma from the confidences       pure function
    3. verify:   ONE target forward over all [x_0, x_1..x_l_r], flattened     one target call
    4. accept:   rejection sampling -> n_r accepted + 1 emitted token         exact target law
    5. commit:   KV rollback to the accepted prefix; the drafter's context grows by n_r + 1 (handed to
                 it before it next drafts: rounds that skip drafting cost one target step and no more)
Without a drafter (or gamma = 0) the same loop is plain target decoding, one token per round.

l_r is further capped by quantities that never depend on this round's drafts (lossless): the
request's room in the context, and the first draft position whose q is not a
finite distribution (a drafter that produced NaN: the drafts before it are still exact proposals,
and admitting x_k never looks past q_k). A drafter that raises is skipped for a growing number of
rounds (1, 2, 4, .. 64), then tried again; the round itself is plain target sampling. A gate
(scheduling.policies.DraftGate) may skip drafting in a round, decided from earlier rounds only (their
acceptance and what they took, `DraftGate.timed`): that round is plain target sampling too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from dspark.calibration import sts
from dspark.calibration.sts import Calibration
from dspark.decoding.runner import TargetRunner
from dspark.decoding.sampling import BatchSampler, SamplingParams, batch_probs, race_winner
from dspark.decoding.verify import verify_choices, verify_sampled
from dspark.errors import UserError
from dspark.models.drafter import DraftCache, Drafter, DraftState
from dspark.scheduling.policies import DraftGate, Policy

MAX_DRAFTER_BACKOFF = 64  # rounds without drafting after repeated drafter errors


def full_length(survival: Optional[torch.Tensor], n_requests: int, gamma: int) -> list[int]:
    """Verify every draft token (the offline-evaluation protocol)."""
    return [gamma] * n_requests


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """(log p(tokens[i]), its k most likely (id, log p)) at row i of the target's logits (>= len(tokens), V).
    The raw distribution, log_softmax(logits), before temperature and top-p/top-k (what vLLM reports by
    default): it does not depend on how the request samples."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), -1)  # (n, V)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if not k:
        return [(c, []) for c in chosen]
    values, ids = lp.topk(k, -1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


@dataclass
class RoundRecord:
    verified: int  # l
    accepted: int  # n (drafts only; the emitted token makes tau = n + 1)
    conf_logit: Optional[list[float]] = None  # raw confidence-head logits of this round's drafts
    survival: Optional[list[float]] = None  # the calibrated prefix survival the scheduler used
    drafted: bool = False  # the drafter ran this round (False: skipped, e.g. after idle rounds)


@dataclass
class Request:
    prompt: list[int]
    sp: SamplingParams = SamplingParams()
    max_new_tokens: int = 64
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    # True: Gumbel-max sampling keyed by (seed, output position), so the output is a function of the
    # prompt and the seed alone (see sampling.py). False: standard rejection sampling (the most
    # accepted drafts) with a generator seeded by `seed`.
    reproducible: bool = False
    # -1: off; k >= 0: record each output token's log-probability under the target and its k most likely tokens
    logprobs: int = -1
    out: list[int] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)  # per output token with logprobs on: see token_logprobs
    rounds: list[RoundRecord] = field(default_factory=list)
    drafted_rounds: int = 0  # rounds drafted for it, and the drafts accepted in them (what the gate reads)
    drafts_accepted: int = 0
    plain_since_drafted: int = 0  # positions of plain rounds the drafter has not read (reset by clear_pending)
    done: bool = False
    prefill_s: float = 0.0
    draft_s: float = 0.0  # decode phase only (prefill excluded)
    verify_s: float = 0.0
    # runtime
    slot: int = -1
    state: Optional[DraftState] = None
    pending: list = field(default_factory=list)  # (target features, next tokens) the drafter has not seen yet
    behind: int = 0  # positions in `pending`
    gen: Optional[torch.Generator] = None

    def defer(self, feats: torch.Tensor, tokens: list[int]) -> None:
        """Committed positions (features (n, m, d), next tokens n ids) for the drafter to read when it next
        drafts; the ids stay a Python list until then (a round that does not draft builds no tensor)."""
        self.pending.append((feats, tokens))
        self.behind += len(tokens)

    def pending_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every deferred position at once: features (behind, m, d) and next tokens (behind,)."""
        feats = torch.cat([f for f, _ in self.pending])
        return feats, torch.tensor([t for _, ids in self.pending for t in ids], device=feats.device)

    def clear_pending(self) -> None:
        self.pending.clear()
        self.behind = 0
        self.plain_since_drafted = 0

    @property
    def tau(self) -> float:
        """Mean tokens per round, the emitted (bonus/correction) token included."""
        return sum(r.accepted + 1 for r in self.rounds) / max(1, len(self.rounds))


class SpeculativeDecoder:
    def __init__(
        self,
        target_model,
        drafter: Drafter | None = None,
        gamma: int = 7,
        policy: Policy = full_length,
        max_slots: int = 16,
        calibration: Optional[Calibration] = None,
        capacity: int = 512,
        gate: Optional[DraftGate] = None,
        max_len: int = 0,
    ):
        self.drafter, self.gamma, self.policy = drafter, gamma if drafter is not None else 0, policy
        taps = drafter.c.tap_layers if drafter is not None else []
        # max_len: tokens (prompt + output) per request; bounds every KV slot (0 = the target's limit)
        self.runner = TargetRunner(target_model, taps, max_slots=max_slots, capacity=capacity, max_len=max_len)
        self.max_len = self.runner.max_len
        self.draft_cache = DraftCache(max_slots)  # the drafter's context, request r in its target slot's rows
        self.calibration = calibration  # STS of the confidence logits (None = raw)
        self.active: list[Request] = []
        self.drafter_error: str | None = None  # the drafter's latest error (decoding fell back to the target)
        self.drafter_failures, self.backoff_left = 0, 0  # consecutive drafter errors; rounds left to skip
        self.last_survival: Optional[torch.Tensor] = None  # (R, gamma) of the latest round, for observers
        self.gate = gate  # None: draft every round
        # the latest round drafted (the gate does not time a plain round after one; the engine counts plain rounds)
        self.drafted_last = False
        # the gate's clock: where a round's work runs on this thread alone (torch on the CPU, one thread), the
        # CPU time it spent, which leaves out other threads' turns (a server's event loop holding the GIL while
        # requests end and start) and other processes': fixed costs that would weigh more on short rounds
        one_thread = self.runner.device.type == "cpu" and torch.get_num_threads() == 1
        self.clock = time.thread_time if one_thread else time.perf_counter

    # -- requests
    def add(self, req: Request) -> None:
        self.add_many([req])

    def add_many(self, reqs: list[Request]) -> None:
        """Prefill in one target forward: the target reads the prompts and emits each request's first
        token (its first anchor). The drafter reads the prompt when it first drafts for the request."""
        for req in reqs:
            if not req.prompt:
                raise UserError("prompt: at least one token is needed")
            if len(req.prompt) + req.max_new_tokens > self.max_len:
                raise UserError(
                    f"prompt of {len(req.prompt)} tokens + max_tokens {req.max_new_tokens} exceeds the "
                    f"context limit of {self.max_len} tokens"
                )
        self.drafted_last = False  # the prefill's target forward comes between: no switch back to time
        t0 = time.perf_counter()
        try:  # whatever fails (a full cache, NaN logits), no slot leaks
            for req in reqs:
                req.gen = torch.Generator().manual_seed(req.seed)
                req.slot = self.runner.alloc()
            out = self.runner.forward([r.slot for r in reqs], [torch.tensor(r.prompt) for r in reqs], last_only=True)
            no_drafts = torch.zeros(len(reqs), 0, dtype=torch.long)  # the first token: a round verifying nothing
            _, firsts = self._verify(reqs, no_drafts, [0] * len(reqs), None, out.logits)  # (1, V) each
            if self.drafter is not None:
                for req, f, t in zip(reqs, firsts, out.taps):
                    req.state = self.draft_cache.state(req.slot)
                    req.defer(t, req.prompt[1:] + [f])
            lps = [
                token_logprobs(x, [f], r.logprobs) if r.logprobs >= 0 else None
                for r, f, x in zip(reqs, firsts, out.logits)
            ]
        except BaseException:  # after this block only bookkeeping: a failed prefill took nothing (a retry may follow)
            for req in reqs:
                self._release(req)
            raise
        dt = (time.perf_counter() - t0) / len(reqs)
        for req, first, lp in zip(reqs, firsts, lps):
            req.prefill_s += dt
            self._commit(req, [first], lp)
            if not req.done:
                self.active.append(req)
        # in slot order: the runner's forward reads a sorted batch's KV slots in place (see runner.forward)
        self.active.sort(key=lambda r: r.slot)

    def cancel(self, req: Request) -> None:
        """Drop a request between rounds (client gone): its KV slot is freed at once."""
        if req in self.active:
            self.active.remove(req)
            req.done = True
            self._release(req)

    def _commit(self, req: Request, tokens: list[int], logprobs: Optional[list] = None) -> None:
        """Append tokens (with their logprobs entries when the request records them) until a stop."""
        for i, t in enumerate(tokens):
            req.out.append(t)
            if logprobs is not None:
                req.token_logprobs.append(logprobs[i])
            if t in req.stop_ids or len(req.out) >= req.max_new_tokens:
                req.done = True
                break
        if req.done:
            self._release(req)

    def _release(self, req: Request) -> None:
        """Free the request's KV slot and drafter state; idempotent (a slot is never freed twice)."""
        if req.slot >= 0:
            self.runner.free(req.slot)
            req.slot = -1
        if self.drafter is not None and req.state is not None:
            self.drafter.release(req.state)
            req.state = None
        req.clear_pending()

    def _caps(self, reqs: list[Request]) -> list[int]:
        """The most drafts each request can verify this round, from a quantity fixed before drafting:
        its room in the context (the anchor and l drafts are appended to its KV slot)."""
        return [max(0, min(self.gamma, self.max_len - self.runner.lengths[r.slot] - 1)) for r in reqs]

    def _sync(self) -> None:
        """Wait for the device's queued work, so that a clock read after it times it (CUDA is asynchronous)."""
        if str(self.runner.device).startswith("cuda"):
            torch.cuda.synchronize(self.runner.device)

    @staticmethod
    def _behind(reqs: list[Request]) -> int:
        """Context positions the drafter has not read yet, over all requests (fixed before drafting)."""
        return sum(r.behind for r in reqs)

    def _catch_up(self, reqs: list[Request]) -> bool:
        """Hand the drafter every position committed since it last saw each request, in one call (its
        prompt, or several skipped rounds). False: the drafter failed and is dropped."""
        behind = [r for r in reqs if r.pending]
        if not behind:
            return True
        try:
            feats, tokens = zip(*(r.pending_context() for r in behind))
            self.drafter.extend([r.state for r in behind], list(feats), list(tokens))
        except Exception as e:  # its caches are now inconsistent: plain target decoding from here on
            self.drafter_error = f"{type(e).__name__}: {e}"
            self.drafter, self.gamma = None, 0
            return False
        for r in behind:
            r.clear_pending()
        return True

    def _propose(self, reqs: list[Request], anchors: torch.Tensor):
        """The drafter's proposal, or None when it is backing off after errors or raises now."""
        if self.backoff_left > 0:
            self.backoff_left -= 1
            return None
        keys = [(r.seed, len(r.out)) if r.reproducible else None for r in reqs]
        sampler = BatchSampler([r.sp for r in reqs], [r.gen for r in reqs], keys)
        try:
            prop = self.drafter.propose([r.state for r in reqs], anchors.to(self.runner.device), self.gamma, sampler)
        except Exception as e:  # never wrong output: this round is plain target decoding
            self.drafter_error = f"{type(e).__name__}: {e}"
            self.drafter_failures += 1
            self.backoff_left = min(MAX_DRAFTER_BACKOFF, 2 ** (self.drafter_failures - 1))
            return None
        self.drafter_failures = 0
        return prop

    # -- one round
    def step(self) -> None:
        reqs = self.active
        if not reqs:
            return
        start = self.clock()
        anchors = torch.tensor([r.out[-1] for r in reqs])
        drafts = probs_q = survival = conf_logits = prop = None
        lengths = [0] * len(reqs)
        probe_s = 0.0  # the catch-up beyond one drafted round's positions: a probe's price (probe_gap)
        own = [(r.drafted_rounds, r.drafts_accepted) for r in reqs] if self.gate is not None else None
        if self.gamma and (
            self.gate is None or self.gate(len(reqs), self._behind(reqs), own, sum(r.plain_since_drafted for r in reqs))
        ):
            t0, c0 = time.perf_counter(), self.clock()
            # steady drafting reads the previous drafted round's tokens; the rest is earlier plain rounds' and prompts'
            extra = sum(r.behind for r in reqs if not (r.rounds and r.rounds[-1].drafted))
            behind = sum(r.behind for r in reqs)
            caught_up = self._catch_up(reqs)
            if self.gate is not None and extra:  # only the gate reads round times
                self._sync()
                probe_s = (self.clock() - c0) * extra / behind
            if caught_up:
                prop = self._propose(reqs, anchors)
        if prop is not None:
            drafts, probs_q = prop.tokens.cpu(), prop.probs
            if prop.conf_logit is not None:
                conf_logits = prop.conf_logit.float().cpu()  # (R, gamma)
                cal = self.calibration or Calibration.identity(self.gamma)
                a = sts.survival(conf_logits.numpy(), cal)  # a_{r,k} = prod_{i<=k} σ(logit_{r,i} / T_i + b_i)
                survival = torch.from_numpy(a).nan_to_num_(0.0)  # a NaN confidence admits nothing
            # the first position whose q is not a finite distribution bounds l (0 when q_1 already is)
            finite = (
                torch.isfinite(probs_q).all(-1).cpu()
                if probs_q is not None
                else torch.ones(drafts.shape, dtype=torch.bool)
            )
            valid = finite.int().cumprod(-1).sum(-1).tolist()
            chosen = self.policy(None if survival is None else survival.numpy(), len(reqs), self.gamma)
            lengths = [max(0, min(int(x), v, c)) for x, v, c in zip(chosen, valid, self._caps(reqs))]
            self.last_survival = survival
            dt = (time.perf_counter() - t0) / len(reqs)
            for r in reqs:
                r.draft_s += dt
        t0 = time.perf_counter()
        tokens = anchors[:, None] if drafts is None else torch.cat([anchors[:, None], drafts], 1)  # (R, 1 + gamma)
        starts = [self.runner.lengths[r.slot] for r in reqs]
        out = self.runner.forward([r.slot for r in reqs], [tokens[i, : 1 + l] for i, l in enumerate(lengths)])
        n_acc, emitted = self._verify(
            reqs, tokens[:, 1:], lengths, probs_q, out.logits, None if prop is None else prop.vocab
        )
        if prop is not None and self.gate is not None:
            self.gate.observe(lengths, n_acc)
        dt = (time.perf_counter() - t0) / len(reqs)
        # per-request Python lists, converted once for the batch
        draft_ids = tokens[:, 1:].tolist()
        conf_rows = [None] * len(reqs) if conf_logits is None else conf_logits.tolist()
        surv_rows = [None] * len(reqs) if survival is None else survival.tolist()
        committed = []
        for i, (r, n) in enumerate(zip(reqs, n_acc)):
            r.verify_s += dt
            r.rounds.append(RoundRecord(lengths[i], n, conf_rows[i], surv_rows[i], prop is not None))
            if prop is not None:
                r.drafted_rounds, r.drafts_accepted = r.drafted_rounds + 1, r.drafts_accepted + n
            else:  # one more position the drafter reads when it next drafts (a catch-up resets it)
                r.plain_since_drafted += 1
            self.runner.truncate(r.slot, starts[i] + 1 + n)  # keep x_0 and the accepted drafts
            new = draft_ids[i][:n] + [emitted[i]]  # made by the target's rows 0..n of this request
            lp = token_logprobs(out.logits[i], new, r.logprobs) if r.logprobs >= 0 else None
            committed.append((r, out.taps[i][: 1 + n], new, lp))
        if self.drafter is not None:  # the drafter's context grows by x_0 and the accepted drafts
            for r, t, new, _ in committed:
                r.defer(t, new)
        for r, _, new, lp in committed:
            self._commit(r, new, lp)
            if r.done and self.gate is not None:  # what a request's prompt costs drafting per output token
                self.gate.finished(len(r.prompt), len(r.out), [x.accepted for x in r.rounds if x.drafted])
        self.active = [r for r in reqs if not r.done]
        if self.gate is not None and self.gamma:
            seconds = self.clock() - start - probe_s
            self.gate.timed(len(reqs), prop is not None, sum(n_acc) + len(reqs), seconds, probe_s, self.drafted_last)
        self.drafted_last = prop is not None

    def _verify(
        self,
        reqs: list[Request],
        drafts: torch.Tensor,
        lengths: list[int],
        q: Optional[torch.Tensor],
        logits: list[torch.Tensor],
        q_ids: Optional[torch.Tensor] = None,
    ) -> tuple[list[int], list[int]]:
        """Request r verifies drafts[r, :lengths[r]] of drafts (R, G) (G = 0: plain target sampling), drawn
        from q (R, G, V_d) over the target ids q_ids (None: all V), against the target's logits
        (l_r + 1, V) of one forward; all requests at once. Returns each request's accepted drafts n and
        emitted token."""
        n_rows = [len(x) for x in logits]
        l, rows_per_request = torch.tensor(lengths, dtype=torch.long), torch.tensor(n_rows)
        first = rows_per_request.cumsum(0) - rows_per_request  # request r's rows of p: first[r] .. first[r] + l_r
        z = torch.cat(logits).float()  # (T, V)
        if all(r.sp.greedy for r in reqs):  # p one-hot at the argmax: x_k accepted iff it is p_k's argmax
            top = z.max(-1)  # each row's max and its first index: argmax's choice (sampling.argmax)
            if top.values.isnan().any():  # (a NaN would be the argmax)
                raise FloatingPointError("the target's distribution is not finite (NaN logits)")
            n, y = verify_choices(drafts, l, top.indices, first)  # no q, p or uniforms needed
            return n.tolist(), y.tolist()
        p = batch_probs(z, [r.sp for r, k in zip(reqs, n_rows) for _ in range(k)])  # (T, V)
        if not p.sum(-1).isfinite().all():  # entries in [0, 1] or NaN: any NaN or inf makes its row sum non-finite
            raise FloatingPointError("the target's distribution is not finite (NaN/inf logits)")
        seeded = [i for i, r in enumerate(reqs) if r.reproducible and not r.sp.greedy]
        if len(seeded) == len(reqs):  # every request's token is its race's winner: no rejection sampling
            keys = [(r.seed, len(r.out) + k) for r, m in zip(reqs, n_rows) for k in range(m)]  # row by row
            n, y = verify_choices(drafts, l, race_winner(p, keys), first)
            return n.tolist(), y.tolist()
        # rejection sampling with each request's own generator (greedy requests too: their p is one-hot)
        u = torch.stack([torch.rand(drafts.shape[1], generator=r.gen, dtype=torch.float64) for r in reqs])
        v = torch.stack([torch.rand((), generator=r.gen, dtype=torch.float64) for r in reqs])
        n, y = verify_sampled(drafts, l, q, p, first, u, v, q_ids)
        if seeded:  # the greedy rule on the perturbed scores, noise keyed by (seed, output position) (sampling.py)
            rows = torch.cat([torch.arange(first[i], first[i] + lengths[i] + 1) for i in seeded])
            keys = [(reqs[i].seed, len(reqs[i].out) + k) for i in seeded for k in range(lengths[i] + 1)]  # as `rows`
            choice = torch.zeros(len(p), dtype=torch.long)
            choice[rows] = race_winner(p[rows], keys)
            idx = torch.tensor(seeded)
            n[idx], y[idx] = verify_choices(drafts[idx], l[idx], choice, first[idx])
        return n.tolist(), y.tolist()

    def run(self, requests: list[Request], progress: Optional[Callable[[int], object]] = None) -> list[Request]:
        """Decode all requests, at most `max_slots` at a time; new ones join as others finish.
        `progress(n)` is called as n more requests finish."""
        queue, finished = list(requests), 0
        while queue or self.active:
            n = min(len(queue), len(self.runner.free_slots))
            if n:
                self.add_many(queue[:n])
                queue = queue[n:]
            self.step()
            if progress is not None and (done := sum(r.done for r in requests)) > finished:
                progress(done - finished)
                finished = done
        return requests
