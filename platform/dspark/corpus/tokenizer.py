"""Byte-level BPE tokenizer trained locally with the `tokenizers` library, and the chat format.

Reserved special tokens: BOS/EOS/PAD, turn markers, and MASK (the parallel drafters' block filler).
A conversation is  <|bos|><|user|>{prompt}<|assistant|>{response}<|eos|> ; the loss mask covers the
response and its EOS only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark.errors import UserError

BOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, MASK]

# Same layout as format_prompt/encode_example, for tokenizer.apply_chat_template.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def to_hf(tok: Tokenizer):
    """Wrap as a transformers fast tokenizer with the special tokens and chat template set."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, mask_token=MASK,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def load_tokenizer(path: str | Path):
    """Load an HF tokenizer folder; a missing or corrupt file is a one-line UserError."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"tokenizer not found: {path / 'tokenizer.json'}")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions on bad JSON
        raise UserError(f"tokenizer {path / 'tokenizer.json'} could not be read: {str(e).splitlines()[0]}") from None


def format_prompt(prompt: str) -> str:
    return f"{BOS}{USER}{prompt}{ASSISTANT}"


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(format_prompt(prompt), add_special_tokens=False)


def encode_example(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask). Prompt and response are encoded separately, as at inference time
    where the response is generated token by token after the encoded prompt."""
    p = encode_prompt(tokenizer, prompt)
    r = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return p + r, [0] * len(p) + [1] * len(r)
