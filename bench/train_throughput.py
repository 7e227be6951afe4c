"""Drafter training throughput on Ray Train + DeepSpeed (CPU here, the same code on GPUs):
tokens/s per worker with 1 and 2 workers, data-wait fraction when streaming the cache from the
local S3 server vs from memory, step time and peak worker memory for ZeRO stages 0-3.

    python bench/train_throughput.py [--cache s3://dspark/quickstart/caches/builtin --steps 12]
    python bench/train_throughput.py --config configs/smollm2.yaml --cache CACHE [--set train.micro_batch=4]

Each configuration is one short real training run (fresh run name, no resume); the figures are
medians over its steps after the first two (warm-up). Settings: the bench's (bench_defaults: the
cache, storage under s3://dspark/bench, micro-batch 2, global batch 8, 2 Ray CPUs) over the --config
file's, --set over both; what a run varies (workers, ZeRO stage, steps, run name) over all of them.
The drafter and the target are the configured ones (train.*, target.*; the cache must be that
target's). Needs the object store (infra/local/start.sh objectstore) and a cache (make demo builds
s3://dspark/quickstart/caches/builtin).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlflow
import ray

from dspark import services
from dspark.cluster import init_ray
from dspark.config import add_config_args, config_from_args, load_config, run_main
from dspark.train import distributed


def bench_defaults(cache: str) -> list[str]:
    return [
        f"cache.uri={cache}",
        "storage.root=s3://dspark/bench",
        "train.micro_batch=2",
        "train.global_batch=8",
        "ray.num_cpus=2",
    ]


def run(args, varied: list[str], in_memory: bool) -> dict:
    """One short training run: the bench's and the user's settings (args), then what this run varies,
    a fresh run name and --steps steps."""
    name, steps = f"bench-{time.time_ns()}", args.steps
    cfg = load_config(
        args.config,
        [
            *args.overrides,
            *varied,
            f"train.run_name={name}",
            f"train.max_steps={steps}",
            f"train.checkpoint_every={steps}",
            "train.evaluate=false",
        ],
    )
    res = distributed.fit(cfg, log=lambda *_: None, in_memory=in_memory)
    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    series = {
        k: [m.value for m in sorted(client.get_metric_history(res["run_id"], f"train.{k}"), key=lambda m: m.step)][2:]
        for k in ("tokens_per_s", "data_wait_frac", "step_s", "peak_rss_mb")
    }
    return {k: (statistics.median(v) if k != "peak_rss_mb" else max(v)) for k, v in series.items() if v}


def main(argv=None):
    p = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--cache", default="s3://dspark/quickstart/caches/builtin")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    args.overrides = bench_defaults(args.cache) + args.overrides
    cfg = config_from_args(args)
    os.environ.update(services.client_env())
    init_ray(cfg)
    rows = []
    for workers in (1, 2):
        for mem in (False, True):
            r = run(args, [f"train.num_workers={workers}", "train.zero_stage=2"], mem)
            rows.append((f"{workers} worker(s), ZeRO-2, {'memory' if mem else 's3 stream'}", workers, r))
    for stage in (0, 1, 3):
        r = run(args, ["train.num_workers=2", f"train.zero_stage={stage}"], False)
        rows.append((f"2 workers, ZeRO-{stage}, s3 stream", 2, r))
    ray.shutdown()
    tc = cfg.train
    print(
        f"train_throughput: {tc.drafter} {tc.num_layers}-layer drafter on target {cfg.target.name_or_path}, "
        f"micro-batch {tc.micro_batch}, global batch {tc.global_batch}, {args.steps} steps per run (median of "
        f"steps 3..), {os.cpu_count()} CPUs, {tc.threads_per_worker} torch thread(s) per worker"
    )
    print("| configuration | tokens/s total | tokens/s per worker | data-wait | step s | peak worker RSS MB |")
    print("|---|---|---|---|---|---|")
    for label, w, r in rows:
        print(
            f"| {label} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / w:.0f} | {r['data_wait_frac']:.1%} | "
            f"{r['step_s']:.2f} | {r['peak_rss_mb']:.0f} |"
        )


if __name__ == "__main__":
    run_main(main)
