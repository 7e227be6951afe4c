"""Serve a target + drafter pair over an OpenAI-compatible HTTP API with Ray Serve (until Ctrl-C).

    python jobs/serve.py --set serve.drafter_uri=s3://dspark/quickstart/drafters/demo
    python jobs/serve.py --set serve.policy=async --set serve.port=8001 --set serve.api_key=secret
    serve run serving/config.yaml          # the same application from a Serve config file

Then: curl 127.0.0.1:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 32}'

Ctrl-C (or SIGTERM), at any point, even with an engine that no longer responds: on the local Ray this
job started, every Ray process it started is stopped; on a cluster (`ray.address`, or as a Ray job)
the Serve application is shut down.
"""

import argparse
import signal
import time

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    args = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    cfg = config_from_args(args)
    from dspark.cluster import cluster_address
    from serving.app import run_local

    # Ctrl-C, `kill` and `ray job stop` stop it, also when it was started with SIGINT ignored (a
    # background job of a non-interactive shell inherits that, and Python then keeps it)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    local = cluster_address(cfg) is None
    try:
        url = run_local(cfg)
        print(
            f"[serve] {cfg.serve.model_name} on {url} (policy {cfg.serve.policy}, "
            f"drafter {cfg.serve.drafter_uri or 'none'}); Ctrl-C stops it"
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("[serve] stopping", flush=True)
    finally:
        stop(local)


def stop(local: bool) -> None:
    """Bounded and deaf to a second Ctrl-C: a half-stopped local Ray is what must not happen. The local
    Ray is stopped as a whole, without asking its (possibly wedged) replicas to drain first."""
    import ray
    from ray import serve

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if not ray.is_initialized():
        return
    if not local:
        serve.shutdown()  # Ray bounds the wait for the replicas, then kills them
        return
    ray.shutdown()


if __name__ == "__main__":
    run_main(main)
