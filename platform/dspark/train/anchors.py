"""Anchor sampling: N block anchors per sequence, uniformly among positions p where the anchor x_p
and its next token are both in the response (what decoding sees: every round's anchor is a
committed response token), and the slot labels x_{p+1..p+gamma} with a contiguous valid prefix."""

from __future__ import annotations

import torch


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None):
    """loss_mask (B, T) bool -> anchors (B, N) long, anchor_ok (B, N) bool (False = padding anchor)."""
    B, T = loss_mask.shape
    cand = loss_mask.clone()
    cand[:, :-1] &= loss_mask[:, 1:]
    cand[:, -1] = False
    cand[:, 0] = False  # an anchor needs at least one context position before it
    scores = torch.rand(B, T, generator=generator).to(loss_mask.device).masked_fill(~cand, -1.0)  # CPU generator
    k = min(n, T)
    top, idx = scores.topk(k, dim=1)  # random subset without replacement; invalid ones sort last
    anchors, ok = idx, top >= 0
    if k < n:
        anchors = torch.cat([anchors, anchors.new_zeros(B, n - k)], 1)
        ok = torch.cat([ok, ok.new_zeros(B, n - k)], 1)
    anchors = torch.where(ok, anchors, torch.ones_like(anchors))  # padding anchors point at position 1
    order = anchors.masked_fill(~ok, T).argsort(1)  # ascending positions, padding last (deterministic layout)
    return anchors.gather(1, order), ok.gather(1, order)


def slot_labels(ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_ok: torch.Tensor, gamma: int):
    """Labels for slots k = 0..gamma-1 (token at p+k+1) and their validity as a contiguous prefix.

    Returns label_pos (B, N, G) clamped into range, labels (B, N, G), valid (B, N, G) bool."""
    B, T = ids.shape
    pos = anchors[:, :, None] + 1 + torch.arange(gamma, device=ids.device)  # (B, N, G)
    inside = pos < T
    label_pos = pos.clamp(max=T - 1)
    flat = label_pos.view(B, -1)
    valid = inside & loss_mask.gather(1, flat).view_as(pos) & anchor_ok[:, :, None]
    valid = valid.long().cumprod(-1).bool()  # a hole ends the prefix
    return label_pos, ids.gather(1, flat).view_as(pos), valid
