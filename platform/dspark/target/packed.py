"""Prepacked linears for a target on the CPU: float32, or bfloat16 on a CPU that multiplies bf16 natively.

At batch 1 a decoding step is almost all weight-streaming matrix-vector products (SmolLM2-135M:
211 linears, 81% of a step in aten::mm). oneDNN runs them faster from its own blocked weight
layout, reordered once at load (what torch.compile's CPU freezing does to a bf16 linear), than
from the row-major layout plain F.linear hands it each call. In float32 on an AVX2-only CPU, where
F.linear's products of a few rows run far below the machine's speed, it gains the most (a 16,384 x 576
draft LM head over 8 rows: 5.6 ms against 2.1 packed, 2 threads). The result is the same product up to
the summation order (the logits of a bf16 SmolLM2 step are bit-identical; float32 ones agree within
float32 rounding); the dense weight stays the module's `weight`,
so whatever reads the weights (the drafter's shared lm_head, hashes, exports) sees no change.
A drafter served beside a packed target is packed too (`Drafter.pack_like`): its linears and its LM
head over the draft vocabulary are the same kind of products. The decoding runner also packs the
projections that read the same input as one product (`PackedLinear.stacked`: q, k, v; gate, up), so
a layer streams its weights in 4 products instead of 7.
"""

from __future__ import annotations

import torch
from torch import nn


def supported(model: nn.Module) -> bool:
    """A float32 or bfloat16 model on the CPU, in a torch with oneDNN's packing ops, which pack that dtype on
    this CPU (its bf16 packing needs AVX-512 or AVX-NE-CONVERT; the caller checks that the CPU multiplies
    bf16 natively: `native_bf16`)."""
    p = next(model.parameters())
    ops = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if not (p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16)):
        return False
    if not (torch.backends.mkldnn.is_available() and ops):
        return False
    try:
        pack(torch.zeros(8, 8, dtype=p.dtype))
    except RuntimeError:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False
    return True


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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias  # the module's own parameters, dense
        self.packed = pack(weight)  # not a parameter or persistent buffer: never saved

    @classmethod
    def stacked(cls, linears: list[nn.Module]) -> PackedLinear | None:
        """One packed product for linears of the same input, their weights stacked by rows:
        stacked(ls)(x) = cat([l(x) for l in ls], -1). None unless every one is packed (the packed stack
        is a new copy: made only where packing already keeps copies, never on an accelerator). Its dense
        weight is not kept: the linears keep theirs."""
        if not linears or any(type(m) is not cls for m in linears):
            return None
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])
        stack = cls(torch.cat([m.weight.detach() for m in linears]), bias)
        stack.weight = None
        return stack

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
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                n += 1
    return n
