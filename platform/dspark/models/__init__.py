"""Drafters: DSpark (parallel backbone + Markov head + confidence head), DFlash, EAGLE-3.

A saved drafter is an HF-style folder: config.json + model.safetensors (the target's embedding and
lm_head are shared and frozen, so they are not in it; `draft_ids` is the draft vocabulary when it has
one) + calibration.json once calibrated.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from dspark import target as targets
from dspark.decoding.runner import family
from dspark.errors import UserError
from dspark.models.config import DrafterConfig
from dspark.models.drafter import Drafter, DraftState, Proposal
from dspark.models.dspark import DSpark
from dspark.models.eagle3 import Eagle3
from dspark.models.layers import DraftLayer, FrozenTargetHead

__all__ = ["DrafterConfig", "Drafter", "DraftState", "Proposal", "build_drafter", "save_drafter", "load_drafter"]


def build_drafter(c: DrafterConfig, target) -> Drafter:
    """`target` is the target HF model or an already extracted FrozenTargetHead."""
    head = target if isinstance(target, FrozenTargetHead) else FrozenTargetHead.from_target(target)
    if c.kind == "eagle3":
        if not c.sample_from_anchor:
            raise UserError(
                "train.sample_from_anchor: false is a parallel (dspark/dflash) block; eagle3 drafts sequentially"
            )
        return Eagle3(c, head)
    if c.kind == "dflash":
        c.markov = "none"
    elif c.markov == "none":
        raise UserError("train.markov: a dspark drafter needs a Markov head (vanilla, gated or rnn)")
    return DSpark(c, head)


CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"  # a drafter folder (+ calibration.json)


def save_drafter(drafter: Drafter, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    drafter.c.save(path / CONFIG_FILE)
    state = {  # weights in float32, the draft vocabulary's ids as integers
        k: (v.float() if v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in drafter.state_dict().items()
    }
    save_file(state, str(path / WEIGHTS_FILE), metadata={"kind": drafter.c.kind})


def load_drafter(path: str | Path, target_model, target_hash: str | None = None, strict_target: bool = True) -> Drafter:
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise UserError(f"drafter not found: {path} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    c = DrafterConfig.load(path / CONFIG_FILE)
    trained_for = c.target.get("weights_sha256")
    if strict_target and target_hash and trained_for and trained_for != target_hash:
        raise UserError(
            f"drafter {path} was trained for target weights {trained_for[:12]}, "
            f"not the loaded target {target_hash[:12]} (target.weights_sha256 mismatch)"
        )
    drafter = build_drafter(c, target_model)
    dtype = next(target_model.parameters()).dtype
    drafter.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    drafter = drafter.to(device=next(target_model.parameters()).device, dtype=dtype).eval()
    drafter.pack_like(target_model)
    return drafter


def fetch_drafter(cfg, uri: str, target) -> Drafter:
    """The drafter at `uri` (a storage URI or models:/NAME@ALIAS), downloaded and loaded for `target`
    (a loaded target: its model and weights hash); only its weights in memory remain."""
    from dspark.artifacts import download_drafter

    with tempfile.TemporaryDirectory(prefix="drafter-") as d:
        return load_drafter(download_drafter(cfg, uri, d), target.model, target.weights_sha256)


def warm_start(cfg, drafter: Drafter) -> None:
    """train.warm_start: the weights of the drafter there (a storage URI, folder or models:/NAME@ALIAS)
    initialise `drafter`, which must have its shapes; its optimizer state and step count are not taken."""
    from dspark.artifacts import download_drafter

    if not cfg.train.warm_start:
        return
    with tempfile.TemporaryDirectory(prefix="drafter-") as d:
        local = download_drafter(cfg, cfg.train.warm_start, d, only=(WEIGHTS_FILE,))
        drafter.load_state_dict(load_file(str(local / WEIGHTS_FILE)))


def init_from_target(cfg, drafter: Drafter) -> None:
    """train.init_layers=target_top: a parallel drafter's layers start as the target's top layers
    (ParallelBackbone.copy_target_top), read from the target's safetensors files; "random" leaves them."""
    if cfg.train.init_layers == "random":
        return
    if not isinstance(drafter, DSpark):
        raise UserError(f"train.init_layers={cfg.train.init_layers}: only a parallel (dspark/dflash) drafter")
    t = cfg.target
    hf = targets.hf_config(t.name_or_path, t.revision, t.cache_dir)
    fam = family(hf)
    if fam.sandwich_norm or fam.unit_offset_norm:  # a draft layer is Llama's: these would be copied as if they were
        raise UserError(
            f"train.init_layers={cfg.train.init_layers}: the target's {hf.model_type} layers are not Llama-shaped "
            "(norms around the attention and MLP outputs, scaled by 1 + w): use train.init_layers=random"
        )
    n = hf.num_hidden_layers
    first = n - drafter.c.num_layers
    if first < 0:
        raise UserError(f"train.num_layers={drafter.c.num_layers}: the target has only {n} layers to copy")
    keys = [f"model.layers.{i}.{k}" for i in range(first, n) for k in DraftLayer.TARGET_KEYS] + ["model.norm.weight"]
    w = targets.read_weights(t.name_or_path, keys, "float32", t.revision, t.cache_dir)
    if "model.norm.weight" not in w:
        raise UserError(f"train.init_layers: target {t.name_or_path} has no model.norm.weight to copy")
    per_layer = [
        {k.removeprefix(f"model.layers.{i}."): v for k, v in w.items() if k.startswith(f"model.layers.{i}.")}
        for i in range(first, n)
    ]
    drafter.backbone.copy_target_top(per_layer, w["model.norm.weight"])


def count_params(drafter: Drafter) -> int:
    return sum(p.numel() for p in drafter.parameters())
