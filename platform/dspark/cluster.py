"""Connecting to Ray: a local Ray on embedded defaults, or a cluster given by `ray.address`."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import psutil

from dspark.services import RAY_ENV_DEFAULTS, free_port


def runtime_env() -> dict:
    """Ship the library to the workers when it is not installed there (a plain checkout submitted
    with `ray job submit --working-dir .`); an installed package needs nothing."""
    try:
        metadata.distribution("dspark")
        return {}
    except metadata.PackageNotFoundError:
        import dspark

        lib = Path(dspark.__file__).parent
        return {"py_modules": [str(lib), str(lib.parents[1] / "serving")]}


def cluster_address(cfg) -> str | None:
    """The cluster to join: `ray.address`, else RAY_ADDRESS when it is a cluster address (as inside a
    Ray job; an http:// dashboard address is for `ray job submit`, not ray.init); None = start a local Ray."""
    env_address = os.environ.get("RAY_ADDRESS", "")
    return cfg.ray.address or (env_address if env_address and not env_address.startswith("http") else None)


def init_ray(cfg) -> None:
    """`cfg` is the root Config. Inside a Ray job the driver joins its cluster; `ray.address` names a
    cluster explicitly; otherwise a local Ray is started. Idempotent."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster_address(cfg)
    if os.environ.get("RAY_ADDRESS", "").startswith("http"):
        os.environ.pop("RAY_ADDRESS")  # or ray.init would try to use it
    kwargs: dict = {"runtime_env": runtime_env(), "ignore_reinit_error": True}
    if address:
        ray.init(address=address, **kwargs)
        return
    for k, v in RAY_ENV_DEFAULTS.items():  # the local Ray's processes inherit this environment
        os.environ.setdefault(k, v)
    # "local": a new Ray, even when `ray start` has recorded another one on this machine (ray.init() joins
    # it). Its workers must reach ITS state API: Ray Train's placement-group cleaner asks it every second
    # whether the run's controller is alive, and a worker without an address finds the latest `ray start`
    # cluster on the machine (which knows no such actor: the cleaner then removes the running training's
    # placement group), or several clusters (an error), or none (a warning every second).
    dashboard = free_port()
    kwargs["runtime_env"] = {
        **kwargs["runtime_env"],
        "env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}"},
    }
    _start_local(
        lambda: ray.init(
            address="local",
            num_cpus=cfg.ray.num_cpus,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard,
            **kwargs,
        )
    )


def _start_local(start, attempts: int = 3) -> None:
    """Ray waits a fixed 30 s for a new local node to register with its GCS; on a busy machine it can
    miss that and raise. Then the processes the failed attempt left are removed and Ray starts again."""
    me = psutil.Process()
    for attempt in range(attempts):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            start()
            return
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise
            for p in me.children(recursive=True):
                if p.pid not in before:
                    p.kill()
            psutil.wait_procs([p for p in me.children(recursive=True) if p.pid not in before], timeout=10)


def quiet_ray_data() -> None:
    """Our jobs print their own progress lines; Ray Data's periodic progress logs are noise there."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
