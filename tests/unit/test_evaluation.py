"""The offline evaluation end to end on the built-in target with a small untrained drafter: speed
rows, the calibration study (STS fit on validation rounds, held-out report, threshold sweep), its
plots and what goes to MLflow."""

import json

import pytest
import torch

from dspark import evaluation
from dspark import target as targets
from dspark.calibration import sts
from dspark.config import load_config
from dspark.corpus.sources import Corpus
from dspark.decoding.sampling import SamplingParams
from dspark.errors import UserError
from dspark.models import CONFIG_FILE, DrafterConfig, build_drafter


class Recorder:
    """Records what would go to MLflow (the tracker interface: metrics, artifact)."""

    def __init__(self):
        self.logged, self.artifacts = {}, []

    def metrics(self, values, step):
        self.logged.update({(k, step): v for k, v in values.items()})

    def artifact(self, path, artifact_path=None):
        self.artifacts.append(path.name)


def test_evaluate_reports_calibration_with_sweep_and_plots(tmp_path):
    cfg = load_config(
        overrides=[
            "eval.gamma=3",
            "eval.temperatures=[1.0]",
            "eval.prompts_per_domain=1",
            "eval.max_new_tokens=6",
            "eval.calibration_prompts_per_domain=3",
            "eval.calibration_max_new_tokens=10",
            "eval.calibration_batch=4",
            "eval.oracle_paths=8",
            "eval.oracle_drafts=4",
            "eval.oracle_stride=2",
        ]
    )
    tgt = targets.load("builtin")
    torch.manual_seed(0)
    dc = DrafterConfig.from_target(
        tgt.config, "dspark", [1, 2, 3], tgt.tokenizer.mask_token_id, num_layers=1, gamma=3, markov_rank=32
    )
    res = evaluation.evaluate(cfg, tgt, {"d": build_drafter(dc, tgt.model).eval()}, Corpus.load(cfg.corpus), tmp_path)
    cal = json.loads((tmp_path / "results.json").read_text())["calibration"]["d"]
    assert len(cal["calibration"]["temperatures"]) == len(cal["calibration"]["biases"]) == 3 and cal["fit_rounds"] > 0
    for dom in ("code", "prose"):
        d = cal["domains"][dom]
        assert d["prompts"] == 3 and d["positions"][0]["n"] == d["rounds"] > 0  # every round verified all drafts
        assert all(p[f"ece_{m}"] >= 0 for p in d["positions"] for m in ("raw", "sts", "sts_bias", "matched_sts_bias"))
        sweep = {r["threshold"]: r for r in d["threshold_sweep"]}
        assert (
            sweep[0.0]["verified"] == 3 and sweep[0.9]["verified"] <= sweep[0.5]["verified"] <= sweep[0.0]["verified"]
        )
    for f in ("reliability_d.png", "threshold_sweep_d.png", "conditional_acceptance.png"):
        assert (tmp_path / f).stat().st_size > 10_000
    assert "| d | prose | " in (tmp_path / "results.md").read_text()
    for r in res["results"]:  # every drafter's tau beside the ideal parallel drafter's, slot 1 exact
        if r.drafter == "d":
            assert len(r.bound_accept) == 3 and abs(r.bound_accept[0] - 1) < 1e-5 and 1 < r.tau_bound <= 4
    rec = Recorder()
    evaluation.log_results(rec, res, tmp_path)
    assert ("d.code.calibration.ece_sts", 1) in rec.logged and ("d.prose.T1.tau", 0) in rec.logged
    assert ("d.prose.T1.tau_bound", 0) in rec.logged and ("target.prose.T1.tau_bound", 0) not in rec.logged
    assert {"results.json", "results.md", "reliability_d.png", "threshold_sweep_d.png"} <= set(rec.artifacts)


def test_each_drafter_is_bounded_by_the_ideal_drafter_of_the_answers_it_learned_from(tmp_path):
    """A drafter trained on greedy answers (its config records the cache's law) evaluated at T=0: its ideal
    parallel drafter is the target's own argmax path, accepted at every slot. A drafter that records no law
    (saved before drafters did) is bounded with the configured cache's, here T=1: one oracle run per law."""
    cfg = load_config(
        overrides=[
            "eval.gamma=3",
            "eval.temperatures=[0.0]",
            "eval.prompts_per_domain=2",
            "eval.max_new_tokens=12",
            "eval.oracle_paths=8",
            "eval.oracle_drafts=4",
            "eval.oracle_stride=2",
            "cache.temperature=1.0",
            "cache.top_p=1.0",
        ]
    )
    tgt = targets.load("builtin")
    torch.manual_seed(0)
    drafters = {}
    for name, law in (("greedy", {"temperature": 0.0, "top_p": 0.95, "top_k": 0}), ("unrecorded", {})):
        dc = DrafterConfig.from_target(
            tgt.config, "dflash", [1, 2, 3], tgt.tokenizer.mask_token_id, num_layers=1, gamma=3, cache_law=law
        )
        drafters[name] = build_drafter(dc, tgt.model).eval()
    assert evaluation.training_law(cfg, drafters["greedy"]) == SamplingParams(0.0)  # top-p is moot when greedy
    res = evaluation.evaluate(cfg, tgt, drafters, Corpus.load(cfg.corpus), tmp_path, calibrate=False)
    rows = {(r.drafter, r.domain): r for r in res["results"]}
    for dom in ("code", "prose"):
        greedy, unrecorded = rows[("greedy", dom)], rows[("unrecorded", dom)]
        assert greedy.bound_law == "T=0" and greedy.bound_accept == pytest.approx([1.0] * 3) and greedy.tau_bound == 4
        assert unrecorded.bound_law == "T=1" and unrecorded.bound_accept[0] == pytest.approx(1.0)
        assert all(0 <= a <= 1 + 1e-6 for a in unrecorded.bound_accept)
    table = (tmp_path / "results.md").read_text()
    assert "| greedy | code | 0 | 3 | " in table and "4.000 (T=0)" in table and " (T=1) |" in table


def test_evaluate_with_a_prefix_policy_adds_its_rows_priced_by_the_table(tmp_path):
    """eval.policy=greedy decodes each drafter with a confidence head a second time under Algorithm 1: with
    a table where a step of 2+ tokens costs 10x one of 1, no draft is worth verifying (every round emits one
    token: tau 1, no position verified); without a table the setting is refused before any work."""
    overrides = ["eval.gamma=3", "eval.temperatures=[1.0]", "eval.prompts_per_domain=1", "eval.max_new_tokens=6"]
    tgt = targets.load("builtin")
    torch.manual_seed(0)
    dc = DrafterConfig.from_target(
        tgt.config, "dspark", [1, 2, 3], tgt.tokenizer.mask_token_id, num_layers=1, gamma=3, markov_rank=32
    )
    drafters = {"d": build_drafter(dc, tgt.model).eval()}
    cfg = load_config(overrides=[*overrides, "eval.policy=greedy", "eval.oracle_paths=0"])
    with pytest.raises(UserError, match="eval.policy=greedy prices its prefixes with eval.sps_table"):
        evaluation.evaluate(cfg, tgt, drafters, Corpus.load(cfg.corpus), tmp_path / "none", calibrate=False)
    assert not (tmp_path / "none").exists()
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"batch": [1, 2, 64], "sps": [100.0, 10.0, 1.0]}))
    cfg = load_config(overrides=[*overrides, "eval.policy=greedy", f"eval.sps_table={table}", "eval.oracle_paths=0"])
    res = evaluation.evaluate(cfg, tgt, drafters, Corpus.load(cfg.corpus), tmp_path / "out", calibrate=False)
    rows = {(r.drafter, r.domain): r for r in res["results"]}
    assert set(rows) == {(n, d) for n in ("target", "d", "d-greedy") for d in ("code", "prose")}
    for dom in ("code", "prose"):
        static, greedy = rows[("d", dom)], rows[("d-greedy", dom)]
        assert static.survival and all(s == s for s in static.survival)  # static verified every position
        assert greedy.tau == 1.0 and all(s != s for s in greedy.survival)  # greedy verified none: NaN
        assert greedy.tokens == static.tokens and greedy.speedup > 0
    assert "| d-greedy | prose | " in (tmp_path / "out" / "results.md").read_text()


def test_interleaved_runs_answer_each_prompt_in_turn_and_as_each_would_alone():
    """Every decoder answers prompt i before any answers prompt i+1 (so the host's drift falls on all runs
    alike), and each run's outputs are those of decoding its prompts alone: request i is seeded seed + i."""
    tgt = targets.load("builtin")
    torch.manual_seed(0)
    dc = DrafterConfig.from_target(
        tgt.config, "dspark", [1, 2, 3], tgt.tokenizer.mask_token_id, num_layers=1, gamma=3, markov_rank=32
    )
    drafter = build_drafter(dc, tgt.model).eval()
    prompts = [tgt.tokenizer.encode(s) for s in ("def add(a, b):", "The river", "import os\n")]
    sp, eos = SamplingParams(1.0), tgt.eos_token_ids
    order = []

    class Logged:
        def __init__(self, name, dec):
            self.name, self.dec = name, dec

        def run(self, reqs):
            order.append((self.name, reqs[0].prompt))
            return self.dec.run(reqs)

    runs = {"plain": evaluation.decoder(tgt.model), "d": evaluation.decoder(tgt.model, drafter, 3)}
    got = evaluation.interleaved({k: Logged(k, d) for k, d in runs.items()}, prompts, sp, 8, eos, seed=5)
    assert order == [(k, p) for p in prompts for k in ("plain", "d")]
    assert [q.out for q in got["plain"]] == [
        q.out for q in evaluation.decode(tgt.model, None, prompts, sp, 0, 8, eos, 5)
    ]
    assert [q.out for q in got["d"]] == [
        q.out for q in evaluation.decode(tgt.model, drafter, prompts, sp, 3, 8, eos, 5)
    ]
    assert all(len(q.out) > 1 for q in got["d"]) and any(r.verified for q in got["d"] for r in q.rounds)


def test_a_calibration_fitted_at_another_gamma_than_trained_is_not_saved_with_the_drafter(tmp_path):
    """Evaluating at eval.gamma 3 a drafter trained at 7 must not replace its calibration with a 3-position
    one (serving at 7 would then refuse it); at the trained gamma it is saved."""
    tgt = targets.load("builtin")
    folders = {n: tmp_path / n for n in ("a", "b")}
    for name, gamma in (("a", 3), ("b", 7)):  # the gamma each was trained at, in its folder's config.json
        folders[name].mkdir()
        c = DrafterConfig.from_target(tgt.config, "dspark", [1, 2, 3], tgt.tokenizer.mask_token_id, gamma=gamma)
        c.save(folders[name] / CONFIG_FILE)
    sts.save(folders["b"], sts.Calibration.identity(7))
    fitted = sts.Calibration([2.0, 3.0, 1.0], [0.5, 0.0, 0.0])
    res = {"calibrations": {"a": fitted, "b": fitted}}
    assert evaluation.save_calibrations(res, folders) == ["b"]
    assert sts.load(folders["a"]) == fitted and sts.load(folders["b"]) == sts.Calibration.identity(7)
