"""The target cache format: sharded Parquet, one row per sequence, plus manifest.json.

Row schema (all tensors are per-row byte strings in the codec named by the manifest):

    seq_id       string        example id (document#index)
    domain       string        "code" / "prose" / ...
    num_tokens   int32         T
    input_ids    list<int32>   prompt + regenerated response, length T
    loss_mask    list<int8>    1 on response tokens (and EOS), length T
    features     large_binary  (T, m, d) outputs of the m tapped decoder layers
    last_hidden  large_binary  (T, d) final-norm hidden state (lm_head input)

Layout under the cache URI:

    manifest.json              written last: a cache without it is not a cache (yet)
    shard-00000.parquet ...    published atomically: written to _tmp/, then moved
    _shards/shard-00000.parquet.json   per-shard stats and what the shard was built with (its
                               "built_with" record), written after the shard is published (resume)
    _lock.json                 while a builder works on the cache (dspark.cache.lock)

Dictionary encoding is off and compression is off for the tensor columns (bf16/fp8 noise does
not compress; dictionaries made IO several times slower).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from dspark.cache import codec as codecs

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSOR_COLUMNS = ("features", "last_hidden")

SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("domain", pa.string()),
        ("num_tokens", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("features", pa.large_binary()),
        ("last_hidden", pa.large_binary()),
    ]
)

PARQUET_OPTIONS = dict(
    use_dictionary=["seq_id", "domain"],
    compression={
        "seq_id": "zstd",
        "domain": "zstd",
        "num_tokens": "zstd",
        "input_ids": "zstd",
        "loss_mask": "zstd",
        "features": "none",
        "last_hidden": "none",
    },
    write_statistics=["seq_id", "num_tokens"],
)


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.parquet"


@dataclass
class ShardStats:
    shard_id: int
    file: str
    rows: int
    tokens: int
    response_tokens: int
    bytes: int
    sha256: str
    skipped_turns: int = 0  # user turns not answered: their prompt left no room in the target's context


@dataclass
class Manifest:
    target: dict  # name, weights_sha256, num_layers, vocab_size
    tokenizer_sha256: str
    layers: list[int]
    hidden_size: int
    codec: str
    generation: dict  # temperature, top_p, top_k, max_new_tokens, seed
    corpus_sha256: str
    shards: list[ShardStats] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    created: float = field(default_factory=time.time)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def law(self) -> dict:
        """The sampling law of the cached answers: temperature, top_p, top_k."""
        return {k: self.generation[k] for k in ("temperature", "top_p", "top_k")}

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def skipped_turns(self) -> int:
        return sum(s.skipped_turns for s in self.shards)

    def to_json(self) -> str:
        d = asdict(self)
        d["schema"] = {f.name: str(f.type) for f in SCHEMA}
        d["totals"] = {
            "rows": self.rows,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "bytes_per_token": self.bytes / max(self.tokens, 1),
            "skipped_turns": self.skipped_turns,
        }
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parse manifest.json; anything malformed raises ValueError."""
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("shards"), list):
            raise ValueError("not a JSON object with a list of shards")
        d.pop("schema", None)
        d.pop("totals", None)
        try:
            d["shards"] = [ShardStats(**s) for s in d["shards"]]
            return cls(**d)
        except TypeError as e:  # missing or unknown fields, a shard that is not an object
            raise ValueError(str(e)) from None


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def estimate_bytes(hidden_size: int, num_layers: int, tokens: int, codec: str = "bf16", rows: int = 0) -> int:
    """Bytes of a cache holding `tokens` tokens (`rows` sequences) with `num_layers` tapped layers.

    Per token: m+1 hidden vectors in the codec, a 4-byte id and a 1-byte mask (lists of ints
    compress to roughly a third under zstd; the estimate keeps them raw, the safe side).
    Per row: list offsets, binary offsets and ids, about 64 bytes."""
    per_token = (num_layers + 1) * codecs.bytes_per_vector(codec, hidden_size) + 5
    return per_token * tokens + 64 * rows
