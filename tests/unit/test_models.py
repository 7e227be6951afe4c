"""Drafters: what training optimises is what decoding runs.

Training packs N anchors per sequence into one forward (block mask, absolute positions, teacher
forcing); decoding drafts one block per request from a KV cache of committed positions. For every
drafter family the logits (and confidence logits) of both paths must agree.
"""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model, untrained_drafter

from dspark import target as targets
from dspark.config import load_config
from dspark.errors import UserError
from dspark.models import load_drafter, save_drafter, warm_start
from dspark.models.drafter import DraftCache, DraftState, pad_states, select_draft_vocab
from dspark.models.layers import DraftLayer, block_attention
from dspark.target.packed import PackedLinear
from dspark.train.anchors import sample_anchors, slot_labels
from dspark.train.loss import LossWeights, drafter_loss

GAMMA = 4
T = 24


@pytest.fixture(scope="module")
def tgt():
    return targets.load("builtin")


# a draft vocabulary of every third token id: most of the test sequences' tokens fall outside it
DRAFT_IDS = list(range(0, 4096, 3))


def _drafter(tgt, kind, markov, draft_ids=None, sample_from_anchor=True):
    d = untrained_drafter(
        tgt, kind, GAMMA, num_layers=2, markov=markov, draft_ids=draft_ids, sample_from_anchor=sample_from_anchor
    )
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
    "kind, markov, draft_ids, sample_from_anchor",
    [
        ("dspark", "vanilla", None, True),
        ("dspark", "gated", None, True),
        ("dspark", "rnn", None, True),
        ("dflash", "none", None, True),
        ("eagle3", "none", None, True),
        ("dspark", "rnn", DRAFT_IDS, True),
        ("dflash", "none", DRAFT_IDS, True),
        ("eagle3", "none", DRAFT_IDS, True),
        ("dflash", "none", None, False),  # the fill-in block (gamma + 1 slots)
        ("dspark", "vanilla", DRAFT_IDS, False),
    ],
)
def test_packed_training_equals_per_block_decoding(tgt, kind, markov, draft_ids, sample_from_anchor):
    """With a draft vocabulary, training's logits are over it and decoding samples from the same
    logits, handed to the sampler with their target ids (q = 0 elsewhere)."""
    drafter = _drafter(tgt, kind, markov, draft_ids, sample_from_anchor)
    inside = torch.zeros(tgt.config.vocab_size, dtype=torch.bool)
    inside[draft_ids if draft_ids is not None else slice(None)] = True
    ids, feats, valid = _batch(tgt)
    anchors = torch.tensor([[3, 9, 15], [1, 6, 12]])  # (B, N) anchor positions p
    with torch.no_grad():
        train = drafter.train_outputs(feats, ids, valid, anchors, GAMMA)
    for b in range(ids.shape[0]):
        for n, p in enumerate(anchors[b].tolist()):
            seen = []

            def teacher(logits, cols=None, vocab=0, b=b, p=p, seen=seen):  # record what the slot saw (over
                full = _scattered(logits, cols, vocab)  # the whole vocabulary), take the true token
                seen.append(full[0])
                return ids[b, p + len(seen)].view(1), torch.softmax(full, -1)

            state = DraftState()  # committed context: positions 0..p-1, each with the token after it
            drafter.extend([state], [feats[b, :p]], [ids[b, 1 : p + 1]])
            prop = drafter.propose([state], ids[b, p].view(1), GAMMA, teacher)
            got = torch.stack(seen)  # (G, V)
            assert (got[:, inside] - train["logits"][b, n]).abs().max() < 1e-4, (kind, markov, b, p)
            assert torch.isneginf(got[:, ~inside]).all()
            if "conf_logit" in train:
                assert (prop.conf_logit[0] - train["conf_logit"][b, n]).abs().max() < 1e-4


def _scattered(logits, cols=None, vocab=0):
    """A sampler's logits (R, n) over target ids `cols` (None: the whole vocabulary) as (R, vocab), -inf elsewhere."""
    return (
        logits
        if cols is None
        else logits.new_full((logits.shape[0], vocab), float("-inf")).index_copy_(-1, cols, logits)
    )


def _greedy(logits, cols=None, vocab=0):
    """A sampler (the Sampler contract): the argmax as a target id, q over the given columns."""
    col = logits.argmax(-1)  # the columns are increasing ids: the first maximum is the scattered argmax
    return (col if cols is None else cols[col]), torch.softmax(logits, -1)


def _real_batch(tgt):
    """One cache row of real target features (taps 1, 2, 3) over a short code snippet, all response."""
    ids = torch.tensor([tgt.tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 2)])
    with torch.no_grad():
        hs = tgt.model(ids, output_hidden_states=True).hidden_states  # embeddings, layer 1..L (last: normed)
    return {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "valid": torch.ones_like(ids, dtype=torch.bool),
        "features": torch.stack([hs[i] for i in (2, 3, 4)], 2),
        "last_hidden": hs[-1],
    }


@pytest.mark.parametrize("kind, markov", [("dspark", "vanilla"), ("dflash", "none"), ("eagle3", "none")])
def test_a_few_steps_on_one_batch_lower_the_loss(tgt, kind, markov):
    """Real target features: the loss on one batch falls when the drafter trains on it."""
    drafter = _drafter(tgt, kind, markov).train()
    batch = _real_batch(tgt)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(12):
        loss, w, _ = drafter_loss(drafter, batch, GAMMA, 8, LossWeights(), torch.Generator().manual_seed(0))
        opt.zero_grad()
        (loss / w).backward()
        opt.step()
        losses.append(float(loss.detach() / w))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("N", [5, 1])  # training packs N blocks; drafting reads one
def test_block_attention_is_dense_attention_with_a_block_diagonal_mask(N):
    g = torch.Generator().manual_seed(0)
    B, H, KVH, L, P, hd = 2, 6, 2, 3, 11, 8
    q = torch.randn(B, H, N * L, hd, generator=g)
    k, v = torch.randn(B, KVH, N * L, hd, generator=g), torch.randn(B, KVH, N * L, hd, generator=g)
    prefix = (torch.randn(B, KVH, P, hd, generator=g), torch.randn(B, KVH, P, hd, generator=g))
    ctx = torch.rand(B, 1, N * L, P, generator=g) < 0.6
    ctx[0, 0, :L] = False  # a block that sees no context at all
    got = block_attention(q, prefix, ctx, k, v, L)
    own = torch.block_diag(*[torch.ones(L, L, dtype=torch.bool)] * N).expand(B, 1, -1, -1)
    want = F.scaled_dot_product_attention(
        q,
        torch.cat([prefix[0], k], 2),
        torch.cat([prefix[1], v], 2),
        attn_mask=torch.cat([ctx, own], -1),
        enable_gqa=True,
    )
    assert (got - want).abs().max() < 1e-5


def test_draft_state_appends_into_buffers_that_double():
    """A state made alone gets a cache of one slot at its first append, grown by doubling."""
    g = torch.Generator().manual_seed(0)
    state, chunks = DraftState(), []
    assert state.kv == [] and state.cache is None
    for n in [5, 1, 3, 60, 2, 200, 7]:  # a prompt, then rounds of committed tokens
        kv = [(torch.randn(2, n, 8, generator=g), torch.randn(2, n, 8, generator=g)) for _ in range(3)]
        buffers = [k.data_ptr() for k in state.cache.k] if state.cache else []
        state.append(kv, n)
        chunks.append(kv)
        grew = buffers != [k.data_ptr() for k in state.cache.k]
        assert grew == (n in (5, 60, 200, 7))  # a copy only when full: capacity 64, 128, 271, 542
    assert state.length == 278 and state.cache.k[0].shape == (1, 2, 542, 8)
    empty = DraftState()
    empty.append([(torch.zeros(2, 0, 8), torch.zeros(2, 0, 8))], 0)  # no positions yet: still a (2, 0, 8) cache
    assert empty.kv[0][0].shape == (2, 0, 8)
    for layer, (k, v) in enumerate(state.kv):
        assert torch.equal(k, torch.cat([c[layer][0] for c in chunks], 1))
        assert torch.equal(v, torch.cat([c[layer][1] for c in chunks], 1))


@pytest.mark.parametrize("kind, markov", [("dspark", "vanilla"), ("eagle3", "none")])
def test_requests_in_a_shared_draft_cache_draft_as_they_do_alone(tgt, kind, markov):
    """Decoding keeps every request's drafter context in its slot of one DraftCache: a round over
    consecutive slots reads them as one view (no copy), other slots in one gather, and either way each
    request drafts what it drafts alone, also in a slot an earlier, longer request used."""
    drafter = _drafter(tgt, kind, markov).eval()
    ids, feats, _ = _batch(tgt, B=4)
    # committed context per request (positions' features, the token after each): 20, 7, 66 and 67 positions
    ctx = [(feats[r, :n], ids[r, 1 : n + 1]) for r, n in ((0, 20), (1, 7))]
    ctx += [(feats[r].repeat(3, 1, 1)[:n], ids[r, 1:].repeat(3)[:n]) for r, n in ((2, 66), (3, 67))]
    cache = DraftCache(4)
    long = cache.state(1)  # slot 1 first holds a longer request, then a new one
    drafter.extend([long], [feats[1, :22]], [ids[1, 1:23]])
    shared = [cache.state(slot) for slot in range(4)]
    drafter.extend(shared[:2], [f for f, _ in ctx[:2]], [t for _, t in ctx[:2]])
    for r in (2, 3):  # later calls, the cache growing past its first capacity (64)
        drafter.extend([shared[r]], [ctx[r][0]], [ctx[r][1]])
    alone = [DraftState() for _ in ctx]
    for a, (f, t) in zip(alone, ctx):
        drafter.extend([a], [f], [t])
    kv, valid = pad_states(shared, 1, room=GAMMA)
    assert kv[0][0].data_ptr() == cache.k[0].data_ptr() and kv[0][0].shape[:3] == (4, cache.k[0].shape[1], 67 + GAMMA)
    assert valid.shape == (4, 67) and valid.sum(1).tolist() == [s.length for s in shared]  # a view of slots 0..3
    anchors = ids[:, -1]
    for rows in ([0, 1, 2, 3], [0, 2, 3], [1, 3]):
        with torch.no_grad():
            batched = drafter.propose([shared[r] for r in rows], anchors[rows], GAMMA, _greedy)
            for i, r in enumerate(rows):
                one = drafter.propose([alone[r]], anchors[r].view(1), GAMMA, _greedy)
                assert torch.equal(batched.tokens[i], one.tokens[0]), (rows, r)
                assert (batched.probs[i] - one.probs[0]).abs().max() < 1e-5
                if one.conf_logit is not None:
                    assert (batched.conf_logit[i] - one.conf_logit[0]).abs().max() < 1e-5


def test_select_draft_vocab_keeps_the_most_frequent_ids_in_order():
    counts = torch.tensor([5, 0, 5, 9, 1])
    assert select_draft_vocab(counts, 3).tolist() == [0, 2, 3]  # the tie at 5 keeps both; 9 first
    assert select_draft_vocab(counts, 5).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(UserError, match="train.draft_vocab"):
        select_draft_vocab(counts, 6)


def test_the_draft_vocabulary_loss_is_the_exact_total_variation(tgt):
    """With a draft vocabulary, the L1 term is still ||q - p_t||_1 of the distribution decoding samples
    from (q = 0 outside V_d), so 1 - L1/2 is still the slot's acceptance probability; CE counts only
    the labels inside V_d."""
    drafter = _drafter(tgt, "dspark", "vanilla", DRAFT_IDS)
    batch = _real_batch(tgt)
    _, _, stats = drafter_loss(drafter, batch, GAMMA, 8, LossWeights(), torch.Generator().manual_seed(0))
    # the same anchors (same generator), then everything over the whole vocabulary
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    anchors, ok = sample_anchors(lmask, 8, torch.Generator().manual_seed(0))
    label_pos, labels, sel = slot_labels(ids, lmask, anchors, ok, GAMMA)
    with torch.no_grad():
        out = drafter.train_outputs(batch["features"], ids, batch["valid"], anchors, GAMMA)
        q = torch.softmax(drafter.to_target_vocab(out["logits"].float()), -1)[sel]  # (S, V)
        p_t = torch.softmax(drafter.head.logits(batch["last_hidden"][0, label_pos[0] - 1]), -1)[sel[0]]
    slot = torch.arange(GAMMA).expand_as(label_pos)[sel]
    accept = 1 - 0.5 * (q - p_t).abs().sum(-1)
    assert torch.allclose(stats["accept_sum_k"], torch.zeros(GAMMA).index_add_(0, slot, accept), atol=1e-5)
    y, w = labels[sel], torch.exp(-slot / 4.0)
    inside = torch.isin(y, torch.tensor(DRAFT_IDS))
    assert 0 < inside.sum() < len(y)  # labels on both sides of the draft vocabulary
    ce = -torch.log(q[torch.arange(len(y)), y][inside])
    assert torch.allclose(stats["ce_sum"], (w[inside] * ce).sum(), rtol=1e-5)
    # train.slot_decay d: the same terms weighted by exp(-k/d) instead of exp(-k/gamma)
    lw = LossWeights(slot_decay=2.0)
    _, _, stats = drafter_loss(drafter, batch, GAMMA, 8, lw, torch.Generator().manual_seed(0))
    assert torch.allclose(stats["ce_sum"], (torch.exp(-slot / 2.0)[inside] * ce).sum(), rtol=1e-5)
    # train.ce_label=argmax: CE's label is the target's most likely token, not the response's
    y_max = p_t.argmax(-1)
    assert not torch.equal(y_max, y)  # the sampled responses leave the argmax somewhere
    inside = torch.isin(y_max, torch.tensor(DRAFT_IDS))
    lw = LossWeights(ce_label="argmax")
    _, _, stats = drafter_loss(drafter, batch, GAMMA, 8, lw, torch.Generator().manual_seed(0))
    ce = -torch.log(q[torch.arange(len(y_max)), y_max][inside])
    assert torch.allclose(stats["ce_sum"], (w[inside] * ce).sum(), rtol=1e-5)
    # T=0 acceptance per slot: the draft's argmax (over V_d, q = 0 elsewhere) is the target's. Drafts forced to
    # the target's most frequent argmax (an untrained drafter's rarely agree) agree exactly where it is the target's
    top = y_max[inside].mode().values
    own_logits = drafter.logits
    drafter.logits = lambda h: own_logits(h).index_add(
        -1, drafter.t2d[top].view(1), torch.full((*h.shape[:-1], 1), 1e4)
    )
    _, _, stats = drafter_loss(drafter, batch, GAMMA, 8, lw, torch.Generator().manual_seed(0))
    agree = (y_max == top).float()
    assert 0 < agree.sum() < len(agree)
    assert torch.equal(stats["greedy_sum_k"], torch.zeros(GAMMA).index_add_(0, slot, agree))


def test_a_draft_vocabulary_is_saved_with_the_weights(tgt, tmp_path):
    drafter = _drafter(tgt, "dspark", "vanilla", DRAFT_IDS)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, targets.load("builtin", cpu_prepack=False).model)  # not packed: the same products
    assert loaded.draft_ids.dtype == torch.long and loaded.draft_ids.tolist() == DRAFT_IDS
    assert torch.equal(loaded.t2d, drafter.t2d) and torch.equal(loaded.draft_lm_head, drafter.draft_lm_head)
    ids, feats, _ = _batch(tgt)
    props = []
    for d in (drafter, loaded):
        state = DraftState()
        d.extend([state], [feats[0, :9]], [ids[0, 1:10]])
        props.append(d.propose([state], ids[0, 9].view(1), GAMMA, _greedy))
    assert torch.equal(props[0].tokens, props[1].tokens) and torch.equal(props[0].probs, props[1].probs)
    assert torch.isin(props[0].tokens, torch.tensor(DRAFT_IDS)).all()
    assert props[0].vocab.tolist() == DRAFT_IDS and props[0].probs.shape[-1] == len(DRAFT_IDS)  # q over V_d
    with pytest.raises(UserError, match="strictly increasing"):  # verification looks the drafts up in order
        loaded.set_draft_vocab(torch.tensor(DRAFT_IDS[::-1]))


def test_warm_start_takes_the_saved_weights_and_refuses_other_shapes(tgt, tmp_path):
    """train.warm_start initialises a drafter (the distributed trainer's and the comparison bench's) with
    a saved drafter's weights; a drafter of other shapes is refused."""
    trained = _drafter(tgt, "dspark", "vanilla", DRAFT_IDS)
    with torch.no_grad():  # weights no fresh drafter has
        for p in trained.parameters():
            p.add_(0.01)
    save_drafter(trained, tmp_path)
    cfg = load_config(overrides=[f"train.warm_start={tmp_path}"])
    fresh = untrained_drafter(tgt, "dspark", GAMMA, num_layers=2, markov="vanilla", draft_ids=DRAFT_IDS)
    saved = load_drafter(tmp_path, tgt.model)
    assert not all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))
    warm_start(cfg, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))
    other = untrained_drafter(tgt, "dspark", GAMMA, num_layers=1, markov="vanilla", draft_ids=DRAFT_IDS)
    with pytest.raises(RuntimeError, match="size mismatch|Missing key|Unexpected key"):
        warm_start(cfg, other)


def test_train_bf16_on_a_cpu_is_autocast_only_where_bf16_is_native(tgt, monkeypatch):
    """train.bf16 on a CPU: the loss's forward under bfloat16 autocast with float32 weights and gradients,
    the same loss as float32 within bf16 rounding; where the CPU would emulate bf16, plain float32."""
    from dspark.config import TrainConfig
    from dspark.train import loop

    drafter, batch = _drafter(tgt, "dspark", "vanilla").train(), _real_batch(tgt)

    def loss_and_grad(tc):
        drafter.zero_grad()
        with loop.autocast(tc):
            autocast_on = torch.is_autocast_enabled("cpu")
            loss, w, _ = drafter_loss(drafter, batch, GAMMA, 8, LossWeights(), torch.Generator().manual_seed(0))
        (loss / w).backward()
        grad = drafter.backbone.layers[0].q_proj.weight.grad
        return autocast_on, float(loss / w), grad.dtype

    monkeypatch.setattr(loop, "native_bf16", lambda device: True)
    on, bf16_loss, grad_dtype = loss_and_grad(TrainConfig(bf16=True))
    assert on and grad_dtype == torch.float32
    off, fp32_loss, _ = loss_and_grad(TrainConfig(bf16=False))
    assert not off and abs(bf16_loss - fp32_loss) < 0.02 * fp32_loss and bf16_loss != fp32_loss
    monkeypatch.setattr(loop, "native_bf16", lambda device: False)
    assert not loss_and_grad(TrainConfig(bf16=True))[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "kind, markov, draft_ids",
    [("dspark", "vanilla", DRAFT_IDS), ("dflash", "none", None), ("eagle3", "none", DRAFT_IDS)],
)
def test_a_drafter_loaded_beside_a_packed_target_is_packed_and_drafts_the_same(
    tgt, tmp_path, kind, markov, draft_ids, dtype
):
    """load_drafter next to a target with packed linears (target.cpu_prepack: float32, or bf16 on a CPU
    that multiplies it natively) packs the drafter's linears and its LM head too, each draft layer's q/k/v
    and gate/up as one product each: the same weights and state dict, the same logits within rounding."""
    save_drafter(_drafter(tgt, kind, markov, draft_ids), tmp_path)
    packed_target = targets.load("builtin", dtype=dtype)
    plain = load_drafter(tmp_path, targets.load("builtin", dtype=dtype, cpu_prepack=False).model)
    loaded = load_drafter(tmp_path, packed_target.model)
    n_packed = sum(type(m) is PackedLinear for m in loaded.modules())
    if dtype == "bfloat16" and not targets.native_bf16("cpu"):  # emulated bf16: neither is packed
        assert n_packed == 0 and loaded.packed_lm_head is None
        return
    assert n_packed == sum(type(m) is torch.nn.Linear for m in plain.modules()) > 0
    assert loaded.packed_lm_head is not None and plain.packed_lm_head is None
    layers = {
        name: [m for m in d.modules() if isinstance(m, DraftLayer)]
        for name, d in (("plain", plain), ("packed", loaded))
    }
    assert layers["packed"] and all(m.stacked for m in layers["packed"]) and not any(m.stacked for m in layers["plain"])
    a, b = plain.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids, feats, _ = _batch(tgt)
    seen = {}
    for name, d in (("plain", plain), ("packed", loaded)):
        logits = seen[name] = []

        def record(u, cols=None, vocab=0, logits=logits):  # every slot's logits, then its argmax
            logits.append(_scattered(u, cols, vocab))
            return _greedy(u, cols, vocab)

        state = DraftState()
        d.extend([state], [feats[0, :9]], [ids[0, 1:10]])
        d.propose([state], ids[0, 9].view(1), GAMMA, record)
    got, want = torch.stack(seen["packed"]), torch.stack(seen["plain"])
    assert got.shape == want.shape == (GAMMA, 1, tgt.config.vocab_size)
    inside = torch.isfinite(want)
    assert torch.equal(inside, torch.isfinite(got))
    tol = dict(atol=0.05, rtol=0.02) if dtype == "bfloat16" else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[inside], want[inside], **tol)  # a different summation order


def test_a_drafter_started_from_the_targets_top_layers_reads_the_context_as_those_layers_do(tgt):
    """train.init_layers=target_top: draft layer i is target layer n - 2 + i, and the fusion passes the
    deepest tap (here layer 3's output, the input of layer 4) through layer 4's input norm, so the first
    draft layer's context keys and values are exactly the target's own at layer 4."""
    from dspark.models import init_from_target

    drafter = untrained_drafter(tgt, "dspark", GAMMA, num_layers=2)  # taps [1, 2, 3] of 6 layers
    ids = torch.randint(10, tgt.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = tgt.model(ids, output_hidden_states=True, use_cache=True)
        feats = torch.stack([out.hidden_states[i + 1] for i in drafter.c.tap_layers], 2)  # (1, T, 3, d)
        pos = torch.arange(T)[None]
        before = drafter.backbone.context_kv(feats, pos)[0]
        init_from_target(load_config(overrides=["train.init_layers=target_top"]), drafter)
        k, v = drafter.backbone.context_kv(feats, pos)[0]  # (1, KVH, T, hd)
    cache = out.past_key_values.layers[4]
    assert not torch.allclose(before[0], cache.keys, atol=1e-3)
    torch.testing.assert_close(k, cache.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, cache.values, atol=1e-4, rtol=1e-4)
    final = targets.read_weights("builtin", ["model.norm.weight"])["model.norm.weight"]
    assert torch.equal(drafter.backbone.norm.weight, final)
    eagle = untrained_drafter(tgt, "eagle3", GAMMA)
    with pytest.raises(UserError, match="init_layers"):
        init_from_target(load_config(overrides=["train.init_layers=target_top"]), eagle)


def test_a_target_whose_layers_are_not_llama_shaped_is_not_copied(tgt, tmp_path):
    """Gemma3's layers norm the attention and MLP outputs and scale by 1 + w: copied into a draft layer they
    would start it wrong, so train.init_layers=target_top names the family instead."""
    from dspark.models import init_from_target

    tiny_model("gemma3_text").config.save_pretrained(tmp_path)
    cfg = load_config(overrides=["train.init_layers=target_top", f"target.name_or_path={tmp_path}"])
    with pytest.raises(UserError, match="gemma3_text layers are not Llama-shaped"):
        init_from_target(cfg, untrained_drafter(tgt, "dspark", GAMMA, num_layers=2))
