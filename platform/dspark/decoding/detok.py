"""A request's output text as its tokens commit, each token decoded once.

Decoding the whole output every round costs O(L) per round, O(L^2) per request. The `tokenizers`
library's DecodeStream decodes only the new tokens and holds back the bytes of an unfinished UTF-8
character until its last byte arrives. At the end one full decode gives the exact text of
`tokenizer.decode(out)`, with any unfinished last character in it as U+FFFD.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer):
        """`tokenizer`: a transformers fast tokenizer (its Rust `backend_tokenizer` decodes)."""
        self.tok = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.text = ""  # what the tokens consumed so far decode to, unfinished characters held back
        self.consumed = 0

    def update(self, out: list[int]) -> str:
        """`out`: the whole output so far (it only grows); decodes the tokens not seen yet."""
        new = out[self.consumed :]
        self.consumed = len(out)
        if new:
            self.text += self.stream.step(self.tok.backend_tokenizer, new) or ""
        return self.text

    def final(self, out: list[int]) -> str:
        """The finished output's text, exactly as one decode of all of it."""
        self.consumed = len(out)
        self.text = self.tok.decode(out, skip_special_tokens=True)
        return self.text
