"""Bad input to a job: one line on stderr naming the culprit, non-zero exit, no traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_job(script, *args):
    env = {**os.environ, "AWS_ENDPOINT_URL": "", "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    return subprocess.run(
        [sys.executable, str(ROOT / "jobs" / script), *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args, named",
    [
        (["--set", "target_train.bogus=1"], "target_train.bogus: unknown key"),
        (["--set", "target_train.lr=fast"], "target_train.lr:"),
        (["--config", "/nonexistent/cfg.yaml"], "config file not found: /nonexistent/cfg.yaml"),
        (["--set", "cache.layers=[1,"], "override cache.layers: the value is not valid YAML"),
    ],
)
def test_train_target_rejects_bad_config(args, named):
    out = run_job("train_target.py", *args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {out.stderr.strip()[len('error: ') :]}"]
    assert named in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["--local-storage", "--set", "target.name_or_path=/nonexistent/model"],
            "target not found: /nonexistent/model",
        ),
        (
            ["--set", "storage.root=s3://dspark/x", "--set", "storage.endpoint_url=http://127.0.0.1:9"],
            "object store http://127.0.0.1:9 is unreachable",
        ),
        (["--stages", "target,bogus"], "--stages: unknown stage 'bogus'"),
    ],
)
def test_quickstart_rejects_bad_input(args, named, tmp_path):
    out = run_job("quickstart.py", "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db", *args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_build_cache_names_a_damaged_source_manifest_and_a_non_utf8_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "manifest.json").write_text("null")
    out = run_job(
        "build_cache.py",
        "--set",
        "mlflow.enabled=false",
        "--set",
        f"cache.source_uri={src}",
        "--set",
        "cache.name=fp8",
        "--set",
        f"storage.root={tmp_path}",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: {src}/manifest.json is not a valid manifest (not a JSON object "
        f"with a list of shards); delete it to rebuild the cache"
    ]
    cfg = tmp_path / "latin1.yaml"
    cfg.write_bytes(b"cache:\n  name: caf\xe9\n")
    out = run_job("build_cache.py", "--config", str(cfg))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: config file {cfg} is not UTF-8 text (byte 0xe9 at offset 18)"
    ], out.stderr[-2000:]


def test_train_dspark_names_a_damaged_cache_instead_of_building_over_it(tmp_path):
    (tmp_path / "caches" / "builtin").mkdir(parents=True)
    (tmp_path / "caches" / "builtin" / "manifest.json").write_text("{not json")
    out = run_job(
        "train_dspark.py",
        "--set",
        f"storage.root={tmp_path}",
        "--set",
        "ray.num_cpus=1",
        "--set",
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db",
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "manifest.json is not a valid manifest" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "building it first" not in out.stdout
