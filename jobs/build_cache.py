"""Build the target cache of `cache.sources` (the built-in corpus and/or JSONL conversations), or finish
an interrupted build.

    python jobs/build_cache.py --set cache.max_examples=512
    python jobs/build_cache.py --set storage.root=s3://dspark/demo --set cache.codec=fp8
    python jobs/build_cache.py --set cache.source_uri=s3://dspark/demo/caches/builtin --set cache.name=fp8 \
        --set cache.codec=fp8 --set cache.layers=[1,3]          # shrink an existing cache
    python jobs/build_cache.py --set "cache.source_uri=[CACHE_A,CACHE_B]" --set cache.name=both   # join caches
    ray job submit --working-dir . -- python jobs/build_cache.py --set cache.num_actors=4

The target regenerates responses to the corpus prompts; one forward per sequence captures the
tapped layers; shards are published atomically and manifest.json last. Stats go to MLflow.
"""

import argparse

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main


def main(argv=None):
    args = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    cfg = config_from_args(args)
    from dspark import tracking
    from dspark.artifacts import cache_uri
    from dspark.cache.build import build_cache, transcode
    from dspark.cache.read import open_cache
    from dspark.cluster import init_ray
    from dspark.storage import Storage

    with tracking.run(cfg, "build-cache") as tracker:
        tracker.params({k: v for k, v in cfg.flat().items() if k.startswith(("cache.", "target.", "storage."))})
        if cfg.cache.source_uri:  # join or shrink existing caches: no target, no Ray needed
            storage = Storage.from_config(cfg.storage)
            uris = [cfg.cache.source_uri] if isinstance(cfg.cache.source_uri, str) else cfg.cache.source_uri
            m = transcode([open_cache(u, storage) for u in uris], cache_uri(cfg), cfg.cache.codec, cfg.cache.layers)
        else:
            init_ray(cfg)
            m = build_cache(cfg, tracker)
        tracker.metrics(
            {
                "cache.rows": m.rows,
                "cache.tokens": m.tokens,
                "cache.bytes": m.bytes,
                "cache.bytes_per_token": m.bytes / max(m.tokens, 1),
            },
            len(m.shards),
        )
        tracker.params({"cache.uri_resolved": cache_uri(cfg), "cache.layers_resolved": m.layers})


if __name__ == "__main__":
    run_main(main)
