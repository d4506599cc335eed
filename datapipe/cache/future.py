"""One future per node: every process's upcoming reads, published in the warm directory,
merged for the warm tier's eviction.

A node runs several ranks, each with DataLoader workers, each with its own schedule
(``TieredCache.set_schedule``). Evicting by one process's future alone throws out what a
sibling reads next. So each process with a schedule publishes its next ``limit`` reads as
``futures/<host>-<pid>-<token>.json`` in the warm directory (written to a temporary name,
locked, then renamed, as the counter files of node_stats.py), and the warm tier ranks a
copy by the soonest next use over every live process: kept if ANY process needs it soon.

* what: the first 16 hex digits of each read's warm key (64 bits of the URL's hash), in
  order; a process's own reads are known exactly from its schedule, another's as "at
  distance i" (its i-th upcoming read when it published).
* when: on ``set_schedule`` and each time the reader moved ``limit // 8`` reads past the
  last publication, so another's view is at most that stale; withdrawn (deleted) at
  ``close()`` and when the schedule is cleared.
* live: a publisher holds an exclusive ``flock`` on its published file (local directory:
  the kernel drops it when the process dies), so the file of a dead process is ignored and
  deleted by the next reader that finds it unlocked.
* cheap: readers re-list the folder at most every ``refresh_s`` and re-read only files
  whose (mtime, size) changed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .eviction import NEVER, Schedule
from .lockfds import close_lock
from .node_stats import publish_locked

__all__ = ["FutureBoard", "MergedFuture", "FUTURES_DIR", "PUBLISH_LIMIT", "future_key"]

FUTURES_DIR = "futures"
PUBLISH_LIMIT = 2048
REFRESH_S = 0.5
_FORMAT = "datapipe-cache-future"
_MAX_FILE_BYTES = 1 << 20  # PUBLISH_LIMIT keys of 16 hex digits, quoted, with room to spare
_SAFE = re.compile(r"[^A-Za-z0-9._]+")


def future_key(warm_key: str) -> str:
    """A published key: the first 16 hex digits of a warm key (its URL's hash)."""
    return warm_key[:16]


class FutureBoard:
    """This process's published future in ``<warm>/futures/`` and the merged futures of the
    other live processes there (see the module docstring)."""

    def __init__(self, root: str, *, limit: int = PUBLISH_LIMIT, refresh_s: float = REFRESH_S) -> None:
        self.dir = os.path.join(root, FUTURES_DIR)
        os.makedirs(self.dir, exist_ok=True)
        host = _SAFE.sub("_", socket.gethostname())[:64] or "host"
        self.name = f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self.path = os.path.join(self.dir, self.name)
        self.limit = limit
        self.refresh_s = refresh_s
        self.published_at: int | None = None  # schedule position at the last publication
        self._fd = -1
        self._lock = threading.Lock()
        self._files: dict[str, tuple[tuple[int, int], dict[str, int]]] = {}  # name -> (mtime, size), keys
        self._merged: dict[str, int] = {}
        self._read_at = -1.0
        self.errors = 0

    # -- this process -------------------------------------------------------------------
    def publish(self, keys: list[str], position: int) -> None:
        """Publish ``keys`` (warm keys of the upcoming reads, soonest first; at most
        ``limit`` are kept). Never raises OSError: a failed write only costs the merge."""
        doc = {"format": _FORMAT, "version": 1, "pid": os.getpid(), "host": socket.gethostname(),
               "updated": time.time(), "keys": [future_key(k) for k in keys[: self.limit]]}
        with self._lock:
            try:
                fd = publish_locked(self.dir, self.name, json.dumps(doc, separators=(",", ":")))
            except OSError:
                self.errors += 1
                return
            old, self._fd = self._fd, fd
            if old >= 0:
                close_lock(old)
            self.published_at = position

    def due(self, position: int) -> bool:
        """Whether the reader moved far enough since the last publication to publish again."""
        return self.published_at is None or position - self.published_at >= max(1, self.limit // 8)

    def withdraw(self) -> None:
        """Delete this process's file (its schedule was cleared, or it closes)."""
        with self._lock:
            fd, self._fd = self._fd, -1
            self.published_at = None
            if fd < 0:
                return
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(self.path)
            except OSError:
                pass
            finally:
                close_lock(fd)

    # -- the other processes ------------------------------------------------------------
    def others(self) -> dict[str, int]:
        """Published key -> the soonest distance at which any other live process reads it."""
        now = time.monotonic()
        if self._read_at >= 0 and now - self._read_at < self.refresh_s:
            return self._merged
        with self._lock:
            self._read_at = now
            try:
                names = [n for n in os.listdir(self.dir) if n.endswith(".json") and not n.startswith(".")]
            except OSError:
                names = []
            files: dict[str, tuple[tuple[int, int], dict[str, int]]] = {}
            for name in names:
                if name == self.name:
                    continue
                got = self._read_live(name)
                if got is not None:
                    files[name] = got
            self._files = files
            merged: dict[str, int] = {}
            for _sig, keys in files.values():
                for k, d in keys.items():
                    if d < merged.get(k, NEVER):
                        merged[k] = d
            self._merged = merged
            return merged

    def _read_live(self, name: str) -> tuple[tuple[int, int], dict[str, int]] | None:
        path = os.path.join(self.dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # its writer holds it: alive
            else:
                # nobody holds it: its process is gone; the file is ours to delete (a
                # publisher's own file is always locked while it may still use it)
                try:
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(path)
                except OSError:
                    pass
                return None
            st = os.fstat(fd)
            sig = (st.st_mtime_ns, st.st_size)
            cached = self._files.get(name)
            if cached is not None and cached[0] == sig:
                return cached
            if st.st_size > _MAX_FILE_BYTES:
                return None
            doc = json.loads(os.pread(fd, _MAX_FILE_BYTES, 0))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("keys"), list):
            return None
        keys: dict[str, int] = {}
        for i, k in enumerate(doc["keys"][: self.limit]):
            if isinstance(k, str) and k not in keys:
                keys[k] = i
        return sig, keys

    @property
    def publishers(self) -> int:
        """Other live processes whose futures the last :meth:`others` merged."""
        return len(self._files)

    def close(self) -> None:
        self.withdraw()


class MergedFuture:
    """A schedule-like view for :func:`eviction.choose_victims`: the next use of a name
    (a URL of this process's schedule, or a warm key) is the sooner of this process's own
    next use and ``position + d`` for the soonest distance ``d`` another live process
    published (counted from this process's position whatever ``start`` a caller asks from,
    so a resident and the incoming object compare on one base)."""

    def __init__(self, own: Schedule[str], others: dict[str, int], key_of: Callable[[str], str]) -> None:
        self.own = own
        self.others = others
        self.key_of = key_of

    @property
    def position(self) -> int:
        return self.own.position

    def next_use(self, name: str, start: int) -> float:
        mine = self.own.next_use(name, start)
        d = self.others.get(self.key_of(name))
        return mine if d is None else min(mine, self.own.position + d)


def describe(root: str) -> dict[str, Any]:
    """Live publishers and how many distinct keys they name, for ``datapipe cache stats``."""
    board = FutureBoard(root, refresh_s=0)
    merged = board.others()
    return {"processes": board.publishers, "keys": len(merged)}
