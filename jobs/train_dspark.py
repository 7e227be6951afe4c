"""Train a drafter (DSpark, DFlash or EAGLE-3) with Ray Train + DeepSpeed ZeRO, streaming the target
cache from storage, tracked in MLflow; then evaluate it offline into the same MLflow run.

    python jobs/train_dspark.py                                   # embedded defaults: local Ray, built-in target,
                                                                  # cache built if missing, SQLite MLflow
    python jobs/train_dspark.py --set train.drafter=dflash --set train.num_layers=5
    ray job submit --working-dir . -- python jobs/train_dspark.py \\
        --set storage.root=s3://bucket/dspark --set train.num_workers=8 --set train.gpus_per_worker=1 \\
        --set train.bf16=true --set target.name_or_path=Qwen/Qwen3-4B --set mlflow.tracking_uri=http://mlflow:5000

The trained drafter (weights, calibration, its speculators export) becomes a new version of the MLflow
registered model mlflow.registered_model (default <cache.name>-<train.drafter>) with mlflow.alias
(default "candidate") on it: models:/NAME@ALIAS then works wherever a drafter URI does.

Rerunning with the same --set train.run_name=NAME resumes from its latest checkpoint. With no
finished cache at cache.uri (default <storage.root>/caches/<cache.name>) the job builds it first with
its cache.* settings, as jobs/build_cache.py would; a damaged or incompatible cache is an error.
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import _bootstrap  # noqa: F401

# Heavy parts of the library (torch, Ray, DeepSpeed) are imported inside the functions that use them,
# after the arguments are parsed: --help and a bad setting answer at once.
from dspark.config import add_config_args, config_from_args, run_main


def main(argv=None):
    args = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    cfg = config_from_args(args)
    from dspark.artifacts import cache_uri
    from dspark.cache.build import build_cache
    from dspark.cache.read import open_cache
    from dspark.cluster import init_ray
    from dspark.storage import Storage
    from dspark.train import distributed

    storage = Storage.from_config(cfg.storage)
    storage.check(cfg.storage.root)
    uri = cache_uri(cfg)
    finished = cache_finished(storage, uri)
    if finished:
        open_cache(uri, storage)  # damaged or incompatible: one line naming it, before any work
    init_ray(cfg)
    if not finished:
        print(
            f"[train] no finished cache at {uri}: building it first with this job's cache.* settings "
            f"(what jobs/build_cache.py does)"
        )
        build_cache(cfg)
    res = distributed.fit(cfg)
    print(distributed.summary(res))
    evaluate_and_register(cfg, storage, res)


def cache_finished(storage, uri: str) -> bool:
    """A build publishes its manifest last: without one there is no cache yet, or an unfinished one."""
    from dspark.cache.format import MANIFEST
    from dspark.storage import Storage

    fs, path = storage.pyarrow_fs(Storage.join(uri, MANIFEST))
    return fs.get_file_info(path).type.name == "File"


def evaluate_and_register(cfg, storage, res) -> None:
    """Offline evaluation of the exported drafter (train.evaluate): summary, table and plots into the
    training run, the fitted calibration saved with the drafter; then the drafter, its calibration and
    its speculators export registered in MLflow (unless mlflow.registered_model is "")."""
    from dspark import evaluation, export, tracking
    from dspark import target as targets
    from dspark.artifacts import registered_model
    from dspark.corpus.sources import Corpus
    from dspark.errors import UserError
    from dspark.models import load_drafter

    name = registered_model(cfg)
    if not cfg.train.evaluate and not name:
        return
    tgt = targets.load_from_config(cfg.target)
    with tempfile.TemporaryDirectory() as d:
        local = storage.download_dir(res["out_uri"], Path(d) / "drafter")
        drafter = load_drafter(local, tgt.model, tgt.weights_sha256)
        if cfg.train.evaluate:
            out = Path(cfg.eval.out_dir) / res["name"]
            ev = evaluation.evaluate(cfg, tgt, {cfg.train.drafter: drafter}, Corpus.load(cfg.corpus), out)
            if ev["calibrations"]:  # the calibration travels with the drafter
                kind = cfg.train.drafter
                evaluation.save_calibrations(ev, {kind: local})
                storage.upload_dir(local, res["out_uri"])
            with tracking.run(cfg, res["name"], run_id=res["run_id"]) as t:
                evaluation.log_results(t, ev, out, prefix="eval.", artifact_path="eval")
            print((out / "results.md").read_text())
        if name and res["run_id"]:
            record = Path(d) / "record"  # the drafter folder plus, where the kind exports, its speculators layout
            shutil.copytree(local, record)
            try:
                export.export_speculators(drafter, tgt, record / "speculators", export.default_verifier(tgt))
            except UserError as e:
                print(f"[train] no speculators export in the registered model: {e}")
            uri = tracking.register_drafter(cfg, res["run_id"], record, name, cfg.mlflow.alias)
            print(f"[train] registered {uri} (alias {cfg.mlflow.alias}: models:/{name}@{cfg.mlflow.alias})")


if __name__ == "__main__":
    run_main(main)
