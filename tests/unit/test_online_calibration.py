"""The calibration actor's logic: unbiased (verified-only) observations, decayed counts that follow
drift, clamped STS refits, and a live calibration error that recovers after a shift."""

import numpy as np

from dspark.calibration import sts
from dspark.calibration.online import OnlineCalibrator
from dspark.decoding.speculative import RoundRecord


def rounds(n, true_t, rng, gamma=4, verify=None, true_b=0.0):
    logits = rng.normal(1.0, 1.5, size=(n, gamma))
    c = 1 / (1 + np.exp(-(logits / np.array(true_t) + true_b)))
    accepted = np.cumprod(rng.uniform(size=(n, gamma)) < c, 1).sum(1)
    ell = np.full(n, gamma) if verify is None else verify
    return logits, ell, np.minimum(accepted, ell)


def feed(cal, logits, ell, acc, in_force):
    pred = sts.survival(logits, in_force)
    return cal.add([RoundRecord(int(v), int(a), list(l), list(p)) for l, v, a, p in zip(logits, ell, acc, pred)])


def test_follows_a_shift_with_clamped_updates():
    rng = np.random.default_rng(0)
    before, after = (1.0, 1.0, 1.0, 1.0), (3.0, 0.5, 2.0, 1.0)
    cal = OnlineCalibrator(
        4,
        sts.Calibration(list(before), [0.0] * 4),
        half_life=500,
        min_rounds=200,
        refit_every=100,
        max_change=1.5,
        window=400,
    )
    for _ in range(10):
        feed(cal, *rounds(100, before, rng), cal.cal)
    error_before = cal.live_error()
    assert error_before < 0.03
    history = []
    for _ in range(40):
        old = list(cal.cal.temps)
        feed(cal, *rounds(100, after, rng), cal.cal)
        assert all(n <= o * 1.5 + 1e-9 and n >= o / 1.5 - 1e-9 for n, o in zip(cal.cal.temps, old))  # clamped
        history.append(cal.live_error())
    assert abs(cal.cal.temps[0] - after[0]) < 0.25 * after[0], cal.cal  # the best-observed position tracks the truth
    assert max(history[:3]) > 2 * error_before  # the shift is visible...
    assert history[-1] < 0.03  # ...and gone once the refits caught up


def test_offsets_follow_a_level_shift_temperatures_alone_cannot():
    """Traffic on which every draft is accepted less often than the head says (logit - 1.2)."""
    errors = {}
    for bias in (True, False):
        rng = np.random.default_rng(2)
        cal = OnlineCalibrator(4, None, half_life=500, min_rounds=200, refit_every=100, bias=bias, window=400)
        for _ in range(40):
            feed(cal, *rounds(100, (1.0,) * 4, rng, true_b=-1.2), cal.cal)
        errors[bias] = cal.live_error()
    assert errors[True] < 0.03 < 2 * 0.03 < errors[False], errors


def test_never_refits_without_enough_rounds_and_counts_only_verified_positions():
    rng = np.random.default_rng(1)
    cal = OnlineCalibrator(4, None, min_rounds=500, refit_every=50)
    logits, _, acc = rounds(400, (2, 2, 2, 2), rng)
    ell = np.ones(400, dtype=int)  # every round verified only its first draft
    assert not feed(cal, logits, ell, np.minimum(acc, 1), sts.Calibration.identity(4))
    assert cal.version == 0 and cal.cal == sts.Calibration.identity(4)
    sel, _, _ = cal.observations().at(2)
    assert sel.sum() == 0  # truncated rounds say nothing about position 2
    stats = cal.stats()
    assert stats["positions"][1]["ece"] is None and stats["rounds_held"] == 400  # JSON-safe: NaN -> None
