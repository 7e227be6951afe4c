"""A prompt/response view of the corpora, so the pipeline exercises response-only loss masking
the way a chat model's data does.

- code:  one example per function: prompt = decorators + signature + docstring, response = body.
- prose: prompt = one paragraph, response = the next paragraphs.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from typing import Iterator

from dspark.corpus.sources import Document, Domain


@dataclass(frozen=True)
class Example:
    doc_id: str
    domain: Domain
    index: int  # position of the example within its document
    prompt: str
    response: str

    @property
    def example_id(self) -> str:
        return f"{self.doc_id}#{self.index}"


def _top_functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions and methods, but not functions nested inside functions (they stay in the body)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child
            elif isinstance(child, (ast.ClassDef, ast.If, ast.Try, ast.With)) or node is tree:
                stack.append(child)


def code_examples(doc: Document, max_response_lines: int = 40) -> Iterator[Example]:
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return  # Python 2 sources and deliberately broken test data
    lines = doc.text.splitlines()
    funcs = sorted(_top_functions(tree), key=lambda f: f.lineno)
    for i, fn in enumerate(funcs):
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
        first = fn.body[0]
        has_doc = (
            isinstance(first, ast.Expr)
            and isinstance(getattr(first, "value", None), ast.Constant)
            and isinstance(first.value.value, str)
        )
        head_end = first.end_lineno if has_doc else first.lineno - 1  # 1-based, inclusive
        if len(fn.body) == (1 if has_doc else 0) or head_end <= start:
            continue
        block = textwrap.dedent("\n".join(lines[start : fn.end_lineno])).splitlines()
        split = head_end - start
        prompt, body = block[:split], block[split : split + max_response_lines]
        if len(body) >= 2:
            yield Example(doc.doc_id, "code", i, "\n".join(prompt) + "\n", "\n".join(body) + "\n")


_PARA = re.compile(r"\n\s*\n")


def prose_examples(doc: Document, max_response_chars: int = 1500) -> Iterator[Example]:
    paras = [p.strip("\n") for p in _PARA.split(doc.text) if p.strip()]
    for i in range(0, len(paras) - 1, 3):
        prompt = paras[i]
        response = "\n\n".join(paras[i + 1 : i + 3])[:max_response_chars]
        if len(prompt) >= 20 and len(response) >= 40:
            yield Example(doc.doc_id, "prose", i, prompt + "\n\n", response + "\n")


def examples(doc: Document, cfg) -> Iterator[Example]:
    """`cfg` is a dspark.config.CorpusConfig."""
    if doc.domain == "code":
        return code_examples(doc, cfg.max_response_lines)
    return prose_examples(doc, cfg.max_response_chars)


def iter_examples(corpus, domain: Domain, split, cfg) -> Iterator[Example]:
    """The examples of one domain's split, in document order, made only as far as they are consumed
    (parsing every source file of the code domain takes a minute)."""
    for doc in corpus.split(domain, split):
        yield from examples(doc, cfg)


def split_examples(corpus, domain: Domain, split, cfg) -> list[Example]:
    return list(iter_examples(corpus, domain, split, cfg))
