"""Online calibration from live acceptance outcomes (the serving calibration actor's logic).

- Unbiased observations only: position k of a round counts only if the round verified >= k drafts
  (a truncated prefix says nothing about the positions it did not verify).
- Exponentially decayed weights (half-life in rounds), so the fit follows traffic as it drifts.
- STS refit (temperatures, and offsets unless `bias=False`) every `refit_every` new rounds once
  `min_rounds` are held; each temperature may move by at most a factor `max_change` and each offset
  by at most `max_bias_change` logits per refit (clamped: one noisy window cannot swing it).
- Live calibration error: over the last `window` rounds, the mean over positions of
  |mean predicted survival (with the calibration in force then) - observed survival|.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from dspark.calibration import sts


class Round(Protocol):
    """One decoding round as the engine records it (dspark.decoding.speculative.RoundRecord)."""

    verified: int  # l: drafts verified
    accepted: int  # n: drafts accepted
    conf_logit: list[float]  # the confidence head's raw logits per draft position
    survival: list[float]  # the calibrated prefix survival the scheduler used


class OnlineCalibrator:
    def __init__(
        self,
        gamma: int,
        cal: sts.Calibration | None = None,
        half_life: float = 2000.0,
        min_rounds: int = 200,
        refit_every: int = 100,
        max_change: float = 2.0,
        max_bias_change: float = 0.5,
        bias: bool = True,
        max_rounds: int = 20000,
        window: int = 300,
    ):
        self.gamma = gamma
        start = (cal or sts.Calibration.identity(gamma)).check(gamma)
        self.cal = sts.Calibration(list(start.temps), list(start.biases))
        self.half_life, self.min_rounds, self.refit_every = half_life, min_rounds, refit_every
        self.max_change, self.max_bias_change, self.bias, self.max_rounds = (
            max_change,
            max_bias_change,
            bias,
            max_rounds,
        )
        self.logits = np.zeros((0, gamma))
        self.verified = np.zeros(0, dtype=np.int64)
        self.accepted = np.zeros(0, dtype=np.int64)
        self.weights = np.zeros(0)
        self.since_refit = 0
        self.version = 0
        self.total = 0
        self.recent = deque(maxlen=window)  # (predicted survival with the temps in force, verified, accepted)

    def add(self, rounds: list[Round]) -> bool:
        """Rounds with confidence logits (drafted rounds). Returns True when the calibration was refitted."""
        if not rounds:
            return False
        n = len(rounds)
        self.weights = self.weights * 0.5 ** (n / self.half_life)
        self.logits = np.vstack([self.logits, np.array([r.conf_logit[: self.gamma] for r in rounds], float)])
        self.verified = np.concatenate([self.verified, [r.verified for r in rounds]])
        self.accepted = np.concatenate([self.accepted, [r.accepted for r in rounds]])
        self.weights = np.concatenate([self.weights, np.ones(n)])
        keep = self.weights > 1e-3
        keep[: max(0, len(keep) - self.max_rounds)] = False
        self.logits, self.verified, self.accepted, self.weights = (
            self.logits[keep],
            self.verified[keep],
            self.accepted[keep],
            self.weights[keep],
        )
        for r in rounds:
            self.recent.append((list(r.survival[: self.gamma]), r.verified, r.accepted))
        self.total += n
        self.since_refit += n
        if self.since_refit >= self.refit_every and len(self.weights) >= self.min_rounds:
            self.refit()
            return True
        return False

    def observations(self) -> sts.Observations:
        return sts.Observations(self.logits, self.verified, self.accepted, self.weights)

    def refit(self) -> sts.Calibration:
        fitted, old = sts.fit(self.observations(), bias=self.bias), self.cal
        self.cal = sts.Calibration(
            [float(np.clip(f, t / self.max_change, t * self.max_change)) for f, t in zip(fitted.temps, old.temps)],
            [
                float(np.clip(f, b - self.max_bias_change, b + self.max_bias_change))
                for f, b in zip(fitted.biases, old.biases)
            ],
        )
        self.since_refit = 0
        self.version += 1
        return self.cal

    def live_error(self) -> float:
        """Mean over positions of |mean predicted survival - observed survival| on the recent window."""
        if not self.recent:
            return float("nan")
        pred = np.array([r[0] for r in self.recent], float)
        ell = np.array([r[1] for r in self.recent])
        n = np.array([r[2] for r in self.recent])
        gaps = []
        for k in range(1, pred.shape[1] + 1):
            sel = ell >= k
            if sel.sum() >= 10:
                gaps.append(abs(pred[sel, k - 1].mean() - (n[sel] >= k).mean()))
        return float(np.mean(gaps)) if gaps else float("nan")

    def stats(self) -> dict:
        """JSON-safe summary (NaN, e.g. a position never verified, becomes None)."""
        rep = sts.report(self.observations(), self.cal) if len(self.weights) else []
        return _finite(
            {
                "rounds_total": self.total,
                "rounds_held": int(len(self.weights)),
                "effective_rounds": float(self.weights.sum()),
                **self.cal.to_dict(),
                "version": self.version,
                "live_error": self.live_error(),
                "positions": [{k: r[k] for k in ("k", "n", "ece", "predicted", "observed")} for r in rep],
            }
        )


def _finite(x):
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x
