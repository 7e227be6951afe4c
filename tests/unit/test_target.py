"""Targets: the committed reference target (loads through the public API, meets its quality floor), GGUF
and package-resource targets converted once (the real SmolLM2), hub snapshots, and the tokens every
target needs (mask, pad, EOS ids)."""

import copy
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
from conftest import SMOLLM2
from transformers import GenerationConfig

from dspark import target as targets
from dspark.config import load_config
from dspark.corpus.examples import split_examples
from dspark.corpus.sources import Corpus
from dspark.corpus.tokenizer import EOS, MASK, USER, chat_ids
from dspark.errors import UserError
from dspark.target import quality
from dspark.target.packed import PackedLinear


@pytest.fixture(scope="module")
def builtin():
    return targets.load("builtin")


def test_builtin_is_a_frozen_qwen3_with_its_tokenizer(builtin):
    assert type(builtin.model).__name__ == "Qwen3ForCausalLM"
    assert not builtin.model.training and not any(p.requires_grad for p in builtin.model.parameters())
    tok = builtin.tokenizer
    assert len(tok) == builtin.config.vocab_size and tok.mask_token_id is not None
    assert len(builtin.weights_sha256) == 64 and builtin.weights_sha256 == targets.weights_hash(builtin.path)


def test_card_records_recipe_corpus_and_quality(builtin):
    card = targets.card("builtin")
    assert card["parameters"] == sum(p.numel() for p in builtin.model.parameters())
    assert card["training"]["tokens"] > 1_000_000 and len(card["corpus"]["sha256"]) == 64
    for domain in ("code", "prose"):
        assert card["heldout"][domain]["top1"] > card["heldout"][domain]["unigram_top1"]


def test_heldout_code_top1_is_clearly_above_unigram(builtin):
    """Measured here, not read from the card: the quality floor the drafters rely on."""
    cfg = load_config()
    corpus = Corpus.load(cfg.corpus)
    exs = split_examples(corpus, "code", "heldout", cfg.corpus)[:16]
    seqs = quality.example_ids(builtin.tokenizer, exs, 512)
    q = quality.lm_quality(builtin.model, seqs, builtin.tokenizer.pad_token_id)
    unigram_top1 = targets.card("builtin")["heldout"]["code"]["unigram_top1"]
    assert q["tokens"] > 1000
    assert q["top1"] > 2 * unigram_top1, (q, unigram_top1)


def test_dtype_and_device_are_configuration(builtin):
    bf16 = targets.load("builtin", device="cpu", dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(UserError, match="unknown dtype"):
        targets.load("builtin", dtype="int3")


def test_auto_dtype_is_bfloat16_only_where_the_cpu_multiplies_it(builtin, monkeypatch):
    for avx512_bf16, amx, expected in [(False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert targets.resolve_dtype("auto", "cpu") == expected
        assert targets.resolve_dtype("float16", "cpu") == "float16"  # an explicit dtype stays as it is
        tgt = targets.load("builtin", device="cpu", dtype="auto")
        assert next(tgt.model.parameters()).dtype == getattr(torch, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_target_runs_packed_linears_with_the_same_results(builtin, dtype):
    """target.cpu_prepack: every linear of a float32 target, and of a bf16 one on a CPU that multiplies bf16
    natively, becomes a PackedLinear (its dense weight still the module's `weight`, the lm_head still tied
    to the embedding) and the logits stay the plain ones."""
    packed = targets.load("builtin", dtype=dtype)
    plain = targets.load("builtin", dtype=dtype, cpu_prepack=False)
    linears = sum(type(m) is torch.nn.Linear for m in plain.model.modules())
    n_packed = sum(type(m) is PackedLinear for m in packed.model.modules())
    if dtype == "bfloat16" and not targets.native_bf16("cpu"):  # emulated bf16: nothing is packed
        assert n_packed == 0
        return
    assert n_packed == linears == 6 * 7 + 1
    assert packed.model.lm_head.weight is packed.model.get_input_embeddings().weight
    ids = torch.randint(10, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = packed.model(ids).logits.float(), plain.model(ids).logits.float()
        step_a = packed.model(ids[:, :1]).logits.float()
        step_b = plain.model(ids[:, :1]).logits.float()
    # rounding of a different summation order
    tol = dict(atol=0.05, rtol=0.02) if dtype == "bfloat16" else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(step_a, step_b, **tol)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.97


def test_missing_target_and_corrupt_tokenizer_are_named(tmp_path, builtin):
    with pytest.raises(UserError, match="target not found: .*nowhere"):
        targets.load(str(tmp_path / "nowhere"))
    broken = tmp_path / "broken"
    shutil.copytree(builtin.path, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer .*could not be read"):
        targets.load(str(broken))
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(UserError, match="could not be loaded|no-such-arch"):
        targets.load(str(broken))


def test_gguf_in_a_package_is_converted_once_and_identified_by_its_sha256(smollm2, monkeypatch):
    gguf = targets.package_file(SMOLLM2)
    assert type(smollm2.model).__name__ == "LlamaForCausalLM" and smollm2.config.num_hidden_layers == 30
    assert (
        Path(smollm2.path).parent == targets.DEFAULT_CACHE_DIR and (Path(smollm2.path) / "model.safetensors").is_file()
    )
    assert smollm2.weights_sha256 == targets.file_sha256(gguf) == targets.weights_hash(smollm2.path)
    assert smollm2.identity()["weights_sha256"] == smollm2.weights_sha256

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert targets.resolve(SMOLLM2) == smollm2.path
    assert targets.resolve(str(gguf)) == smollm2.path  # the same GGUF named by its path shares the copy


def test_smollm2_tokens_pad_mask_eos_and_chat_template(smollm2):
    tok = smollm2.tokenizer
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == (2,) and smollm2.pad_token_id == 2
    assert tok.mask_token == "<empty_output>" and smollm2.mask_token_id == 16  # unused, not in the template
    assert smollm2.identity()["mask_token_id"] == 16
    ids = chat_ids(tok, "What is 2+2?")
    assert tok.decode(ids).startswith("<|im_start|>system\n") and tok.decode(ids).endswith("<|im_start|>assistant\n")
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, len(ids) :])  # real weights: it answers


def test_target_names_that_cannot_resolve_are_named(tmp_path):
    with pytest.raises(UserError, match="package 'no_such_package_xyz' is not installed"):
        targets.resolve("pkg://no_such_package_xyz/model.gguf")
    with pytest.raises(UserError, match="expected pkg://<package>/<file"):
        targets.resolve("pkg://dspark")
    with pytest.raises(UserError, match="target not found: .*missing.gguf"):
        targets.resolve("pkg://dspark/missing.gguf")
    with pytest.raises(UserError, match="target not found: .*nowhere.gguf"):
        targets.resolve(str(tmp_path / "nowhere.gguf"))
    with pytest.raises(UserError, match="revision applies to hub ids only"):
        targets.resolve("builtin", revision="main")


def test_hub_id_resolves_to_its_snapshot_and_records_the_commit(tmp_path, monkeypatch, builtin):
    """An offline HF cache holding one snapshot of org/tiny (the built-in target's files)."""
    commit = "ab" * 20
    repo = tmp_path / "models--org--tiny"
    shutil.copytree(builtin.path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tgt = targets.load("org/tiny", revision="main")
    assert tgt.path == str(repo / "snapshots" / commit) and tgt.revision == commit
    assert tgt.weights_sha256 == builtin.weights_sha256 and tgt.identity()["revision"] == commit
    with pytest.raises(UserError, match="target org/tiny@v9 could not be fetched"):
        targets.load("org/tiny", revision="v9")


def test_mask_and_pad_tokens_are_configurable_and_checked(builtin):
    def tok(**kw):
        return targets.tokenizer_for("builtin", **kw)

    assert tok().mask_token_id == builtin.mask_token_id == builtin.tokenizer.convert_tokens_to_ids(MASK)
    assert tok(mask_token=USER).mask_token_id == builtin.tokenizer.convert_tokens_to_ids(USER)
    assert tok(mask_token=100).mask_token_id == 100 and tok(pad_token=EOS).pad_token_id == builtin.eos_token_ids[0]
    with pytest.raises(UserError, match="target.mask_token: 'nope' is not a token"):
        tok(mask_token="nope")
    with pytest.raises(UserError, match="target.mask_token: id 99999 is outside the vocabulary"):
        tok(mask_token=99999)
    cfg = load_config(overrides=[f"target.mask_token={USER}", "target.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.target.chat_template_kwargs == {"enable_thinking": False}
    assert targets.tokenizer_from_config(cfg.target).mask_token == USER


def test_default_mask_is_an_unused_special_token_and_pad_falls_back_to_eos(builtin):
    tok = copy.deepcopy(builtin.tokenizer)
    tok.mask_token, tok.pad_token, tok.bos_token = None, None, None  # none of them, like Llama's (no BOS: Qwen's)
    targets.prepare_tokenizer(tok, builtin.config.vocab_size)
    assert (
        tok.bos_token_id is None and tok.mask_token == MASK
    )  # special, and the chat template never writes it (unlike <|user|> etc.)
    assert tok.pad_token_id == tok.eos_token_id
    none_free = copy.deepcopy(builtin.tokenizer)
    none_free.mask_token = None
    with pytest.raises(UserError, match="no unused special token: set target.mask_token"):
        targets.prepare_tokenizer(none_free, 6)  # every id >= 6 lies past the model's embedding rows


def test_eos_ids_join_the_generation_config_and_the_tokenizer(builtin):
    assert targets.eos_ids(GenerationConfig(eos_token_id=[7, 2]), builtin.tokenizer) == (7, 2)
    assert targets.eos_ids(GenerationConfig(eos_token_id=7), builtin.tokenizer) == (7, 2)
    assert targets.eos_ids(GenerationConfig(), builtin.tokenizer) == (2,)
