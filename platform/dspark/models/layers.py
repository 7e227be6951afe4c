"""Building blocks shared by the drafters: context fusion, RoPE, and a Qwen3-style draft layer whose
attention reads an external key/value prefix (the target context) besides its own tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.errors import UserError
from dspark.models.config import DrafterConfig
from dspark.target.packed import PackedLinear


class ContextFusion(nn.Module):
    """Concatenated tapped target layers (.., m*d) -> bias-free Linear -> RMSNorm = context (.., d)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.proj = nn.Linear(c.m * c.hidden_size, c.hidden_size, bias=False)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # (B, T, m, d) -> (B, T, d)
        return self.norm(self.proj(feats.flatten(-2)))


Rotation = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (B, T, 1, hd)


def rotation(pos: torch.Tensor, hd: int, theta: float) -> Rotation:
    """The rotary embedding's float32 cos/sin at absolute positions pos (B, T): computed once for the
    queries and keys of every layer that reads these positions."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=pos.device, dtype=torch.float32) / hd))  # (hd/2,)
    ang = (pos.to(torch.float32)[..., None] * inv).repeat(1, 1, 2)[:, :, None]  # (B, T, 1, hd)
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """Rotary embedding. x: (B, T, H, hd), rot: `rotation` at its positions (applied in x's dtype)."""
    cos, sin = (t.to(x.dtype) for t in rot)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def grouped_attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention where G = H / KVH query heads share each key/value head (head h reads KV head h // G),
    computed as G x Q query rows of each KV head, each row with its token's mask: the same result as SDPA's
    enable_gqa, which on CPU took 1.4x as long for a drafting round's attention at 8 requests (SmolLM2's
    drafter shapes; the target runner does the same for 4-8x).
    q (B, H, Q, hd); k, v (B, KVH, K, hd); mask (B, 1, Q, K) bool, True = visible, or None -> (B, H, Q, hd)."""
    B, H, Q, hd = q.shape
    G = H // k.shape[1]
    qg = q.reshape(B, k.shape[1], G * Q, hd)  # rows (g, t) of KV head kv: query head kv * G + g, token t
    if mask is not None and G > 1 and mask.shape[-2] > 1:
        mask = mask.repeat(1, 1, G, 1)  # row (g, t) is token t's
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).view(B, H, Q, hd)


def with_own(prefix: tuple[torch.Tensor, torch.Tensor], k, v, room: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [prefix; own] along the positions: prefix k/v (B, KVH, P, hd), own k/v (B, KVH, Q, hd).
    room: the prefix's last Q columns are free for them (a drafting round's cache, `pad_states`), and they
    are written there; else concatenated."""
    if room:
        prefix[0][:, :, -k.shape[2] :], prefix[1][:, :, -v.shape[2] :] = k, v
        return prefix
    return torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)


def block_attention(q, prefix, ctx_mask, k, v, L: int) -> torch.Tensor:
    """Attention of N packed blocks of L queries: each query sees the visible prefix and its own block.

    q (B, H, N·L, hd); prefix k/v (B, KVH, P, hd); ctx_mask (B, 1, N·L, P) bool; k/v (B, KVH, N·L, hd) the
    blocks' own. The same result as dense attention over [prefix; blocks] with a mask that is
    block-diagonal on the blocks' keys, computed as one softmax over [P prefix scores; L own-block
    scores] per query: N·L·(P + L) scores instead of N·L·(P + N·L) (training packs hundreds of anchors
    per sequence). One block (drafting) is plain fused attention; it may come with room for itself after
    the prefix, prefix k/v (B, KVH, P + L, hd) (a drafting round's `pad_states`): its k/v are written there
    instead of concatenated with the prefix."""
    B, H, Q, hd = q.shape
    KVH, P = k.shape[1], prefix[0].shape[2]
    if Q == L:
        mask = torch.cat([ctx_mask, ctx_mask.new_ones(B, 1, Q, Q)], -1)
        return grouped_attention(q, *with_own(prefix, k, v, room=P == ctx_mask.shape[-1] + Q), mask)
    N, g = Q // L, H // KVH  # blocks, query heads per kv head (head h reads kv head h // g)
    qg = q.view(B, KVH, g, Q, hd) * hd**-0.5
    s_ctx = (qg @ prefix[0][:, :, None].transpose(-1, -2)).masked_fill(~ctx_mask[:, :, None], float("-inf"))
    kb, vb = k.view(B, KVH, 1, N, L, hd), v.view(B, KVH, 1, N, L, hd)
    s_own = qg.view(B, KVH, g, N, L, hd) @ kb.transpose(-1, -2)  # (B, KVH, g, N, L, L)
    w = torch.cat([s_ctx, s_own.reshape(B, KVH, g, Q, L)], -1).softmax(-1)  # (B, KVH, g, Q, P + L)
    own = w[..., P:].reshape(B, KVH, g, N, L, L) @ vb  # (B, KVH, g, N, L, hd)
    out = w[..., :P] @ prefix[1][:, :, None] + own.reshape(B, KVH, g, Q, hd)
    return out.reshape(B, H, Q, hd)


class DraftLayer(nn.Module):
    """Pre-norm transformer block (Qwen3 layout: per-head q/k RMSNorm, GQA, SwiGLU MLP).

    Keys/values are [prefix; own tokens]: the prefix (e.g. the projected target context) is passed
    in already projected, so it can be cached across drafting rounds. `attn_width` > 1: q/k/v read
    an attention input of attn_width·d built by the caller (EAGLE-3's [norm(embedding); norm(hidden)])."""

    def __init__(self, c: DrafterConfig, attn_width: int = 1):
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.c = c
        self.input_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(attn_width * d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(attn_width * d, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(attn_width * d, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=c.rms_norm_eps)
        self.post_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.gate = nn.Linear(d, c.intermediate_size, bias=False)
        self.up = nn.Linear(d, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, d, bias=False)
        # "qkv", "kv", "gate_up" -> one packed product for linears of the same input (`stack`; empty: none)
        self.stacked: dict[str, PackedLinear] = {}

    def stack(self) -> None:
        """Once its linears are packed (inference beside a packed target, `Drafter.pack_like`): q, k, v as
        one product, k, v as one for the context's rows, gate and up as one (`PackedLinear.stacked`: each
        call streams the weights of several). Nothing is stacked where they are not packed."""
        parts = {
            "qkv": [self.q_proj, self.k_proj, self.v_proj],
            "kv": [self.k_proj, self.v_proj],
            "gate_up": [self.gate, self.up],
        }
        stacked = {name: PackedLinear.stacked(linears) for name, linears in parts.items()}
        self.stacked = stacked if all(stacked.values()) else {}

    # HF Llama/Qwen decoder-layer keys -> this layer's; OPTIONAL_KEYS are Qwen3's only (a Llama's stay at 1)
    TARGET_KEYS = {
        "input_layernorm.weight": "input_norm.weight",
        "self_attn.q_proj.weight": "q_proj.weight",
        "self_attn.k_proj.weight": "k_proj.weight",
        "self_attn.v_proj.weight": "v_proj.weight",
        "self_attn.o_proj.weight": "o_proj.weight",
        "self_attn.q_norm.weight": "q_norm.weight",
        "self_attn.k_norm.weight": "k_norm.weight",
        "post_attention_layernorm.weight": "post_norm.weight",
        "mlp.gate_proj.weight": "gate.weight",
        "mlp.up_proj.weight": "up.weight",
        "mlp.down_proj.weight": "down.weight",
    }
    OPTIONAL_KEYS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}

    @torch.no_grad()
    def copy_target_layer(self, weights: dict[str, torch.Tensor]) -> None:
        """Initialise from one target decoder layer: weights maps TARGET_KEYS' keys (all but OPTIONAL_KEYS
        required) to tensors."""
        if missing := sorted(set(self.TARGET_KEYS) - self.OPTIONAL_KEYS - set(weights)):
            raise UserError(f"the target layer has no {', '.join(missing)}: not a Llama/Qwen layer to copy")
        own = dict(self.named_parameters())
        for key in self.TARGET_KEYS.keys() & weights.keys():
            name = self.TARGET_KEYS[key]
            if weights[key].shape != own[name].shape:
                raise UserError(
                    f"target layer {key}: shape {tuple(weights[key].shape)}, the drafter's {name} is "
                    f"{tuple(own[name].shape)}"
                )
            own[name].copy_(weights[key])

    def project_kv(
        self, h: torch.Tensor, pos: torch.Tensor, rot: Rotation | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (B, T, d) already normalised -> k, v: (B, KVH, T, hd), RoPE applied to k (`rot`: its cos/sin
        at pos, when the caller has them)."""
        kv = self.stacked.get("kv")
        k, v = (self.k_proj(h), self.v_proj(h)) if kv is None else kv(h).chunk(2, -1)
        return self._heads_kv(k, v, rot or rotation(pos, self.c.head_dim, self.c.rope_theta))

    def _heads_kv(self, k: torch.Tensor, v: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, T, KVH·hd) as projected -> (B, KVH, T, hd) each, k normalised and rotated."""
        B, T, _ = k.shape
        k = self.k_norm(k.view(B, T, self.c.num_kv_heads, self.c.head_dim))
        v = v.view(B, T, self.c.num_kv_heads, self.c.head_dim)
        return rope(k, rot).transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        attn_in: torch.Tensor | None = None,
        block: int = 0,
        rot: Rotation | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (B, Q, d) the residual stream at positions pos (B, Q); prefix k/v: (B, KVH, P, hd), or (B, KVH,
        P + Q, hd) whose last Q columns are room for this call's own k/v (written there, not concatenated:
        a drafting round's cache, `pad_states`); mask: (B, 1, Q, P+Q) bool, True = visible (None = all
        visible); attn_in: (B, Q, attn_width·d) what q/k/v read (default input_norm(x)). block > 0: the
        queries are Q / block blocks of `block` tokens, each seeing its own block whole and the prefix where
        mask (B, 1, Q, P) allows (block_attention). rot: the rotation at pos, when the caller shares it
        between layers. Returns (B, Q, d) and this call's own k/v."""
        B, Q, _ = x.shape
        h = self.input_norm(x) if attn_in is None else attn_in
        H, KVH, hd = self.c.num_heads, self.c.num_kv_heads, self.c.head_dim
        qkv = self.stacked.get("qkv")
        q, k, v = (
            (self.q_proj(h), self.k_proj(h), self.v_proj(h))
            if qkv is None
            else qkv(h).split([H * hd, KVH * hd, KVH * hd], -1)
        )
        rot = rot or rotation(pos, hd, self.c.rope_theta)
        q = rope(self.q_norm(q.view(B, Q, H, hd)), rot).transpose(1, 2)  # (B, H, Q, hd)
        k, v = self._heads_kv(k, v, rot)  # (B, KVH, Q, hd)
        if block:
            a = block_attention(q, prefix, mask, k, v, block)
        else:
            room = mask is not None and prefix is not None and prefix[0].shape[2] == mask.shape[-1]
            k_all, v_all = (k, v) if prefix is None else with_own(prefix, k, v, room)
            a = grouped_attention(q, k_all, v_all, mask)  # (B, H, Q, hd)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, Q, -1))
        h = self.post_norm(x)
        gate_up = self.stacked.get("gate_up")
        gate, up = (self.gate(h), self.up(h)) if gate_up is None else gate_up(h).chunk(2, -1)
        return x + self.down(F.silu(gate) * up), (k, v)


class FrozenTargetHead(nn.Module):
    """The target's embedding table and lm_head, shared and frozen. Held as non-persistent buffers:
    never trained, never written into drafter checkpoints, moved with .to()."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.register_buffer("embed_weight", embed.detach(), persistent=False)  # (V, d)
        self.register_buffer("lm_head_weight", lm_head.detach(), persistent=False)  # (V, d)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.lm_head_weight.T.to(h.dtype)

    @classmethod
    def from_target(cls, model) -> "FrozenTargetHead":
        return cls(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
