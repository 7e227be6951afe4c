"""DSpark = parallel backbone + sequential Markov head + confidence head.  DFlash = the backbone alone.

Drafting one round (anchor x_0 at position p):
    h_1..h_gamma = backbone([x_0, MASK, ..]),   U_k = lm_head(h_k) over V_d    one parallel forward
    for k = 1..gamma:                                                           cheap sequential loop
        p_k = softmax(U_k + B_k(x_{<k}))   x_k ~ p_k   c_k = σ(w·[h_k; W1[x_{k-1}]] + b)
DFlash samples every slot from softmax(U_k) independently.

The fill-in block (`sample_from_anchor: false`, z-lab's DFlash): the backbone reads gamma + 1 slots
[x_0, MASK x gamma] at positions p .. p+gamma and h_k is the output at the k-th mask (position p+k),
the slot of the token it predicts; the anchor's own output is not used. Everything after is the same.
"""

from __future__ import annotations

import itertools

import torch

from dspark.models.backbone import ParallelBackbone, block_positions, packed_mask
from dspark.models.config import DrafterConfig
from dspark.models.drafter import Drafter, DraftState, Proposal, Sampler, pad_states
from dspark.models.layers import FrozenTargetHead
from dspark.models.markov import ConfidenceHead, MarkovHead


class DSpark(Drafter):
    def __init__(self, c: DrafterConfig, head: FrozenTargetHead):
        super().__init__(c, head)
        self.backbone = ParallelBackbone(c)
        self.markov = MarkovHead(c) if c.markov != "none" else None
        self.confidence = ConfidenceHead(c) if self.markov is not None else None

    @property
    def has_confidence(self) -> bool:
        return self.confidence is not None

    def _block(self, anchor_tokens: torch.Tensor, L: int) -> torch.Tensor:
        """anchor_tokens (..., ) -> block ids (..., L): [x_0, MASK, ..., MASK]."""
        block = torch.full(
            (*anchor_tokens.shape, L), self.c.mask_token_id, dtype=torch.long, device=anchor_tokens.device
        )
        block[..., 0] = anchor_tokens
        return block

    def train_outputs(self, feats, ids, valid, anchors, gamma):
        B, T = ids.shape
        N, L = anchors.shape[1], self.c.block_len(gamma)
        pos_ctx = torch.arange(T, device=ids.device).expand(B, T)
        ctx_kv = self.backbone.context_kv(feats, pos_ctx)
        block = self._block(ids.gather(1, anchors), L)  # (B, N, L)
        x = self.head.embed(block.reshape(B, N * L)).to(feats.dtype)  # (B, N*L, d)
        h = self.backbone(x, block_positions(anchors, L), ctx_kv, packed_mask(anchors, valid, L), L)
        h = h.view(B, N, L, -1)[:, :, L - gamma :]  # (B, N, G, d): the slots that predict x_{p+1..p+G}
        logits = self.logits(h)  # (B, N, G, V_d) base logits U
        out = {"hidden": h}
        if self.markov is not None:
            # teacher forcing: slot k's previous token is the ground truth x_{p+k} (slot 0: the anchor)
            prev_pos = (anchors[:, :, None] + torch.arange(gamma, device=ids.device)).clamp(max=T - 1)  # (B, N, G)
            prev = ids.gather(1, prev_pos.view(B, -1)).view(B * N, gamma)
            bias, e = self.markov.parallel(h.reshape(B * N, gamma, -1), prev)
            logits = logits + bias.view(B, N, gamma, -1)
            out["conf_logit"] = self.confidence(h, e.view(B, N, gamma, -1))  # (B, N, G)
        out["logits"] = logits
        return out

    @torch.no_grad()
    def extend(self, states: list[DraftState], feats: list[torch.Tensor], next_tokens: list[torch.Tensor]) -> None:
        # every request's new rows in ONE projection: fusion, k/v projections and RoPE act per token,
        # so flattening requests is exact (and one call instead of one per request)
        n = [f.shape[0] for f in feats]
        pos = torch.cat([torch.arange(s.length, s.length + k, device=f.device) for s, f, k in zip(states, feats, n)])
        flat = torch.cat(feats)[None].to(self.backbone.fusion.proj.weight.dtype)  # (1, sum n, m, d)
        kv = self.backbone.context_kv(flat, pos[None])  # per layer (1, KVH, sum n, hd)
        for s, (a, b) in zip(states, zip(itertools.accumulate([0] + n[:-1]), itertools.accumulate(n))):
            s.append([(k[0, :, a:b], v[0, :, a:b]) for k, v in kv], b - a)

    @torch.no_grad()
    def propose(self, states: list[DraftState], anchors: torch.Tensor, gamma: int, sample: Sampler) -> Proposal:
        R, L = len(states), self.c.block_len(gamma)
        ctx_kv, valid = pad_states(states, len(self.backbone.layers), room=L)  # the block is written after it
        p = torch.tensor([s.length for s in states], device=anchors.device)  # anchor positions
        pos = p[:, None] + torch.arange(L, device=anchors.device)  # (R, L)
        x = self.head.embed(self._block(anchors, L)).to(ctx_kv[0][0].dtype)  # (R, L, d)
        h = self.backbone(x, pos, ctx_kv, valid[:, None, None, :].expand(R, 1, L, -1), L)[:, L - gamma :]  # (R, G, d)
        U = self.logits(h).float()  # (R, G, V_d)
        if self.markov is None:  # DFlash: every slot independently
            toks, probs = zip(*(self.sample(sample, U[:, k]) for k in range(gamma)))
            return self.proposal(toks, probs)
        toks, probs, es = [], [], []
        prev, state = anchors, self.markov.init_state(R, h.device, h.dtype)
        for k in range(gamma):  # only what x_k needs is sequential
            bias, e, state = self.markov.step(h[:, k], prev, state)
            tok, q = self.sample(sample, U[:, k] + bias.float())
            toks.append(tok)
            probs.append(q)
            es.append(e)
            prev = tok
        conf = self.confidence(h, torch.stack(es, 1)).float()  # (R, G): every slot's c_k in one call
        return self.proposal(toks, probs, conf)
