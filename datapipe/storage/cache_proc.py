"""The per-process state of a TieredCache: created on first use in each process (checked
by pid), never pickled, so a cache object crosses fork and spawn as configuration only."""

from __future__ import annotations

import os
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .hot import HotTier, InflightBytes, Turns
from .node_stats import CounterFile, CounterFlusher
from .stores import Store
from .warm import WarmDir

if TYPE_CHECKING:
    from .cache import TieredCache

__all__ = ["CacheProc"]


class Stats(Counter):
    """Counters that several threads of one process bump at once (readers, prefetchers):
    ``stats[k] += 1`` is a read then a write and loses counts under threads, so every
    change goes through ``update``, under a lock, and readers take ``snapshot()``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # before Counter.__init__; Counter.update calls itself
        super().__init__()

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        with self._lock:
            super().update(*args, **kwargs)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self)


class CacheProc:
    """Everything a TieredCache creates per process."""

    def __init__(self, cache: "TieredCache") -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.stores: dict[str, Store] = {}
        self.sizes: dict[str, int] = {}
        self.versions: dict[str, str | None] = {}  # the version each size was probed at
        self.hot = HotTier(cache.hot_bytes)
        self.inflight = InflightBytes(cache.max_inflight_bytes)
        self.stats = Stats()
        self.pins: dict[str, list[int]] = {}
        self.pending: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(cache.prefetch_threads, thread_name_prefix="datapipe-prefetch")
        self.parts = ThreadPoolExecutor(cache.retry.max_parts + 1, thread_name_prefix="datapipe-cold")
        self.warm: WarmDir | None = None
        self.warned: set[str] = set()
        self.refused: dict[str, int] = {}
        self.turns = Turns()
        self.last_prefetch_error: str | None = None
        self.prefetcher: threading.Thread | None = None
        self.wake = threading.Condition()
        self.closed = False
        self.counters: CounterFlusher | None = None
        if cache.warm_dir is not None:
            try:
                self.warm = WarmDir(cache.warm_dir, cache.warm_bytes)
                self.stats.update(warm_tmp_cleaned=self.warm.cleaned)
            except OSError as e:
                cache._warn(self, "warm-init", f"warm cache {cache.warm_dir} unusable ({e}); "
                            "reading through to the cold tier")
        if self.warm is not None:
            try:  # node-wide counters: this process's share, written to the warm dir
                self.counters = CounterFlusher(self, CounterFile(self.warm.root), self.stats,
                                               cache.stats_interval_s)
            except OSError as e:
                cache._warn(self, "stats-init", f"cache counters cannot be kept in {cache.warm_dir} "
                            f"({e}); node-wide stats will miss this process")
