import pytest

from dspark.corpus.tokenizer import (
    ASSISTANT,
    MASK,
    SPECIAL_TOKENS,
    chat_ids,
    chat_text,
    encode_example,
    encode_prompt,
    format_prompt,
    load_tokenizer,
    to_hf,
    train_tokenizer,
)
from dspark.errors import UserError

TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"] * 50


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    to_hf(train_tokenizer(TEXT, 320)).save_pretrained(str(d))
    return d


def test_special_tokens_are_reserved_and_atomic(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS)))
    assert tok.mask_token == MASK and tok.mask_token_id == ids[-1]
    assert tok.encode(format_prompt("x"), add_special_tokens=False)[:2] == [tok.bos_token_id, ids[3]]


def test_byte_level_roundtrip(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = "naïve café — ünïcode\tand\n    indentation"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_loss_mask_covers_response_and_eos_only(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids, mask = encode_example(tok, "def add(a, b):\n", "    return a + b\n")
    first = mask.index(1)
    assert ids[first - 1] == tok.convert_tokens_to_ids(ASSISTANT)
    assert ids[-1] == tok.eos_token_id and all(mask[first:]) and not any(mask[:first])
    assert tok.decode(ids[first:-1]) == "    return a + b\n"


def test_chat_template_matches_training_format(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == format_prompt("hi")


def test_chat_helpers_render_prompts_and_conversations_with_the_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert chat_ids(tok, "hi") == encode_prompt(tok, "hi")  # one BOS: the template writes it, encode adds none
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert chat_text(tok, turns) == "<|bos|><|system|>be brief<|user|>a<|assistant|>b<|eos|><|user|>c<|assistant|>"
    assert chat_text(tok, turns[:3], add_generation_prompt=False).endswith("b<|eos|>")


def test_chat_template_kwargs_reach_the_template_and_its_errors_are_named(tok_dir):
    tok = load_tokenizer(tok_dir)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    )
    assert chat_text(tok, "hi") == "hi" and chat_text(tok, "hi", chat_template_kwargs={"shout": True}) == "hi!"
    with pytest.raises(UserError, match="chat template refused the conversation: no tools"):
        chat_text(tok, [{"role": "tool", "content": "x"}])
    with pytest.raises(UserError, match="chat template refused the conversation: .*empty conversation"):
        chat_text(tok, [])
    tok.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        chat_ids(tok, "hi")


def test_missing_and_corrupt_tokenizer_are_named(tmp_path, tok_dir):
    with pytest.raises(UserError, match="tokenizer not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    (tmp_path / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    with pytest.raises(UserError, match=r"tokenizer .*tokenizer.json could not be read"):
        load_tokenizer(tmp_path)
