"""Which target layers a drafter reads, and forward hooks that capture them.

Default taps are spread evenly over the whole depth, from layer 1 to layer round(33/35 * (L-1)): the
paper's [1, 9, 17, 25, 33] for Qwen3-4B (L=36, m=5), [1, 14, 27] for SmolLM2-135M (L=30, m=3) and
[1, 3, 5] for the built-in 6-layer target (m=3), whose top layers a drafter would otherwise never see.
The final-norm output ("last hidden") is captured too: it is what the frozen lm_head turns into the
target's distribution.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import torch

from dspark.errors import UserError


def default_layers(num_layers: int, m: int) -> list[int]:
    lo = min(1, num_layers - 1)
    hi = max(int(round((num_layers - 1) * 33 / 35)), lo)  # the paper's top tap, 33 of 0..35, scaled
    return sorted({int(round(x)) for x in np.linspace(lo, hi, min(m, hi - lo + 1))})


def resolve_layers(num_layers: int, layers: list[int], m: int) -> list[int]:
    layers = list(layers) or default_layers(num_layers, m)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise UserError(
            f"cache.layers: layer ids {bad} out of range for a target with {num_layers} layers (0..{num_layers - 1})"
        )
    if len(set(layers)) != len(layers) or layers != sorted(layers):
        raise UserError(f"cache.layers: {layers} must be distinct and increasing")
    return layers


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


@contextmanager
def capture(model, layers: list[int]):
    """Within the block, `out["layers"]` holds the captured (B, T, d) outputs of `layers` (in order)
    and `out["last"]` the final-norm output, for the most recent forward."""
    out: dict = {"layers": [None] * len(layers), "last": None}
    hooks = []

    def keep(slot):
        def hook(_mod, _inp, output):
            h = output[0] if isinstance(output, tuple) else output
            if slot is None:
                out["last"] = h
            else:
                out["layers"][slot] = h

        return hook

    blocks = decoder_layers(model)
    for slot, i in enumerate(layers):
        hooks.append(blocks[i].register_forward_hook(keep(slot)))
    hooks.append(model.model.norm.register_forward_hook(keep(None)))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def extract(model, input_ids: list[int], layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over one sequence: (T, m, d) tapped layer outputs and (T, d) last hidden."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    # the logits are not read: an HF model that can keep none but the last row's skips the LM head over the
    # rest (a fifth of a SmolLM2 forward's products)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with capture(model, layers) as out:
        model(input_ids=ids, use_cache=False, **keep)
    feats = torch.stack([h[0] for h in out["layers"]], dim=1)  # (T, m, d)
    return feats, out["last"][0]  # (T, m, d), (T, d)
