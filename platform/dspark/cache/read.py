"""Reading a target cache: manifest validation, shard checks, a streaming Ray Data dataset, and
decoding of a batch back to torch tensors for training.

Every read of a shard for its rows (the Ray Data dataset, iter_local, transcode) reads the whole
file once, checks its size and sha256 against the manifest, and only then parses it: a damaged
shard stops the reader with an error naming it, at the cost of hashing (about 1 GB/s per core) and
of holding one shard per reader in memory (the builder holds one per actor already)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from dspark.cache import codec as codecs
from dspark.cache.format import FORMAT_VERSION, MANIFEST, SCHEMA, Manifest, ShardStats
from dspark.errors import UserError
from dspark.storage import Storage

log = logging.getLogger(__name__)


class CacheError(UserError):
    """A cache that does not match what was asked for, or a damaged shard (named in the message)."""


@dataclass
class Cache:
    uri: str
    storage: Storage
    manifest: Manifest

    @property
    def fs_root(self) -> tuple[pafs.FileSystem, str]:
        return self.storage.pyarrow_fs(self.uri)

    def shard_uri(self, s: ShardStats) -> str:
        return Storage.join(self.uri, s.file)


def open_cache(uri: str, storage: Storage, expect: dict | None = None) -> Cache:
    """Read and validate manifest.json. `expect` maps manifest fields (e.g. "layers", "hidden_size",
    "target.weights_sha256") to required values; a mismatch names the field."""
    manifest = read_manifest(storage, uri)
    if manifest is None:
        raise CacheError(f"no cache at {uri}: {MANIFEST} not found (the build did not finish?)")
    if manifest.format_version != FORMAT_VERSION:
        raise CacheError(
            f"{uri}: format_version {manifest.format_version} is not supported (expected {FORMAT_VERSION})"
        )
    for key, want in (expect or {}).items():
        have = manifest
        for part in key.split("."):
            have = have[part] if isinstance(have, dict) else getattr(have, part)
        if have != want:
            raise CacheError(f"cache {uri} does not match: {key} is {have!r}, expected {want!r}")
    return Cache(uri, storage, manifest)


def read_manifest(storage: Storage, uri: str) -> Manifest | None:
    """The cache's manifest.json, None when there is none; a damaged one is a CacheError naming it."""
    fs, root = storage.pyarrow_fs(uri)
    try:
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            return Manifest.from_json(f.read().decode())
    except FileNotFoundError:
        return None
    except ValueError as e:  # JSON, UTF-8 or structure
        raise CacheError(
            f"{Storage.join(uri, MANIFEST)} is not a valid manifest ({str(e).splitlines()[0]}); "
            f"delete it to rebuild the cache"
        ) from None


def read_shard(cache: Cache, s: ShardStats) -> pq.ParquetFile:
    """One whole shard, read once into memory and checked against the manifest (size, sha256) before
    it is parsed."""
    return pq.ParquetFile(pa.BufferReader(shard_bytes(cache, s)))


def shard_bytes(cache: Cache, s: ShardStats) -> bytes:
    """A shard's file, checked against the manifest (size, sha256)."""
    fs, root = cache.fs_root
    try:
        with fs.open_input_stream(f"{root}/{s.file}") as f:
            data = f.read()
    except FileNotFoundError:
        raise CacheError(f"shard {cache.shard_uri(s)} is damaged: missing") from None
    problem = _content_problem(len(data), hashlib.sha256(data).hexdigest(), s)
    if problem:
        raise CacheError(f"shard {cache.shard_uri(s)} is damaged: {problem}")
    return data


def token_counts(cache: Cache, shards: list[ShardStats], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the responses (loss_mask) of `shards`: (vocab_size,) int64.
    Reads only the ids and mask columns (range reads on object storage), not the features."""
    fs, root = cache.fs_root
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in shards:
        try:
            t = pq.read_table(f"{root}/{s.file}", filesystem=fs, columns=["input_ids", "loss_mask"])
        except (FileNotFoundError, pa.ArrowInvalid) as e:
            raise CacheError(f"shard {cache.shard_uri(s)} is damaged: {e}") from None
        ids = t.column("input_ids").combine_chunks().flatten().to_numpy()
        mask = t.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise CacheError(f"shard {cache.shard_uri(s)} has token ids outside the target's vocabulary {vocab_size}")
        counts += np.bincount(ids[mask.astype(bool)], minlength=vocab_size)
    return torch.from_numpy(counts)


def check_shards(cache: Cache, skip_bad: bool = False, verify_checksums: bool = False) -> list[ShardStats]:
    """Cheap checks of every shard (exists, size, Parquet footer, schema, row count; sha256 when asked).
    A bad shard raises a CacheError naming it, or with skip_bad is logged, counted and left out."""
    fs, root = cache.fs_root
    good, skipped = [], []
    for s in cache.manifest.shards:
        problem = _shard_problem(fs, f"{root}/{s.file}", s, verify_checksums)
        if problem is None:
            good.append(s)
        elif skip_bad:
            skipped.append(s.file)
            log.warning("skipping bad shard %s: %s", s.file, problem)
        else:
            raise CacheError(f"shard {cache.shard_uri(s)} is damaged: {problem}")
    if skipped:
        log.warning("skipped %d bad shard(s) of %d: %s", len(skipped), len(cache.manifest.shards), ", ".join(skipped))
    if not good:
        raise CacheError(f"cache {cache.uri} has no readable shards")
    return good


def _shard_problem(fs: pafs.FileSystem, path: str, s: ShardStats, verify_checksums: bool) -> str | None:
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        return "missing"
    if info.size != s.bytes:
        return _content_problem(info.size, None, s)
    try:
        with fs.open_input_file(path) as f:
            meta = pq.read_metadata(f)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a bad footer
        return f"unreadable Parquet footer ({str(e).splitlines()[0]})"
    if not meta.schema.to_arrow_schema().equals(SCHEMA):
        return f"schema differs from the cache format: {meta.schema.to_arrow_schema()}"
    if meta.num_rows != s.rows:
        return f"{meta.num_rows} rows, manifest says {s.rows}"
    if verify_checksums:
        h = hashlib.sha256()
        with fs.open_input_stream(path) as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        return _content_problem(info.size, h.hexdigest(), s)
    return None


def _content_problem(size: int, sha256: str | None, s: ShardStats) -> str | None:
    if size != s.bytes:
        return f"size {size} bytes, manifest says {s.bytes} (truncated or replaced)"
    if sha256 is not None and sha256 != s.sha256:
        return "sha256 differs from the manifest (corrupted)"
    return None


def dataset(cache: Cache, shards: list[ShardStats] | None = None, blocks_per_shard: int = 0):
    """A streaming Ray Data dataset over the shards (never downloads the whole cache first): one read
    task per shard verifies it (read_shard) and hands out its rows with a "path" column (the shard's URI).

    Smaller blocks deliver the first batch sooner: by default one block per row group."""
    import ray

    shards = shards if shards is not None else cache.manifest.shards
    items = [{"file": s.file} for s in shards]
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _read_blocks, batch_size=1, batch_format="pyarrow", fn_kwargs={"cache": cache, "blocks": blocks_per_shard}
    )


def _read_blocks(batch: pa.Table, cache: Cache, blocks: int):
    """Ray Data map: shard file names -> the shards' rows, `blocks` tables per shard (0: one per row group)."""
    by_file = {s.file: s for s in cache.manifest.shards}
    for file in batch.column("file").to_pylist():
        s = by_file[file]
        pf = read_shard(cache, s)
        if blocks:
            table, step = pf.read(), max(1, -(-s.rows // blocks))  # ceil(rows / blocks); a shard may be empty
            parts = (table.slice(i, step) for i in range(0, s.rows, step))
        else:
            parts = (pf.read_row_group(i) for i in range(pf.num_row_groups))
        for t in parts:
            yield t.append_column("path", pa.array([cache.shard_uri(s)] * t.num_rows))


def decode_batch(batch: dict, manifest: Manifest, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A numpy batch of cache rows -> right-padded tensors:
    input_ids (B, T) long, loss_mask (B, T) bool, valid (B, T) bool,
    features (B, T, m, d) and last_hidden (B, T, d) in `dtype`."""
    m, d, codec = len(manifest.layers), manifest.hidden_size, manifest.codec
    lengths = [int(n) for n in batch["num_tokens"]]
    B, T = len(lengths), max(lengths)
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "valid": torch.zeros(B, T, dtype=torch.bool),
        "features": torch.zeros(B, T, m, d, dtype=dtype),
        "last_hidden": torch.zeros(B, T, d, dtype=dtype),
    }
    for r, n in enumerate(lengths):
        where = batch["path"][r] if "path" in batch else "?"
        try:
            feats = codecs.decode(bytes(batch["features"][r]), codec, d, dtype).reshape(n, m, d)
            last = codecs.decode(bytes(batch["last_hidden"][r]), codec, d, dtype).reshape(n, d)
            ids = np.asarray(batch["input_ids"][r], dtype=np.int64)
            mask = np.asarray(batch["loss_mask"][r], dtype=bool)
            if len(ids) != n or len(mask) != n:
                raise ValueError(f"{len(ids)} ids and {len(mask)} mask entries for num_tokens={n}")
        except (ValueError, RuntimeError) as e:
            raise CacheError(f"row {batch['seq_id'][r]!r} of shard {where} cannot be decoded: {e}") from None
        out["input_ids"][r, :n] = torch.from_numpy(ids)
        out["loss_mask"][r, :n] = torch.from_numpy(mask)
        out["valid"][r, :n] = True
        out["features"][r, :n] = feats
        out["last_hidden"][r, :n] = last
    return out


def iter_local(
    cache: Cache,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    shards: list[ShardStats] | None = None,
    dtype: torch.dtype = torch.float32,
    domains: tuple[str, ...] | None = None,
    keep: Callable[[str], bool] | None = None,
):
    """Single-process streaming reader (tests, offline experiments): shards in a seeded order, rows
    shuffled within each shard, one shard in memory at a time; yields decoded batches (of the rows
    whose `domain` is in `domains` and for whose `seq_id` keep(seq_id) holds, when given)."""
    rng = np.random.default_rng(seed * 1_000_003 + epoch)
    shards = list(shards if shards is not None else cache.manifest.shards)
    for i in rng.permutation(len(shards)):
        s = shards[i]
        table = read_shard(cache, s).read()
        rows = {k: table.column(k).to_pylist() for k in table.column_names}
        rows["path"] = [s.file] * table.num_rows
        order = rng.permutation(table.num_rows)
        if domains is not None:
            order = [t for t in order if rows["domain"][t] in domains]
        if keep is not None:
            order = [t for t in order if keep(rows["seq_id"][t])]
        for j in range(0, len(order), batch_size):
            idx = order[j : j + batch_size]
            yield decode_batch({k: [v[t] for t in idx] for k, v in rows.items()}, cache.manifest, dtype)
