"""Exports (DFlash, DSpark, EAGLE-3) load in the speculators package (vLLM's documented format) and
reproduce our drafters: bench/speculators_roundtrip.sh makes speculators' own venv
(.local/venvs/speculators, once), exports each drafter with jobs/export.py --reference and reruns its
block there (bench/speculators_check.py)."""

import os
import subprocess
from pathlib import Path

import torch
from tiny_models import untrained_drafter

from dspark import target as targets
from dspark.models import save_drafter

ROOT = Path(__file__).resolve().parents[2]


def test_speculators_reproduces_exported_dflash_dspark_and_eagle3(tmp_path):
    tgt = targets.load("builtin")
    ids = torch.arange(3, 4096, 7)  # a draft vocabulary: lm_head rows, d2t and t2d are exported
    paths = []
    for name, kind, anchor in [
        ("dflash", "dflash", True),
        ("dflash-fill-in", "dflash", False),  # the block vLLM's DFlash serves (speculators' default)
        ("dspark", "dspark", True),
        ("eagle3", "eagle3", True),
    ]:
        d = untrained_drafter(
            tgt, kind, gamma=5, num_layers=2, markov_rank=16, draft_ids=ids, sample_from_anchor=anchor
        )
        save_drafter(d, tmp_path / name)
        paths.append(str(tmp_path / name))
    env = {**os.environ, "OUT": str(tmp_path / "exports"), "DTYPE": "float32"}
    out = subprocess.run(
        [str(ROOT / "bench" / "speculators_roundtrip.sh"), *paths],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum(line == "OK" for line in lines) == 4
    assert sum(line.startswith("DFlashDraftModel") for line in lines) == 2
    assert any(line.startswith("DSparkDraftModel") for line in lines)
    assert any(line.startswith("Eagle3DraftModel") for line in lines)
    # the exported aux ids pick, in the verifier itself, exactly the layers the drafter was trained on
    aux = [line for line in lines if line.startswith("verifier hidden states at aux ids [2, 3, 4]")]
    assert len(aux) == 4 and all(float(line.rsplit(" ", 1)[1]) < 1e-4 for line in aux)
