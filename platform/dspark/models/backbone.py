"""The parallel (DFlash-style) backbone: one forward drafts a whole block.

Input block for an anchor at position p: [x_p, MASK, ..., MASK] (L slots) at positions p .. p+L-1;
L = gamma and slot i predicts the token at p+i+1 (or, the fill-in block, L = gamma + 1 and mask i the
token at its own position p+i: DrafterConfig.sample_from_anchor). Every draft layer attends to
    keys/values = [k/v_proj(C_j) for context j < p ; k/v_proj(block)]
where C is the fused target context. Visibility: context strictly before the anchor plus the whole
own block (bidirectional); never another block. Training packs N blocks of a sequence into one
forward with exactly this visibility (`packed_mask` for the context, `block_attention` for the blocks),
so packed logits equal per-block inference logits.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.config import DrafterConfig
from dspark.models.layers import ContextFusion, DraftLayer, rotation

KV = tuple[torch.Tensor, torch.Tensor]


class ParallelBackbone(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.fusion = ContextFusion(c)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    @torch.no_grad()
    def copy_target_top(self, layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor) -> None:
        """Start from the target's top: draft layer i = target layer n - num_layers + i (`layers`, in order,
        each its HF keys without the "model.layers.N." prefix), the final norm the target's. The fusion
        passes the deepest tap through unchanged (the input of those layers when it is layer n - num_layers
        - 1's output) and normalises it with the first copied layer's input norm, so the context keys and
        values start as that layer's own."""
        for layer, w in zip(self.layers, layers, strict=True):
            layer.copy_target_layer(w)
        d = self.c.hidden_size
        self.fusion.proj.weight.zero_()
        self.fusion.proj.weight[:, (self.c.m - 1) * d :].copy_(torch.eye(d))  # (d, m*d): the last tap
        self.fusion.norm.weight.copy_(layers[0]["input_layernorm.weight"])
        self.norm.weight.copy_(final_norm)

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[KV]:
        """feats: (B, C, m, d) tapped target layers at positions pos (B, C) -> per layer k/v (B, KVH, C, hd)."""
        ctx = self.fusion(feats)  # (B, C, d)
        rot = rotation(pos, self.c.head_dim, self.c.rope_theta)  # the same for every layer
        return [layer.project_kv(ctx, pos, rot) for layer in self.layers]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_kv: list[KV], ctx_mask: torch.Tensor, L: int):
        """x: (B, Q, d): Q / L blocks of L slot embeddings at pos (B, Q); ctx_mask (B, 1, Q, C) the context
        each slot sees (its own block it sees whole) -> final hidden (B, Q, d)."""
        rot = rotation(pos, self.c.head_dim, self.c.rope_theta)
        for layer, kv in zip(self.layers, ctx_kv):
            x, _ = layer(x, pos, kv, ctx_mask, block=L, rot=rot)
        return self.norm(x)


def block_positions(anchors: torch.Tensor, L: int) -> torch.Tensor:
    """anchors (B, N) -> slot positions (B, N*L): p_n + i."""
    B, N = anchors.shape
    return (anchors[:, :, None] + torch.arange(L, device=anchors.device)).reshape(B, N * L)


def packed_mask(anchors: torch.Tensor, ctx_valid: torch.Tensor, L: int) -> torch.Tensor:
    """Context visibility for N packed blocks of L slots per sequence (each block sees itself whole).

    anchors (B, N) positions; ctx_valid (B, C) context rows that exist. Returns (B, 1, N*L, C):
    query (n, i) sees context j iff j < anchors[n] and ctx_valid[j]."""
    B, N = anchors.shape
    C = ctx_valid.shape[1]
    j = torch.arange(C, device=anchors.device)
    ctx = (j[None, None, :] < anchors[:, :, None]) & ctx_valid[:, None, :]  # (B, N, C)
    return ctx[:, :, None, :].expand(B, N, L, C).reshape(B, N * L, C)[:, None]
