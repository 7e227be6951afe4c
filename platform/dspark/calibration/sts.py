"""Sequential Temperature Scaling (paper §3.2.1).

The confidence head predicts conditional acceptance c_k; the scheduler needs calibrated prefix
survival a_k = prod_{i<=k} c_i. On held-out rounds, for k = 1..gamma in order, pick T_k from a grid
minimising the ECE of  a_{k-1}(calibrated, fixed) * σ(logit_k / T_k)  against "the first k drafts
were all accepted", using only rounds that verified at least k drafts (truncation would bias it).
Scaling is monotone per position, so ranking quality (AUROC of c_k) is unchanged."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.calibration.metrics import auroc, brier, ece, ece_floor

GRID = np.geomspace(0.25, 4.0, 49)


@dataclass
class Observations:
    logits: np.ndarray  # (n, gamma) raw confidence logits of each round's drafts
    verified: np.ndarray  # (n,) l: drafts the round verified
    accepted: np.ndarray  # (n,) drafts accepted
    weights: np.ndarray | None = None  # (n,) optional (decayed) weights

    @classmethod
    def from_rounds(cls, rounds) -> "Observations":
        rounds = [r for r in rounds if r.conf_logit is not None]
        return cls(np.array([r.conf_logit for r in rounds], float).reshape(len(rounds), -1),
                   np.array([r.verified for r in rounds]), np.array([r.accepted for r in rounds]))

    def at(self, k: int):
        """Rounds that verified position k (1-based) and whether positions 1..k were all accepted."""
        sel = self.verified >= k
        w = None if self.weights is None else self.weights[sel]
        return sel, (self.accepted[sel] >= k).astype(float), w


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def survival(logits: np.ndarray, temps) -> np.ndarray:
    """(n, gamma) logits -> calibrated prefix survival with per-position temperatures."""
    t = np.asarray(temps, float)[: logits.shape[1]]
    return np.cumprod(_sigmoid(logits / t), axis=1)


def fit(obs: Observations, grid: np.ndarray = GRID, bins: int = 20) -> list[float]:
    gamma = obs.logits.shape[1]
    temps = [1.0] * gamma
    prev = np.ones(len(obs.logits))
    for k in range(1, gamma + 1):
        sel, y, w = obs.at(k)
        if sel.sum() == 0:
            break
        errs = [ece(prev[sel] * _sigmoid(obs.logits[sel, k - 1] / t), y, bins, w) for t in grid]
        temps[k - 1] = float(grid[int(np.nanargmin(errs))])
        prev = prev * _sigmoid(obs.logits[:, k - 1] / temps[k - 1])
    return temps


def report(obs: Observations, temps, bins: int = 20, floor: bool = False) -> list[dict]:
    """Per position k: ECE, AUROC, Brier of a_k and the number of rounds it is measured on; with
    floor, also the ECE a perfectly calibrated predictor would show on those rounds (simulated)."""
    a = survival(obs.logits, temps)
    out = []
    for k in range(1, obs.logits.shape[1] + 1):
        sel, y, w = obs.at(k)
        out.append({"k": k, "n": int(sel.sum()), "ece": ece(a[sel, k - 1], y, bins, w),
                    "ece_floor": ece_floor(a[sel, k - 1], bins) if floor else None,
                    "auroc": auroc(a[sel, k - 1], y), "brier": brier(a[sel, k - 1], y),
                    "predicted": float(a[sel, k - 1].mean()) if sel.any() else float("nan"),
                    "observed": float(y.mean()) if sel.any() else float("nan")})
    return out


def save(path: str | Path, temps, extra: dict | None = None) -> None:
    Path(path).write_text(json.dumps({"temperatures": list(temps), **(extra or {})}, indent=2) + "\n")


def load(path: str | Path) -> list[float] | None:
    p = Path(path)
    return json.loads(p.read_text())["temperatures"] if p.is_file() else None
