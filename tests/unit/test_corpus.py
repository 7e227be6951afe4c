import gzip
import textwrap

import pytest

from dspark.config import load_config
from dspark.corpus.examples import code_examples, prose_examples, split_examples
from dspark.corpus.sources import Corpus, Document, split_of
from dspark.errors import UserError

CODE = textwrap.dedent('''
    """Module docstring."""
    import os


    @decorator
    def add(a, b):
        """Add two numbers."""
        total = a + b
        return total


    class Box:
        def size(self):
            n = len(self.items)
            return n * 2

        def empty(self):
            return None


    def outer(x):
        def inner(y):
            return y
        return inner(x)
    ''')

PARA = "This paragraph explains how the tool reads its input files in order."


def _info(node: str, body: str) -> str:
    return f"\x1f\nFile: tool.info,  Node: {node},  Next: Other,  Up: Top\n\n{body}\n"


@pytest.fixture
def roots(tmp_path):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    for i in range(30):
        (code / "pkg" / f"m{i}.py").write_text(CODE)
    info = tmp_path / "info"
    info.mkdir()
    nodes = "".join(_info(f"Node {i}", "\n\n".join([PARA] * 7)) for i in range(30))
    with gzip.open(info / "tool.info.gz", "wt") as f:
        f.write("This is tool.info, produced by makeinfo.\n" + nodes + "\x1f\nTag Table:\n\x1f\nEnd Tag Table\n")
    return load_config(overrides=[f"corpus.code_roots=['{code}']", f"corpus.prose_roots=['{info}']"]).corpus


def test_code_examples_are_signature_plus_docstring_then_body():
    exs = list(code_examples(Document("code/m.py", "code", CODE)))
    prompts = [e.prompt for e in exs]
    assert prompts[0] == '@decorator\ndef add(a, b):\n    """Add two numbers."""\n'
    assert exs[0].response == "    total = a + b\n    return total\n"
    assert "def size(self):\n" in prompts  # methods are dedented examples of their own
    assert not any("def empty" in p for p in prompts)  # a one-line body is too short to be a response
    assert not any("def inner" in p for p in prompts)  # nested functions stay inside their parent's body
    assert "def inner(y):" in exs[-1].response


def test_unparsable_code_gives_no_examples():
    assert list(code_examples(Document("code/py2.py", "code", "print 'hello'\n"))) == []


def test_prose_nodes_become_documents_and_paragraph_examples(roots):
    corpus = Corpus.load(roots)
    prose = corpus.docs["prose"]
    assert len(prose) == 30 and prose[0].doc_id == "prose/tool.info/Node 0"
    exs = list(prose_examples(prose[0]))
    assert len(exs) == 2  # 7 paragraphs: prompt 0 -> 1,2 ; prompt 3 -> 4,5 ; 6 has no continuation
    assert exs[0].prompt == PARA + "\n\n" and exs[0].response == PARA + "\n\n" + PARA + "\n"


def test_splits_are_deterministic_disjoint_and_cover_everything(roots):
    a, b = Corpus.load(roots), Corpus.load(roots)
    assert a.manifest() == b.manifest()
    for domain in ("code", "prose"):
        ids = [set(d.doc_id for d in a.split(domain, s)) for s in ("train", "validation", "heldout")]
        assert sum(len(s) for s in ids) == len(a.docs[domain])
        assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert split_of("code/pkg/m1.py") == split_of("code/pkg/m1.py")
    train_code = set(d.doc_id for d in a.split("code", "train"))
    ex = split_examples(a, "code", "train", roots)
    assert ex and all(e.doc_id in train_code for e in ex)


def test_manifest_hash_changes_with_content(roots, tmp_path):
    before = Corpus.load(roots).manifest()["sha256"]
    (tmp_path / "code" / "pkg" / "m0.py").write_text(CODE + "\nX = 1\n")
    assert Corpus.load(roots).manifest()["sha256"] != before


def test_missing_root_is_named(tmp_path):
    cfg = load_config(overrides=[f"corpus.prose_roots=['{tmp_path / 'nope'}']"]).corpus
    with pytest.raises(UserError, match="corpus root not found: .*nope"):
        Corpus.load(cfg)
