"""EAGLE-3 baseline: the standard EAGLE-3 draft layer over fused target features.

Position t's context is g_t = fc([taps at t]) (m·d -> d, no norm), paired with the next token x_{t+1}.
The layer's attention reads [input_norm(emb(x_{t+1})); hidden_norm(g_t)] (2d wide: q/k/v are 2d -> ..),
its residual stream starts at g_t, and norm(output) predicts x_{t+2}. While drafting, the layer's own
output h replaces g for the next step (so drafting cost grows linearly with gamma). This is EAGLE-3 as
speculators / vLLM load it (fc, layers.0.{input_layernorm, hidden_norm, self_attn, mlp}, norm;
norm_before_residual = false). Training-time test (TTT) reproduces drafting:

    step 0: all positions at once, causal attention over real (target-feature) positions
    step k: for each anchor, input [emb(x_{p+k}); h^{k-1}] at position p+k-1, attending to the
            step-0 keys at positions <= p-1 plus its own chain of steps 1..k

Loss: soft cross-entropy against the target distribution, step weight 0.8^k (see dspark.train.loss).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.config import DrafterConfig
from dspark.models.drafter import Drafter, DraftState, Proposal, Sampler, pad_states
from dspark.models.layers import DraftLayer, FrozenTargetHead


class Eagle3(Drafter):
    def __init__(self, c: DrafterConfig, head: FrozenTargetHead):
        super().__init__(c, head)
        d = c.hidden_size
        self.fc = nn.Linear(c.m * d, d, bias=False)  # fused taps g (.., m·d) -> (.., d)
        self.hidden_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.layer = DraftLayer(c, attn_width=2)  # its input_norm normalises the embeddings
        self.norm = nn.RMSNorm(d, eps=c.rms_norm_eps)

    def fusion(self, feats: torch.Tensor) -> torch.Tensor:  # (.., m, d) -> (.., d)
        return self.fc(feats.flatten(-2))

    def _step(self, tokens, hidden, pos, prefix, mask):
        """One pass of the layer: tokens (B, Q) with hidden (B, Q, d) (g or the previous output)."""
        e = self.head.embed(tokens).to(hidden.dtype)
        attn_in = torch.cat([self.layer.input_norm(e), self.hidden_norm(hidden)], -1)  # (B, Q, 2d)
        return self.layer(hidden, pos, prefix, mask, attn_in)

    def train_outputs(self, feats, ids, valid, anchors, gamma):
        B, T = ids.shape
        N = anchors.shape[1]
        dev = ids.device
        # step 0 over every position t: input (x_{t+1}, g_t), causal attention among real positions
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # (B, T) x_{t+1}
        pos = torch.arange(T, device=dev).expand(B, T)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))[None] & valid[:, None, :]
        causal = causal | torch.eye(T, dtype=torch.bool, device=dev)[None]  # padding rows see themselves
        h0, (k0, v0) = self._step(nxt, self.fusion(feats), pos, None, causal[:, None])  # (B, T, d)
        a = (anchors - 1).clamp(min=0)  # step 0 for anchor p runs at position p-1
        h = h0.gather(1, a[:, :, None].expand(B, N, h0.shape[-1]))  # (B, N, d)
        hs = [h]
        see_ctx = (torch.arange(T, device=dev)[None, None, :] <= a[:, :, None]) & valid[:, None, :]  # (B, N, T)
        chain_k, chain_v = [], []
        for k in range(1, gamma):
            tok = ids.gather(1, (anchors + k).clamp(max=T - 1))  # teacher forcing: x_{p+k}
            q_pos = a + k  # (B, N)
            eye = torch.eye(N, dtype=torch.bool, device=dev)
            # keys: step-0 context, then the chain of steps 1..k-1 (N each), then this step's own N keys
            mask = torch.cat([see_ctx] + [eye[None].expand(B, N, N)] * k, -1)[:, None]
            prefix = (torch.cat([k0, *chain_k], 2), torch.cat([v0, *chain_v], 2))
            h, (kk, vv) = self._step(tok, h, q_pos, prefix, mask)
            chain_k.append(kk)
            chain_v.append(vv)
            hs.append(h)
        h = torch.stack(hs, 2)  # (B, N, G, d)
        return {"hidden": h, "logits": self.logits(self.norm(h))}  # (B, N, G, V_d)

    # -- decoding
    @torch.no_grad()
    def extend(self, states: list[DraftState], feats: list[torch.Tensor], next_tokens: list[torch.Tensor]) -> None:
        for s, f, nxt in zip(states, feats, next_tokens):
            n = f.shape[0]
            dtype = self.fc.weight.dtype
            pos = torch.arange(s.length, s.length + n, device=f.device)[None]
            new = torch.tril(torch.ones(n, n, dtype=torch.bool, device=f.device))
            if s.length:
                prefix = s.kv[0][0][None], s.kv[0][1][None]
                mask = torch.cat([torch.ones(n, s.length, dtype=torch.bool, device=f.device), new], -1)
            else:
                prefix, mask = None, new
            h, (k, v) = self._step(nxt[None], self.fusion(f[None].to(dtype)), pos, prefix, mask[None, None])
            s.append([(k[0], v[0])], n)
            s.extra["h"] = h[0, -1]  # step-0 output at the last committed position: drafts token 1

    @torch.no_grad()
    def propose(self, states: list[DraftState], anchors: torch.Tensor, gamma: int, sample: Sampler) -> Proposal:
        R = len(states)
        kv, valid = pad_states(states, 1, room=gamma - 1)  # the chain's k/v are written after the context
        ctx_k, ctx_v = kv[0]
        C = valid.shape[1]
        h = torch.stack([s.extra["h"] for s in states])  # (R, d)
        last = torch.tensor([s.length - 1 for s in states], device=anchors.device)  # position of step 0
        tok, q = self.sample(sample, self.logits(self.norm(h)).float())
        toks, probs = [tok], [q]
        for k in range(1, gamma):
            own = torch.ones(R, 1, k, dtype=torch.bool, device=anchors.device)  # earlier chain steps + itself
            mask = torch.cat([valid[:, None, :], own], -1)[:, None]
            # the context, steps 1..k-1 (written by those steps), and room for this step's own k/v
            prefix = (ctx_k[:, :, : C + k], ctx_v[:, :, : C + k])
            out, _ = self._step(tok[:, None], h[:, None], (last + k)[:, None], prefix, mask)
            h = out[:, 0]
            tok, q = self.sample(sample, self.logits(self.norm(h)).float())
            toks.append(tok)
            probs.append(q)
        return self.proposal(toks, probs)
