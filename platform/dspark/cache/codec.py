"""Tensor codecs for cache columns. Parquet has no bf16 or fp8 type, so a tensor is stored as the
raw bytes of one row (sequence) in a binary column; the manifest names the codec and shapes.

- bf16: the bfloat16 bit patterns, 2 bytes per element. Lossless for a bf16 target.
- fp8:  float8 e4m3 with one float32 scale per vector (per token and layer): the scales
        (n_vec * 4 bytes) followed by the codes (n_vec * dim bytes). Error per element
        <= 2^-4 of its magnitude, plus at most 2^-10 * amax/448 near zero (e4m3 subnormals).
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.errors import UserError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
CODECS = ("bf16", "fp8")


def bytes_per_vector(codec: str, dim: int) -> int:
    if codec == "bf16":
        return 2 * dim
    if codec == "fp8":
        return dim + 4
    raise UserError(f"unknown codec {codec!r} (valid: {', '.join(CODECS)})")


def encode(x: torch.Tensor, codec: str) -> bytes:
    """x: (..., dim) floating tensor -> bytes; vectors along the last dimension."""
    x = x.detach().cpu()
    if codec == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    if codec == "fp8":
        flat = x.float().reshape(-1, x.shape[-1])  # (n_vec, dim)
        scale = flat.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # (n_vec, 1)
        codes = (flat / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return scale.numpy().astype(np.float32).tobytes() + codes.numpy().tobytes()
    raise UserError(f"unknown codec {codec!r} (valid: {', '.join(CODECS)})")


def decode(buf: bytes, codec: str, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bytes -> (n_vec, dim) tensor of `dtype`. A length that does not fit the codec raises ValueError."""
    per = bytes_per_vector(codec, dim)
    if len(buf) % per:
        raise ValueError(f"{len(buf)} bytes is not a whole number of {codec} vectors of dim {dim}")
    n = len(buf) // per
    raw = np.frombuffer(buf, dtype=np.uint8)
    if codec == "bf16":
        t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(n, dim)
        return t.to(dtype)
    scale = torch.from_numpy(raw[: 4 * n].view(np.float32).copy()).reshape(n, 1)
    codes = torch.from_numpy(raw[4 * n :].copy()).view(torch.float8_e4m3fn).reshape(n, dim)
    return (codes.float() * scale).to(dtype)
