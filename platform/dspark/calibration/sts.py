"""Sequential Temperature Scaling (paper §3.2.1), with an optional per-position offset.

The confidence head predicts conditional acceptance c_k; the scheduler needs calibrated prefix
survival a_k = prod_{i<=k} c_i. On held-out rounds, for k = 1..gamma in order, pick T_k from a grid
minimising the ECE of  a_{k-1}(calibrated, fixed) * σ(logit_k / T_k + b_k)  against "the first k
drafts were all accepted", using only rounds that verified at least k drafts (truncation would bias
it). b_k = 0 is the paper's STS. With the offset, each candidate T_k gets the b_k that makes the mean
predicted a_k equal the observed survival rate: a temperature alone cannot move predictions that sit
on both sides of 1/2 in the same direction, so it cannot undo a level shift (a drafter whose
acceptance drops on traffic it was not trained for). Both maps are monotone per position, so
ranking quality (AUROC of c_k) is unchanged."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.calibration.metrics import auroc, brier, ece, ece_floor
from dspark.errors import UserError

GRID = np.geomspace(0.25, 4.0, 49)
MAX_BIAS = 8.0  # |b_k| in logits; bisection range of the offset


@dataclass
class Calibration:
    """c_k = σ(logit_k / temps[k] + biases[k]) per draft position."""

    temps: list[float]
    biases: list[float]

    @classmethod
    def identity(cls, gamma: int) -> "Calibration":
        return cls([1.0] * gamma, [0.0] * gamma)

    def check(self, gamma: int) -> "Calibration":
        """One map per draft position: a calibration of another length is refused when it is loaded or
        installed, never discovered mid-round."""
        if not len(self.temps) == len(self.biases) == gamma:
            raise UserError(
                f"calibration has {len(self.temps)} positions but gamma={gamma} drafts are served; "
                f"refit it for this gamma (or serve the drafter's trained gamma)"
            )
        return self

    def conditional(self, logits: np.ndarray) -> np.ndarray:
        """(n, g) raw confidence logits -> calibrated conditional confidences c_k."""
        g = logits.shape[1]
        return _sigmoid(logits / np.asarray(self.temps[:g], float) + np.asarray(self.biases[:g], float))

    def to_dict(self) -> dict:
        return {"temperatures": [float(t) for t in self.temps], "biases": [float(b) for b in self.biases]}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        temps = [float(t) for t in d["temperatures"]]
        return cls(temps, [float(b) for b in d.get("biases") or [0.0] * len(temps)])


@dataclass
class Observations:
    logits: np.ndarray  # (n, gamma) raw confidence logits of each round's drafts
    verified: np.ndarray  # (n,) l: drafts the round verified
    accepted: np.ndarray  # (n,) drafts accepted
    weights: np.ndarray | None = None  # (n,) optional (decayed) weights

    @classmethod
    def from_rounds(cls, rounds) -> "Observations":
        rounds = [r for r in rounds if r.conf_logit is not None]
        return cls(
            np.array([r.conf_logit for r in rounds], float).reshape(len(rounds), -1),
            np.array([r.verified for r in rounds]),
            np.array([r.accepted for r in rounds]),
        )

    @classmethod
    def concat(cls, parts: list["Observations"]) -> "Observations":
        return cls(
            np.concatenate([p.logits for p in parts]),
            np.concatenate([p.verified for p in parts]),
            np.concatenate([p.accepted for p in parts]),
        )

    def subset(self, rows: np.ndarray) -> "Observations":
        return Observations(
            self.logits[rows],
            self.verified[rows],
            self.accepted[rows],
            None if self.weights is None else self.weights[rows],
        )

    def at(self, k: int):
        """Rounds that verified position k (1-based) and whether positions 1..k were all accepted."""
        sel = self.verified >= k
        w = None if self.weights is None else self.weights[sel]
        return sel, (self.accepted[sel] >= k).astype(float), w


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def survival(logits: np.ndarray, cal: Calibration) -> np.ndarray:
    """(n, gamma) logits -> calibrated prefix survival a_k = prod_{i<=k} c_i."""
    return np.cumprod(cal.conditional(logits), axis=1)


def _matching_biases(prev: np.ndarray, logit: np.ndarray, y: np.ndarray, w, temps: np.ndarray) -> np.ndarray:
    """Per temperature t: the offset b with weighted mean of prev * σ(logit / t + b) = observed rate
    (monotone in b: bisection, every temperature's at once)."""
    w = np.ones_like(y) if w is None else w
    target = np.average(y, weights=w)
    e = np.exp(-logit[None, :] / temps[:, None])  # (T, n); σ(z + b) = 1 / (1 + e^-z e^-b): no exp in the loop
    pw = prev * w / w.sum()
    lo, hi = np.full(len(temps), -MAX_BIAS), np.full(len(temps), MAX_BIAS)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        below = (pw / (1 + e * np.exp(-mid)[:, None])).sum(1) < target
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def fit(
    obs: Observations, grid: np.ndarray = GRID, bins: int = 20, bias: bool = True, min_events: float = 10.0
) -> Calibration:
    """Left to right, one (T_k, b_k) per position with the earlier positions' calibration fixed.
    A position with fewer than `min_events` survivals or failures keeps the identity map: there is
    not enough evidence to move it (an offset fitted to zero survivals would run to -MAX_BIAS)."""
    gamma = obs.logits.shape[1]
    cal = Calibration.identity(gamma)
    prev = np.ones(len(obs.logits))
    for k in range(1, gamma + 1):
        sel, y, w = obs.at(k)
        ww = np.ones_like(y) if w is None else w
        if min((ww * y).sum(), (ww * (1 - y)).sum()) < min_events:
            prev = prev * _sigmoid(obs.logits[:, k - 1])
            continue
        p, lk = prev[sel], obs.logits[sel, k - 1]
        cands = list(zip(grid, _matching_biases(p, lk, y, w, grid) if bias else np.zeros(len(grid))))
        errs = [ece(p * _sigmoid(lk / t + b), y, bins, w) for t, b in cands]
        cal.temps[k - 1], cal.biases[k - 1] = (float(v) for v in cands[int(np.nanargmin(errs))])
        prev = prev * _sigmoid(obs.logits[:, k - 1] / cal.temps[k - 1] + cal.biases[k - 1])
    return cal


def report(obs: Observations, cal: Calibration, bins: int = 20, floor: bool = False) -> list[dict]:
    return report_survival(obs, survival(obs.logits, cal), bins, floor)


def report_survival(obs: Observations, a: np.ndarray, bins: int = 20, floor: bool = False) -> list[dict]:
    """Per position k: ECE, AUROC, Brier of the predicted survival a (n, gamma) and the number of
    rounds it is measured on; with floor, also the ECE a perfectly calibrated predictor would show
    on those rounds (simulated)."""
    out = []
    for k in range(1, obs.logits.shape[1] + 1):
        sel, y, w = obs.at(k)
        out.append(
            {
                "k": k,
                "n": int(sel.sum()),
                "ece": ece(a[sel, k - 1], y, bins, w),
                "ece_floor": ece_floor(a[sel, k - 1], bins) if floor else None,
                "auroc": auroc(a[sel, k - 1], y),
                "brier": brier(a[sel, k - 1], y),
                "predicted": float(a[sel, k - 1].mean()) if sel.any() else float("nan"),
                "observed": float(y.mean()) if sel.any() else float("nan"),
            }
        )
    return out


def cross_fitted(a: Observations, b: Observations, bias: bool) -> tuple[Observations, np.ndarray]:
    """Two-fold: fit on a, predict b; fit on b, predict a. Returns (b + a, predicted survival)."""
    pred = np.concatenate([survival(b.logits, fit(a, bias=bias)), survival(a.logits, fit(b, bias=bias))])
    return Observations.concat([b, a]), pred


FILE = "calibration.json"  # in the drafter's folder, next to its config and weights: served with it


def save(drafter_dir: str | Path, cal: Calibration, extra: dict | None = None) -> None:
    """Write `cal` (and `extra`, e.g. what it was fitted on) into the drafter's folder."""
    (Path(drafter_dir) / FILE).write_text(json.dumps({**cal.to_dict(), **(extra or {})}, indent=2) + "\n")


def load(drafter_dir: str | Path) -> Calibration | None:
    """The calibration in a drafter's folder (files without biases are plain STS); None when absent."""
    p = Path(drafter_dir) / FILE
    return Calibration.from_dict(json.loads(p.read_text())) if p.is_file() else None
