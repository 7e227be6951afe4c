"""A request's output text as its tokens commit, decoding only the new tokens.

Decoding the whole output every round costs O(L) per round, O(L^2) per request. The `tokenizers`
library's DecodeStream decodes the new tokens (with the few it holds back) and keeps the bytes of an
unfinished UTF-8 character until its last byte arrives. At the end one full decode gives the exact
text, with any unfinished last character in it as U+FFFD. Streaming and the final decode use the
same (Rust) tokenizer, so the final text always extends what was streamed.
"""

from __future__ import annotations

from typing import Optional

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer):
        """`tokenizer`: a transformers fast tokenizer (its Rust `backend_tokenizer` decodes)."""
        self.backend = tokenizer.backend_tokenizer
        # None after DecodeStream refused a sequence (it can, for some byte-fallback tokenizers):
        # from then on the whole output is decoded each round
        self.stream: Optional[DecodeStream] = DecodeStream(skip_special_tokens=True)
        self.text = ""  # what the tokens consumed so far decode to, unfinished characters held back
        self.consumed = 0

    def update(self, out: list[int]) -> str:
        """`out`: the whole output so far (it only grows); decodes the tokens not seen yet."""
        new = out[self.consumed :]
        self.consumed = len(out)
        if self.stream is not None and new:
            try:
                self.text += self.stream.step(self.backend, new) or ""
            except Exception:
                self.stream = None
        if self.stream is None:
            self.text = self.backend.decode(out, skip_special_tokens=True).rstrip("\ufffd")
        return self.text

    def final(self, out: list[int]) -> str:
        """The finished output's text, exactly as one decode of all of it."""
        self.consumed = len(out)
        self.text = self.backend.decode(out, skip_special_tokens=True)
        return self.text
