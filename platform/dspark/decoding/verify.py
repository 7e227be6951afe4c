"""Lossless verification (speculative sampling, Leviathan et al. / Chen et al.), for a whole batch of
requests at once (a handful of tensor operations per round, not a Python loop per request and draft).

For one request with drafts x_1..x_l drawn from q_1..q_l, and target distributions p_1..p_{l+1}
from ONE target forward over [x_0, x_1..x_l]:

    for k = 1..l:
        accept x_k with probability min(1, p_k(x_k) / q_k(x_k))
        on the first rejection: emit y ~ norm(max(0, p_k - q_k)) and stop
    if all l were accepted: emit the bonus y ~ p_{l+1}

Every emitted token is distributed exactly as the target's p, whatever q is, and l may be chosen
per request (the scheduler) as long as the choice does not look at x_k itself before admitting it.
Greedy is the one-hot case: p_k(x_k) is 1 or 0, so x_k is accepted iff it is the argmax of p_k, and
y = the argmax of the first mismatch. A drafter that reports no q proposed deterministically: q_k is
the one-hot of x_k.

Layout: request r's drafts are drafts[r, :l_r] of a (R, G) batch; the target's distributions of all
requests are the rows of one (T, V) tensor p, request r's l_r + 1 rows from first[r] on. A drafter
with a draft vocabulary gives q over its V_d target ids only (q = 0 elsewhere): q_k(x_k) is read at
the draft's column, and only the rejected row q_k of each request is scattered to V for the residual.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dspark.decoding.sampling import inverse_cdf


def _rows(first: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(R, width): row of p of each request's position k, k = 0 .. width-1 (positions past l_r: its last row)."""
    return first[:, None] + torch.arange(width).minimum(lengths[:, None])


def verify_sampled(
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    q: Optional[torch.Tensor],
    p: torch.Tensor,
    first: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    q_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling. drafts (R, G) long, lengths (R,) l_r <= G, q (R, G, V_d) or None over the
    increasing target ids q_ids (V_d,) (None: all V), p (T, V), first (R,); u (R, G) and v (R,): uniforms
    in [0, 1) (request r's from its own generator). Returns n accepted (R,) and the emitted tokens (R,)."""
    R, G = drafts.shape
    verified = torch.arange(G) < lengths[:, None]  # (R, G)
    px = p[_rows(first, lengths, G), drafts].double().cpu()  # (R, G) p_k(x_k)
    if q is None:
        qx = torch.ones_like(px)
    else:  # q_k(x_k) at the draft's column (a draft is sampled from q: its id is one of q_ids)
        col = drafts.to(q.device)
        if q_ids is not None:  # increasing ids; drafts arrive as a slice
            col = torch.searchsorted(q_ids.to(q.device), col.contiguous())
        qx = q.gather(-1, col[..., None])[..., 0].double().cpu()
    n = ((u * qx < px) & verified).int().cumprod(1).sum(1)  # x_k accepted w.p. min(1, px / qx), until the first miss
    emit = p[first + n]  # (R, V): p_k at the first rejection, or the bonus p_{l+1}
    if G:
        k = n.clamp(max=G - 1)
        if q is None:
            q_k = F.one_hot(drafts[torch.arange(R), k], p.shape[-1])
        elif q_ids is None:
            q_k = q[torch.arange(R), k]
        else:  # only these R rows are scattered to V
            q_k = q.new_zeros(R, p.shape[-1]).index_copy_(-1, q_ids.to(q.device), q[torch.arange(R), k])
        rejected = (n < lengths).to(emit.device)[:, None]
        residual = (emit - torch.where(rejected, q_k.to(emit), 0.0)).clamp(min=0)  # max(0, p_k - q_k), unnormalised
        emit = torch.where(residual.sum(-1, keepdim=True) > 0, residual, emit)  # all 0 only by rounding when p == q
    return n, inverse_cdf(emit, v)


def verify_choices(
    drafts: torch.Tensor, lengths: torch.Tensor, choice: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule against the target's own choice per row of p, choice (T,) (seeded requests: its
    Gumbel-max sample, see sampling.py): n = the drafts that match it, then its choice after them."""
    R, G = drafts.shape
    c = choice[_rows(first, lengths, G + 1)]  # (R, G + 1)
    n = ((drafts == c[:, :G]) & (torch.arange(G) < lengths[:, None])).int().cumprod(1).sum(1)
    return n, c.gather(1, n[:, None])[:, 0]
