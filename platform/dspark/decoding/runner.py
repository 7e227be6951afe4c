"""The target's forward for decoding: many requests' new tokens in ONE flattened forward, each at its
own positions against its own KV cache, returning logits and the drafter's tapped features.

It runs the weights of an HF Qwen3-family model (embed, decoder layers, final norm, lm_head,
rotary embedding) with a slot-based KV cache: request r owns slot s with keys/values
(KVH, capacity, hd) per layer and a length. Rolling back rejected drafts is setting the length
back. Attention is SDPA over the active slots, padded to the longest; device and dtype are the
model's own (CPU float32 here, CUDA bf16 in production).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.errors import UserError


@dataclass
class StepOutput:
    logits: list[torch.Tensor]  # per request (n_r, V)
    taps: list[torch.Tensor]  # per request (n_r, m, d): tapped layer outputs for the drafter


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class TargetRunner:
    def __init__(self, model, tap_layers: list[int], max_slots: int = 8, capacity: int = 512, max_len: int = 0):
        """capacity: initial KV positions per slot (grown on demand); max_len: the most positions a slot
        may ever hold (0 = the target's max_position_embeddings), which bounds the cache's memory at
        max_slots x max_len positions per layer."""
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False):
            raise UserError("target: sliding-window attention is not supported by the decoding runner")
        self.model, self.taps = model, list(tap_layers)
        self.base = model.model
        self.layers = self.base.layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kvh = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.max_len = min(max_len or self.max_positions, self.max_positions)
        capacity = min(capacity, self.max_len)
        self.k = [torch.zeros(max_slots, self.kvh, capacity, self.hd, device=self.device, dtype=self.dtype)
                  for _ in self.layers]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.lengths = [0] * max_slots
        self.free_slots = list(range(max_slots - 1, -1, -1))

    # -- slots
    def alloc(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free KV-cache slot")
        s = self.free_slots.pop()
        self.lengths[s] = 0
        return s

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.free_slots.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll back: positions >= length are forgotten (they will be overwritten)."""
        assert length <= self.lengths[slot]
        self.lengths[slot] = length

    def _ensure(self, need: int) -> None:
        """Grow every layer's cache to hold `need` positions: all new buffers are allocated before any
        is swapped in, so running out of memory leaves the old cache whole."""
        cap = self.k[0].shape[2]
        if need <= cap:
            return
        new_cap = min(max(need, 2 * cap), self.max_len)
        grown = [[t.new_zeros(*t.shape[:2], new_cap, self.hd) for t in store] for store in (self.k, self.v)]
        for store, new in zip((self.k, self.v), grown):
            for i, t in enumerate(new):
                t[:, :, :cap] = store[i]
                store[i] = t

    # -- forward
    @torch.no_grad()
    def forward(self, slots: list[int], tokens: list[torch.Tensor]) -> StepOutput:
        """Append tokens[r] (n_r,) to slot slots[r]; returns logits and taps for every new token."""
        n = [int(t.numel()) for t in tokens]
        R, nmax = len(slots), max(n)
        start = [self.lengths[s] for s in slots]
        end = [a + b for a, b in zip(start, n)]
        if max(end) > self.max_len:
            raise UserError(f"context of {max(end)} tokens exceeds the limit of {self.max_len} positions per request")
        self._ensure(max(end))
        ids = torch.cat(tokens).to(self.device)  # (Ttot,)
        pos = torch.cat([torch.arange(a, b) for a, b in zip(start, end)]).to(self.device)  # (Ttot,)
        row = torch.cat([torch.full((k,), r) for r, k in enumerate(n)]).to(self.device)  # request of each token
        col = torch.cat([torch.arange(k) for k in n]).to(self.device)  # index within the request's new tokens
        slot_t = torch.tensor(slots, device=self.device)
        L = max(end)
        # query t of request r sees key j iff j <= start_r + t   (its cache and its own earlier new tokens)
        j = torch.arange(L, device=self.device)
        qpos = torch.tensor(start, device=self.device)[:, None] + torch.arange(nmax, device=self.device)  # (R, nmax)
        mask = (j[None, None, :] <= qpos[:, :, None])[:, None]  # (R, 1, nmax, L)

        x = self.base.embed_tokens(ids[None])  # (1, Ttot, d)
        cos, sin = self.base.rotary_emb(x, pos[None])  # (1, Ttot, hd)
        cos, sin = cos[0][:, None], sin[0][:, None]  # (Ttot, 1, hd)
        taps = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)[0]  # (Ttot, d)
            q = attn.q_norm(attn.q_proj(h).view(-1, attn.config.num_attention_heads, self.hd))
            k = attn.k_norm(attn.k_proj(h).view(-1, self.kvh, self.hd))
            v = attn.v_proj(h).view(-1, self.kvh, self.hd)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (Ttot, H|KVH, hd)
            self.k[i][slot_t[row], :, pos] = k
            self.v[i][slot_t[row], :, pos] = v
            qp = q.new_zeros(R, nmax, q.shape[1], self.hd)
            qp[row, col] = q
            keys, vals = self.k[i][slot_t, :, :L], self.v[i][slot_t, :, :L]  # (R, KVH, L, hd)
            o = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, vals, attn_mask=mask, enable_gqa=True,
                                               scale=attn.scaling)  # (R, H, nmax, hd)
            o = o.transpose(1, 2)[row, col].reshape(1, -1, q.shape[1] * self.hd)  # (1, Ttot, H*hd)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.taps:
                taps.append(x[0])
        for s, e in zip(slots, end):
            self.lengths[s] = e
        logits = self.model.lm_head(self.base.norm(x))[0]  # (Ttot, V)
        feats = torch.stack(taps, 1) if taps else logits.new_zeros(len(ids), 0, x.shape[-1])  # (Ttot, m, d)
        return StepOutput(list(logits.split(n)), list(feats.split(n)))
