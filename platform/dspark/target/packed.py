"""Prepacked linears for a bfloat16 target on a CPU that multiplies bf16 natively.

At batch 1 a decoding step is almost all weight-streaming matrix-vector products (SmolLM2-135M:
211 linears, 81% of a step in aten::mm). oneDNN runs them faster from its own blocked weight
layout, reordered once at load (what torch.compile's CPU freezing does to a bf16 linear), than
from the row-major layout plain F.linear hands it each call. The result is the same product
(the logits of a SmolLM2 step are bit-identical); the dense weight stays the module's `weight`,
so whatever reads the weights (the drafter's shared lm_head, hashes, exports) sees no change.
A drafter served beside a packed target is packed too (`Drafter.pack_like`): its linears and its LM
head over the draft vocabulary are the same kind of products.
"""

from __future__ import annotations

import torch
from torch import nn


def supported(model: nn.Module) -> bool:
    """A bfloat16 model on the CPU, in a torch with oneDNN's packing ops (the caller checks that the CPU
    multiplies bf16 natively: `native_bf16`)."""
    p = next(model.parameters())
    ops = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and ops


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight -> its oneDNN-packed copy: an opaque tensor for `linear`, never saved."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) from pack(weight): (..., in) -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def is_packed(model: nn.Module) -> bool:
    """Whether prepack packed the model's linears."""
    return any(type(m) is PackedLinear for m in model.modules())


class PackedLinear(nn.Module):
    """nn.Linear's product from a oneDNN-packed copy of the weight (kept alongside as `weight`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack(linear.weight)  # not a parameter or persistent buffer: never saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.packed, self.bias)


def prepack(model: nn.Module) -> int:
    """Replace every nn.Linear of a supported model by a PackedLinear; returns how many (0: unsupported)."""
    if not supported(model):
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n
