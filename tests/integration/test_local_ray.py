"""A job's local Ray (embedded defaults: no cluster address) answers its own workers' state queries, with
another Ray cluster running on the machine. Ray Train's placement-group cleaner, in a worker, asks every
second whether the run's controller is alive: it must not ask another cluster (which knows no such
actor, and a dead controller's placement group is removed) nor fail (a warning every second in the
job's output)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

CLEANER_VIEW = textwrap.dedent(
    """
    import ray
    from dspark.cluster import init_ray
    from dspark.config import load_config

    init_ray(load_config())

    @ray.remote(num_cpus=0)
    class Controller:
        def ping(self):
            return 1

    @ray.remote(num_cpus=0)
    def alive(actor_id):  # what the cleaner calls, where it runs: in a worker of this Ray
        from ray.train.v2._internal.state.util import is_actor_alive

        try:
            return is_actor_alive(actor_id=actor_id, timeout=30)
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    c = Controller.remote()
    ray.get(c.ping.remote())
    print("ALIVE", ray.get(alive.remote(c._actor_id.hex())))
    ray.shutdown()
    """
)


def test_a_local_rays_workers_query_their_own_cluster(ray_head):
    # ray_head: another cluster (with its dashboard) runs on this machine
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT / "platform")
    out = subprocess.run(
        [sys.executable, "-c", CLEANER_VIEW], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("ALIVE")]
    assert lines == ["ALIVE True"], (out.stdout[-2000:], out.stderr[-3000:])
