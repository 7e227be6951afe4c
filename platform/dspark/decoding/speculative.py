"""Speculative decoding over a batch of requests (continuous batching: requests join and leave
between rounds).

One round, for every active request r with anchor x_0 (the last committed token):
    1. draft:    the drafter proposes x_1..x_gamma (+ confidences)           one drafter call
    2. schedule: the policy picks l_r in 0..gamma from the confidences       pure function
    3. verify:   ONE target forward over all [x_0, x_1..x_l_r], flattened     one target call
    4. accept:   rejection sampling -> n_r accepted + 1 emitted token         exact target law
    5. commit:   KV rollback to the accepted prefix; the drafter's context grows by n_r + 1
Without a drafter (or gamma = 0) the same loop is plain target decoding, one token per round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from dspark.calibration.sts import Calibration
from dspark.decoding.runner import TargetRunner
from dspark.decoding.sampling import BatchSampler, SamplingParams, draw, probs
from dspark.decoding.verify import verify_greedy, verify_one
from dspark.models.drafter import Drafter, DraftState

# policy(survival: (R, gamma) calibrated prefix-survival estimates or None, R, gamma) -> lengths (R,)
Policy = Callable[[Optional[torch.Tensor], int, int], list[int]]


def full_length(survival: Optional[torch.Tensor], n_requests: int, gamma: int) -> list[int]:
    """Verify every draft token (the offline-evaluation protocol)."""
    return [gamma] * n_requests


@dataclass
class RoundRecord:
    verified: int  # l
    accepted: int  # n (drafts only; the emitted token makes tau = n + 1)
    conf_logit: Optional[list[float]] = None  # raw confidence-head logits of this round's drafts
    survival: Optional[list[float]] = None  # the calibrated prefix survival the scheduler used


@dataclass
class Request:
    prompt: list[int]
    sp: SamplingParams = SamplingParams()
    max_new_tokens: int = 64
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    out: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    done: bool = False
    prefill_s: float = 0.0
    draft_s: float = 0.0  # decode phase only (prefill excluded)
    verify_s: float = 0.0
    # runtime
    slot: int = -1
    state: Optional[DraftState] = None
    gen: Optional[torch.Generator] = None

    @property
    def tau(self) -> float:
        """Mean tokens per round, the emitted (bonus/correction) token included."""
        return sum(r.accepted + 1 for r in self.rounds) / max(1, len(self.rounds))


class SpeculativeDecoder:
    def __init__(self, target_model, drafter: Drafter | None = None, gamma: int = 7, policy: Policy = full_length,
                 max_slots: int = 16, calibration: Optional[Calibration] = None, capacity: int = 512,
                 idle_probe: int = 0):
        self.drafter, self.gamma, self.policy = drafter, gamma if drafter is not None else 0, policy
        taps = drafter.c.tap_layers if drafter is not None else []
        self.runner = TargetRunner(target_model, taps, max_slots=max_slots, capacity=capacity)
        self.calibration = calibration  # STS of the confidence logits (None = raw)
        self.active: list[Request] = []
        self.drafter_error: str | None = None  # set when the drafter failed and decoding fell back to the target
        self.last_survival: Optional[torch.Tensor] = None  # (R, gamma) of the latest round, for observers
        # After a round in which the policy verified no draft at all (high load: a verified token costs
        # more throughput than it is expected to return), skip the drafter for `idle_probe` rounds, then
        # draft again to re-check. Lossless: the skip depends only on past rounds, never on the
        # current drafts, and a skipped round is plain target sampling.
        self.idle_probe, self.idle_left = idle_probe, 0

    # -- requests
    def add(self, req: Request) -> None:
        self.add_many([req])

    def add_many(self, reqs: list[Request]) -> None:
        """Prefill in one target forward: the target reads the prompts and emits each request's first
        token (its first anchor)."""
        for req in reqs:
            req.gen = torch.Generator().manual_seed(req.seed)
            req.slot = self.runner.alloc()
        t0 = time.perf_counter()
        try:
            out = self.runner.forward([r.slot for r in reqs], [torch.tensor(r.prompt) for r in reqs])
        except BaseException:
            for req in reqs:
                self.runner.free(req.slot)
            raise
        dt = (time.perf_counter() - t0) / len(reqs)
        firsts = [self._sample_target(out.logits[i][-1], req) for i, req in enumerate(reqs)]
        if self.drafter is not None:
            for req in reqs:
                req.state = DraftState()
            self.drafter.extend([r.state for r in reqs], out.taps,
                                [torch.tensor(r.prompt[1:] + [f], device=t.device) for r, f, t in zip(reqs, firsts, out.taps)])
        for req, first in zip(reqs, firsts):
            req.prefill_s += dt
            self._commit(req, [first])
            if not req.done:
                self.active.append(req)

    def cancel(self, req: Request) -> None:
        """Drop a request between rounds (client gone): its KV slot is freed at once."""
        if req in self.active:
            self.active.remove(req)
            req.done = True
            self._release(req)

    def _sample_target(self, logits: torch.Tensor, req: Request) -> int:
        if req.sp.greedy:
            return int(logits.argmax())
        return int(draw(probs(logits, req.sp).cpu()[None], req.gen)[0])

    def _commit(self, req: Request, tokens: list[int]) -> None:
        for t in tokens:
            req.out.append(t)
            if t in req.stop_ids or len(req.out) >= req.max_new_tokens:
                req.done = True
                break
        if req.done:
            self._release(req)

    def _release(self, req: Request) -> None:
        self.runner.free(req.slot)
        if self.drafter is not None and req.state is not None:
            self.drafter.release(req.state)

    # -- one round
    def step(self) -> None:
        reqs = self.active
        if not reqs:
            return
        anchors = torch.tensor([r.out[-1] for r in reqs])
        drafts = probs_q = None
        lengths = [0] * len(reqs)
        survival = conf_logits = None
        prop = None
        if self.gamma and self.idle_left > 0:
            self.idle_left -= 1
        elif self.gamma:
            t0 = time.perf_counter()
            sampler = BatchSampler([r.sp for r in reqs], [r.gen for r in reqs])
            try:
                prop = self.drafter.propose([r.state for r in reqs], anchors.to(self.runner.device), self.gamma, sampler)
            except Exception as e:  # never wrong output: continue as plain target decoding
                self.drafter_error = f"{type(e).__name__}: {e}"
                self.drafter, self.gamma = None, 0
        if prop is not None:
            drafts, probs_q = prop.tokens.cpu(), prop.probs
            if prop.conf_logit is not None:
                conf_logits = prop.conf_logit.float().cpu()
                logit = prop.conf_logit.float()
                if self.calibration is not None:  # c_k = σ(logit_k / T_k + b_k)
                    cal = self.calibration
                    logit = (logit / torch.tensor(cal.temps[: self.gamma], device=logit.device)
                             + torch.tensor(cal.biases[: self.gamma], device=logit.device))
                survival = torch.sigmoid(logit).cumprod(-1).cpu()  # a_{r,k} = prod_{i<=k} c_{r,i}
            lengths = [max(0, min(self.gamma, int(x))) for x in self.policy(survival, len(reqs), self.gamma)]
            self.last_survival = survival
            if sum(lengths) == 0:
                self.idle_left = self.idle_probe
            dt = (time.perf_counter() - t0) / len(reqs)
            for r in reqs:
                r.draft_s += dt
        t0 = time.perf_counter()
        seqs = [torch.cat([anchors[i:i + 1], drafts[i, :lengths[i]]]) if drafts is not None else anchors[i:i + 1]
                for i in range(len(reqs))]
        starts = [self.runner.lengths[r.slot] for r in reqs]
        out = self.runner.forward([r.slot for r in reqs], seqs)
        dt = (time.perf_counter() - t0) / len(reqs)
        committed = []
        for i, r in enumerate(reqs):
            r.verify_s += dt
            l = lengths[i]
            if l == 0:
                n, y = 0, self._sample_target(out.logits[i][0], r)
            elif r.sp.greedy:
                n, y = verify_greedy(drafts[i, :l], out.logits[i])
            else:
                n, y = verify_one(drafts[i, :l], probs_q[i, :l], out.logits[i], r.sp, r.gen)
            r.rounds.append(RoundRecord(l, n, None if conf_logits is None else conf_logits[i].tolist(),
                                        None if survival is None else survival[i].tolist()))
            self.runner.truncate(r.slot, starts[i] + 1 + n)  # keep x_0 and the accepted drafts
            new = (drafts[i, :n].tolist() if n else []) + [y]
            committed.append((r, out.taps[i][: 1 + n], new))
        if self.drafter is not None:  # the drafter's context grows by x_0 and the accepted drafts
            self.drafter.extend([r.state for r, _, _ in committed], [t for _, t, _ in committed],
                                [torch.tensor(new, device=t.device) for _, t, new in committed])
        for r, _, new in committed:
            self._commit(r, new)
        self.active = [r for r in reqs if not r.done]

    def run(self, requests: list[Request]) -> list[Request]:
        """Decode all requests, at most `max_slots` at a time; new ones join as others finish."""
        queue = list(requests)
        while queue or self.active:
            n = min(len(queue), len(self.runner.free_slots))
            if n:
                self.add_many(queue[:n])
                queue = queue[n:]
            self.step()
        return requests
