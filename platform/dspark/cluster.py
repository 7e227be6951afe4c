"""Connecting to Ray: a local Ray on embedded defaults, or a cluster given by `ray.address`."""
from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path


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


def init_ray(cfg) -> None:
    """`cfg` is the root Config. Inside a Ray job the driver joins its cluster; `ray.address` names a
    cluster explicitly; otherwise a local Ray is started. Idempotent."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.ray.address
    env_address = os.environ.get("RAY_ADDRESS", "")
    if env_address.startswith("http"):
        os.environ.pop("RAY_ADDRESS")  # a job-submission (dashboard) address, not for ray.init
    elif address is None and env_address:
        address = env_address  # running as a Ray job: join the cluster it runs on
    kwargs: dict = {"runtime_env": runtime_env(), "ignore_reinit_error": True}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, **kwargs)


def quiet_ray_data() -> None:
    """Our jobs print their own progress lines; Ray Data's periodic progress logs are noise there."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
