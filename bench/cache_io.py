"""Cache IO throughput: write and read MB/s and tokens/s on local disk and on the local S3 server,
and how long a Ray Data read takes to deliver its first batch for different block sizes.

    python bench/cache_io.py [--shards 8 --rows 64 --tokens 256 --codec bf16]
    python bench/cache_io.py --config configs/smollm2.yaml [--set cache.num_layers=4]

Rows are synthetic but shaped like the configured target's (its hidden size and vocabulary: the
built-in target's d=256 by default; its weights are not loaded), with cache.layers (else
cache.num_layers, 3 by default) tapped layers + last hidden, in the real cache schema and Parquet
options; the content of hidden states does not change IO cost (they do not compress either way).
Starts its own object store (SeaweedFS on 127.0.0.1, in a temporary folder) and a local Ray
(ray.num_cpus, else every CPU). Prints what it measured and how.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray
import torch

from dspark import target as targets
from dspark.cache import codec as codecs
from dspark.cache.build import publish_shard
from dspark.cache.format import MANIFEST, Manifest
from dspark.cache.read import dataset, decode_batch, open_cache
from dspark.cluster import quiet_ray_data
from dspark.config import add_config_args, config_from_args, run_main
from dspark.services import BUCKET, ObjectStore
from dspark.storage import Storage


def synthetic_rows(rows: int, tokens: int, d: int, m: int, vocab: int, codec: str, rng: np.random.Generator) -> dict:
    keys = ("seq_id", "domain", "num_tokens", "input_ids", "loss_mask", "features", "last_hidden")
    cols: dict = {k: [] for k in keys}
    for i in range(rows):
        n = int(rng.integers(tokens // 2, tokens * 3 // 2))
        cols["seq_id"].append(f"bench/{i}")
        cols["domain"].append("code")
        cols["num_tokens"].append(n)
        cols["input_ids"].append(rng.integers(0, vocab, n).tolist())
        cols["loss_mask"].append([0] * (n // 3) + [1] * (n - n // 3))
        cols["features"].append(codecs.encode(torch.randn(n, m, d), codec))
        cols["last_hidden"].append(codecs.encode(torch.randn(n, d), codec))
    return cols


def bench_location(
    name: str, uri: str, storage: Storage, shard_cols: list[dict], codec: str, d: int, m: int, repeats: int = 3
):
    fs, root = storage.pyarrow_fs(uri)
    fs.create_dir(root, recursive=True)
    t0 = time.perf_counter()
    stats = [publish_shard(fs, root, i, cols) for i, cols in enumerate(shard_cols)]
    write_s = time.perf_counter() - t0
    man = Manifest(
        target={},
        tokenizer_sha256="",
        layers=list(range(m)),
        hidden_size=d,
        codec=codec,
        generation={},
        corpus_sha256="",
        shards=stats,
    )
    with fs.open_output_stream(f"{root}/{MANIFEST}") as f:
        f.write(man.to_json().encode())
    nbytes, ntok = man.bytes, man.tokens
    t0 = time.perf_counter()
    for s in stats:
        pq.read_table(f"{root}/{s.file}", filesystem=fs)
    pa_read_s = time.perf_counter() - t0
    cache = open_cache(uri, storage)
    for _ in dataset(cache).iter_batches(batch_size=16):  # warm-up: Ray workers started, files cached alike
        pass
    out = [
        f"{name:6s} write  {nbytes / 2**20 / write_s:8.1f} MB/s {ntok / write_s:10,.0f} tok/s   (publish_shard: "
        f"tmp file + move, {len(stats)} shards, {nbytes / 2**20:.1f} MiB)",
        f"{name:6s} read   {nbytes / 2**20 / pa_read_s:8.1f} MB/s {ntok / pa_read_s:10,.0f} tok/s   "
        f"(pyarrow read_table per shard)",
    ]
    for label, blocks in (("1 block/shard", 1), ("default", 0), ("8 blocks/shard", 8)):
        firsts, totals = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            first, n_tok = None, 0
            for batch in dataset(cache, blocks_per_shard=blocks).iter_batches(batch_size=16, batch_format="numpy"):
                if first is None:
                    first = time.perf_counter() - t0
                n_tok += int(decode_batch(batch, cache.manifest)["valid"].sum())
            firsts.append(first)
            totals.append(time.perf_counter() - t0)
        total = float(np.median(totals))
        out.append(
            f"{name:6s} ray    {nbytes / 2**20 / total:8.1f} MB/s {n_tok / total:10,.0f} tok/s   "
            f"(Ray Data read_parquet + decode, {label}: first batch after {np.median(firsts):.2f}s, "
            f"full pass {total:.2f}s; median of {repeats})"
        )
    return out


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="mean tokens per row")
    p.add_argument("--codec", default=None, choices=codecs.CODECS, help="default: cache.codec (bf16)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    codec = args.codec or cfg.cache.codec
    hf = targets.hf_config(cfg.target.name_or_path, cfg.target.revision, cfg.target.cache_dir)
    d, m, vocab = hf.hidden_size, len(cfg.cache.layers) or cfg.cache.num_layers, hf.vocab_size
    rng = np.random.default_rng(0)
    shard_cols = [synthetic_rows(args.rows, args.tokens, d, m, vocab, codec, rng) for _ in range(args.shards)]
    print(
        f"cache_io: {args.shards} shards x {args.rows} rows x ~{args.tokens} tokens, d={d}, m={m} "
        f"(target {cfg.target.name_or_path}), codec {codec}, {os.cpu_count()} CPUs; "
        f"local S3 = SeaweedFS on 127.0.0.1"
    )
    ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
    quiet_ray_data()
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp) / "services")
        st = store.start()
        try:
            os.environ.update(st.env)
            storage = Storage(
                endpoint_url=st.env["AWS_ENDPOINT_URL"],
                access_key=st.env["AWS_ACCESS_KEY_ID"],
                secret_key=st.env["AWS_SECRET_ACCESS_KEY"],
            )
            lines = bench_location("local", str(Path(tmp) / "cache"), storage, shard_cols, codec, d, m)
            lines += bench_location("s3", f"s3://{BUCKET}/bench-cache", storage, shard_cols, codec, d, m)
        finally:
            store.stop()
    print("\n".join(lines))


if __name__ == "__main__":
    run_main(main)
