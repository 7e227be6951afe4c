"""Cluster manifests parse, point at the real entry point, and pass only valid config keys."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from dspark.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _overrides(command: str) -> tuple[str, list[str]]:
    words = shlex.split(re.sub(r"\$\{(\w+)\}", r"X_\1", command))
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    return words, sets


@pytest.mark.parametrize("path", sorted((ROOT / "infra").rglob("*.yaml")))
def test_every_manifest_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, path


def test_rayjob_runs_the_training_job_with_valid_settings():
    job = yaml.safe_load((ROOT / "infra/k8s/rayjob-train.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    words, sets = _overrides(job["spec"]["entrypoint"])
    assert words[:2] == ["python", "jobs/train_dspark.py"] and (ROOT / words[1]).is_file()
    cfg = load_config(overrides=[s.replace("X_DSPARK_STORAGE_ROOT", "s3://b/p") for s in sets])
    assert cfg.train.num_workers == 4 and cfg.train.bf16 and cfg.target.device == "cuda"
    keys = {s.split("=")[0] for s in sets}
    assert {"storage.root", "mlflow.tracking_uri", "target.name_or_path"} <= keys
    settings = [d for d in yaml.safe_load_all((ROOT / "infra/k8s/settings.yaml").read_text())]
    names = {d["metadata"]["name"] for d in settings}
    for group in [job["spec"]["rayClusterSpec"]["headGroupSpec"], *job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]:
        refs = group["template"]["spec"]["containers"][0]["envFrom"]
        assert {r.get("configMapRef", r.get("secretRef"))["name"] for r in refs} <= names
    cm = next(d for d in settings if d["kind"] == "ConfigMap")["data"]
    assert {"DSPARK_STORAGE_ROOT", "MLFLOW_TRACKING_URI", "DSPARK_TARGET", "AWS_ENDPOINT_URL"} <= set(cm)


def test_cluster_launcher_mounts_and_installs_the_project():
    conf = yaml.safe_load((ROOT / "infra/cluster/aws.yaml").read_text())
    assert conf["file_mounts"] == {"/home/ubuntu/dspark": "."}
    assert any("pip install -e /home/ubuntu/dspark" in c for c in conf["setup_commands"])
    header = (ROOT / "infra/cluster/aws.yaml").read_text().split("cluster_name")[0]
    words, sets = _overrides(header.replace("#", " ").replace("\\", " "))
    assert "jobs/train_dspark.py" in words
    load_config(overrides=sets)


def test_serve_configs_build_the_real_application_with_valid_settings():
    import importlib

    for path, get in (
        (ROOT / "serving/config.yaml", lambda d: d["applications"][0]),
        (ROOT / "infra/k8s/rayservice.yaml", lambda d: yaml.safe_load(d["spec"]["serveConfigV2"])["applications"][0]),
    ):
        app = get(yaml.safe_load(path.read_text()))
        module, attr = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr)), path
        cfg = load_config(overrides=app["args"]["overrides"])
        assert cfg.serve.drafter_uri, path


def _containers(node):
    """Every container spec in a manifest (head, workers, submitter)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "containers":
                yield from v
            else:
                yield from _containers(v)
    elif isinstance(node, list):
        for v in node:
            yield from _containers(v)


def test_pods_run_the_project_image_and_clusters_autoscale():
    dockerfile = (ROOT / "infra/docker/Dockerfile").read_text()
    assert "pip install --no-cache-dir ." in dockerfile and "COPY --chown=ray:users jobs jobs" in dockerfile
    for name in ("raycluster.yaml", "rayjob-train.yaml", "rayservice.yaml"):
        doc = yaml.safe_load((ROOT / "infra/k8s" / name).read_text())
        images = {c["image"] for c in _containers(doc)}
        assert images == {"ghcr.io/your-org/dspark:0.1.0"}, name  # nothing installed at pod start
        assert not any("pip install" in " ".join(c.get("args", [])) for c in _containers(doc)), name
        cluster = doc["spec"].get("rayClusterSpec") or doc["spec"].get("rayClusterConfig") or doc["spec"]
        assert cluster["enableInTreeAutoscaling"] is True, name
    job = yaml.safe_load((ROOT / "infra/k8s/rayjob-train.yaml").read_text())["spec"]
    assert yaml.safe_load(job["runtimeEnvYAML"])["working_dir"] == "/home/ray/dspark"
    assert job["submitterConfig"]["backoffLimit"] >= 1
    svc = yaml.safe_load((ROOT / "infra/k8s/rayservice.yaml").read_text())
    app = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]
    from serving.app import engine_options

    opts = engine_options(load_config(overrides=app["args"]["overrides"]))
    assert opts["ray_actor_options"]["num_gpus"] == 1 and opts["autoscaling_config"]["max_replicas"] == 4
