"""The decoding runner equals each family's own HF forward: prefill, ragged multi-request
verification (slots of different lengths appending different numbers of tokens in one forward, the
requests in any order), rollback (truncate, then append other tokens), and requests whose slots have
others between them (read as one view of the cache, or gathered where the gaps are wide). Tiny random configs of
every supported family, with the features that make them differ switched on (biases, q/k norms,
sliding windows shorter than the context, Gemma3's sandwich norms, embedding scale, query scalar,
local rotary base and logit soft-capping); and the real SmolLM2 weights."""

import pytest
import torch
import transformers
from tiny_models import CONFIGS, TINY, tiny_model

from dspark import target as targets
from dspark.decoding.runner import FAMILIES, TargetRunner, attention_span
from dspark.errors import UserError
from dspark.target import packed


def check_against_hf(model, seqs: list[torch.Tensor], tol: float) -> TargetRunner:
    """Three requests through one runner, each phase compared with the model's full-sequence forward."""

    def ref(seq):
        out = model(seq[None], output_hidden_states=True)
        return out.logits[0], out.hidden_states

    def same(got, want):
        assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (got - want).abs().max()

    r = TargetRunner(model, [0, 1], max_slots=6, capacity=8)  # capacity grows on demand
    slots = [r.alloc() for _ in seqs]
    prefix = [len(s) - k for s, k in zip(seqs, (3, 1, 5))]
    first = r.forward(slots, [s[:p] for s, p in zip(seqs, prefix)])  # (a) prefill, ragged lengths
    for i, (s, p) in enumerate(zip(seqs, prefix)):
        logits, hidden = ref(s[:p])
        same(first.logits[i], logits)
        for m, layer in enumerate([0, 1]):
            same(first.taps[i][:, m], hidden[layer + 1][0])
    # (b) verify 5, 1 and 3 tokens at once, the requests in another order than their slots
    second = r.forward(slots[::-1], [s[p:] for s, p in zip(seqs, prefix)][::-1])
    for i, (s, p) in enumerate(zip(seqs[::-1], prefix[::-1])):
        same(second.logits[i], ref(s)[0][p:])
    g = torch.Generator().manual_seed(1)
    keep = [len(seqs[0]) - 4, len(seqs[2]) - 2]  # (c) roll two slots back and append other tokens
    new = [torch.randint(0, model.config.vocab_size, (k,), generator=g) for k in (2, 6)]
    for slot, k in zip(slots[::2], keep):
        r.truncate(slot, k)
    third = r.forward(slots[::2], new)
    for i, (s, k, extra) in enumerate(zip(seqs[::2], keep, new)):
        same(third.logits[i], ref(torch.cat([s[:k], extra]))[0][k:])
    # (d) every request appends 2 tokens (the uniform case: no padding of the queries)
    seqs = [torch.cat([s[:k], extra]) for s, k, extra in zip(seqs[::2], keep, new)] + [seqs[1]]
    new = [torch.randint(0, model.config.vocab_size, (2,), generator=g) for _ in seqs]
    fourth = r.forward(slots[::2] + slots[1:2], new)
    for i, (s, extra) in enumerate(zip(seqs, new)):
        same(fourth.logits[i], ref(torch.cat([s, extra]))[0][len(s) :])
    seqs = [torch.cat([s, extra]) for s, extra in zip(seqs, new)]  # in slots 0, 2, 1
    # (e) slots 0 and 2 append a token each: attention reads slots 0-2 as one view, slot 1's row dropped
    assert attention_span(slots[::2]) == slice(0, 3)
    new = [torch.randint(0, model.config.vocab_size, (1,), generator=g) for _ in range(2)]
    fifth = r.forward(slots[::2], new)
    for i, (s, extra) in enumerate(zip(seqs[:2], new)):
        same(fifth.logits[i], ref(torch.cat([s, extra]))[0][len(s) :])
    seqs[:2] = [torch.cat([s, extra]) for s, extra in zip(seqs[:2], new)]
    # (f) slots 0 and 4 (three free or idle slots between them): their rows gathered, not read as one view
    r.alloc()
    far, other = r.alloc(), torch.randint(0, model.config.vocab_size, (6,), generator=g)
    r.forward([far], [other[:5]])
    assert attention_span([slots[0], far]) is None
    new = torch.randint(0, model.config.vocab_size, (2,), generator=g)
    sixth = r.forward([slots[0], far], [new, other[5:]])
    same(sixth.logits[0], ref(torch.cat([seqs[0], new]))[0][len(seqs[0]) :])
    same(sixth.logits[1], ref(other)[0][5:])
    return r


@pytest.mark.parametrize(
    "slots, span",
    [
        ([5], slice(5, 6)),
        (list(range(15)), slice(0, 15)),
        ([s for s in range(16) if s != 7], slice(0, 16)),  # a free slot among 15: one view, its row dropped
        ([0, 2], slice(0, 3)),  # as many free rows between them as half the requests: still one view
        ([0, 3], None),
        ([0, 2, 4, 6], None),  # every other slot: their rows are copied
    ],
)
def test_attention_reads_one_view_of_the_cache_unless_the_free_slots_between_are_many(slots, span):
    assert attention_span(slots) == span


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_runner_equals_hf_forward(family):
    model = tiny_model(family)
    assert model.config.model_type == family
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in (11, 4, 14)]
    check_against_hf(model, seqs, 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_packed_runner_runs_stacked_projections_and_equals_hf_forward(family, dtype):
    """A float32 target, or a bf16 one on a CPU that multiplies bf16 natively (target.cpu_prepack): the runner
    reads q, k, v and gate, up as one packed product each; its logits stay the HF forward's up to rounding."""
    if dtype == "bfloat16" and not targets.native_bf16("cpu"):
        pytest.skip("this CPU emulates bf16: nothing is packed")
    model = tiny_model(family).to(getattr(torch, dtype))
    assert packed.prepack(model) > 0
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in (11, 4, 14)]
    r = check_against_hf(model, seqs, 0.05 if dtype == "bfloat16" else 1e-4)
    assert all(type(m) is packed.PackedLinear for m in r.qkv + r.gate_up)


def test_every_supported_family_is_tested():
    assert sorted(FAMILIES) == sorted(CONFIGS)


def test_unsupported_family_and_features_are_refused_by_name():
    torch.manual_seed(0)
    granite = transformers.AutoModelForCausalLM.from_config(transformers.GraniteConfig(**TINY))
    with pytest.raises(UserError, match="model type 'granite' is not supported.*llama"):
        TargetRunner(granite, [])
    gemma = tiny_model("gemma3_text")
    gemma.config.attn_logit_softcapping = 50.0
    with pytest.raises(UserError, match="soft-capping"):
        TargetRunner(gemma, [])


def test_runner_equals_hf_forward_on_smollm2(smollm2):
    from dspark.corpus.tokenizer import chat_ids

    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    tok = smollm2.tokenizer
    seqs = [torch.tensor(chat_ids(tok, p)) for p in ("What is 2+2?", "Hi", "Write a haiku about the sea.")]
    seqs[1] = seqs[1][-9:]  # a short one among long ones
    check_against_hf(smollm2.model, seqs, 1e-4)
