"""Drafters: what training optimises is what decoding runs.

Training packs N anchors per sequence into one forward (block mask, absolute positions, teacher
forcing); decoding drafts one block per request from a KV cache of committed positions. For every
drafter family the logits (and confidence logits) of both paths must agree.
"""

import pytest
import torch
from tiny_models import untrained_drafter

from dspark import target as targets
from dspark.models.drafter import DraftState
from dspark.train.loss import LossWeights, drafter_loss

GAMMA = 4
T = 24


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


def _drafter(tgt, kind, markov):
    d = untrained_drafter(tgt, kind, GAMMA, num_layers=2, markov=markov)
    with torch.no_grad():  # random, non-trivial Markov and confidence heads (some start at zero)
        for p in d.parameters():
            if p.requires_grad and p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return d


def _batch(tgt, B=2):
    g = torch.Generator().manual_seed(1)
    d = tgt.config.hidden_size
    ids = torch.randint(10, tgt.config.vocab_size, (B, T), generator=g)
    feats = torch.randn(B, T, 3, d, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, T - 3 :] = False  # a padded row
    return ids, feats, valid


@pytest.mark.parametrize(
    "kind, markov",
    [("dspark", "vanilla"), ("dspark", "gated"), ("dspark", "rnn"), ("dflash", "none"), ("eagle3", "none")],
)
def test_packed_training_equals_per_block_decoding(tgt, kind, markov):
    drafter = _drafter(tgt, kind, markov)
    ids, feats, valid = _batch(tgt)
    anchors = torch.tensor([[3, 9, 15], [1, 6, 12]])  # (B, N) anchor positions p
    with torch.no_grad():
        train = drafter.train_outputs(feats, ids, valid, anchors, GAMMA)
    for b in range(ids.shape[0]):
        for n, p in enumerate(anchors[b].tolist()):
            seen = []

            def teacher(logits, b=b, p=p, seen=seen):  # record what the slot saw, take the true token
                seen.append(logits[0])
                return ids[b, p + len(seen)].view(1), torch.softmax(logits, -1)

            state = DraftState()  # committed context: positions 0..p-1, each with the token after it
            drafter.extend([state], [feats[b, :p]], [ids[b, 1 : p + 1]])
            prop = drafter.propose([state], ids[b, p].view(1), GAMMA, teacher)
            got = torch.stack(seen)  # (G, V)
            assert (got - train["logits"][b, n]).abs().max() < 1e-4, (kind, markov, b, p)
            if "conf_logit" in train:
                assert (prop.conf_logit[0] - train["conf_logit"][b, n]).abs().max() < 1e-4


@pytest.mark.parametrize("kind, markov", [("dspark", "vanilla"), ("dflash", "none"), ("eagle3", "none")])
def test_a_few_steps_on_one_batch_lower_the_loss(tgt, kind, markov):
    """Real target features: the loss on one batch falls when the drafter trains on it."""
    drafter = _drafter(tgt, kind, markov).train()
    ids = torch.tensor([tgt.tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 2)])
    with torch.no_grad():
        hs = tgt.model(ids, output_hidden_states=True).hidden_states  # embeddings, layer 1..L (last: normed)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "valid": torch.ones_like(ids, dtype=torch.bool),
        "features": torch.stack([hs[i] for i in (2, 3, 4)], 2),
        "last_hidden": hs[-1],
    }
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(12):
        loss, w, _ = drafter_loss(drafter, batch, GAMMA, 8, LossWeights(), torch.Generator().manual_seed(0))
        opt.zero_grad()
        (loss / w).backward()
        opt.step()
        losses.append(float(loss.detach() / w))
    assert losses[-1] < 0.8 * losses[0], losses


def test_draft_state_appends_into_buffers_that_double():
    g = torch.Generator().manual_seed(0)
    state, chunks = DraftState(), []
    for n in [5, 1, 3, 60, 2, 200, 7]:  # a prompt, then rounds of committed tokens
        kv = [(torch.randn(2, n, 8, generator=g), torch.randn(2, n, 8, generator=g)) for _ in range(3)]
        buffers = [k.data_ptr() for k, _ in state.buffers]
        state.append(kv, n)
        chunks.append(kv)
        grew = buffers != [k.data_ptr() for k, _ in state.buffers]
        assert grew == (n in (5, 60, 200, 7))  # a copy only when full: capacity 64, 128, 271, 542
    assert state.length == 278 and state.buffers[0][0].shape[1] == 542
    empty = DraftState()
    empty.append([(torch.zeros(2, 0, 8), torch.zeros(2, 0, 8))], 0)  # no positions yet: still a (2, 0, 8) cache
    assert empty.kv[0][0].shape == (2, 0, 8)
    for layer, (k, v) in enumerate(state.kv):
        assert torch.equal(k, torch.cat([c[layer][0] for c in chunks], 1))
        assert torch.equal(v, torch.cat([c[layer][1] for c in chunks], 1))
