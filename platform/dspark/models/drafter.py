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
    """The drafter's context of every request in ONE buffer per draft layer, k and v each (slots, KVH,
    capacity, hd), as the target runner keeps its KV cache: a request's state lives in its slot's rows (the
    decoder gives it the request's target slot), so a round over requests in consecutive slots reads their
    contexts as one view (`pad_states`), and the block a round drafts is written after them in place. The
    capacity doubles when a slot needs more (every slot's rows move once: O(L) copies in all)."""

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

    def ensure(self, need: int, like: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> None:
        """Room for `need` positions per slot; `like` (per layer k, v of shape (KVH, n, hd)) gives the shapes
        and dtype of a cache not allocated yet."""
        capacity = self.k[0].shape[2] if self.k else 0
        if self.k and need <= capacity:
            return
        capacity = max(need, 2 * capacity, 64)
        for i, store in enumerate((self.k, self.v)):
            shapes = [t[0] for t in store] if store else [kv[i] for kv in like]  # (KVH, *, hd) per layer
            grown = [t.new_zeros(self.slots, t.shape[0], capacity, t.shape[-1]) for t in shapes]  # all first
            for layer, old in enumerate(store):
                grown[layer][:, :, : old.shape[2]] = old
            store[:] = grown


@dataclass
class DraftState:
    """Per-request drafter cache: per draft layer (k, v) whose first `length` positions are the committed
    context, in the request's slot of a `DraftCache`: the decoder's, shared by its requests, or, for a state
    made alone (profiling, tests), a cache of one slot made at its first append."""

    length: int = 0  # committed context positions 0 .. length-1
    extra: dict = field(default_factory=dict)  # drafter-specific (e.g. EAGLE-3's last hidden state)
    cache: Optional[DraftCache] = None
    slot: int = 0  # its rows in `cache`

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) views of shape (KVH, length, hd)."""
        if self.cache is None:
            return []
        return [
            (k[self.slot, :, : self.length], v[self.slot, :, : self.length]) for k, v in zip(self.cache.k, self.cache.v)
        ]

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """layer_kv: per layer (k, v) of shape (KVH, n, hd) for the new positions."""
        if self.cache is None:
            self.cache, self.slot = DraftCache(1), 0
        end = self.length + n
        self.cache.ensure(end, layer_kv)
        for kb, vb, (k, v) in zip(self.cache.k, self.cache.v, layer_kv):
            kb[self.slot, :, self.length : end] = k
            vb[self.slot, :, self.length : end] = v
        self.length = end


def pad_states(states: list[DraftState], n_layers: int, room: int = 0):
    """The requests' caches as (R, KVH, Cmax + room, hd) per layer plus a (R, Cmax) validity mask: positions
    past a request's length are masked out, and the last `room` columns are free for the caller to write
    (the block a round drafts: `block_attention`), in place of a concatenation. Requests in consecutive
    slots of one DraftCache (in slot order; one request alone) are handed over as views, without a copy,
    other slots of one cache gathered in one indexing per layer, states of several caches copied."""
    R, cmax = len(states), max(s.length for s in states)
    cache, first = states[0].cache, states[0].slot
    lengths = torch.tensor([s.length for s in states], device=cache.k[0].device)
    valid = torch.arange(cmax, device=lengths.device)[None, :] < lengths[:, None]  # (R, Cmax)
    width = cmax + room
    if all(s.cache is cache for s in states):
        cache.ensure(width)
        consecutive = all(s.slot == first + r for r, s in enumerate(states))
        rows = slice(first, first + R) if consecutive else torch.tensor([s.slot for s in states], device=valid.device)
        return [(k[rows, :, :width], v[rows, :, :width]) for k, v in zip(cache.k[:n_layers], cache.v[:n_layers])], valid
    out = []
    for layer in range(n_layers):
        ref = cache.k[layer]
        k, v = ref.new_zeros(R, ref.shape[1], width, ref.shape[3]), ref.new_zeros(R, ref.shape[1], width, ref.shape[3])
        for r, s in enumerate(states):
            k[r, :, : s.length], v[r, :, : s.length] = s.kv[layer]
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
