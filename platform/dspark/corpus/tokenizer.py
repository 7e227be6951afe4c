"""Byte-level BPE tokenizer trained locally with the `tokenizers` library, and the chat format.

Reserved special tokens: BOS/EOS/PAD, turn markers, and MASK (the parallel drafters' block filler).
A conversation is  <|bos|><|user|>{prompt}<|assistant|>{response}<|eos|> ; the loss mask covers the
response and its EOS only. `chat_text` / `chat_ids` render prompts and conversations with ANY target
tokenizer's own chat template (this format is the built-in target's template).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from jinja2 import TemplateError
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
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
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


def chat_text(
    tokenizer,
    conversation: str | list[dict],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
) -> str:
    """A prompt (one user turn) or a conversation ([{"role": ..., "content": ...}, ...]) rendered with
    the tokenizer's own chat template; `chat_template_kwargs` reach the template (e.g. enable_thinking)."""
    if not tokenizer.chat_template:
        raise UserError("the target's tokenizer has no chat template")
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else list(conversation)
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )
    except (TemplateError, ValueError) as e:  # the template's raise_exception, or no messages
        raise UserError(f"the target's chat template refused the conversation: {e}") from None


def chat_ids(
    tokenizer,
    conversation: str | list[dict],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of `chat_text`: the template writes any BOS itself, so none is added here."""
    text = chat_text(tokenizer, conversation, add_generation_prompt, chat_template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


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
