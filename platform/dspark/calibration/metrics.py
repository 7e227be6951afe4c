"""Confidence quality on the cumulative prefix survival a_k = prod_{i<=k} c_i: ECE (20 equal-width
bins), AUROC, Brier, and the reliability diagram's points."""

from __future__ import annotations

import numpy as np


def ece(pred: np.ndarray, outcome: np.ndarray, bins: int = 20, weights: np.ndarray | None = None) -> float:
    """Expected calibration error: sum_b (w_b / w) |mean pred_b - observed rate_b| (weights optional,
    e.g. decayed counts of an online calibrator)."""
    pred, outcome = np.asarray(pred, float), np.asarray(outcome, float)
    w = np.ones_like(pred) if weights is None else np.asarray(weights, float)
    if pred.size == 0 or w.sum() <= 0:
        return float("nan")
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    wb = np.bincount(idx, w, bins)
    gap = np.bincount(idx, w * pred, bins) - np.bincount(idx, w * outcome, bins)  # w_b (mean pred - rate)
    return float(np.abs(gap[wb > 0]).sum() / w.sum())


def ece_floor(pred: np.ndarray, bins: int = 20, draws: int = 200, seed: int = 0) -> float:
    """The ECE a PERFECTLY calibrated predictor would show on this many rounds: the mean ECE when the
    outcomes are drawn from the predictions themselves. Measured ECE near it is sampling noise."""
    pred = np.asarray(pred, float)
    if pred.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    return float(np.mean([ece(pred, rng.random(pred.size) < pred, bins) for _ in range(draws)]))


def auroc(pred: np.ndarray, outcome: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties count half):
    the Mann-Whitney U statistic over average ranks."""
    from scipy.stats import rankdata

    pred, outcome = np.asarray(pred, float), np.asarray(outcome, bool)
    n_pos, n_neg = int(outcome.sum()), int((~outcome).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(pred)  # average ranks for ties
    return float((ranks[outcome].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(pred: np.ndarray, outcome: np.ndarray) -> float:
    pred, outcome = np.asarray(pred, float), np.asarray(outcome, float)
    return float(np.mean((pred - outcome) ** 2)) if pred.size else float("nan")


def reliability(pred: np.ndarray, outcome: np.ndarray, bins: int = 20):
    """Per non-empty bin: (mean predicted, observed rate, count)."""
    pred, outcome = np.asarray(pred, float), np.asarray(outcome, float)
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    rows = []
    for b in range(bins):
        sel = idx == b
        if sel.any():
            rows.append((float(pred[sel].mean()), float(outcome[sel].mean()), int(sel.sum())))
    return rows
