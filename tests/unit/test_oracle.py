"""The ideal-parallel-drafter bound against its exact value: on a tiny target with a 96-token vocabulary
the slot-2 marginal q_2 = Σ_x S(x|c) p(.|c, x) and the acceptance of its drafts can be enumerated."""

import pytest
import torch
from tiny_models import tiny_model

from dspark.decoding.sampling import SamplingParams, probs
from dspark.evaluation import oracle

LAW = SamplingParams(0.7, top_p=0.9)  # the training data's sampling law (the cache's)


@torch.no_grad()
def exact_alpha2(model, ctx: list[int], sp: SamplingParams) -> float:
    V = model.config.vocab_size
    p1_logits = model(input_ids=torch.tensor([ctx])).logits[0, -1]
    nxt = model(input_ids=torch.tensor([ctx + [x] for x in range(V)])).logits[:, -1]  # (V, V): row x = p(.|c, x)
    q2 = (probs(p1_logits, LAW)[:, None] * torch.softmax(nxt.float(), -1)).sum(0)  # marginal at T=1
    p1, p2 = probs(p1_logits, sp), probs(nxt, sp)  # (V,), (V, V)
    if sp.greedy:  # drafts are argmaxes: slot 1 is the greedy token, slot 2 must match the greedy continuation
        g = int(p1.argmax())
        return float(q2.argmax() == p2[g].argmax())
    # d_1 ~ q_1 = p_1 is always accepted; then slot 2 is accepted with Σ_v min(q_2, p(.|c, d_1))
    return float((p1 * torch.minimum(q2[None], p2).sum(-1)).sum())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_bound_matches_its_exact_value_on_an_enumerable_target(temperature):
    model = tiny_model("llama")
    sp = SamplingParams(temperature)
    ctxs = [[5, 17, 42, 8], [60, 3, 3, 91, 12, 7], [48, 87, 27, 54]]  # at T=0 the last one's slot 2 fails
    for ctx in ctxs:
        gen = torch.Generator().manual_seed(0)
        num, den = oracle.context_sums(model, ctx, 2, sp, LAW, paths=4000, drafts=4000, generator=gen)
        alpha = (num / den).tolist()
        assert alpha[0] == pytest.approx(1.0, abs=1e-5)  # q_1 is the target's own distribution
        assert alpha[1] == pytest.approx(exact_alpha2(model, ctx, sp), abs=0.02)


def test_the_bound_pools_contexts_along_each_response():
    model = tiny_model("llama")
    alpha, tau, n = oracle.bound(model, [([5, 17, 42], [8, 9, 10, 11, 12, 13])], 3, SamplingParams(1.0), LAW, 64, 32, 2)
    assert n == 3  # anchors out[:1], out[:3], out[:5]
    assert alpha[0] == pytest.approx(1.0, abs=1e-5) and all(0 < a <= 1 for a in alpha)
    assert tau == pytest.approx(1 + alpha[0] + alpha[0] * alpha[1] + alpha[0] * alpha[1] * alpha[2])
