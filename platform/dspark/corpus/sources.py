"""Built-in corpora: real text that every machine of this kind already has on disk.

- code:  Python source of this interpreter's standard library (tests included).
- prose: the GNU info manuals under /usr/share/info (coreutils, sed, grep, gettext, ...), one
         document per info node.

Splits are by whole document (a source file, or an info node) and depend only on the document's
id, so they are deterministic across machines and stable when documents are added.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator, Literal

from dspark.errors import UserError

Domain = Literal["code", "prose"]
Split = Literal["train", "validation", "heldout"]
DOMAINS: tuple[Domain, ...] = ("code", "prose")
SPLITS: tuple[Split, ...] = ("train", "validation", "heldout")

MAX_DOC_BYTES = 400_000  # generated tables and data dumps are not useful text


@dataclass(frozen=True)
class Document:
    doc_id: str  # "code/json/decoder.py", "prose/sed.info/The 's' Command"
    domain: Domain
    text: str

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def split_of(doc_id: str, validation_pct: int = 5, heldout_pct: int = 5) -> Split:
    bucket = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % 100
    if bucket < heldout_pct:
        return "heldout"
    if bucket < heldout_pct + validation_pct:
        return "validation"
    return "train"


def _resolve_root(root: str) -> Path:
    path = Path(sysconfig.get_paths()["stdlib"]) if root == "stdlib" else Path(root)
    if not path.is_dir():
        raise UserError(f"corpus root not found: {root} ({path})")
    return path


SKIPPED_DIRS = ("site-packages", "__pycache__")  # installed packages are not the standard library


def _python_files(base: Path) -> list[Path]:
    """The *.py files under base, sorted, as base.rglob("*.py") finds them (symlinked folders are not
    entered), without walking the skipped folders: a venv's or interpreter's site-packages can hold
    ten times more files than the standard library."""
    found = []
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if not any(s in d for s in SKIPPED_DIRS)]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def code_documents(roots: list[str]) -> Iterator[Document]:
    for root in roots:
        base = _resolve_root(root)
        for path in _python_files(base):
            rel = path.relative_to(base).as_posix()
            if any(s in rel for s in SKIPPED_DIRS) or path.stat().st_size > MAX_DOC_BYTES:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few test files are deliberately not UTF-8
            if text.strip():
                yield Document(f"code/{rel}", "code", text)


_INFO_HEADER = re.compile(r"^File: ([^,]+),\s+Node: ([^,\n]+)")


def _read_info(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def prose_documents(roots: list[str]) -> Iterator[Document]:
    for root in roots:
        base = _resolve_root(root)
        for path in sorted(base.glob("*.info*")):
            if not (path.suffix == ".gz" or path.name.endswith(".info") or re.search(r"\.info-\d+$", path.name)):
                continue
            for node in _read_info(path).split("\x1f"):
                node = node.lstrip("\n")
                m = _INFO_HEADER.match(node)
                if not m:
                    continue  # tag tables, indirect tables, preamble
                body = node.split("\n", 1)[1].strip("\n") if "\n" in node else ""
                if len(body) >= 200:
                    yield Document(f"prose/{m.group(1)}/{m.group(2).strip()}", "prose", body)


def documents(domain: Domain, code_roots: list[str], prose_roots: list[str]) -> Iterator[Document]:
    if domain == "code":
        yield from code_documents(code_roots)
    else:
        yield from prose_documents(prose_roots)


@dataclass
class Corpus:
    """All documents of both domains, split by document id."""

    docs: dict[Domain, list[Document]]
    validation_pct: int = 5
    heldout_pct: int = 5

    @classmethod
    def load(cls, cfg) -> "Corpus":
        """`cfg` is a dspark.config.CorpusConfig."""
        for root in [*cfg.code_roots, *cfg.prose_roots]:
            _resolve_root(root)  # a bad root fails before anything is read
        docs: dict[Domain, list[Document]] = {}
        for domain in DOMAINS:
            found = list(documents(domain, cfg.code_roots, cfg.prose_roots))
            if not found:
                roots = cfg.code_roots if domain == "code" else cfg.prose_roots
                raise UserError(f"no {domain} documents found under corpus roots {roots}")
            docs[domain] = found
        return cls(docs, cfg.validation_pct, cfg.heldout_pct)

    def split(self, domain: Domain, split: Split) -> list[Document]:
        return [d for d in self.docs[domain] if split_of(d.doc_id, self.validation_pct, self.heldout_pct) == split]

    def manifest(self) -> dict:
        """Per domain and split: documents, bytes and a content hash; plus one corpus hash."""
        out: dict = {"splits": {}, "validation_pct": self.validation_pct, "heldout_pct": self.heldout_pct}
        overall = hashlib.sha256()
        for domain in DOMAINS:
            for split in SPLITS:
                h = hashlib.sha256()
                docs = sorted(self.split(domain, split), key=lambda d: d.doc_id)
                for d in docs:
                    h.update(f"{d.doc_id}\0{d.sha256}\n".encode())
                out["splits"][f"{domain}/{split}"] = {
                    "documents": len(docs),
                    "bytes": sum(len(d.text.encode()) for d in docs),
                    "sha256": h.hexdigest(),
                }
                overall.update(h.hexdigest().encode())
        out["sha256"] = overall.hexdigest()
        return out
