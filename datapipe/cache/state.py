"""The per-process state of a TieredCache: its tiers, thread pools, pins, counters. Created
on first use in each process (checked by pid) and never pickled, so a cache object crosses
fork and spawn as its configuration and schedule."""

from __future__ import annotations

import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from ..errors import DatapipeError, StorageError
from ..telemetry import Telemetry
from .cold import ColdReader
from .deadline import Deadline
from .folder_check import START_CHECK_DEADLINE_S, check_folder_within
from .future import FutureBoard
from .hot import HotTier, Room, Turns
from .node_stats import CounterFile, CounterFlusher
from .nodelocal import LocalTier
from .pacing import ColdPacer
from .settings import Settings
from .shared import SharedTier
from .tier import DirTier
from .walk import WARM_RANK, Tiers
from .warm import BROKEN_DIR_ERRNOS, WarmDir

__all__ = ["ProcessState", "Stats"]

#: the shared tier's rank: below every node-local one
_SHARED_RANK = 1 << 20


class Stats(Counter[str]):
    """Counters that several threads of one process bump at once (readers, prefetchers):
    ``stats[k] += 1`` is a read then a write and loses counts under threads, so every
    change goes through ``update``, under a lock, and readers take ``snapshot()``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # before Counter.__init__; Counter.update calls itself
        #: a :class:`datapipe.telemetry.Telemetry` that also gets the cold store's retries and
        #: throttled answers (counted here, wherever they happen)
        self.telemetry: Telemetry | None = None
        super().__init__()

    def update(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            super().update(*args, **kwargs)
        tel = self.telemetry
        if tel is not None and kwargs:
            if "cold_retries" in kwargs:
                tel.cold_retry(int(kwargs["cold_retries"]))
            if "cold_throttled" in kwargs:
                tel.throttled(int(kwargs["cold_throttled"]))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self)


class ProcessState:
    """Everything a TieredCache holds in one process: the hot tier, the directory tiers
    (``tiers``: the warm directory, the further node-local ones and the shared one, each
    None or left out when there is none or it could not be opened) above the cold reader,
    pins, pending prefetches and their pool, the schedule-prefetch thread and its wake-up,
    counters."""

    def __init__(self, settings: Settings) -> None:
        s = settings
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.stats = Stats()
        self.warned: set[str] = set()
        self.hot = HotTier(s.hot_bytes)
        self.cold = ColdReader(storage_options=s.storage_options, retry=s.retry,
                               max_inflight_bytes=s.max_inflight_bytes, cold_wrapper=s.cold_wrapper,
                               count=self.stats.update)
        self.pins: dict[str, list[int]] = {}
        self.pending: dict[str, Future[None]] = {}
        self.pool = ThreadPoolExecutor(s.prefetch_threads, thread_name_prefix="datapipe-prefetch")
        self.refused: dict[str, int] = {}
        self.turns = Turns()
        self.last_prefetch_error: str | None = None
        self.prefetcher: threading.Thread | None = None
        # The schedule-prefetch thread sleeps on `wake` until `woken` is set: by a new
        # schedule, a moved position, a finished prefetch, or close.
        self.wake = threading.Condition()
        self.woken = False
        # Pin waits sleep on `room`: this process's releases, fills and discards notify it.
        self.room = Room()
        self.closed = False
        self.deadline = Deadline(s.tier_deadline_s)
        self.tiers = Tiers(self.cold, self.stats.update, warn=self.warn, retry_s=s.tier_retry_s, give_up=self._give_up,
                           deadline=self.deadline, min_mb_s=s.tier_min_mb_s, window_bytes=s.tier_window_bytes,
                           rearm=self.rearm)
        self.counters: CounterFlusher | None = None
        if s.warm_dir is not None:
            try:
                self.tiers.warm = self._local("warm", WARM_RANK, WarmDir(s.warm_dir, s.warm_bytes), s,
                                              budget_arg="warm_bytes", repair=self.warm_broken)
                self.tiers.warm.recreates = True
                self.stats.update(warm_tmp_cleaned=self.tiers.warm.dir.cleaned)
            except OSError as e:
                self.warn("warm-init", f"warm cache {s.warm_dir} unusable ({e}); reading through to the cold tier")
        warm = self.warm
        try:  # node-wide when there is a warm directory to keep its state in
            self.cold.pacer = ColdPacer(warm.root if warm is not None else None,
                                        ceiling=s.cold_concurrency, count=self.stats.update)
        except OSError as e:
            self.warn("pacing-init", f"cold pacing cannot be kept in {s.warm_dir} ({e}); pacing per process")
            self.cold.pacer = ColdPacer(None, ceiling=s.cold_concurrency, count=self.stats.update)
        for t in s.local_tiers:  # further node-local directories, in order, named by their place
            path = os.fspath(t.path)
            level = len(self.tiers.lower) + 1
            try:
                tier = self._local(f"local{level + 1}", WARM_RANK + level, WarmDir(path, t.bytes), s)
                tier.repair = partial(self._dir_broken, tier=tier, recreate=False)
                self.tiers.lower.append(tier)
            except OSError as e:
                self.warn(f"local-init-{path}", f"node-local cache {path} unusable ({e}); skipped")
        self.future: FutureBoard | None = None
        if warm is not None:
            try:  # this process's schedule, published for its siblings on the node
                self.future = FutureBoard(warm.root)
            except OSError as e:
                self.warn("future-init", f"schedules cannot be shared in {s.warm_dir} ({e}); eviction "
                          "there uses this process's schedule alone")
        if s.shared_dir is not None:
            try:
                self.tiers.shared = SharedTier(s.shared_dir, s.shared_bytes, rank=_SHARED_RANK, cold=self.cold,
                                               count=self.stats.update, warn=self.warn,
                                               lease_timeout_s=s.lease_timeout_s, wait_s=s.shared_wait_s,
                                               repair=self.shared_broken)
                self.tiers.shared.recreates = True
                self.stats.update(shared_tmp_cleaned=self.tiers.shared.cleaned)
            except OSError as e:
                self.warn("shared-init", f"shared cache {s.shared_dir} unusable ({e}); reading through to the "
                          "cold tier")
        #: the folders this process checked at open and found sound (handed to the processes
        #: it starts with the cache: ``Settings.checked_roots``)
        self.passed: set[str] = set()
        for dir_tier in self._dir_tiers():
            dir_tier.io, dir_tier.hung = self.deadline, self.tiers.hung
            if dir_tier.dir.root not in s.checked_roots:  # once per process tree, not per worker
                self._check_at_open(dir_tier)
        if warm is not None:
            try:  # node-wide counters: this process's share, written to the warm dir
                counter_file = CounterFile(warm.root)
                warm_tier = self.tiers.warm
                counter_file.paused = lambda: warm_tier is not None and warm_tier.retry_at is not None
                # a broken folder is the tier's failure, said by the tier when a read meets it;
                # the counters are written again once the folder takes writes
                counter_file.tier_failed = lambda e: e.errno in BROKEN_DIR_ERRNOS
                self.counters = CounterFlusher(self, counter_file, self.stats, s.stats_interval_s)
            except OSError as e:
                self.warn("stats-init", f"cache counters cannot be kept in {s.warm_dir} ({e}); node-wide "
                          "stats will miss this process")

    def _dir_tiers(self) -> list[DirTier]:
        tiers: list[DirTier] = [] if self.tiers.warm is None else [self.tiers.warm]
        tiers.extend(self.tiers.lower)
        if self.tiers.shared is not None:
            tiers.append(self.tiers.shared)
        return tiers

    def _check_at_open(self, tier: DirTier) -> None:
        """The doctor's check of a folder (``folder_check.check_folder``), cheap: a probe of
        ``START_PROBE_BYTES`` written, fsync'd, read back and removed, free space against the
        budget, under the deadline. A tier that fails it is out of the path from the start
        (one warning naming it and the fix; probed back as any tier out), never an error:
        the tiers below serve. A budget the disk cannot hold is a warning."""
        what = "node-local" if tier in self.tiers.lower else tier.name
        seconds = self.deadline.seconds if self.deadline.seconds is not None else START_CHECK_DEADLINE_S
        check = check_folder_within(tier.dir.root, seconds, budget_bytes=tier.dir.budget, used=tier.dir.usage)
        problem, failed = check.problem, check.failed
        tier.count_event("checks")
        if not failed:
            self.passed.add(tier.dir.root)
        if failed:
            self.tiers.take_out(tier, OSError(problem))
            self.warn(f"{tier.name}_broken", f"{what} cache {tier.dir.root} fails the check at open ({problem}): "
                      "taken out of the path, reads go through to the tiers below it; probed again every "
                      f"{self.tiers.retry_s:g} s and taken back when it answers. Fix the folder, or point "
                      "the tier elsewhere (`datapipe doctor` checks it)")
        elif problem:
            self.warn(f"{tier.name}_budget", f"{what} cache {tier.dir.root}: {problem}")

    def set_telemetry(self, telemetry: Telemetry | None) -> None:
        """Record this process's reads, hits, misses, broken tiers, retries and throttled
        answers into ``telemetry`` too (None: no longer)."""
        self.stats.telemetry = telemetry
        self.tiers.telemetry = telemetry
        self.cold.telemetry = telemetry

    def _local(self, name: str, rank: int, d: WarmDir, s: Settings, *, budget_arg: str | None = None,
               repair: Callable[[OSError], bool] | None = None) -> LocalTier:
        return LocalTier(name, rank, d, cold=self.cold, count=self.stats.update, warn=self.warn, room=self.room,
                         pins_held=self.pin_count, pin_wait_s=s.pin_wait_s, budget_arg=budget_arg, repair=repair)

    @property
    def warm(self) -> WarmDir | None:
        """The warm directory (None: none, or it could not be used)."""
        return None if self.tiers.warm is None else self.tiers.warm.dir

    def warn(self, kind: str, msg: str) -> None:
        """Count a warning of ``kind``; warn the first time this process sees it."""
        self.stats.update({f"warnings_{kind}": 1})
        with self.lock:  # threads that meet one failure together: the first says it
            first = kind not in self.warned
            self.warned.add(kind)
        if first:
            warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def rearm(self, *kinds: str) -> None:
        """Warnings of ``kinds`` are said again the next time they are met (a tier's outage
        is over: its next one is news)."""
        with self.lock:
            self.warned.difference_update(kinds)

    def warm_broken(self, e: OSError) -> bool:
        """True when ``e`` says the warm directory itself is gone or unwritable (deleted,
        remounted read-only): it is re-created if it can be, a warning is given once,
        and the caller reads through; one that still fails its probe is out of the path
        until a later probe passes (walk.py)."""
        return self._dir_broken(e, tier=self.tiers.warm)

    def shared_broken(self, e: OSError) -> bool:
        """The same for the shared directory (unmounted, read-only, stale handle)."""
        return self._dir_broken(e, tier=self.tiers.shared)

    def _dir_broken(self, e: OSError, *, tier: DirTier | None, recreate: bool = True) -> bool:
        """``recreate``: re-create a deleted folder (``warm_dir``, ``shared_dir``), else
        probe it as it is (``local_tiers``). One warning per tier and process, whatever
        happens after: the tier goes out and comes back (one message) as its probes say."""
        if isinstance(e, DatapipeError) or e.errno not in BROKEN_DIR_ERRNOS or tier is None:
            return False
        tier.count_event("errors")
        if self.stats.telemetry is not None:
            self.stats.telemetry.error(tier.telemetry_name)
        repaired = ""
        if recreate:
            try:
                tier.dir.repair()
            except OSError as e2:
                repaired = f"; it cannot be re-created ({e2})"
            except StorageError as e2:  # the path is someone else's folder now: never touched again
                self._give_up(tier)
                self.warn(f"{tier.name}-init", f"{tier.name} cache {tier.dir.root} unusable ({e2}); reading "
                          "through to the cold tier")
                return True
        what = "node-local" if tier in self.tiers.lower else tier.name
        try:
            if not repaired:
                tier.dir.probe()
        except OSError:
            repaired = "; it fails a probe too"
        if repaired:
            self.tiers.take_out(tier, e)
            self.warn(f"{tier.name}_broken", f"{what} cache {tier.dir.root} failed ({e}){repaired}: taken out "
                      f"of the path, reads go through to the tiers below it; probed again every "
                      f"{self.tiers.retry_s:g} s and taken back when it answers")
        else:
            self.warn(f"{tier.name}_broken", f"{what} cache {tier.dir.root} failed ({e}); reading through "
                      "to the tiers below it")
        return True

    def _give_up(self, tier: DirTier) -> None:
        """Stop using a directory tier whose path now holds someone else's folder: reads
        go through, and nothing of this process writes or deletes in it again."""
        if tier is self.tiers.shared:
            self.tiers.shared = None
            return
        if tier in self.tiers.lower:
            self.tiers.lower.remove(tier)
            return
        self.tiers.warm, future = None, self.future
        self.future = None
        if future is not None:
            future.close()
        if self.counters is not None:
            self.counters.file.abandon()

    def warm_usage(self) -> int:
        """Bytes in the warm tier; 0 (with the one warning) when it is gone or unreadable:
        stats must not fail because the directory did."""
        warm = self.warm
        if warm is None or self.tiers.warm_in_path() is None:
            return 0  # out of the path: its one warning said why
        try:
            return warm.usage()
        except OSError as e:
            if not self.warm_broken(e):
                raise
            if self.warm is not warm:
                return 0  # given up (someone else's folder at its path now)
            try:
                return warm.usage()
            except OSError:
                return 0

    def shared_usage(self) -> int:
        shared = self.tiers.shared
        if shared is None or not self.tiers.in_path(shared):
            return 0
        try:
            return shared.dir.usage()
        except OSError as e:
            self.shared_broken(e)
            return 0

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

    def pin_count(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.pins.values())

    def close(self) -> None:
        """Stop background work, close pins, drop the hot tier, write the counters."""
        self.closed = True
        self.turns.close()
        self.notify_prefetcher()
        self.room.notify()
        if self.prefetcher is not None:
            self.prefetcher.join(timeout=5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.deadline.close()
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
