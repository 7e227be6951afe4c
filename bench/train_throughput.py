"""Drafter training throughput on Ray Train + DeepSpeed (CPU here, the same code on GPUs):
tokens/s per worker with 1 and 2 workers, data-wait fraction when streaming the cache from the
local S3 server vs from memory, step time and peak worker memory for ZeRO stages 0-3.

    python bench/train_throughput.py [--cache s3://dspark/quickstart/caches/builtin --steps 12]

Each configuration is one short real training run (fresh run name, no resume); the figures are
medians over its steps after the first two (warm-up). Needs the object store (infra/local/start.sh
objectstore) and a cache (make demo builds s3://dspark/quickstart/caches/builtin).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def run(cfg_overrides: list[str], in_memory: bool, steps: int) -> dict:
    import mlflow

    from dspark.config import load_config
    from dspark.train import distributed

    name = f"bench-{time.time_ns()}"
    cfg = load_config(overrides=[*cfg_overrides, f"train.run_name={name}", f"train.max_steps={steps}",
                                 f"train.checkpoint_every={steps}", "train.evaluate=false"])
    res = distributed.fit(cfg, log=lambda *_: None, in_memory=in_memory)
    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    series = {k: [m.value for m in sorted(client.get_metric_history(res["run_id"], f"train.{k}"), key=lambda m: m.step)][2:]
              for k in ("tokens_per_s", "data_wait_frac", "step_s", "peak_rss_mb")}
    return {k: (statistics.median(v) if k != "peak_rss_mb" else max(v)) for k, v in series.items() if v}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default="s3://dspark/quickstart/caches/builtin")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    import os

    import ray

    from dspark import services
    from dspark.cluster import init_ray
    from dspark.config import load_config

    os.environ.update(services.client_env())
    base = [f"cache.uri={args.cache}", "storage.root=s3://dspark/bench", "train.micro_batch=2", "train.global_batch=8",
            "ray.num_cpus=2"]
    init_ray(load_config(overrides=base))
    rows = []
    for workers in (1, 2):
        for mem in (False, True):
            r = run(base + [f"train.num_workers={workers}", "train.zero_stage=2"], mem, args.steps)
            rows.append((f"{workers} worker(s), ZeRO-2, {'memory' if mem else 's3 stream'}", workers, r))
    for stage in (0, 1, 3):
        r = run(base + ["train.num_workers=2", f"train.zero_stage={stage}"], False, args.steps)
        rows.append((f"2 workers, ZeRO-{stage}, s3 stream", 2, r))
    ray.shutdown()
    print(f"train_throughput: DSpark 2-layer drafter on the built-in target, micro-batch 2, global batch 8, "
          f"{args.steps} steps per run (median of steps 3..), {os.cpu_count()} CPUs, 1 torch thread per worker")
    print("| configuration | tokens/s total | tokens/s per worker | data-wait | step s | peak worker RSS MB |")
    print("|---|---|---|---|---|---|")
    for label, w, r in rows:
        print(f"| {label} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / w:.0f} | {r['data_wait_frac']:.1%} | "
              f"{r['step_s']:.2f} | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
