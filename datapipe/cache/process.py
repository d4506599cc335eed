"""The per-process state of a TieredCache: tiers, thread pools, pins, counters. Created on
first use in each process (checked by pid) and never pickled, so a cache object crosses
fork and spawn as its configuration and schedule."""

from __future__ import annotations

import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import DatapipeError, StorageError
from ..storage import RetryPolicy, Store
from .cold import ColdReader
from .future import FutureBoard
from .hot import HotTier, Turns
from .node_stats import CounterFile, CounterFlusher
from .pacing import DEFAULT_CEILING, ColdPacer
from .shared import SharedTier
from .warm import BROKEN_DIR_ERRNOS, WarmDir

__all__ = ["ProcessState", "Stats"]


class Stats(Counter[str]):
    """Counters that several threads of one process bump at once (readers, prefetchers):
    ``stats[k] += 1`` is a read then a write and loses counts under threads, so every
    change goes through ``update``, under a lock, and readers take ``snapshot()``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # before Counter.__init__; Counter.update calls itself
        super().__init__()

    def update(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            super().update(*args, **kwargs)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self)


class ProcessState:
    """Everything a TieredCache holds in one process: the hot tier, the warm directory, the
    further node-local directories (``lower``) and the shared tier (None when there is none
    or it could not be opened), the cold reader, pins, pending
    prefetches and their pool, the schedule-prefetch thread and its wake-up, counters."""

    def __init__(self, *, hot_bytes: int, warm_dir: str | None, warm_bytes: int, storage_options: dict[str, Any],
                 retry: RetryPolicy, max_inflight_bytes: int, prefetch_threads: int,
                 cold_wrapper: Callable[[Store], Store] | None, stats_interval_s: float,
                 shared_dir: str | None = None, shared_bytes: int = 0,
                 lease_timeout_s: float = 30.0, shared_wait_s: float = 300.0,
                 cold_concurrency: int = DEFAULT_CEILING,
                 local_tiers: tuple[tuple[str, int], ...] = ()) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.stats = Stats()
        self.warned: set[str] = set()
        self.hot = HotTier(hot_bytes)
        self.cold = ColdReader(storage_options=storage_options, retry=retry, max_inflight_bytes=max_inflight_bytes,
                               cold_wrapper=cold_wrapper, count=self.stats.update)
        self.pins: dict[str, list[int]] = {}
        self.pending: dict[str, Future[None]] = {}
        self.pool = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="datapipe-prefetch")
        self.refused: dict[str, int] = {}
        self.turns = Turns()
        self.last_prefetch_error: str | None = None
        self.prefetcher: threading.Thread | None = None
        # The schedule-prefetch thread sleeps on `wake` until `woken` is set: by a new
        # schedule, a moved position, a finished prefetch, or close.
        self.wake = threading.Condition()
        self.woken = False
        # Pin waits sleep on `room`: this process's releases, fills and discards notify it.
        self.room = threading.Condition()
        self.closed = False
        self.warm: WarmDir | None = None
        self.counters: CounterFlusher | None = None
        if warm_dir is not None:
            try:
                self.warm = WarmDir(warm_dir, warm_bytes)
                self.stats.update(warm_tmp_cleaned=self.warm.cleaned)
            except OSError as e:
                self.warn("warm-init", f"warm cache {warm_dir} unusable ({e}); reading through to the cold tier")
        try:  # node-wide when there is a warm directory to keep its state in
            self.cold.pacer = ColdPacer(self.warm.root if self.warm is not None else None,
                                        ceiling=cold_concurrency, count=self.stats.update)
        except OSError as e:
            self.warn("pacing-init", f"cold pacing cannot be kept in {warm_dir} ({e}); pacing per process")
            self.cold.pacer = ColdPacer(None, ceiling=cold_concurrency, count=self.stats.update)
        self.lower: list[WarmDir] = []  # further node-local directories, in order
        for path, budget in local_tiers:
            try:
                self.lower.append(WarmDir(path, budget))
            except OSError as e:
                self.warn(f"local-init-{path}", f"node-local cache {path} unusable ({e}); skipped")
        self.future: FutureBoard | None = None
        if self.warm is not None:
            try:  # this process's schedule, published for its siblings on the node
                self.future = FutureBoard(self.warm.root)
            except OSError as e:
                self.warn("future-init", f"schedules cannot be shared in {warm_dir} ({e}); eviction "
                          "there uses this process's schedule alone")
        self.shared: SharedTier | None = None
        if shared_dir is not None:
            try:
                self.shared = SharedTier(shared_dir, shared_bytes, lease_timeout_s=lease_timeout_s,
                                         wait_s=shared_wait_s)
                self.stats.update(shared_tmp_cleaned=self.shared.cleaned)
            except OSError as e:
                self.warn("shared-init", f"shared cache {shared_dir} unusable ({e}); reading through to the cold tier")
        if self.warm is not None:
            try:  # node-wide counters: this process's share, written to the warm dir
                self.counters = CounterFlusher(self, CounterFile(self.warm.root), self.stats, stats_interval_s)
            except OSError as e:
                self.warn("stats-init", f"cache counters cannot be kept in {warm_dir} ({e}); node-wide "
                          "stats will miss this process")

    def warn(self, kind: str, msg: str) -> None:
        """Count a warning of ``kind``; warn the first time this process sees it."""
        self.stats.update({f"warnings_{kind}": 1})
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def warm_broken(self, e: OSError) -> bool:
        """True when ``e`` says the warm directory itself is gone or unwritable (deleted,
        remounted read-only): it is re-created if it can be, a warning is given once,
        and the caller reads through."""
        return self._dir_broken(e, self.warm, "warm")

    def shared_broken(self, e: OSError) -> bool:
        """The same for the shared directory (unmounted, read-only, stale handle)."""
        return self._dir_broken(e, None if self.shared is None else self.shared.dir, "shared")

    def _dir_broken(self, e: OSError, d: Any, tier: str) -> bool:
        if isinstance(e, DatapipeError) or e.errno not in BROKEN_DIR_ERRNOS or d is None:
            return False
        self.stats.update({f"{tier}_errors": 1})
        try:
            d.repair()
            repaired = ""
        except OSError as e2:
            repaired = f"; it cannot be re-created ({e2})"
        except StorageError as e2:  # the path is someone else's folder now: never touched again
            self._give_up(tier)
            self.warn(f"{tier}-init", f"{tier} cache {d.root} unusable ({e2}); reading through to the cold tier")
            return True
        self.warn(f"{tier}_broken", f"{tier} cache {d.root} failed ({e}){repaired}; "
                  "reading through to the cold tier")
        return True

    def _give_up(self, tier: str) -> None:
        """Stop using a directory tier whose path now holds someone else's folder: reads
        go through, and nothing of this process writes or deletes in it again."""
        if tier == "shared":
            self.shared = None
            return
        self.warm, future = None, self.future
        self.future = None
        if future is not None:
            future.close()
        if self.counters is not None:
            self.counters.file.abandon()

    def notify_prefetcher(self) -> None:
        with self.wake:
            self.woken = True
            self.wake.notify_all()

    def wait_for_work(self) -> None:
        """The schedule-prefetch thread: sleep until :meth:`notify_prefetcher`."""
        with self.wake:
            while not self.woken and not self.closed:
                self.wake.wait()
            self.woken = False

    def notify_room(self) -> None:
        with self.room:
            self.room.notify_all()

    def wait_for_room(self, timeout: float) -> None:
        """Sleep until this process releases a pin or lands a fill, or ``timeout`` passes
        (pins of other processes are released without a signal that crosses processes)."""
        with self.room:
            self.room.wait(timeout)

    def pin_count(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.pins.values())

    def close(self) -> None:
        """Stop background work, close pins, drop the hot tier, write the counters."""
        self.closed = True
        self.turns.close()
        self.notify_prefetcher()
        self.notify_room()
        if self.prefetcher is not None:
            self.prefetcher.join(timeout=5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.cold.close()
        if self.counters is not None:
            self.counters.close()
        if self.future is not None:
            self.future.close()
        with self.lock:
            for fds in self.pins.values():
                for fd in fds:
                    os.close(fd)
            self.pins.clear()
        self.hot.clear()
