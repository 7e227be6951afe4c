"""The target's forward for decoding: many requests' new tokens in ONE flattened forward, each at its
own positions against its own KV cache, returning logits and the drafter's tapped features.

It runs the weights of an HF decoder-only model of a supported family (embed, decoder layers, final
norm, lm_head, rotary embedding; see FAMILIES for how they differ) with a slot-based KV cache:
request r owns slot s with keys/values (KVH, capacity, hd) per layer and a length. Rolling back
rejected drafts is setting the length back. Attention is SDPA over the active slots, padded to the
longest, with each layer's sliding window in the mask; device and dtype are the model's own (CPU
float32 here, CUDA bf16 in production).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dspark.errors import UserError
from dspark.target.packed import PackedLinear


@dataclass
class StepOutput:
    logits: list[torch.Tensor]  # per request (n_r, V); (1, V) at its last new token with last_only
    taps: list[torch.Tensor]  # per request (n_r, m, d): tapped layer outputs for the drafter


@dataclass(frozen=True)
class Family:
    """How a family's decoder layer differs from Llama's (projection biases, embedding scale and attention
    scale live in the HF modules the runner calls, so they need no flag)."""

    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma3)
    sandwich_norm: bool = False  # attention and MLP outputs normed before the residual add (Gemma3)
    rope_per_layer_type: bool = False  # sliding and full layers use different rotary tables (Gemma3)
    unit_offset_norm: bool = False  # RMSNorm scales n = x / rms(x) by 1 + w in float32, then casts (Gemma3)

    def norms(self) -> list[str]:
        """The RMSNorm modules of a decoder layer, by their names in it."""
        names = ["input_layernorm", "post_attention_layernorm"]
        if self.sandwich_norm:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        return names + (["self_attn.q_norm", "self_attn.k_norm"] if self.qk_norm else [])


FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(qk_norm=True, sandwich_norm=True, rope_per_layer_type=True, unit_offset_norm=True),
}


class FusedRMSNorm:
    """An HF RMSNorm module's forward as one fused normalisation and one product: n = x / rms(x) in float32,
    then w * n.to(dtype) (Llama, Mistral, Qwen2, Qwen3) or (n * (1 + w)).to(dtype) in float32 (Gemma3,
    `unit_offset`). The module's result up to the summation order of rms(x) (the same bits on the CPU in
    float32, bfloat16 and float16), in about 3/4 of its time: a step calls 2, 4 or 6 per layer, and at batch
    1 on a small target their Python ops are a share of the step (the built-in target, one thread: 25 of
    them, 19 us each against 14). It reads the module's weight at each call."""

    def __init__(self, module: nn.Module, unit_offset: bool):
        self.module, self.unit_offset = module, unit_offset
        self.eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        self.shape = (module.weight.shape[-1],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = F.rms_norm(x.float(), self.shape, eps=self.eps)
        if self.unit_offset:
            return (n * (1.0 + self.module.weight.float())).type_as(x)
        return self.module.weight * n.to(x.dtype)


def family(cfg) -> Family:
    """The runner's description of a target's family; unsupported features are refused by name."""
    fam = FAMILIES.get(cfg.model_type)
    if fam is None:
        raise UserError(
            f"target: model type {cfg.model_type!r} is not supported by the decoding runner "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise UserError("target: attention logit soft-capping is not supported by the decoding runner")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UserError("target: bidirectional attention is not supported by the decoding runner")
    return fam


def layer_types(cfg) -> list[str]:
    """Each layer's attention: "sliding_attention" or "full_attention". Families without
    `layer_types` (Mistral) slide on every layer when `sliding_window` is set."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        sliding = getattr(cfg, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * cfg.num_hidden_layers
    return list(types)


@dataclass
class _Ragged:
    """Where each of the Ttot flattened new tokens of one forward belongs."""

    slots: torch.Tensor  # (R,) the slot of each request
    # the cache rows attention reads as one view (span.start .. span.stop - 1: the slots, and slots between
    # them that no request of this forward holds, whose rows are computed and dropped), else None: a gathered copy
    span: Optional[slice]
    rows: int  # B, attention's batch: the span's length, else R
    row: torch.Tensor  # (Ttot,) each token's row of that batch: its request, or its slot - span.start
    col: torch.Tensor  # (Ttot,) its index among its request's new tokens
    pos: torch.Tensor  # (Ttot,) its position in its sequence
    slot: torch.Tensor  # (Ttot,) its request's slot
    nmax: int  # most new tokens of one request
    L: int  # longest sequence after this forward
    uniform: bool  # B = R and every request appends nmax tokens: the Ttot tokens are (B, nmax) as they lie


def attention_span(slots: list[int]) -> Optional[slice]:
    """The cache rows a forward's attention reads as one view, for its requests' slots (ascending, distinct):
    from the first slot to the last, where no more than half as many rows between them are held by no
    request of the forward (a server whose middle slots freed: their rows are computed and dropped); None
    where the gaps are wider: the slots' rows are copied. Copying every layer's KV of the slots cost more
    than attending to the extra rows (the built-in target, one thread, 15 requests around a free slot:
    6.1-6.5 ms a step against 7.0-7.4 copied, 5.5-6.1 with no gap; 8 requests in every other slot of 16:
    about equal)."""
    width = slots[-1] - slots[0] + 1
    return slice(slots[0], slots[-1] + 1) if 2 * width <= 3 * len(slots) else None


def _mask(j: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, 1, nmax, L) boolean: key j is visible to the query at position q iff q - window < j <= q."""
    visible = j[None, None, :] <= qpos[:, :, None]
    if window is not None:
        visible &= j[None, None, :] > qpos[:, :, None] - window
    return visible[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class TargetRunner:
    def __init__(self, model, tap_layers: list[int], max_slots: int = 8, capacity: int = 512, max_len: int = 0):
        """capacity: initial KV positions per slot (grown on demand); max_len: the most positions a slot
        may ever hold (0 = the target's max_position_embeddings), which bounds the cache's memory at
        max_slots x max_len positions per layer."""
        cfg = model.config
        self.family, self.types = family(cfg), layer_types(cfg)
        self.windows = [cfg.sliding_window if t == "sliding_attention" else None for t in self.types]
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.model, self.taps = model, list(tap_layers)
        self.base = model.model
        self.layers = self.base.layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.nh, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.max_len = min(max_len or self.max_positions, self.max_positions)
        capacity = min(capacity, self.max_len)
        self.k = [
            torch.zeros(max_slots, self.kvh, capacity, self.hd, device=self.device, dtype=self.dtype)
            for _ in self.layers
        ]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.lengths = [0] * max_slots
        self.free_slots = list(range(max_slots - 1, -1, -1))
        # a packed target's projections of the same input as one product each (None: the modules' own)
        self.qkv = [
            PackedLinear.stacked([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers
        ]
        self.gate_up = [PackedLinear.stacked([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        # each layer's RMSNorms by name ("input_layernorm", "self_attn.q_norm", ..), fused; and the final one
        fused = functools.partial(FusedRMSNorm, unit_offset=self.family.unit_offset_norm)
        self.norms = [{name: fused(l.get_submodule(name)) for name in self.family.norms()} for l in self.layers]
        self.final_norm = fused(self.base.norm)

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
    def forward(self, slots: list[int], tokens: list[torch.Tensor], last_only: bool = False) -> StepOutput:
        """Append tokens[r] (n_r,) to slot slots[r]; returns logits and taps for every new token. last_only:
        logits at each request's last new token alone (a prefill: its first output token needs no other row,
        and the LM head over every prompt token cost SmolLM2 a fifth of a prefill's products); taps still at
        every token."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        if order != list(range(len(slots))):  # by slot: a server whose slots are all busy reads its KV as a view
            out = self.forward([slots[i] for i in order], [tokens[i] for i in order], last_only)
            back = sorted(range(len(order)), key=order.__getitem__)  # request r's place in the sorted forward
            return StepOutput([out.logits[k] for k in back], [out.taps[k] for k in back])
        n = [int(t.numel()) for t in tokens]
        nmax = max(n)
        start = [self.lengths[s] for s in slots]
        end = [a + b for a, b in zip(start, n)]
        if max(end) > self.max_len:
            raise UserError(f"context of {max(end)} tokens exceeds the limit of {self.max_len} positions per request")
        self._ensure(max(end))
        ids = torch.cat(tokens).to(self.device)  # (Ttot,)
        dev, n_t = self.device, torch.tensor(n, device=self.device)
        # each new token's request, index among that request's new tokens and position in its sequence
        row = torch.repeat_interleave(torch.arange(len(n), device=dev), n_t, output_size=len(ids))  # (Ttot,)
        col = torch.arange(len(ids), device=dev) - (n_t.cumsum(0) - n_t)[row]  # (Ttot,)
        pos = torch.tensor(start, device=dev)[row] + col  # (Ttot,)
        slot_t = torch.tensor(slots, device=self.device)
        L = max(end)
        assert len(set(slots)) == len(slots), f"a slot twice in one forward: {slots}"
        span = attention_span(slots)  # (the slots are in order: sorted above)
        B = span.stop - span.start if span is not None else len(slots)  # attention's batch
        # query t of request r sees key j iff  q - window < j <= q  with q = start_r + t (its cache and its
        # own earlier new tokens; no lower bound on full-attention layers)
        j = torch.arange(L, device=self.device)
        qpos = torch.tensor(start, device=self.device)[:, None] + torch.arange(nmax, device=self.device)  # (R, nmax)
        batch_row = row  # each token's row of attention's batch
        if B > len(slots):  # the span holds rows no request of this forward has: at position 0 they see key 0
            at = slot_t - span.start  # (R,) each request's row
            qpos, batch_row = qpos.new_zeros(B, nmax).index_copy_(0, at, qpos), at[row]  # (B, nmax)
        # window -> (B, 1, G * nmax, L): row (g, t) is token t's mask, for the G query heads of a KV head
        masks = {w: _mask(j, qpos, w).repeat(1, 1, self.nh // self.kvh, 1) for w in set(self.windows)}
        uniform = B == len(slots) and min(n) == nmax
        where = _Ragged(slot_t, span, B, batch_row, col, pos, slot_t[row], nmax, L, uniform)

        x = self.base.embed_tokens(ids[None])  # (1, Ttot, d); Gemma3's module scales by sqrt(d)
        rope = self._rope(x, pos)
        taps = []
        for i, layer in enumerate(self.layers):
            cos, sin, norm = *rope[self.types[i]], self.norms[i]
            o = self._attention(
                i, layer.self_attn, norm["input_layernorm"](x)[0], cos, sin, where, masks[self.windows[i]]
            )
            if self.family.sandwich_norm:
                x = x + norm["post_attention_layernorm"](o)
                x = x + norm["post_feedforward_layernorm"](
                    self._mlp(i, layer.mlp, norm["pre_feedforward_layernorm"](x))
                )
            else:
                x = x + o
                x = x + self._mlp(i, layer.mlp, norm["post_attention_layernorm"](x))
            if i in self.taps:
                taps.append(x[0])
        for s, e in zip(slots, end):
            self.lengths[s] = e
        feats = torch.stack(taps, 1) if taps else x.new_zeros(len(ids), 0, x.shape[-1])  # (Ttot, m, d)
        if last_only:
            x = x[:, n_t.cumsum(0) - 1]  # (1, R, d): each request's last new token
        logits = self.model.lm_head(self.final_norm(x))[0]  # (Ttot, V), or (R, V) with last_only
        if self.softcap is not None:  # Gemma: logits = c * tanh(logits / c)
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return StepOutput(list(logits.split(1 if last_only else n)), list(feats.split(n)))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> dict:
        """layer type -> (cos, sin), each (Ttot, 1, hd)."""
        if self.family.rope_per_layer_type:
            tables = {t: self.base.rotary_emb(x, pos[None], t) for t in set(self.types)}
        else:
            tables = dict.fromkeys(set(self.types), self.base.rotary_emb(x, pos[None]))
        return {t: (cos[0][:, None], sin[0][:, None]) for t, (cos, sin) in tables.items()}

    def _mlp(self, i: int, mlp, h: torch.Tensor) -> torch.Tensor:
        """Layer i's gated MLP, down(act(gate h) * up h), with gate and up as one product where packed."""
        if self.gate_up[i] is None:
            return mlp(h)
        gate, up = self.gate_up[i](h).chunk(2, -1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _attention(self, i: int, attn, h: torch.Tensor, cos, sin, where: _Ragged, mask) -> torch.Tensor:
        """Layer i's attention for the flattened new tokens h (Ttot, d): stores their keys/values in
        their slots, attends each request over its own slot, returns the o_proj output (1, Ttot, d)."""
        H, row, col = self.nh, where.row, where.col
        if self.qkv[i] is None:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            q, k, v = self.qkv[i](h).split([H * self.hd, self.kvh * self.hd, self.kvh * self.hd], -1)
        q, k, v = q.view(-1, H, self.hd), k.view(-1, self.kvh, self.hd), v.view(-1, self.kvh, self.hd)
        if self.family.qk_norm:
            q, k = self.norms[i]["self_attn.q_norm"](q), self.norms[i]["self_attn.k_norm"](k)
        q, k = _rotate(torch.cat([q, k], 1), cos, sin).split([H, self.kvh], 1)  # (Ttot, H|KVH, hd)
        self.k[i][where.slot, :, where.pos] = k
        self.v[i][where.slot, :, where.pos] = v
        B, G = where.rows, H // self.kvh  # G query heads share a KV head: head h reads KV head h // G
        if where.uniform:
            qp = q.view(B, where.nmax, H, self.hd)
        else:
            qp = q.new_zeros(B, where.nmax, H, self.hd)
            qp[row, col] = q
        at = where.span if where.span is not None else where.slots  # a view of the cache, else a gathered copy
        keys = self.k[i][at, :, : where.L]  # (B, KVH, L, hd)
        vals = self.v[i][at, :, : where.L]
        # the G query heads of a KV head as G x nmax query rows of it, each with its token's mask: the same
        # result as enable_gqa, which on CPU took 4-8x longer when decoding (SmolLM2's shapes, bf16)
        qg = qp.transpose(1, 2).reshape(B, self.kvh, G * where.nmax, self.hd)  # rows (g, t) of KV head kv
        o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=attn.scaling)  # (B, KVH, G * nmax, hd)
        o = o.view(B, H, where.nmax, self.hd).transpose(1, 2)  # (B, nmax, H, hd)
        o = o.reshape(1, -1, H * self.hd) if where.uniform else o[row, col].reshape(1, -1, H * self.hd)
        return attn.o_proj(o)  # (1, Ttot, d)
