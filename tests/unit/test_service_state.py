"""Service state files without real services: a stand-in process started and stopped by the same
code, a reused pid, and damaged state files; the ports services are given."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from dspark.errors import UserError
from dspark.services import Service, free_port

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


class Sleeper(Service):
    name = "objectstore"  # the CLI's name, so `status objectstore --dir` reads this state file
    grace_s = 5.0

    def ports(self):
        return {}

    def command(self, ports):
        return SLEEP

    def healthy(self, st):
        return True


@pytest.fixture
def bystander():
    """An unrelated process in its own session: what a reused pid can point to."""
    proc = subprocess.Popen(SLEEP, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(timeout=60)


def test_stop_ends_the_process_it_started(tmp_path):
    svc = Sleeper(tmp_path)
    st = svc.start()
    assert svc.state() == st and st.started > 0
    assert svc.stop() == "stopped"
    assert svc.state() is None and not svc.state_file.exists()


def test_stop_leaves_a_process_that_reused_the_pid_alone(tmp_path, bystander):
    svc = Sleeper(tmp_path)
    # a state file as older versions wrote it (no start time), whose pid now names another process
    svc.state_file.write_text(json.dumps({"name": "objectstore", "pid": bystander.pid, "ports": {}}))
    said = svc.stop()
    assert bystander.poll() is None and not svc.state_file.exists()
    assert said.startswith(f"pid {bystander.pid} left alone: the state file has no start time")
    # the service started a minute before the process now holding its pid
    started = psutil.Process(bystander.pid).create_time() - 60
    svc.state_file.write_text(
        json.dumps({"name": "objectstore", "pid": bystander.pid, "ports": {}, "started": started})
    )
    assert svc.state() is None  # not reported as running either
    assert svc.stop() == f"not running (pid {bystander.pid} now belongs to another process: left alone)"
    assert bystander.poll() is None and not svc.state_file.exists()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"name": "objectstore"}',
        '{"name": "objectstore", "pid": "12", "ports": {}}',
        b"\xff\xfe",
    ],
)
def test_a_damaged_state_file_is_one_line_naming_it(tmp_path, content):
    svc = Sleeper(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    if isinstance(content, bytes):
        svc.state_file.write_bytes(content)
    else:
        svc.state_file.write_text(content)
    with pytest.raises(UserError, match=f"state file {svc.state_file} is damaged"):
        svc.stop()
    out = subprocess.run(
        [sys.executable, "-m", "dspark.services", "status", "objectstore", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"error: state file {svc.state_file} is damaged (")


def test_free_ports_come_from_outside_the_ranges_other_processes_are_handed():
    """Serve binds its port seconds after it is chosen, while Ray starts processes that bind ports:
    a port from the kernel's ephemeral range (or Ray's worker ports) could be taken in between."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(20000 <= p < ephemeral for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free indeed
