"""Ctrl-C on jobs/serve.py stops it and every Ray process it started, even while its engine is wedged
(SIGSTOP: it answers nothing, so the application never becomes ready). The README test checks the
same of infra/local/stop.sh after a real job."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from dspark.services import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _all_gone(procs, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return [f"{p.pid} {p.name()}" for p in alive]
        time.sleep(0.5)


def _named(pid: int, word: str) -> list:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if word in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def test_ctrl_c_stops_serve_and_its_local_ray_with_a_wedged_engine():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "jobs/serve.py"),
            "--set",
            f"serve.port={free_port()}",
            "--set",
            "serve.sps_batches=[1]",
            "--set",
            "ray.num_cpus=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        engine = wait_for(
            lambda: proc.poll() is not None or _named(proc.pid, "SpeculativeEngine"), 300, "engine replica"
        )
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        for p in engine:
            p.suspend()  # wedged while starting: serve.run waits for it forever
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    assert "[serve] stopping" in out
    assert _all_gone(started) == []
