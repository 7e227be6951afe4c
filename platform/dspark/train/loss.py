"""Drafter losses, per slot k = 0..gamma-1 over a contiguous valid prefix.

    DSpark:  L = 0.1·CE + 0.9·L1 + 1.0·BCE,  slot weight w_k = exp(-k/d), d = gamma (the paper's eq. 9-11;
             train.slot_decay sets d, DeepSpec's configs use 4)
             CE  = -log p_d(x*)                     x* = the response's own next token (train.ce_label=sampled),
                                                    or the target's argmax there (argmax: greedy decoding's)
             L1  = ||p_d - p_t||_1  (= 2·TV; 1 - TV is exactly the acceptance probability)
             BCE = BCE(c_k, c*_k),  c*_k = 1 - ½||p_d - p_t||_1  (detached, fp32, T=1)
    DFlash:  CE only (same slot weights)
    EAGLE-3: soft CE  -Σ_v p_t(v) log p_d(v),  step weight 0.8^k

p_t comes from the cached final-norm hidden state through the frozen lm_head, ONLY at the sampled
label positions (never full-sequence logits). With a draft vocabulary V_d, p_d lives on V_d and is 0
elsewhere: L1 = Σ_{v∈V_d} |p_d - p_t| + p_t(outside V_d) (still exactly 2 TV), CE skips labels
outside V_d (no draft can propose them), and EAGLE-3's soft CE sums over V_d. Losses are returned as
a weighted SUM plus the weight total, so a distributed loop can normalise by the all-reduced total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.train.anchors import sample_anchors, slot_labels


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    eagle_step: float = 0.8  # EAGLE-3: w_k = 0.8^k
    dist: str = "l1"  # DSpark's distribution term: "l1" (the paper) or "kl" (KL(p_t || p_d), for ablations)
    slot_decay: float | None = None  # d in w_k = exp(-k/d); None = gamma
    ce_label: str = "sampled"  # CE's x*: the response's token ("sampled") or the target's argmax ("argmax")

    @classmethod
    def from_config(cls, tc) -> "LossWeights":
        return cls(ce=tc.ce_weight, dist=tc.dist_loss, slot_decay=tc.slot_decay, ce_label=tc.ce_label)


def slot_weights(kind: str, gamma: int, lw: LossWeights, device) -> torch.Tensor:
    k = torch.arange(gamma, device=device, dtype=torch.float32)
    if kind == "eagle3":
        return lw.eagle_step**k
    return torch.exp(-k / (lw.slot_decay or gamma))  # the paper: exp(-(k-1)/γ), k = 1..γ


def drafter_loss(
    drafter,
    batch: dict,
    gamma: int,
    n_anchors: int,
    lw: LossWeights = LossWeights(),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """batch: decoded cache rows (input_ids, loss_mask, valid, features, last_hidden).
    Returns (weighted loss sum, weight sum, detached per-slot statistics)."""
    kind = drafter.c.kind
    ids, lmask, valid = batch["input_ids"], batch["loss_mask"], batch["valid"]
    anchors, ok = sample_anchors(lmask, n_anchors, generator)
    label_pos, labels, lvalid = slot_labels(ids, lmask, anchors, ok, gamma)  # (B, N, G)
    feats = batch["features"].to(drafter.head.embed_weight.dtype)
    out = drafter.train_outputs(feats, ids, valid, anchors, gamma)
    sel = lvalid  # only these slots enter the loss and the statistics
    logits = out["logits"][sel].float()  # (S, V_d)
    B, T = ids.shape
    last = batch["last_hidden"]  # (B, T, d)
    with torch.no_grad():
        # the target distribution for the token at p+k+1 comes from the hidden state at p+k; anchors' blocks
        # overlap (N·gamma slots over T positions), so it is computed once per distinct position
        flat = (torch.arange(B, device=ids.device)[:, None, None] * T + label_pos - 1)[sel]  # (S,) row·T + pos
        uniq, inverse = torch.unique(flat, return_inverse=True)  # (U,), (S,)
        h_u = last.reshape(B * T, -1)[uniq].to(drafter.head.lm_head_weight.dtype)  # (U, d)
        p_u = torch.softmax(drafter.head.logits(h_u).float(), -1)  # (U, V)
        y_max = p_u.argmax(-1)[inverse]  # (S,) the target's greedy token
        y = labels[sel] if lw.ce_label == "sampled" else y_max  # (S,) target ids
        outside = torch.zeros_like(p_u[:, 0])  # p_t's mass the drafter cannot propose
        if drafter.draft_ids is not None:
            p_u = p_u[:, drafter.draft_ids]  # (U, V_d)
            outside = (1 - p_u.sum(-1)).clamp(min=0)
            y, y_max = drafter.t2d[y], drafter.t2d[y_max]  # draft index, -1 outside V_d
        p_t, outside = p_u[inverse], outside[inverse]  # (S, V_d), (S,)
    logp_d = torch.log_softmax(logits, -1)
    p_d = logp_d.exp()
    w = slot_weights(kind, gamma, lw, ids.device).expand_as(label_pos)[sel]  # (S,)
    ce = -logp_d.gather(1, y.clamp(min=0)[:, None])[:, 0] * (y >= 0)  # (S,)
    l1 = (p_d - p_t).abs().sum(-1) + outside  # (S,)  = 2 TV
    accept = (1 - 0.5 * l1).detach()  # c*_k: acceptance probability of this slot at T=1
    if kind == "eagle3":
        per = -(p_t * logp_d).sum(-1)
    elif kind == "dflash":
        per = ce
    else:
        bce = F.binary_cross_entropy_with_logits(out["conf_logit"][sel].float(), accept.clamp(0, 1), reduction="none")
        dist = l1 if lw.dist == "l1" else (p_t * (torch.log(p_t.clamp_min(1e-12)) - logp_d)).sum(-1)
        per = lw.ce * ce + lw.tv * dist + lw.conf * bce
    loss_sum = (w * per).sum()
    weight_sum = w.sum().detach()
    slot = torch.arange(gamma, device=ids.device).expand_as(label_pos)[sel]
    x_d = logits.argmax(-1)  # (S,) the draft at T=0: accepted iff it is the target's argmax (teacher-forced context)
    stats = {
        "ce_sum": (w * ce).sum().detach(),
        "l1_sum": (w * l1).sum().detach(),
        "accept_sum_k": torch.zeros(gamma, device=ids.device).index_add_(0, slot, accept),
        "top1_sum_k": torch.zeros(gamma, device=ids.device).index_add_(0, slot, (x_d == y).float()),
        "greedy_sum_k": torch.zeros(gamma, device=ids.device).index_add_(0, slot, (x_d == y_max).float()),
        "count_k": torch.zeros(gamma, device=ids.device).index_add_(0, slot, torch.ones_like(accept)),
        "tokens": valid.sum().detach(),
        "slots": sel.sum().detach(),
    }
    if kind == "dspark":
        stats["bce_sum"] = (w * bce).sum().detach()
    return loss_sum, weight_sum, stats


def summarize(stats: dict, weight_sum: float) -> dict[str, float]:
    """Per-slot acceptance estimate (1 - TV), expected accepted length tau = 1 + Σ_k Π_{i<=k} acc_i; the same
    at T=0 (greedy_tau, from argmax agreement: draft k accepted iff it is the target's argmax)."""
    count = stats["count_k"].double().clamp(min=1)
    acc, greedy, top1 = (stats[f"{key}_sum_k"].double() / count for key in ("accept", "greedy", "top1"))
    out = {"ce": float(stats["ce_sum"]) / weight_sum, "l1": float(stats["l1_sum"]) / weight_sum}
    if "bce_sum" in stats:
        out["bce"] = float(stats["bce_sum"]) / weight_sum
    for k in range(len(acc)):
        out[f"accept_{k + 1}"], out[f"top1_{k + 1}"] = float(acc[k]), float(top1[k])
    out["expected_tau"] = 1 + float(acc.cumprod(0).sum())
    out["greedy_tau"] = 1 + float(greedy.cumprod(0).sum())
    return {k: (v if math.isfinite(v) else 0.0) for k, v in out.items()}
