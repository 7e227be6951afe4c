"""One builder at a time per cache: `_lock.json` under the cache URI.

The lock object names its holder (an owner id, host, pid and process start time) and a heartbeat
that a thread of the holder rewrites every TTL_S / 4 seconds. It is created only if absent:
O_EXCL on a local filesystem, a conditional put (`If-None-Match: *`) on S3 (AWS S3 and the local
SeaweedFS both honour it; tests/integration/test_cache_build.py checks the latter). A second builder is
refused with an error naming the holder, unless the lock is stale: its heartbeat is older than
TTL_S, or its holder ran on this host and is gone (a killed build resumes at once). A stale lock is
deleted and created again, and the holder reads it back to confirm it won.

What this guarantees, and what it does not:
- two builders started at different moments on one cache: the second is refused;
- on a server that ignores If-None-Match, two builders starting within the same second may both
  proceed (the read-back catches only the later of two overwrites): best effort there;
- taking over a stale lock (delete, then create) can race with another taker the same way;
- expiry compares the heartbeat with this machine's clock: machines must agree within TTL_S; a
  holder that cannot write its heartbeat for TTL_S (an object-store outage) can lose the lock, and
  then fails at its next check instead of publishing the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from dspark.errors import UserError
from dspark.services import is_process, process_started
from dspark.storage import Storage

log = logging.getLogger(__name__)

LOCK = "_lock.json"
TTL_S = 120.0


class CacheLock:
    """`with CacheLock(storage, uri) as lock:` ... `lock.check()` before publishing what the lock guards."""

    def __init__(self, storage: Storage, uri: str, ttl_s: float = TTL_S):
        self.uri, self.ttl_s = uri, ttl_s
        self.fs, root = storage.fsspec_fs(uri)
        self.path = f"{root}/{LOCK}"
        self.me = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": process_started(os.getpid()),
        }
        self.lost: dict | None = None  # the holder that replaced us, if any
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="cache-lock", daemon=True)

    def __enter__(self) -> "CacheLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        holder = self._read()
        if holder is not None:
            if not self._stale(holder):
                age = time.time() - holder.get("heartbeat", 0)
                raise UserError(
                    f"cache {self.uri} is being built by another builder (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, heartbeat {age:.0f}s ago): wait for it to finish; if it is gone, "
                    f"its lock {LOCK} expires {max(0.0, self.ttl_s - age):.0f}s from now"
                )
            log.warning(
                "taking over the stale lock of %s (pid %s on %s)", self.uri, holder.get("pid"), holder.get("host")
            )
            self._remove()
        try:
            with self.fs.open(self.path, "xb") as f:
                f.write(self._content())
        except OSError:  # FileExistsError; or S3's 412 PreconditionFailed, which s3fs may map to EINVAL
            if self._read() is None:
                raise
            raise UserError(f"cache {self.uri}: another builder took its lock {LOCK} at the same moment") from None
        if (self._read() or {}).get("owner") != self.me["owner"]:
            raise UserError(f"cache {self.uri}: another builder took its lock {LOCK} at the same moment")
        self._beat.start()

    def check(self) -> None:
        """Raise if another builder holds the lock now (ours expired while we could not renew it)."""
        if self.lost is None:
            holder = self._read() or {}
            self.lost = None if holder.get("owner") == self.me["owner"] else holder
        if self.lost is not None:
            raise UserError(
                f"cache {self.uri}: lost its lock {LOCK} to another builder (pid {self.lost.get('pid')} on "
                f"{self.lost.get('host')}); nothing more was published by this one"
            )

    def release(self) -> None:
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join()
        if self.lost is None and (self._read() or {}).get("owner") == self.me["owner"]:
            self._remove()

    # -- internals
    def _content(self) -> bytes:
        return json.dumps({**self.me, "heartbeat": time.time()}).encode()

    def _read(self) -> dict | None:
        """The lock's holder, None without a lock; an unreadable lock (being written) counts as fresh."""
        try:
            holder = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            holder = None
        return holder if isinstance(holder, dict) else {"host": "?", "pid": "?", "heartbeat": time.time()}

    def _remove(self) -> None:
        try:
            self.fs.rm(self.path)
        except FileNotFoundError:
            pass

    def _stale(self, holder: dict) -> bool:
        if time.time() - holder.get("heartbeat", 0) > self.ttl_s:
            return True
        here = holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int)
        return here and not is_process(holder["pid"], holder.get("started") or 0.0)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                holder = self._read()
                if (holder or {}).get("owner") != self.me["owner"]:
                    self.lost = holder or {}
                    return
                self.fs.pipe_file(self.path, self._content())
            except OSError as e:  # an outage: retry at the next beat; the lock lasts TTL_S
                log.warning("cache lock heartbeat of %s failed: %s", self.uri, str(e).splitlines()[0])
