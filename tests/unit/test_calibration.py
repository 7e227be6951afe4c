import numpy as np

from dspark import evaluation
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
    assert ece(small, rng.random(small.size) < small**2) > 2 * ece_floor(small)  # miscalibration stands out


def _synthetic(n=20_000, gamma=4, true_t=(2.0, 0.5, 1.0, 3.0), seed=0, true_b=(0.0, 0.0, 0.0, 0.0)):
    """The head's logits are off by a per-position temperature (and offset): true c_k = σ(logit_k / t_k + b_k)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(1.0, 1.5, size=(n, gamma))
    c = 1 / (1 + np.exp(-(logits / np.array(true_t) + np.array(true_b))))
    accepted_each = rng.uniform(size=(n, gamma)) < c
    accepted = np.cumprod(accepted_each, 1).sum(1)
    return sts.Observations(logits, np.full(n, gamma), accepted), true_t


def test_sts_recovers_temperatures_and_removes_miscalibration():
    obs, true_t = _synthetic()
    cal = sts.fit(obs, bias=False)  # the paper's STS
    assert np.allclose(cal.temps, true_t, rtol=0.2) and cal.biases == [0.0] * 4, cal
    with_offset = sts.fit(obs)  # nothing to correct: the offsets stay near 0
    assert np.allclose(with_offset.biases, 0, atol=0.25) and np.allclose(with_offset.temps[:3], true_t[:3], rtol=0.2)
    assert max(r["ece"] for r in sts.report(obs, with_offset)) < 0.02
    before = sts.report(obs, sts.Calibration.identity(4))
    after = sts.report(obs, cal)
    assert max(r["ece"] for r in after) < 0.02 < max(r["ece"] for r in before)
    for b, a in zip(before, after):  # per-position scaling is monotone: ranking quality unchanged at k=1
        if b["k"] == 1:
            assert abs(b["auroc"] - a["auroc"]) < 1e-9


def test_offsets_undo_a_level_shift_that_temperatures_cannot(tmp_path):
    obs, _ = _synthetic(true_t=(1.0, 1.0, 1.0, 1.0), true_b=(-1.0, -0.7, 0.5, 0.0), seed=1)
    held, _ = _synthetic(true_t=(1.0, 1.0, 1.0, 1.0), true_b=(-1.0, -0.7, 0.5, 0.0), seed=2)
    temps_only, both = sts.report(held, sts.fit(obs, bias=False)), sts.report(held, sts.fit(obs))
    assert max(r["ece"] for r in both) < 0.015 < 0.03 < max(r["ece"] for r in temps_only)
    assert np.allclose(sts.fit(obs).biases[:3], (-1.0, -0.7, 0.5), atol=0.2)
    path = tmp_path  # round trip; a file without offsets is plain STS
    sts.save(path, sts.fit(obs), {"note": "x"})
    assert sts.load(path) == sts.fit(obs)
    (path / sts.FILE).write_text('{"temperatures": [1.5, 2.0]}')
    assert sts.load(path) == sts.Calibration([1.5, 2.0], [0.0, 0.0])


def test_positions_without_evidence_keep_the_identity_map():
    obs, _ = _synthetic(n=3000, true_t=(1.0, 1.0, 1.0, 1.0), true_b=(-1.0, -1.0, -1.0, -1.0), seed=3)
    obs.accepted = np.minimum(obs.accepted, 2)  # nobody ever survives past position 2
    cal = sts.fit(obs)
    assert cal.biases[0] < -0.5 and (cal.temps[2:], cal.biases[2:]) == ([1.0, 1.0], [0.0, 0.0]), cal


def test_truncated_rounds_do_not_count_past_their_length():
    obs, _ = _synthetic(n=2000)
    obs.verified[:1000] = 1  # half the rounds verified one draft only
    sel, y, _ = obs.at(2)
    assert sel.sum() == 1000 and sel[1000:].all()


def test_threshold_sweep_replays_shorter_verification_exactly():
    c = np.array([[0.9, 0.8, 0.1], [0.5, 0.5, 0.5], [0.9, 0.9, 0.9]])  # conditional confidences
    obs = sts.Observations(np.log(c / (1 - c)), verified=np.array([3, 3, 1]), accepted=np.array([2, 0, 1]))
    # a = (0.9, 0.72, 0.072) and (0.5, 0.25, 0.125); the third round verified one draft only: left out
    rows = {
        r["threshold"]: r
        for r in evaluation.threshold_sweep(obs, sts.Calibration.identity(3), thresholds=(0.0, 0.3, 0.95))
    }
    assert (
        rows[0.0]["verified"] == 3 and rows[0.0]["accepted"] == 1 and abs(rows[0.0]["acceptance_rate"] - 1 / 3) < 1e-12
    )
    assert (
        rows[0.3]["verified"] == 1.5
        and rows[0.3]["accepted"] == 1
        and abs(rows[0.3]["acceptance_rate"] - 2 / 3) < 1e-12
    )
    assert rows[0.3]["rejected"] == 0.5 and rows[0.3]["tokens_per_step"] == 2
    assert rows[0.95]["verified"] == 0 and rows[0.95]["acceptance_rate"] == 0
