"""Incremental detokenization: whatever the tokens and however they arrive in rounds, the streamed text
is always a prefix of the full decode and the finished text equals it."""

import random

import pytest

from dspark import target as targets
from dspark.decoding.detok import Detokenizer

TEXTS = ["héllo wörld ☃ 日本語 🎉 def f(x):\n    return x", "ça va? 😀😀 ünïcödé", "plain ascii, nothing special"]


@pytest.mark.parametrize("tokenizer", ["builtin", "smollm2"])
def test_streamed_text_is_a_prefix_and_the_final_text_is_exact(tokenizer, request):
    tok = targets.tokenizer_for("builtin") if tokenizer == "builtin" else request.getfixturevalue("smollm2_tokenizer")
    rng = random.Random(0)
    for trial in range(200):
        if trial % 2:  # real text, multi-byte characters split across tokens
            ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        else:  # any ids at all: special tokens, invalid UTF-8 in the middle
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        d, out = Detokenizer(tok), []
        while len(out) < len(ids):
            out = ids[: len(out) + rng.randrange(1, 5)]  # a round commits 1-4 tokens
            assert tok.decode(out, skip_special_tokens=True).startswith(d.update(out))
        if trial % 2:  # a text that ends on a whole character is all streamed before the end
            assert d.text == tok.decode(out, skip_special_tokens=True)
        assert d.final(out) == tok.decode(out, skip_special_tokens=True)


class Refusing:
    """DecodeStream raises on some byte-fallback sequences ("Invalid prefix encountered")."""

    def step(self, tokenizer, ids):
        raise Exception("Invalid prefix encountered")


def test_a_sequence_the_stream_refuses_falls_back_to_whole_decodes():
    tok = targets.tokenizer_for("builtin")
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    d = Detokenizer(tok)
    d.update(ids[:3])
    d.stream = Refusing()
    for n in range(4, len(ids) + 1):
        assert tok.decode(ids[:n], skip_special_tokens=True).startswith(d.update(ids[:n]))
    assert d.stream is None and d.text == d.final(ids) == tok.decode(ids, skip_special_tokens=True)
