import numpy as np

from dspark.calibration import sts
from dspark.calibration.metrics import auroc, brier, ece, ece_floor, reliability


def test_metrics_on_known_values():
    pred = np.array([0.1, 0.1, 0.9, 0.9])
    out = np.array([0, 0, 1, 1])
    assert abs(ece(pred, out) - 0.1) < 1e-12
    assert auroc(pred, out) == 1.0 and auroc(pred, 1 - out) == 0.0
    assert auroc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5  # ties count half
    assert abs(brier(pred, out) - 0.01) < 1e-12
    assert [c for _, _, c in reliability(pred, out)] == [2, 2]
    assert ece(pred, out, weights=np.array([1, 1, 0, 0])) == ece(pred[:2], out[:2])


def test_ece_floor_is_what_perfect_calibration_shows_at_this_sample_size():
    rng = np.random.default_rng(3)
    small, large = rng.uniform(0, 1, 500), rng.uniform(0, 1, 50_000)
    for pred in (small, large):
        calibrated = ece(pred, rng.random(pred.size) < pred)
        assert 0.3 < calibrated / ece_floor(pred) < 2.5  # a calibrated predictor sits at the floor
    assert ece_floor(small) > 3 * ece_floor(large)  # ~ 1/sqrt(n)
    assert ece(small, rng.random(small.size) < small ** 2) > 2 * ece_floor(small)  # miscalibration stands out


def _synthetic(n=20_000, gamma=4, true_t=(2.0, 0.5, 1.0, 3.0), seed=0):
    """The head's logits are off by a per-position temperature: true c_k = σ(logit_k / t_k)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(1.0, 1.5, size=(n, gamma))
    c = 1 / (1 + np.exp(-logits / np.array(true_t)))
    accepted_each = rng.uniform(size=(n, gamma)) < c
    accepted = np.cumprod(accepted_each, 1).sum(1)
    return sts.Observations(logits, np.full(n, gamma), accepted), true_t


def test_sts_recovers_temperatures_and_removes_miscalibration():
    obs, true_t = _synthetic()
    temps = sts.fit(obs)
    assert np.allclose(temps, true_t, rtol=0.2), temps
    before = sts.report(obs, [1.0] * 4)
    after = sts.report(obs, temps)
    assert max(r["ece"] for r in after) < 0.02 < max(r["ece"] for r in before)
    for b, a in zip(before, after):  # per-position scaling is monotone: ranking quality unchanged at k=1
        if b["k"] == 1:
            assert abs(b["auroc"] - a["auroc"]) < 1e-9


def test_truncated_rounds_do_not_count_past_their_length():
    obs, _ = _synthetic(n=2000)
    obs.verified[:1000] = 1  # half the rounds verified one draft only
    sel, y, _ = obs.at(2)
    assert sel.sum() == 1000 and sel[1000:].all()
