"""What every drafter provides to training and to speculative decoding.

A drafter may have a reduced draft vocabulary (EAGLE-3's): its LM head and Markov W2 score only
V_d of the target's V tokens (the most frequent in the training responses), and every distribution
it proposes from is given over those V_d ids (`Proposal.vocab`), q(v) = 0 outside. Verification needs
nothing else: q is just another distribution, so the output law stays the target's.

Decoding keeps one `DraftState` per request. After the target commits tokens, `extend` appends the
target features of the new positions (and, per position, the token that follows it: the last one
is the new anchor). `propose` then drafts gamma tokens after each request's anchor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from dspark.errors import UserError
from dspark.models.config import DrafterConfig
from dspark.models.layers import DraftLayer, FrozenTargetHead
from dspark.target import packed

# sample(logits (R, V)) -> (tokens (R,), probabilities (R, V) or None when greedy); with a draft vocabulary
# sample(logits (R, V_d), ids (V_d,), V): the columns score target ids `ids`, the rest have probability 0;
# the tokens are target ids, the probabilities (R, V_d) over the columns
Sampler = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass
class Proposal:
    tokens: torch.Tensor  # (R, gamma) long, target ids
    # (R, gamma, V_d) the q_k the tokens were sampled from, over the target ids `vocab` (V_d,) (None: all V,
    # V_d = V); q is 0 at every other id. None when greedy
    probs: Optional[torch.Tensor]
    conf_logit: Optional[torch.Tensor]  # (R, gamma) confidence-head logits; None without a head
    vocab: Optional[torch.Tensor] = None


class DraftCache:
    """Every request's drafter context in ONE buffer per draft layer, k and v each (slots, KVH, capacity,
    hd), as the target runner keeps its KV cache: request r's state lives in slot r's rows (the decoder
    gives it the target slot of the request), so a round over requests in consecutive slots reads their
    contexts as one view (`pad_states`) instead of copying each into a padded batch. The capacity doubles
    when a slot needs more (every slot's rows move once: O(L) copies in all)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.k: list[torch.Tensor] = []  # per layer (slots, KVH, capacity, hd); allocated at the first append
        self.v: list[torch.Tensor] = []

    def state(self, slot: int) -> "DraftState":
        """A request's empty state in `slot` (rows left by an earlier request are zeroed: a masked position of
        attention must hold a finite value)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"draft cache slot {slot} not in 0..{self.slots - 1}")
        for t in self.k + self.v:
            t[slot].zero_()
        return DraftState(cache=self, slot=slot)

    def ensure(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], need: int) -> None:
        """Room for `need` positions per slot; layer_kv (per layer (KVH, n, hd)) gives the shapes and dtype."""
        capacity = self.k[0].shape[2] if self.k else 0
        if need <= capacity:
            return
        capacity = max(need, 2 * capacity, 64)
        for store, i in ((self.k, 0), (self.v, 1)):
            grown = [
                x[i].new_zeros(self.slots, x[i].shape[0], capacity, x[i].shape[2]) for x in layer_kv
            ]  # all allocated before any is swapped in
            for layer, old in enumerate(store):
                grown[layer][:, :, : old.shape[2]] = old
            store[:] = grown


@dataclass
class DraftState:
    """Per-request drafter cache: per draft layer (k, v) of shape (KVH, capacity, hd) whose first `length`
    positions are the committed context, in the request's slot of a shared `DraftCache` (decoding), or in
    buffers of its own (cache None: profiling, tests). The capacity doubles when full, so appending L
    positions copies O(L) in all (concatenating the whole cache every round copied O(L^2))."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    length: int = 0  # committed context positions 0 .. length-1
    extra: dict = field(default_factory=dict)  # drafter-specific (e.g. EAGLE-3's last hidden state)
    cache: Optional[DraftCache] = None
    slot: int = -1  # its rows in `cache`

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) views of shape (KVH, length, hd)."""
        if self.cache is not None:
            return [
                (k[self.slot, :, : self.length], v[self.slot, :, : self.length])
                for k, v in zip(self.cache.k, self.cache.v)
            ]
        return [(k[:, : self.length], v[:, : self.length]) for k, v in self.buffers]

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """layer_kv: per layer (k, v) of shape (KVH, n, hd) for the new positions."""
        end = self.length + n
        if self.cache is not None:
            self.cache.ensure(layer_kv, end)
            stores = [(k[self.slot], v[self.slot]) for k, v in zip(self.cache.k, self.cache.v)]
        else:
            capacity = self.buffers[0][0].shape[1] if self.buffers else 0
            if not self.buffers or end > capacity:
                capacity = max(end, 2 * capacity, 64)
                old = self.buffers or layer_kv  # the first append: only the shapes and dtype matter
                self.buffers = [(_grown(k, self.length, capacity), _grown(v, self.length, capacity)) for k, v in old]
            stores = self.buffers
        for (kb, vb), (k, v) in zip(stores, layer_kv):
            kb[:, self.length : end] = k
            vb[:, self.length : end] = v
        self.length = end


def _grown(t: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A (KVH, capacity, hd) buffer holding the first `length` positions of t (KVH, *, hd)."""
    out = t.new_empty(t.shape[0], capacity, t.shape[2])
    out[:, :length] = t[:, :length]
    return out


def pad_states(states: list[DraftState], n_layers: int):
    """Stack per-request caches into (R, KVH, Cmax, hd) per layer plus a (R, Cmax) validity mask (read-only).
    One request's cache, or requests in consecutive slots of one DraftCache (in slot order), are handed
    over as views, without a copy; other slots of one cache are gathered in one indexing per layer;
    positions past a request's length are masked out."""
    R = len(states)
    cmax = max(s.length for s in states)
    ref = states[0].kv[0][0]
    lengths = torch.tensor([s.length for s in states], device=ref.device)
    valid = torch.arange(cmax, device=ref.device)[None, :] < lengths[:, None]  # (R, Cmax)
    if R == 1:
        return [(k[None], v[None]) for k, v in states[0].kv[:n_layers]], valid
    cache, first = states[0].cache, states[0].slot
    if cache is not None and all(s.cache is cache for s in states):  # one view, or one gather of the rows
        consecutive = all(s.slot == first + r for r, s in enumerate(states))
        rows = slice(first, first + R) if consecutive else torch.tensor([s.slot for s in states], device=ref.device)
        return [(k[rows, :, :cmax], v[rows, :, :cmax]) for k, v in zip(cache.k[:n_layers], cache.v[:n_layers])], valid
    kvh, hd = ref.shape[0], ref.shape[2]
    out = []
    for layer in range(n_layers):
        k = ref.new_zeros(R, kvh, cmax, hd)
        v = ref.new_zeros(R, kvh, cmax, hd)
        for r, s in enumerate(states):
            k[r, :, : s.length] = s.kv[layer][0]
            v[r, :, : s.length] = s.kv[layer][1]
        out.append((k, v))
    return out, valid


def select_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of `counts` (V,) (ties: the lower id), in increasing order."""
    if not 0 < size <= counts.numel():
        raise UserError(f"train.draft_vocab: {size} must be between 1 and the target's vocabulary {counts.numel()}")
    top = torch.sort(counts, descending=True, stable=True).indices[:size]  # stable: ties keep the lower id
    return top.sort().values


class Drafter(nn.Module):
    """Base class: holds the config, the frozen target embedding/lm_head and the draft vocabulary."""

    def __init__(self, c: DrafterConfig, head: FrozenTargetHead):
        super().__init__()
        self.c = c
        self.head = head
        # draft_ids (V_d,): the target ids of the draft vocabulary, saved with the weights (None = all V);
        # t2d (V,): target id -> draft index or -1; draft_lm_head (V_d, d): lm_head rows of draft_ids
        self.register_buffer("draft_ids", torch.arange(c.draft_vocab) if c.draft_vocab else None)
        self.register_buffer("t2d", None, persistent=False)
        self.register_buffer("draft_lm_head", None, persistent=False)
        self.packed_lm_head = None  # prepack: the oneDNN-packed copy of the LM head the drafter scores with
        if c.draft_vocab:
            self._index_draft_vocab()
            self.register_load_state_dict_post_hook(lambda module, _keys: module._index_draft_vocab())

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """ids (V_d,): increasing target token ids (select_draft_vocab); before training."""
        if self.draft_ids is None or ids.shape != self.draft_ids.shape:
            raise UserError(f"a draft vocabulary of shape {tuple(ids.shape)} for draft_vocab={self.c.draft_vocab}")
        self.draft_ids.copy_(ids)
        self._index_draft_vocab()

    @torch.no_grad()
    def _index_draft_vocab(self) -> None:
        ids = self.draft_ids.to(self.head.lm_head_weight.device)
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):  # verification looks drafts up in order
            raise UserError("draft_ids: the draft vocabulary's target ids must be strictly increasing")
        self.t2d = torch.full((self.c.vocab_size,), -1, dtype=torch.long, device=ids.device)
        self.t2d[ids] = torch.arange(ids.numel(), device=ids.device)
        self.draft_lm_head = self.head.lm_head_weight[ids]
        self.packed_lm_head = None  # packed from the old rows

    def pack_like(self, target_model: nn.Module) -> int:
        """Beside a target whose linears are packed (target.cpu_prepack): every linear and the LM head the
        drafter scores with run from oneDNN-packed weights too, and each draft layer's linears of one input
        as one product (`DraftLayer.stack`). Inference only (no gradients); the weights, the state dict and
        what exports read are unchanged. Returns how many linears were packed (0: none)."""
        n = packed.prepack(self) if packed.is_packed(target_model) else 0
        if n:
            self.packed_lm_head = packed.pack(
                self.head.lm_head_weight if self.draft_lm_head is None else self.draft_lm_head
            )
            for layer in self.modules():
                if isinstance(layer, DraftLayer):
                    layer.stack()
        return n

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d) -> logits over the draft vocabulary (..., V_d); (..., V) without one."""
        if self.packed_lm_head is not None and h.dtype == self.head.lm_head_weight.dtype:  # packed in that dtype
            return packed.linear(h, self.packed_lm_head)
        if self.draft_ids is None:
            return self.head.logits(h)
        return h @ self.draft_lm_head.T.to(h.dtype)

    def to_target_vocab(self, u: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., V_d) -> (..., V) with -inf outside it (q = 0 there)."""
        if self.draft_ids is None:
            return u
        out = u.new_full((*u.shape[:-1], self.c.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, u)

    def sample(self, sample: Sampler, u: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Draft tokens (target ids) from draft-vocabulary logits u (R, V_d) (V without one) and q (R, V_d)."""
        if self.draft_ids is None:
            return sample(u)
        return sample(u, self.draft_ids, self.c.vocab_size)

    def proposal(
        self, tokens: list[torch.Tensor], probs: list[Optional[torch.Tensor]], conf_logit: Optional[torch.Tensor] = None
    ) -> Proposal:
        """A round's drafts from what `sample` returned per position (each (R,) and (R, V_d) or None) and
        the confidence logits (R, gamma), if any."""
        q = None if probs[0] is None else torch.stack(probs, 1)
        return Proposal(torch.stack(tokens, 1), q, conf_logit, self.draft_ids)

    @property
    def has_confidence(self) -> bool:
        return False

    def train_outputs(
        self, feats: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor, gamma: int
    ) -> dict[str, torch.Tensor]:
        """Teacher-forced drafts for N anchors per sequence.

        feats (B, T, m, d), ids (B, T), valid (B, T), anchors (B, N) anchor positions p.
        Returns logits (B, N, gamma, V_d) (the draft vocabulary's) for the tokens at p+1 .. p+gamma, and
        conf_logit (B, N, gamma) when the drafter has a confidence head."""
        raise NotImplementedError

    def extend(self, states: list[DraftState], feats: list[torch.Tensor], next_tokens: list[torch.Tensor]) -> None:
        """Append committed positions. feats[r]: (n_r, m, d); next_tokens[r]: (n_r,) the token after each."""
        raise NotImplementedError

    def propose(self, states: list[DraftState], anchors: torch.Tensor, gamma: int, sample: Sampler) -> Proposal:
        """Draft gamma tokens after each request's anchor token (at position states[r].length)."""
        raise NotImplementedError

    def release(self, state: DraftState) -> None:
        """A request finished: free what its state holds beyond plain tensors (default: nothing)."""
