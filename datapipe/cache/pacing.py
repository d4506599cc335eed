"""Cold-tier pacing: how many requests a node sends to one prefix of the cold store at once,
adapted to the store's answers (AIMD, as TCP does with its window).

S3 answers 503 SlowDown once a prefix (bucket + leading path) gets more requests per
second than it is partitioned for (about 5,500 GET/s per prefix). Retrying at the same
rate keeps it saturated; every process backing off on its own still leaves the node as a
whole too fast. So:

* per prefix: ``bucket`` plus the first path segment (``s3://b/ds/x.tar`` -> ``s3://b/ds``);
* node-wide: the state lives in the warm directory (``pacing/<hash>.json``, updated under a
  ``flock`` of ``pacing/<hash>.lock``) and a request holds one of ``limit`` slot files
  (``pacing/<hash>.slot-<i>``, an exclusive ``flock``, dropped by the kernel if its holder
  dies) while it runs, so the limit holds across every rank and worker of the node.
  Without a warm directory the same state is kept per process;
* additive increase: each successful request adds ``1 / limit`` (one more slot per round
  of requests), up to ``ceiling``; multiplicative decrease: a throttled answer halves the
  limit (at most once per ``cooldown_s``: a burst of 503s is one signal) and pauses the
  prefix for a jittered backoff that doubles while throttling continues;
* one retry layer: the throttled request itself is retried by storage/retry.py (which
  classifies it, :func:`storage.retry.is_throttle`); pacing only gates and reacts.

Waiting for a slot (and a pause after throttling) happens inside the request's attempt,
marked :func:`storage.retry.queued`: being paced is not a failed attempt, so it does not
count against the attempt's timeout (``RetryPolicy.attempt_timeout_s``), only against the
request's total deadline (``RetryPolicy.deadline_s``), which bounds the wait for a slot too.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import xxhash

from ..errors import OptionError
from ..storage import DelegatingStore, Store, is_throttle, queued
from .lockfds import close_lock, open_lock

__all__ = ["ColdPacer", "PacedStore", "pacing_prefix", "pacing_state", "PACING_DIR", "DEFAULT_CEILING"]

PACING_DIR = "pacing"
DEFAULT_CEILING = 64
_COOLDOWN_S = 0.2
_BACKOFF_BASE_S = 0.05
_BACKOFF_MAX_S = 5.0
_SLOT_POLL_S = 0.002
_SLOT_POLL_MAX_S = 0.05
_FOLD_S = 0.05  # successes are folded into the node's state at most this often


def pacing_prefix(url: str) -> str:
    """``s3://bucket/first/...`` -> ``s3://bucket/first``; the unit S3 partitions by."""
    scheme, sep, rest = url.partition("://")
    parts = rest.split("/")
    return f"{scheme}{sep}{'/'.join(parts[:2] if len(parts) > 2 else parts[:1])}"


class _PrefixState:
    """The AIMD state of one prefix: in memory, mirrored to a file when node-wide."""

    def __init__(self, prefix: str, ceiling: int) -> None:
        self.prefix = prefix
        self.ceiling = float(ceiling)
        self.limit = float(ceiling)
        self.not_before = 0.0  # wall clock (time.time): shared by the node's processes
        self.streak = 0  # throttled answers since the last success
        self.last_decrease = 0.0
        self.throttled = 0
        self.backoffs = 0
        self.min_limit = float(ceiling)

    def doc(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "limit": self.limit, "not_before": self.not_before,
                "streak": self.streak, "last_decrease": self.last_decrease, "throttled": self.throttled,
                "backoffs": self.backoffs, "min_limit": self.min_limit}

    def load(self, doc: dict[str, Any]) -> None:
        """Take the fields of ``doc`` that are sane (a file anyone could have written):
        limits within [1, ceiling], a pause no longer than the longest backoff."""
        for k in ("limit", "not_before", "last_decrease", "min_limit"):
            v = doc.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                setattr(self, k, float(v))
        self.limit = min(max(self.limit, 1.0), self.ceiling)
        self.min_limit = min(max(self.min_limit, 1.0), self.ceiling)
        self.not_before = min(self.not_before, time.time() + _BACKOFF_MAX_S)
        for k in ("streak", "throttled", "backoffs"):
            v = doc.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                setattr(self, k, v)


class ColdPacer:
    """Node-wide (``root``: the warm directory) or per-process (``root=None``) AIMD limits
    on requests in flight to each prefix of the cold store. ``count(**counters)`` receives
    ``cold_throttled``, ``cold_backoffs``, ``cold_limit_decreases`` and
    ``pacing_wait_seconds``. Built per process (it holds file descriptors)."""

    def __init__(self, root: str | None, *, ceiling: int = DEFAULT_CEILING,
                 count: Callable[..., None] = lambda **_: None) -> None:
        if ceiling < 1:
            raise OptionError(f"cold_concurrency must be >= 1, got {ceiling}")
        self.ceiling = ceiling
        self.count = count
        self.dir = None if root is None else os.path.join(root, PACING_DIR)
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self._lock = threading.Lock()
        self._states: dict[str, _PrefixState] = {}
        self._seen: dict[str, int] = {}  # prefix -> mtime_ns of the state file last read
        self._slot_fds: dict[str, list[int]] = {}
        self._slot_locks: dict[str, list[threading.Lock]] = {}
        self._in_use: dict[str, int] = {}
        self._successes: dict[str, int] = {}
        self._folded_at: dict[str, float] = {}

    def _name(self, prefix: str) -> str:
        return xxhash.xxh3_64_hexdigest(prefix.encode())

    # -- the state of a prefix ------------------------------------------------------------
    def _state(self, prefix: str) -> _PrefixState:
        st = self._states.get(prefix)
        if st is None:
            st = self._states[prefix] = _PrefixState(prefix, self.ceiling)
        if self.dir is not None:
            path = os.path.join(self.dir, self._name(prefix) + ".json")
            try:
                mtime = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                return st
            if self._seen.get(prefix) != mtime:
                try:
                    with open(path) as f:
                        doc = json.load(f)
                    if isinstance(doc, dict):
                        st.load(doc)
                    self._seen[prefix] = mtime
                except (OSError, ValueError):
                    pass  # a state file of someone else's making: our own state stands
        return st

    @contextmanager
    def _update(self, prefix: str) -> Iterator[_PrefixState]:
        """Read-modify-write of a prefix's state, under the node's lock when node-wide."""
        with self._lock:
            if self.dir is None:
                yield self._state(prefix)
                return
            name = self._name(prefix)
            fd = open_lock(os.path.join(self.dir, name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._seen.pop(prefix, None)  # read it afresh under the lock
                st = self._state(prefix)
                yield st
                tmp = os.path.join(self.dir, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
                with open(tmp, "w") as f:
                    json.dump(st.doc(), f)
                os.replace(tmp, os.path.join(self.dir, name + ".json"))
            finally:
                close_lock(fd)

    def limit(self, prefix: str) -> float:
        with self._lock:
            return self._state(prefix).limit

    def limits(self) -> dict[str, dict[str, Any]]:
        """Each prefix this process has paced: its current limit and the node's counts."""
        out: dict[str, dict[str, Any]] = {}
        for prefix in [p for p, n in self._successes.items() if n]:
            self._fold(prefix)
        with self._lock:
            for prefix in list(self._states):
                st = self._state(prefix)
                out[prefix] = {"limit": round(st.limit, 2), "min_limit": round(st.min_limit, 2),
                               "throttled": st.throttled, "backoffs": st.backoffs}
        return out

    # -- reacting to answers -------------------------------------------------------------
    def throttled(self, prefix: str) -> None:
        """A throttled answer: halve the limit (once per cooldown) and pause the prefix."""
        now = time.time()
        decreased = False
        with self._update(prefix) as st:
            st.throttled += 1
            st.streak += 1
            if now - st.last_decrease >= _COOLDOWN_S:
                st.limit = max(1.0, st.limit / 2)
                st.min_limit = min(st.min_limit, st.limit)
                st.last_decrease = now
                decreased = True
            pause = min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** min(st.streak - 1, 16)) * random.uniform(0.5, 1.0)
            if now + pause > st.not_before:
                st.not_before = now + pause
                st.backoffs += 1
        self.count(cold_throttled=1, cold_backoffs=1, cold_limit_decreases=int(decreased))

    def succeeded(self, prefix: str) -> None:
        """A request answered: grow the limit by 1/limit (folded into the node's state at
        most every few tens of milliseconds, so success costs no lock per request)."""
        now = time.monotonic()
        with self._lock:
            self._successes[prefix] = self._successes.get(prefix, 0) + 1
            st = self._states.get(prefix)
            if st is not None and st.limit >= self.ceiling and st.streak == 0:
                self._successes[prefix] = 0
                return  # nothing to grow: no write
            if now - self._folded_at.get(prefix, 0.0) < _FOLD_S:
                return
            self._folded_at[prefix] = now
        self._fold(prefix)

    def _fold(self, prefix: str) -> None:
        """Apply the successes counted since the last fold to the node's limit."""
        with self._update(prefix) as st:
            n = self._successes.pop(prefix, 0)
            if not n:
                return
            for _ in range(n):
                st.limit = min(float(self.ceiling), st.limit + 1.0 / max(1.0, st.limit))
            st.streak = 0

    # -- slots ------------------------------------------------------------------------------
    def _slots(self, prefix: str) -> tuple[list[int], list[threading.Lock]]:
        fds = self._slot_fds.get(prefix)
        if fds is None:
            fds, locks = [], []
            if self.dir is not None:
                base = os.path.join(self.dir, self._name(prefix))
                for i in range(self.ceiling):
                    fds.append(open_lock(f"{base}.slot-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
            locks = [threading.Lock() for _ in range(self.ceiling)]
            self._slot_fds[prefix], self._slot_locks[prefix] = fds, locks
        return fds, self._slot_locks[prefix]

    @contextmanager
    def slot(self, prefix: str, max_wait_s: float | None = None) -> Iterator[None]:
        """Hold one of the prefix's ``limit`` slots (node-wide) for one request. Waiting
        longer than ``max_wait_s`` (the request's deadline) raises TimeoutError without
        taking one: by then the retry layer has given up on this attempt, and a slot it
        took later would send a request whose answer nobody reads. The wait is
        :func:`~datapipe.storage.retry.queued`: the attempt's timeout does not run meanwhile."""
        with queued():
            held = self._take_slot(prefix, max_wait_s)
        try:
            yield
        finally:
            fds, locks = self._slot_fds[prefix], self._slot_locks[prefix]
            if fds:
                fcntl.flock(fds[held], fcntl.LOCK_UN)
            locks[held].release()

    def _take_slot(self, prefix: str, max_wait_s: float | None) -> int:
        """Wait out the prefix's pause, then take a free slot: its number."""
        t0 = time.monotonic()
        pause = _SLOT_POLL_S
        held = -1
        paused = False
        while held < 0:
            if max_wait_s is not None and time.monotonic() - t0 > max_wait_s:
                self.count(pacing_wait_seconds=time.monotonic() - t0)
                raise TimeoutError(f"no request slot for {prefix} within {max_wait_s:g} s "
                                   "(requests to it are paced after throttling)")
            with self._lock:
                st = self._state(prefix)
                fds, locks = self._slots(prefix)
                wait = min(st.not_before - time.time(), _BACKOFF_MAX_S)
                n = max(1, min(self.ceiling, int(st.limit)))
            if wait > 0 and not paused:
                paused = True  # the prefix's pause, once per request; then slots decide
                time.sleep(wait)
                continue
            for i in range(n):
                if not locks[i].acquire(blocking=False):
                    continue
                if not fds:
                    held = i
                    break
                try:
                    fcntl.flock(fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = i
                    break
                except BlockingIOError:
                    locks[i].release()
            if held < 0:
                time.sleep(pause * random.uniform(0.5, 1.0))
                pause = min(_SLOT_POLL_MAX_S, pause * 2)
        waited = time.monotonic() - t0
        if waited > 0.001:
            self.count(pacing_wait_seconds=waited)
        return held

    def call(self, prefix: str, fn: Callable[[], Any], max_wait_s: float | None = None) -> Any:
        """``fn()`` holding a slot (waiting at most ``max_wait_s`` for one); its answer
        feeds the limit. Errors propagate unchanged (the retry layer decides what to retry)."""
        with self.slot(prefix, max_wait_s):
            try:
                out = fn()
            except BaseException as e:
                if is_throttle(e):
                    self.throttled(prefix)
                raise
        self.succeeded(prefix)
        return out

    def close(self) -> None:
        with self._lock:
            for fds in self._slot_fds.values():
                for fd in fds:
                    close_lock(fd)
            self._slot_fds.clear()
            self._slot_locks.clear()


class PacedStore(DelegatingStore):
    """A cold store whose reads go through a :class:`ColdPacer` (writes are not the cold
    tier's business and pass through)."""

    def __init__(self, inner: Store, pacer: ColdPacer, max_wait_s: float | None = None) -> None:
        super().__init__(inner)
        self.pacer = pacer
        self.prefix = pacing_prefix(inner.root + "/x")
        #: how long a request waits for a slot: the retry policy's total deadline
        self.max_wait_s = max_wait_s

    def get(self, key: str) -> bytes:
        out: bytes = self.pacer.call(self.prefix, lambda: self.inner.get(key), self.max_wait_s)
        return out

    def get_range(self, key: str, start: int, end: int) -> bytes:
        out: bytes = self.pacer.call(self.prefix, lambda: self.inner.get_range(key, start, end), self.max_wait_s)
        return out

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        out: bytes = self.pacer.call(self.prefix, lambda: self.inner.get_range_at(key, start, end, version),
                                     self.max_wait_s)
        return out

    def stat(self, key: str) -> tuple[int, str | None]:
        out: tuple[int, str | None] = self.pacer.call(self.prefix, lambda: self.inner.stat(key), self.max_wait_s)
        return out

    def size(self, key: str) -> int:
        out: int = self.pacer.call(self.prefix, lambda: self.inner.size(key), self.max_wait_s)
        return out


def pacing_state(root: str) -> dict[str, dict[str, Any]]:
    """The node's pacing state in a warm directory, by prefix (read only)."""
    folder = os.path.join(root, PACING_DIR)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("prefix"), str):
            st = _PrefixState(doc["prefix"], 1)
            st.load(doc)
            out[st.prefix] = {"limit": round(st.limit, 2), "min_limit": round(st.min_limit, 2),
                              "throttled": st.throttled, "backoffs": st.backoffs}
    return out
