"""Serve a target + drafter pair over an OpenAI-compatible HTTP API with Ray Serve (until Ctrl-C).

    python jobs/serve.py --set serve.drafter_uri=s3://dspark/quickstart/drafters/demo
    python jobs/serve.py --set serve.policy=async --set serve.port=8001 --set serve.api_key=secret
    serve run serving/config.yaml          # the same application from a Serve config file

Then: curl 127.0.0.1:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 32}'
"""
import argparse
import time

import _bootstrap  # noqa: F401

from dspark.config import add_config_args, config_from_args, run_main


def main(argv=None):
    args = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    cfg = config_from_args(args)
    from serving.app import run_local

    url = run_local(cfg)
    print(f"[serve] {cfg.serve.model_name} on {url} (policy {cfg.serve.policy}, drafter {cfg.serve.drafter_uri or 'none'});"
          " Ctrl-C stops it")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()


if __name__ == "__main__":
    run_main(main)
