"""The README's command blocks, run as written: each block is extracted from README.md (never copied
here) and run by bash in a fresh copy of the repository (tracked and new files, no `.local/`: its own
services, MLflow store and Ray head on free loopback ports), the project's venv as its `.venv`.

- "Local services" runs verbatim: its job is sized to take a few minutes on 2 CPU cores.
- "Quickstart": `make demo` takes ~6 minutes, so each `make` line is resolved with `make -n` (the
  Makefile must have it) and the demo's command runs with `--stages target,cache` and a smaller
  cache: the object store, the reference target, a Ray Data cache build on s3://, services stopped.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART_SUBSET = [
    "--stages",
    "target,cache",
    "--set",
    "cache.max_examples=8",
    "--set",
    "cache.max_new_tokens=16",
    "--set",
    "eval.prompts_per_domain=2",
]


def readme_block(heading: str) -> str:
    """The first ```bash block of the README section `## heading`."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def clone(tmp_path):
    """The working tree as a user's fresh clone has it: what git tracks or would add, nothing ignored."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    dest = (tmp_path / "dspark").resolve()
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    (dest / ".venv").symlink_to(Path(sys.prefix).resolve())
    yield dest
    subprocess.run([str(dest / "infra/local/stop.sh")], cwd=dest, capture_output=True, timeout=120)  # after a failure


def user_shell_env(clone: Path) -> dict:
    """A user's shell with the venv activated: none of this session's service settings."""
    env = {
        k: v
        for k, v in os.environ.items()  # MAKE*: the suite may run under `make test`, a user's shell not
        if not k.startswith(("RAY_", "AWS_", "MLFLOW_", "DSPARK_", "MAKE", "MFLAGS"))
    }
    env.update(
        PATH=f"{clone / '.venv/bin'}:{env['PATH']}", PYTHONPATH=f"{clone / 'platform'}:{clone}", OMP_NUM_THREADS="1"
    )
    return env


def leftovers(clone: Path, timeout: float = 60.0) -> list[str]:
    """Processes that mention the clone in their command line or environment (every service and every
    process of its Ray head does: the head's environment names the clone's state folder), once none
    are left or after `timeout` seconds (processes being stopped may take a moment to exit)."""
    deadline = time.monotonic() + timeout
    while (found := _mentioning(clone)) and time.monotonic() < deadline:
        time.sleep(1)
    return found


def _mentioning(clone: Path) -> list[str]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if str(clone) in " ".join(p.cmdline()) or any(str(clone) in v for v in p.environ().values()):
                found.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            continue
    return found


def test_local_services_block_runs_as_written(clone):
    block = readme_block("Local services")
    assert "infra/local/start.sh" in block and "ray job submit" in block and "infra/local/stop.sh" in block
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", "-e", "-c", block], cwd=clone, env=user_shell_env(clone), capture_output=True, text=True, timeout=1200
    )
    log = out.stdout + out.stderr
    print(f"[readme] Local services block: {time.monotonic() - t0:.0f}s\n{log[-3000:]}")
    assert out.returncode == 0, log[-6000:]
    job = re.search(r"Job '(raysubmit_\w+)' succeeded", log)
    assert job, log[-6000:]
    assert "[train] no finished cache at s3://dspark/demo/caches/builtin: building it first" in log
    assert len(re.findall(r"Reporting training result \d+", log)) == 2, log[-6000:]  # steps 2 and 4
    run_id = re.search(r"MLflow run ([0-9a-f]{32})", log).group(1)
    secret = json.loads((clone / ".local/services/objectstore/credentials.json").read_text())["secret_key"]
    assert secret not in log  # the job's logs and the submit command carry no credential

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / '.local/mlflow/mlflow.db'}")
    assert sorted(m.step for m in client.get_metric_history(run_id, "train.loss")) == [1, 2, 3, 4]
    assert leftovers(clone) == []


def test_quickstart_block_commands(clone):
    env = user_shell_env(clone)
    targets = re.findall(r"^make (\w+)", readme_block("Quickstart (from a fresh clone)"), re.M)
    assert targets == ["demo", "test"]
    recipes = {
        t: subprocess.run(["make", "-n", t], cwd=clone, env=env, capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
        for t in targets
    }
    demo = shlex.split(recipes["demo"])
    assert demo[1:] == ["jobs/quickstart.py"], recipes
    t0 = time.monotonic()
    out = subprocess.run(demo + QUICKSTART_SUBSET, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    print(f"[readme] quickstart --stages target,cache: {time.monotonic() - t0:.0f}s\n{out.stdout[-2000:]}")
    assert out.returncode == 0, log[-6000:]
    assert re.search(r"\[target\] held-out code : perplexity", log), log[-4000:]
    assert re.search(r"\[cache\] s3://dspark/quickstart/caches/builtin: 8 rows", log), log[-4000:]
    assert "[quickstart] done" in log
    assert leftovers(clone) == []
