"""DSpark's sequential stage: a logit bias B_k that lets draft position k depend on the tokens
sampled before it, p_k(v) ∝ exp(U_k(v) + B_k(x_{<k}, v)); and the confidence head.

    vanilla: B_k = W2 · W1[x_{k-1}]                        (low-rank first-order transition, rank r)
    gated:   B_k = W2 · (σ(W_g [h_k; e]) ⊙ e),  e = W1[x_{k-1}]
    rnn:     z = [s_{k-1}; e; h_k];  g, c, o = split(W z)
             s_k = σ(g) ⊙ s_{k-1} + (1 - σ(g)) ⊙ tanh(c);  B_k = W2 · tanh(o);  s_0 = 0
    confidence: c_k = σ(w · [h_k; W1[x_{k-1}]] + b)  ≈ P(x_k accepted | x_{<k} accepted)

Training runs all positions at once with teacher forcing (the RNN unrolled over gamma); inference
calls `step` left to right. Cost per step: one r-gather and one r x V_d product (V_d: the draft
vocabulary; V without one).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.config import DrafterConfig


class MarkovHead(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        r, d = c.markov_rank, c.hidden_size
        self.kind, self.r = c.markov, r
        self.W1 = nn.Embedding(c.vocab_size, r)
        self.W2 = nn.Linear(r, c.draft_vocab or c.vocab_size, bias=False)  # scores the draft vocabulary
        nn.init.normal_(self.W1.weight, std=0.02)
        nn.init.normal_(self.W2.weight, std=0.02)  # DeepSpec's init (zero init measured no different)
        if self.kind == "gated":
            self.Wg = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.W = nn.Linear(2 * r + d, 3 * r)

    def init_state(self, n: int, device, dtype) -> torch.Tensor | None:
        return torch.zeros(n, self.r, device=device, dtype=dtype) if self.kind == "rnn" else None

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """h: (N, d), prev: (N,) token ids -> bias (N, V_d), e = W1[prev] (N, r), next state."""
        e = self.W1(prev)  # (N, r)
        if self.kind == "vanilla":
            return self.W2(e), e, state
        if self.kind == "gated":
            return self.W2(torch.sigmoid(self.Wg(torch.cat([h, e], -1))) * e), e, state
        g, c, o = self.W(torch.cat([state, e, h], -1)).chunk(3, -1)  # each (N, r)
        state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
        return self.W2(torch.tanh(o)), e, state

    def parallel(self, h: torch.Tensor, prev: torch.Tensor):
        """Teacher forcing over whole blocks. h: (N, G, d), prev: (N, G) -> bias (N, G, V_d), e (N, G, r)."""
        if self.kind != "rnn":
            bias, e, _ = self.step(h, prev, None)  # vanilla/gated are position-wise
            return bias, e
        state = self.init_state(h.shape[0], h.device, h.dtype)
        out_b, out_e = [], []
        for k in range(h.shape[1]):
            b, e, state = self.step(h[:, k], prev[:, k], state)
            out_b.append(b)
            out_e.append(e)
        return torch.stack(out_b, 1), torch.stack(out_e, 1)


class ConfidenceHead(nn.Module):
    """c_k = σ(w·[h_k; W1[x_{k-1}]] + b); returns the logit so calibration can scale it (STS)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.proj = nn.Linear(c.hidden_size + c.markov_rank, 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:  # (.., d), (.., r) -> (..)
        return self.proj(torch.cat([h, e], -1)).squeeze(-1)
