"""The user's own data: prompts and conversations from JSONL files on local disk or s3://.

One JSON object per line, in any of these formats (original assistant answers are dropped: the
target regenerates every assistant turn, see dspark.cache.build.regenerate):
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}     OpenAI
    {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}       ShareGPT
    {"turns": ["first user turn", "second user turn", ...]}                         the DSpark paper's sets
    {"prompt": "..."}                                                                one prompt
Consecutive user messages form one turn. A bad record is a UserError naming the file and line, or,
with `skip_bad`, a counted skip.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from itertools import chain, islice

from dspark.corpus.examples import iter_examples, split_examples
from dspark.corpus.sources import DOMAINS, Corpus
from dspark.errors import UserError

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}


@dataclass(frozen=True)
class Conversation:
    conv_id: str  # "<source>:<line>" for files, the example id for the built-in corpus
    source: str  # the set it comes from: a file's stem ("mt-bench") or a built-in domain ("code")
    turns: tuple[str, ...]  # the user turns, in order
    system: str = ""

    def messages(self, answers: list[str]) -> list[dict]:
        """The conversation up to user turn len(answers) + 1, with `answers` as the assistant's earlier turns."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for user, answer in zip(self.turns, answers):
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return msgs + [{"role": "user", "content": self.turns[len(answers)]}]

    def to_json(self) -> str:
        return json.dumps(
            {"conv_id": self.conv_id, "source": self.source, "turns": list(self.turns), "system": self.system}
        )

    @classmethod
    def from_json(cls, text: str) -> "Conversation":
        d = json.loads(text)
        return cls(d["conv_id"], d["source"], tuple(d["turns"]), d["system"])


@dataclass
class Loaded:
    conversations: list[Conversation]
    sha256: str  # of the file's bytes
    skipped: list[str] = field(default_factory=list)  # "line N: why", when skipping was asked for


def _text(content, what: str) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"{what} is not a non-empty string")
    return content


def _from_messages(msgs, role_key: str, content_key: str) -> tuple[str, list[str]]:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("expected a non-empty list of messages")
    system, turns, prev = "", [], ""
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get(role_key) not in ROLES:
            raise ValueError(f"message {i}: {role_key} must be one of {sorted(ROLES)}")
        role, text = ROLES[m[role_key]], _text(m.get(content_key), f"message {i}: {content_key}")
        if role == "system":
            if i:
                raise ValueError(f"message {i}: a system message must come first")
            system = text
        elif role == "user":
            if prev == "user":
                turns[-1] += "\n\n" + text
            else:
                turns.append(text)
        prev = role
    return system, turns


def parse_record(record) -> tuple[str, list[str]]:
    """(system prompt, user turns) of one JSON record in any supported format; ValueError if bad."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    if "messages" in record:
        system, turns = _from_messages(record["messages"], "role", "content")
    elif "conversations" in record:
        system, turns = _from_messages(record["conversations"], "from", "value")
    elif "turns" in record:
        if not isinstance(record["turns"], list):
            raise ValueError("turns must be a list of strings")
        system, turns = "", [_text(t, f"turns[{i}]") for i, t in enumerate(record["turns"])]
    elif "prompt" in record:
        system, turns = "", [_text(record["prompt"], "prompt")]
    else:
        raise ValueError("no 'messages', 'conversations', 'turns' or 'prompt' key")
    if not turns:
        raise ValueError("no user turn")
    return system, turns


def parse_jsonl(text: str, name: str, source: str, skip_bad: bool = False) -> tuple[list[Conversation], list[str]]:
    """Conversations of a JSONL text (blank lines ignored); `name` is the file named in errors."""
    convs, skipped = [], []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit inside strings
        if not line.strip():
            continue
        try:
            system, turns = parse_record(json.loads(line))
        except ValueError as e:  # JSONDecodeError is a ValueError
            if not skip_bad:
                raise UserError(
                    f"{name}:{n}: bad record: {e} (set cache.skip_bad_records=true to skip such lines)"
                ) from None
            skipped.append(f"line {n}: {e}")
            continue
        convs.append(Conversation(f"{source}:{n}", source, tuple(turns), system))
    return convs, skipped


def source_name(uri: str) -> str:
    """A file's set name: its stem ("s3://b/sets/mt-bench.jsonl" -> "mt-bench")."""
    base = posixpath.basename(uri.rstrip("/"))
    return base[: -len(".jsonl")] if base.endswith(".jsonl") else base


def load_jsonl(uri: str, storage, skip_bad: bool = False) -> Loaded:
    """A JSONL file from a local path, file:// or s3:// (through `storage`, a dspark.storage.Storage)."""
    fs, path = storage.pyarrow_fs(uri)
    try:
        with fs.open_input_stream(path) as f:
            data = f.read()
    except (FileNotFoundError, OSError) as e:
        raise UserError(f"prompt file {uri} could not be read: {str(e).splitlines()[0]}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {uri} is not UTF-8: {e}") from None
    convs, skipped = parse_jsonl(text, uri, source_name(uri), skip_bad)
    if not convs:
        raise UserError(f"prompt file {uri} holds no usable record")
    return Loaded(convs, hashlib.sha256(data).hexdigest(), skipped)


def spread(items: list, n: int) -> list:
    """At most n items taken at an even stride (deterministic, spread over the whole list); n=0: all."""
    if not n:
        return list(items)
    return items[:: max(1, len(items) // n)][:n]


def builtin_conversations(corpus, split: str, cfg, n: int = 0) -> list[Conversation]:
    """One-turn conversations of the built-in corpus's split, its domains interleaved, at most n (0 = all).
    `cfg` is a dspark.config.CorpusConfig."""
    if n:  # interleaved, and only the documents the first n examples come from are parsed
        by_dom = [iter_examples(corpus, d, split, cfg) for d in DOMAINS]
        examples = list(islice(chain.from_iterable(zip(*by_dom)), n))
    else:
        examples = [ex for d in DOMAINS for ex in split_examples(corpus, d, split, cfg)]
    return [Conversation(ex.example_id, ex.domain, (ex.prompt,)) for ex in examples]


def cache_sources(cfg, storage, log_fn=print) -> tuple[list[Conversation], str]:
    """The conversations `cache.sources` names ("builtin": the built-in corpus's train split; else JSONL
    URIs), at most `cache.max_examples` from each, and one sha256 identifying them all.
    `cfg` is a dspark.config.Config."""
    cc = cfg.cache
    # the user's files first: a bad record is named before the built-in corpus is read (seconds)
    files = {src: load_jsonl(src, storage, cc.skip_bad_records) for src in cc.sources if src != "builtin"}
    convs, hashes = [], []
    for src in cc.sources:
        if src == "builtin":
            corpus = Corpus.load(cfg.corpus)
            convs += builtin_conversations(corpus, "train", cfg.corpus, cc.max_examples)
            hashes.append(corpus.manifest()["sha256"])
            continue
        loaded = files[src]
        if loaded.skipped:
            log_fn(f"[cache] {src}: skipped {len(loaded.skipped)} bad records ({'; '.join(loaded.skipped[:3])})")
        convs += spread(loaded.conversations, cc.max_examples)
        hashes.append(loaded.sha256)
    if len(hashes) == 1:
        return convs, hashes[0]  # a single source keeps its own hash (the built-in corpus's manifest)
    return convs, hashlib.sha256("\n".join(f"{s}={h}" for s, h in zip(cc.sources, hashes)).encode()).hexdigest()
