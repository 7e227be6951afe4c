"""The main job on embedded defaults: start the local object store, then run the pipeline on the
built-in target and corpora, tracking everything in the local SQLite MLflow store.

    python jobs/quickstart.py                      # everything, services stopped at the end
    python jobs/quickstart.py --keep-services      # leave the object store running
    python jobs/quickstart.py --set eval.prompts_per_domain=8

Stages:
  target  load the reference target; held-out perplexity / top-1 per domain; greedy samples
  cache   build the target cache of the built-in corpus on the object store (Ray Data)
  train   train a DSpark drafter: Ray Train, 2 workers, DeepSpeed ZeRO-2, streaming from s3://, MLflow
  eval    offline evaluation of the drafter (tau, acceptance, speedup, STS calibration)
  serve   serve target + drafter with Ray Serve and send one OpenAI-style request
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.artifacts import cache_uri, drafter_uri
from dspark.config import Config, add_config_args, config_from_args, run_main


def stage_target(cfg: Config, storage, tracker) -> dict:
    """Load the reference target and measure what the card claims, on held-out text."""
    from dspark import target as targets
    from dspark.corpus.examples import split_examples
    from dspark.corpus.sources import DOMAINS, Corpus
    from dspark.target import quality

    t0 = time.perf_counter()
    tgt = targets.load_from_config(cfg.target)
    card = targets.card(tgt.path)
    n_params = sum(p.numel() for p in tgt.model.parameters())
    print(
        f"[target] {tgt.path}: {type(tgt.model).__name__}, {n_params / 1e6:.2f} M parameters, "
        f"{tgt.config.num_hidden_layers} layers, vocab {tgt.config.vocab_size} "
        f"(loaded in {time.perf_counter() - t0:.1f}s)"
    )
    corpus = Corpus.load(cfg.corpus)
    report = {"target": tgt.path, "parameters": n_params, "heldout": {}}
    for domain in DOMAINS:
        exs = split_examples(corpus, domain, "heldout", cfg.corpus)[: cfg.eval.prompts_per_domain]
        seqs = quality.example_ids(tgt.tokenizer, exs, tgt.config.max_position_embeddings)
        q = quality.lm_quality(tgt.model, seqs, tgt.tokenizer.pad_token_id)
        base = card.get("heldout", {}).get(domain, {})
        report["heldout"][domain] = {
            **q,
            "examples": len(exs),
            "unigram_ppl": base.get("unigram_ppl"),
            "unigram_top1": base.get("unigram_top1"),
        }
        print(
            f"[target] held-out {domain:5s}: perplexity {q['ppl']:7.1f}  top-1 {q['top1']:6.1%}  "
            f"({q['tokens']:,} tokens of {len(exs)} examples; unigram baseline: perplexity "
            f"{base.get('unigram_ppl', float('nan')):.1f}, top-1 {base.get('unigram_top1', float('nan')):.1%})"
        )
        tracker.metrics({f"target.{domain}.ppl": q["ppl"], f"target.{domain}.top1": q["top1"]}, 0)
    prompts = [ex.prompt for d in DOMAINS for ex in split_examples(corpus, d, "heldout", cfg.corpus)[:2]]
    report["greedy"] = []
    for prompt, text in zip(prompts, quality.greedy_continuations(tgt.model, tgt.tokenizer, prompts, 48)):
        report["greedy"].append({"prompt": prompt, "continuation": text})
        print(f"[target] --- prompt ---\n{prompt.rstrip()}\n[target] --- greedy continuation ---\n{text.rstrip()}\n")
    return report


def stage_cache(cfg: Config, storage, tracker) -> dict:
    from dspark.cache.build import build_cache
    from dspark.cache.format import estimate_bytes
    from dspark.cluster import init_ray

    init_ray(cfg)
    m = build_cache(cfg, tracker)
    est = estimate_bytes(m.hidden_size, len(m.layers), m.tokens, m.codec, rows=m.rows)
    print(
        f"[cache] {cache_uri(cfg)}: {m.rows} rows, {m.tokens:,} tokens, {m.bytes / 2**20:.1f} MiB, "
        f"{m.bytes / max(m.tokens, 1):,.0f} bytes/token ({m.codec}); size estimate {est / 2**20:.1f} MiB "
        f"({(est - m.bytes) / m.bytes:+.1%})"
    )
    return {"uri": cache_uri(cfg), "rows": m.rows, "tokens": m.tokens, "bytes": m.bytes, "estimate": est}


def stage_train(cfg: Config, storage, tracker) -> dict:
    from dspark.cluster import init_ray
    from dspark.train import distributed

    init_ray(cfg)
    res = distributed.fit(cfg)
    print(distributed.summary(res))
    m = res["metrics"] or {}
    return {
        "out_uri": res["out_uri"],
        "run_id": res["run_id"],
        "steps": res["steps"],
        "loss": m.get("loss"),
        "expected_tau": m.get("expected_tau"),
    }


def stage_eval(cfg: Config, storage, tracker) -> dict:
    import tempfile
    from pathlib import Path

    from dspark import evaluation
    from dspark import target as targets
    from dspark.corpus.sources import Corpus
    from dspark.models import load_drafter

    uri = drafter_uri(cfg)
    tgt = targets.load_from_config(cfg.target)
    with tempfile.TemporaryDirectory() as d:
        local = storage.download_dir(uri, Path(d) / "drafter")
        drafter = load_drafter(local, tgt.model, tgt.weights_sha256)
        out = Path(cfg.eval.out_dir) / "quickstart"
        ev = evaluation.evaluate(cfg, tgt, {"dspark": drafter}, Corpus.load(cfg.corpus), out)
        if ev["calibrations"]:
            evaluation.save_calibrations(ev, {"dspark": local})
            storage.upload_dir(local, uri)
    evaluation.log_results(tracker, ev, out, prefix="eval.", artifact_path="eval")
    print((out / "results.md").read_text().rstrip())
    print(f"[eval] plots and JSON in {out}")
    return {"results": [r.__dict__ for r in ev["results"]]}


def stage_serve(cfg: Config, storage, tracker) -> dict:
    import openai
    from ray import serve

    from dspark.services import free_port
    from serving.app import run_local

    cfg.serve.port = free_port()
    cfg.serve.drafter_uri = drafter_uri(cfg)
    url = run_local(cfg)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompt = "def read_lines(path):\n"
    r = client.completions.create(model=cfg.serve.model_name, prompt=prompt, max_tokens=48, temperature=0)
    s = r.model_extra["speculative"]
    print(
        f"[serve] POST {url}/v1/completions {{prompt: {prompt!r}, max_tokens: 48, temperature: 0}}\n"
        f"{prompt}{r.choices[0].text}\n[serve] {r.usage.completion_tokens} tokens in {s['rounds']} rounds "
        f"(mean tau {s['mean_tau']:.2f}, mean verification length {s['mean_verify_len']:.2f})"
    )
    serve.shutdown()
    return {"url": url, "text": r.choices[0].text, "speculative": s}


STAGES = {"target": stage_target, "cache": stage_cache, "train": stage_train, "eval": stage_eval, "serve": stage_serve}

# Embedded defaults of the demo: small enough to finish in minutes on 2 CPU cores (--set overrides them).
DEMO_DEFAULTS = [
    "cache.max_examples=256",
    "cache.shard_rows=32",
    "cache.max_new_tokens=96",
    "cache.num_actors=2",
    "ray.num_cpus=2",
    "train.run_name=quickstart",
    "train.num_workers=2",
    "train.zero_stage=2",
    "train.max_steps=200",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.lr=2e-3",
    "train.checkpoint_every=50",
    "eval.prompts_per_domain=6",
    "eval.max_new_tokens=48",
    "eval.calibration_prompts_per_domain=12",
    "eval.calibration_max_new_tokens=64",
    "serve.sps_batches=[1,2,4,8,16]",
]


def main(argv=None):
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {list(STAGES)}")
    parser.add_argument("--keep-services", action="store_true", help="leave the local services running")
    parser.add_argument("--local-storage", action="store_true", help="use a local folder instead of the object store")
    args = parser.parse_args(argv)
    args.overrides = DEMO_DEFAULTS + args.overrides
    cfg = config_from_args(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    for s in stages:
        if s not in STAGES:
            from dspark.errors import UserError

            raise UserError(f"--stages: unknown stage '{s}' (valid: {', '.join(STAGES)})")

    from dspark import services, tracking
    from dspark.storage import Storage

    started = []
    t_all = time.perf_counter()
    try:
        if not args.local_storage and not Storage.is_remote(cfg.storage.root):
            store = services.ObjectStore()
            st = store.start()
            started.append(store)
            os.environ.update(st.env)
            cfg.storage.root = f"s3://{services.BUCKET}/quickstart"
            print(f"[services] object store {st.version} on {st.env['AWS_ENDPOINT_URL']} ready in {st.ready_s:.1f}s")
        storage = Storage.from_config(cfg.storage)
        storage.check(cfg.storage.root)
        report = {"stages": {}}
        with tracking.run(cfg, "quickstart") as tracker:
            tracker.params(cfg.flat())
            for name in stages:
                t0 = time.perf_counter()
                report["stages"][name] = STAGES[name](cfg, storage, tracker)
                report["stages"][name]["seconds"] = time.perf_counter() - t0
            fs, path = storage.pyarrow_fs(Storage.join(cfg.storage.root, "report.json"))
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(path) as f:
                f.write(json.dumps(report, indent=2).encode())
            print(
                f"[quickstart] report written to {Storage.join(cfg.storage.root, 'report.json')}; "
                f"MLflow run {tracker.run_id} in {cfg.mlflow.tracking_uri}"
            )
        print(f"[quickstart] done in {time.perf_counter() - t_all:.0f}s")
    finally:
        if not args.keep_services:
            for svc in started:
                svc.stop()


if __name__ == "__main__":
    run_main(main)
