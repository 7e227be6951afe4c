"""One builder per cache: the lock refuses a second builder, names the holder, and is taken over
when its holder is gone (same host) or its heartbeat expired; a holder that lost it finds out."""

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest

from dspark.cache.lock import LOCK, CacheLock
from dspark.errors import UserError
from dspark.storage import Storage


def _holder(**fields) -> bytes:
    return json.dumps(
        {"owner": "other", "host": "elsewhere", "pid": 1, "started": 0.0, "heartbeat": time.time(), **fields}
    ).encode()


def test_a_second_builder_is_refused_until_the_first_releases(tmp_path):
    with CacheLock(Storage(), str(tmp_path)):
        assert json.loads((tmp_path / LOCK).read_text())["host"] == socket.gethostname()
        with pytest.raises(
            UserError,
            match=r"is being built by another builder \(pid \d+ on .*, heartbeat 0s ago\): "
            r"wait for it to finish; if it is gone, its lock _lock.json expires 120s",
        ):
            CacheLock(Storage(), str(tmp_path)).acquire()
    assert not (tmp_path / LOCK).exists()
    with CacheLock(Storage(), str(tmp_path)):
        pass


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(proc.pid).create_time()
    proc.wait(timeout=60)  # a builder on this host that was killed
    (tmp_path / LOCK).write_bytes(_holder(host=socket.gethostname(), pid=proc.pid, started=started))
    with CacheLock(Storage(), str(tmp_path)) as lock:
        assert json.loads((tmp_path / LOCK).read_text())["owner"] == lock.me["owner"]
    (tmp_path / LOCK).write_bytes(_holder(heartbeat=time.time() - 121))  # another host, silent for too long
    with CacheLock(Storage(), str(tmp_path)):
        pass
    (tmp_path / LOCK).write_bytes(_holder(heartbeat=time.time() - 60))  # another host, alive a minute ago
    with pytest.raises(UserError, match=r"pid 1 on elsewhere, heartbeat 60s ago.* expires 60s from now"):
        CacheLock(Storage(), str(tmp_path)).acquire()


def test_a_holder_that_lost_its_lock_stops_before_publishing(tmp_path):
    with CacheLock(Storage(), str(tmp_path)) as lock:
        lock.check()
        (tmp_path / LOCK).write_bytes(_holder())  # expired while we could not renew it, and taken over
        with pytest.raises(UserError, match="lost its lock _lock.json to another builder .pid 1 on elsewhere"):
            lock.check()
    assert json.loads((tmp_path / LOCK).read_text())["owner"] == "other"  # the new holder's lock is left alone
