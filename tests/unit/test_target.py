"""The committed reference target: loads through the public API and meets its quality floor."""
import json
import shutil

import pytest
import torch

from dspark import target as targets
from dspark.config import load_config
from dspark.corpus.examples import split_examples
from dspark.corpus.sources import Corpus
from dspark.errors import UserError
from dspark.target import quality


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
