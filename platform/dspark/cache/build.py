"""Building a target cache with Ray Data.

The prompts are cut into shards of `cache.shard_rows` examples. A Ray Data `map_batches` over the
shard list runs an actor pool (`ShardBuilder`, each holding the target, on CPU or `num_gpus`):
per shard it regenerates the responses (batched HF generation with a KV cache and the configured
sampling), runs one target forward per sequence capturing the tapped layers and the final-norm
hidden state, and publishes the Parquet shard atomically. The driver streams the per-shard stats
back, reports progress, and writes manifest.json last. Rerunning skips shards already published.
"""
from __future__ import annotations

import io
import logging
import time
import uuid
from dataclasses import asdict

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from dspark.cache import codec as codecs
from dspark.cache.format import MANIFEST, PARQUET_OPTIONS, SCHEMA, Manifest, ShardStats, sha256_of, shard_name
from dspark.config import Config
from dspark.corpus.tokenizer import encode_prompt
from dspark.errors import UserError
from dspark.storage import Storage

log = logging.getLogger(__name__)


def _put_atomic(fs: pafs.FileSystem, final: str, data: bytes, tmp_dir: str) -> None:
    """Write to a temporary name, then move into place: readers never see a partial file."""
    fs.create_dir(tmp_dir, recursive=True)
    fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    tmp = f"{tmp_dir}/{final.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, final)


def _read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


class ShardBuilder:
    """Ray Data actor: holds the target; turns one batch of shard descriptions into published shards."""

    def __init__(self, cfg_json: str, cache_uri: str, layers: list[int], storage: Storage):
        cfg = Config.model_validate_json(cfg_json)
        from dspark import target as targets

        self.cfg, self.cache_uri, self.layers, self.storage = cfg, cache_uri, layers, storage
        self.tgt = targets.load_from_config(cfg.target)
        self.tok = self.tgt.tokenizer

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {k: [] for k in ("shard_id", "stats", "seconds")}
        for shard_id, ids, domains, prompts in zip(batch["shard_id"], batch["seq_ids"], batch["domains"], batch["prompts"]):
            t0 = time.perf_counter()
            stats = self.build_shard(int(shard_id), list(ids), list(domains), list(prompts))
            out["shard_id"].append(int(shard_id))
            out["stats"].append(stats)
            out["seconds"].append(time.perf_counter() - t0)
        return out

    def build_shard(self, shard_id: int, seq_ids: list[str], domains: list[str], prompts: list[str]) -> dict:
        cc = self.cfg.cache
        seqs = regenerate(self.tgt.model, self.tok, prompts, cc, cc.seed * 100_003 + shard_id)
        n_prompt = [len(encode_prompt(self.tok, p)) for p in prompts]
        cols = make_rows(self.tgt.model, self.layers, cc.codec, seq_ids, domains, seqs, n_prompt)
        fs, root = self.storage.pyarrow_fs(self.cache_uri)
        stats = publish_shard(fs, root, shard_id, cols)
        return asdict(stats)


def publish_shard(fs: pafs.FileSystem, root: str, shard_id: int, cols: dict[str, list]) -> ShardStats:
    """Write one shard (then its stats sidecar), each atomically."""
    buf = io.BytesIO()
    rows = len(cols["seq_id"])
    pq.write_table(pa.table(cols, schema=SCHEMA), buf, row_group_size=max(1, min(64, rows)), **PARQUET_OPTIONS)
    data = buf.getvalue()
    name = shard_name(shard_id)
    _put_atomic(fs, f"{root}/{name}", data, f"{root}/_tmp")
    stats = ShardStats(shard_id, name, rows, sum(cols["num_tokens"]),
                       sum(int(sum(m)) for m in cols["loss_mask"]), len(data), sha256_of(data))
    _put_atomic(fs, f"{root}/_shards/{name}.json", stats.to_json(), f"{root}/_tmp")
    return stats


@torch.no_grad()
def regenerate(model, tok, prompts: list[str], cc, seed: int) -> list[list[int]]:
    """The target answers the prompts itself: batched, left-padded, KV-cached HF generation with the
    configured sampling (`cc` is a CacheConfig). Returns prompt + response ids per prompt."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    responses: list[list[int]] = []
    sampling = dict(do_sample=True, temperature=cc.temperature, top_p=cc.top_p, top_k=cc.top_k or None) \
        if cc.temperature > 0 else dict(do_sample=False)
    for i in range(0, len(prompts), cc.batch_size):
        enc = [encode_prompt(tok, p) for p in prompts[i:i + cc.batch_size]]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(enc):
            ids[r, width - len(e):] = torch.tensor(e)
            mask[r, width - len(e):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=cc.max_new_tokens,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sampling)
        for row in gen[:, width:].tolist():
            resp = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            responses.append([t for t in resp if t != tok.pad_token_id] or [tok.eos_token_id])
    return [encode_prompt(tok, p) + r for p, r in zip(prompts, responses)]


def make_rows(model, layers: list[int], codec: str, seq_ids: list[str], domains: list[str],
              seqs: list[list[int]], n_prompt: list[int]) -> dict[str, list]:
    """Cache rows (columns of SCHEMA) for token sequences whose first n_prompt tokens are the prompt:
    one target forward per sequence captures the tapped layers and the last hidden state."""
    from dspark.target.taps import extract

    cols: dict[str, list] = {f.name: [] for f in SCHEMA}
    for sid, dom, ids, n in zip(seq_ids, domains, seqs, n_prompt):
        feats, last = extract(model, ids, layers)  # (T, m, d), (T, d)
        for k, v in (("seq_id", sid), ("domain", dom), ("num_tokens", len(ids)), ("input_ids", ids),
                     ("loss_mask", [0] * n + [1] * (len(ids) - n)), ("features", codecs.encode(feats, codec)),
                     ("last_hidden", codecs.encode(last, codec))):
            cols[k].append(v)
    return cols


def published_stats(fs: pafs.FileSystem, root: str) -> dict[int, ShardStats]:
    """Stats of shards already published by an earlier (possibly crashed) build."""
    done: dict[int, ShardStats] = {}
    listing = fs.get_file_info(pafs.FileSelector(f"{root}/_shards", allow_not_found=True))
    for info in listing:
        if info.path.endswith(".parquet.json"):
            s = ShardStats.from_json(_read_bytes(fs, info.path))
            if fs.get_file_info(f"{root}/{s.file}").type == pafs.FileType.File:
                done[s.shard_id] = s
    return done


def cache_uri(cfg: Config) -> str:
    return cfg.cache.uri or Storage.join(cfg.storage.root, "caches", cfg.cache.name)


def build_cache(cfg: Config, tracker=None, log_fn=print) -> Manifest:
    """Build (or finish building) the cache of the built-in corpus's train split; returns the manifest."""
    import ray

    from dspark import target as targets
    from dspark.corpus.examples import split_examples
    from dspark.corpus.sources import DOMAINS, Corpus
    from dspark.target.taps import resolve_layers

    cc = cfg.cache
    codecs.bytes_per_vector(cc.codec, 1)  # validates the codec name
    storage = Storage.from_config(cfg.storage)
    uri = cache_uri(cfg)
    storage.check(uri)
    fs, root = storage.pyarrow_fs(uri)
    fs.create_dir(root, recursive=True)

    tgt_path = targets.resolve(cfg.target.name_or_path)
    tgt_cfg = targets.hf_config(tgt_path)  # sizes and layer ids are validated before any work
    layers = resolve_layers(tgt_cfg.num_hidden_layers, cc.layers, cc.num_layers)
    corpus = Corpus.load(cfg.corpus)
    examples = [ex for d in DOMAINS for ex in split_examples(corpus, d, "train", cfg.corpus)]
    if cc.max_examples:
        # a deterministic, domain-balanced subset: interleave the domains
        by_dom = [[ex for ex in examples if ex.domain == d] for d in DOMAINS]
        examples = [ex for group in zip(*by_dom) for ex in group][: cc.max_examples]
    shards = [examples[i:i + cc.shard_rows] for i in range(0, len(examples), cc.shard_rows)]

    manifest = Manifest(
        target={"name": cfg.target.name_or_path, "weights_sha256": targets.weights_hash(tgt_path),
                "num_layers": tgt_cfg.num_hidden_layers, "vocab_size": tgt_cfg.vocab_size},
        tokenizer_sha256=targets.tokenizer_hash(tgt_path),
        layers=layers, hidden_size=tgt_cfg.hidden_size, codec=cc.codec,
        generation={"temperature": cc.temperature, "top_p": cc.top_p, "top_k": cc.top_k,
                    "max_new_tokens": cc.max_new_tokens, "seed": cc.seed},
        corpus_sha256=corpus.manifest()["sha256"],
    )
    existing = fs.get_file_info(f"{root}/{MANIFEST}")
    if existing.type == pafs.FileType.File:
        old = Manifest.from_json(_read_bytes(fs, f"{root}/{MANIFEST}").decode())
        if len(old.shards) == len(shards) and _same_build(old, manifest):
            log_fn(f"[cache] {uri} is complete: {old.rows} rows, {old.tokens:,} tokens; nothing to do")
            return old
        raise UserError(f"cache {uri} already holds a different build (manifest.json); choose another cache.uri or delete it")

    done = published_stats(fs, root)
    todo = [i for i in range(len(shards)) if i not in done]
    log_fn(f"[cache] {uri}: {len(examples)} prompts in {len(shards)} shards, {len(done)} already published; "
           f"layers {layers}, codec {cc.codec}")
    t0 = time.perf_counter()
    rows = tokens = nbytes = 0
    if todo:
        items = [{"shard_id": i, "seq_ids": [e.example_id for e in shards[i]], "domains": [e.domain for e in shards[i]],
                  "prompts": [e.prompt for e in shards[i]]} for i in todo]
        from dspark.cluster import quiet_ray_data

        quiet_ray_data()
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(ShardBuilder, batch_size=1, compute=ray.data.ActorPoolStrategy(size=cc.num_actors),
                            num_gpus=cc.num_gpus_per_actor or None,
                            num_cpus=1 if not cc.num_gpus_per_actor else None,
                            fn_constructor_kwargs={"cfg_json": cfg.model_dump_json(), "cache_uri": uri, "layers": layers,
                                                   "storage": storage})
        for row in ds.iter_rows():
            s = ShardStats(**row["stats"])
            done[s.shard_id] = s
            rows, tokens, nbytes = rows + s.rows, tokens + s.tokens, nbytes + s.bytes
            dt = time.perf_counter() - t0
            log_fn(f"[cache] shard {s.shard_id:5d} ({len(done)}/{len(shards)}): {s.rows} rows, {s.tokens:,} tokens, "
                   f"{s.bytes / 2**20:.1f} MiB in {row['seconds']:.1f}s | total {rows / dt:.2f} rows/s, "
                   f"{tokens / dt:,.0f} tokens/s, {nbytes / 2**20:.1f} MiB written")
            if tracker:
                tracker.metrics({"cache.rows": rows, "cache.tokens": tokens, "cache.bytes": nbytes,
                                 "cache.rows_per_s": rows / dt, "cache.tokens_per_s": tokens / dt}, len(done))
    manifest.shards = [done[i] for i in range(len(shards))]
    _put_atomic(fs, f"{root}/{MANIFEST}", manifest.to_json().encode(), f"{root}/_tmp")
    if fs.get_file_info(f"{root}/_tmp").type == pafs.FileType.Directory:
        fs.delete_dir(f"{root}/_tmp")  # leftovers of writers that crashed mid-file
    log_fn(f"[cache] published {uri}/{MANIFEST}: {manifest.rows} rows, {manifest.tokens:,} tokens, "
           f"{manifest.bytes / 2**20:.1f} MiB ({manifest.bytes / max(manifest.tokens, 1):,.0f} bytes/token)")
    return manifest


def _same_build(a: Manifest, b: Manifest) -> bool:
    keys = ("target", "tokenizer_sha256", "layers", "hidden_size", "codec", "generation", "corpus_sha256")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def transcode(src, dst_uri: str, codec: str, layers: list[int] | None = None, log_fn=print) -> Manifest:
    """Shrink an existing cache without re-running the target: another codec (e.g. fp8) and/or a
    subset of its tapped layers. Shard by shard, each published atomically, manifest last; shards
    already transcoded are skipped. `src` is a dspark.cache.read.Cache."""
    from dspark.cache.read import decode_batch

    m = src.manifest
    layers = list(layers or m.layers)
    missing = [i for i in layers if i not in m.layers]
    if missing:
        raise UserError(f"cache.layers: {missing} are not in the source cache (it has {m.layers})")
    keep = [m.layers.index(i) for i in layers]
    fs_src, root_src = src.fs_root
    fs, root = src.storage.pyarrow_fs(dst_uri)
    fs.create_dir(root, recursive=True)
    done = published_stats(fs, root)
    out = Manifest(target=m.target, tokenizer_sha256=m.tokenizer_sha256, layers=layers, hidden_size=m.hidden_size,
                   codec=codec, generation={**m.generation, "transcoded_from": src.uri}, corpus_sha256=m.corpus_sha256)
    for s in m.shards:
        if s.shard_id in done:
            continue
        table = pq.read_table(f"{root_src}/{s.file}", filesystem=fs_src)
        rows = {k: table.column(k).to_pylist() for k in table.column_names}
        dec = decode_batch(rows, m)
        feats, last = [], []
        for r, n in enumerate(rows["num_tokens"]):
            feats.append(codecs.encode(dec["features"][r, :n][:, keep], codec))
            last.append(codecs.encode(dec["last_hidden"][r, :n], codec))
        rows["features"], rows["last_hidden"] = feats, last
        done[s.shard_id] = publish_shard(fs, root, s.shard_id, rows)
        log_fn(f"[cache] transcoded {s.file}: {s.bytes / 2**20:.1f} -> {done[s.shard_id].bytes / 2**20:.1f} MiB")
    out.shards = [done[s.shard_id] for s in m.shards]
    _put_atomic(fs, f"{root}/{MANIFEST}", out.to_json().encode(), f"{root}/_tmp")
    return out
