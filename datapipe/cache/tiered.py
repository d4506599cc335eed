"""TieredCache: read-through hot (memory) -> warm (a node-local directory) -> shared (a
directory every node mounts) -> cold (any URL).

    cache = TieredCache(hot_bytes=2 << 30, warm_dir="/local/cache", warm_bytes=500 << 30,
                        shared_dir="/lustre/cache", shared_bytes=50 << 40)   # shared: optional
    data = cache.read("s3://bucket/ds/shard-00007.tar", checksum=index_checksum)
    with cache.pinned(url) as path: ...        # a local file, never evicted while pinned
    got = cache.pin_or_read(url, checksum=c)   # a pinned path if admitted, else the bytes
    cache.set_schedule(epoch_order)            # clairvoyant eviction + prefetch in that order

The object holds configuration and the schedule; threads, stores, file descriptors and
counters live in a ProcessState created in each process on first use (checked by pid), so
a cache is picklable and safe in forked or spawned DataLoader workers. Budgets: the warm
directory never holds more than ``warm_bytes`` (downloads reserve their size first); this
process's memory holds at most ``hot_bytes`` in the hot tier plus ``max_inflight_bytes``
being downloaded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from typing import Any

from ..checksum import verify
from ..errors import CacheBudgetError, CacheOptionError, DatapipeError, OptionError, StorageError
from ..options import (
    MAX_COUNT,
    check_bytes,
    check_callable,
    check_float,
    check_int,
    check_mapping,
    check_path,
    show,
)
from ..storage import RetryPolicy, Store
from ..telemetry import Telemetry
from .cold import CHANGE_RESTARTS, checksum_ok
from .deadline import DEFAULT_TIER_DEADLINE_S
from .eviction import NextUses, Schedule, VictimChooser, choose_victims
from .future import MergedFuture, future_key
from .node_stats import COUNTER_KEYS, FLUSH_INTERVAL_S, sum_counter_files
from .nodelocal import LocalTier
from .pacing import DEFAULT_CEILING
from .rates import DEFAULT_TIER_MIN_MB_S, DEFAULT_TIER_WINDOW_BYTES
from .settings import CacheTier, check_local_tiers, refuse_shared_folders
from .shared import DEFAULT_LEASE_TIMEOUT_S, DEFAULT_SHARED_WAIT_S
from .state import ProcessState
from .walk import DEFAULT_TIER_RETRY_S, WARM_RANK
from .warm import BROKEN_DIR_ERRNOS, url_key

__all__ = ["TieredCache", "CHANGE_RESTARTS"]

#: the most threads ``prefetch_threads`` may start
MAX_PREFETCH_THREADS = 256


class TieredCache:
    """Read-through cache of whole objects by URL, in three tiers (see the module docstring).

    Schedules: ``set_schedule(urls)`` hands over this process's future reads in order
    (repeats allowed). Eviction then keeps what is needed soonest (Belady) and does not
    admit an object that would be evicted before its next use (``read`` and
    ``pin_or_read`` read it through; ``local_path``, which must return a file, admits
    it anyway); a background thread
    prefetches the next ``lookahead`` scheduled objects, within ``max_inflight_bytes``.
    The reader's position moves by itself: a ``read(url)`` whose URL occurs at most
    ``window`` places ahead moves the position past that occurrence (``read_range`` only
    when the URL is exactly the next one, so many ranges of one shard count once); a read
    that arrives late (reads run in parallel) takes its own earlier occurrence, at most
    ``window`` places behind, and until it is served eviction keeps its object. Call
    ``advance(n)`` to skip ``n`` scheduled reads yourself; ``schedule_position`` tells
    where the cache believes the reader is.

    Arguments: ``hot_bytes`` (0: no memory tier), ``warm_dir``/``warm_bytes`` (None/0:
    no disk tier), ``storage_options`` for the cold fsspec filesystems,
    ``max_inflight_bytes`` (bytes downloading at once in this process), ``retry`` (a
    :class:`RetryPolicy`: attempts, backoff, per-attempt timeout, range-request size),
    ``prefetch_threads``, ``pin_wait_s`` (how long ``local_path`` waits for room when the
    warm tier is all pinned before raising CacheBudgetError), ``cold_wrapper`` (a
    picklable callable wrapping each cold Store, e.g. for fault injection),
    ``stats_interval_s`` (how often, at most, this process writes its counters to the
    warm directory for ``stats(node=True)``; also written at close and at exit).
    ``shared_dir``/``shared_bytes`` (None/0: no shared tier): a directory every node
    mounts, below the warm tier; a miss there is downloaded from cold by one node while
    the others wait (see shared.py). ``lease_timeout_s``: how long a download's holder
    may stay silent before another node takes its lease over; ``shared_wait_s``: how
    long a node waits for another's download before reading cold itself.
    ``local_tiers``: further node-local directories below ``warm_dir`` (a larger, slower
    disk), each a :class:`CacheTier` (path, bytes), in order; a miss in one fills from the next
    (counters ``local2_*``, ``local3_*``, ...). Pins (:meth:`local_path`) are in
    ``warm_dir``. ``cold_concurrency``: the most requests in flight to one prefix of a remote cold store
    (bucket + first path segment) from the whole node (from this process without a warm
    directory); the limit in force adapts below it to throttling (pacing.py).
    ``telemetry``: a :class:`datapipe.telemetry.Telemetry` to record each tier's reads
    (bytes, seconds), hits, misses and failures, and the cold store's retries and
    throttled answers into (a loader given ``telemetry=`` hands its own over).
    ``tier_retry_s``: a directory tier that fails and fails a probe too (read-only, deleted
    and not re-creatable, full) is out of the path, warned about once: reads go through
    to the tiers below it, writes skip it; every ``tier_retry_s`` seconds a read probes it
    (an unnamed file written, fsync'd and read back) and the first probe that passes takes
    it back, with one message (counters ``<tier>_outs``, ``<tier>_backs``).
    ``tier_deadline_s`` (None: no deadline): a read or write of a directory tier that
    does not answer in that time (a hung mount, a lock never released) is abandoned, the
    read served from the tiers below, and the tier taken out the same way (``<tier>_hung``).
    ``tier_min_mb_s`` (None: off): a directory tier whose reads, over a window of
    ``tier_window_bytes`` in at least four reads of 64 KiB or more, run below that many MB/s
    (10^6 bytes; 50 by default: a healthy disk reads hundreds, an NVMe thousands) is
    taken out the same way, with one warning naming it, its rate and the floor, unless the
    tier that would serve in its place measured slower still (``<tier>_slow_kept``); when
    its probe passes it is on trial, back in the path for good (one message) once a window
    of its reads runs at the floor again. Each process checks each directory tier once as
    it opens them (the doctor's check, ``datapipe.cache.check_folder``: 16 KiB written,
    fsync'd, read back and removed, free space against the budget, a few ms per tier): one
    that fails is out of the path from the start, with a warning naming it and the fix.

    Errors: ObjectNotFoundError (no object at the URL), RemoteError (retries exhausted),
    ChecksumError (a fill failed its checksum twice), CacheBudgetError (an object larger
    than a tier's budget, checked before it is downloaded, or no unpinned room for a pin),
    ObjectChangedError (the object kept changing while it was downloaded: every part of
    one download reads one version, and a change starts the download over, at most
    ``CHANGE_RESTARTS`` times). A warm tier that cannot be written (full disk, read-only,
    deleted) warns once and reads through; a deleted one is re-created."""

    def __init__(
        self,
        hot_bytes: int = 0,
        warm_dir: str | os.PathLike[str] | None = None,
        warm_bytes: int = 0,
        *,
        storage_options: dict[str, Any] | None = None,
        max_inflight_bytes: int = 1 << 30,
        retry: RetryPolicy | None = None,
        prefetch_threads: int = 4,
        pin_wait_s: float = 60.0,
        cold_wrapper: Callable[[Store], Store] | None = None,
        stats_interval_s: float = FLUSH_INTERVAL_S,
        shared_dir: str | os.PathLike[str] | None = None,
        shared_bytes: int = 0,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        shared_wait_s: float = DEFAULT_SHARED_WAIT_S,
        cold_concurrency: int = DEFAULT_CEILING,
        local_tiers: Sequence[CacheTier] = (),
        telemetry: Telemetry | None = None,
        tier_retry_s: float = DEFAULT_TIER_RETRY_S,
        tier_deadline_s: float | None = DEFAULT_TIER_DEADLINE_S,
        tier_min_mb_s: float | None = DEFAULT_TIER_MIN_MB_S,
        tier_window_bytes: int = DEFAULT_TIER_WINDOW_BYTES,
    ) -> None:
        B = CacheOptionError  # a budget's error is a CacheBudgetError too
        hot_bytes, warm_bytes = check_bytes("hot_bytes", hot_bytes, error=B), check_bytes("warm_bytes", warm_bytes,
                                                                                          error=B)
        shared_bytes = check_bytes("shared_bytes", shared_bytes, error=B)
        max_inflight_bytes = check_bytes("max_inflight_bytes", max_inflight_bytes, min=1, error=B,
                                         hint="the bytes downloading at once in this process")
        warm_dir = None if warm_dir is None else check_path("warm_dir", warm_dir)
        shared_dir = None if shared_dir is None else check_path("shared_dir", shared_dir)
        if warm_dir is not None and warm_bytes <= 0:
            raise B(f"warm_dir={warm_dir!s} needs warm_bytes > 0")
        if warm_dir is None and warm_bytes:
            raise B("warm_bytes given without warm_dir")
        if shared_dir is not None and shared_bytes <= 0:
            raise B(f"shared_dir={shared_dir!s} needs shared_bytes > 0")
        if shared_dir is None and shared_bytes:
            raise B("shared_bytes given without shared_dir")
        lease_timeout_s = check_float("lease_timeout_s", lease_timeout_s, min=0, min_open=True,
                                      hint="a number of seconds > 0")
        shared_wait_s = check_float("shared_wait_s", shared_wait_s, min=0, min_open=True,
                                    hint="a number of seconds > 0")
        pin_wait_s = check_float("pin_wait_s", pin_wait_s, min=0, hint="a number of seconds >= 0")
        stats_interval_s = check_float("stats_interval_s", stats_interval_s, min=0, min_open=True,
                                       hint="a number of seconds > 0")
        tier_retry_s = check_float("tier_retry_s", tier_retry_s, min=0, max=1e9,
                                   hint="seconds between probes of a tier out of the path, >= 0")
        if tier_deadline_s is not None:
            tier_deadline_s = check_float("tier_deadline_s", tier_deadline_s, min=0, min_open=True, max=1e6,
                                          hint="seconds a read or write of a directory tier may take, > 0, or None")
        if tier_min_mb_s is not None:
            tier_min_mb_s = check_float("tier_min_mb_s", tier_min_mb_s, min=0, max=1e9,
                                        hint="the MB/s below which a directory tier is slow, >= 0, or None")
        tier_window_bytes = check_bytes("tier_window_bytes", tier_window_bytes, min=1, error=CacheOptionError,
                                        hint="the bytes of reads a tier's rate is judged over")
        cold_concurrency = check_int("cold_concurrency", cold_concurrency, min=1, max=MAX_COUNT,
                                     hint="requests in flight to one prefix of a remote cold store")
        prefetch_threads = check_int("prefetch_threads", prefetch_threads, min=1, max=MAX_PREFETCH_THREADS)
        storage_options = {} if storage_options is None else check_mapping("storage_options", storage_options)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise OptionError(f"retry={show(retry)}: expected a datapipe.storage.RetryPolicy or None")
        if cold_wrapper is not None:
            check_callable("cold_wrapper", cold_wrapper, hint="a picklable function Store -> Store, or None")
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise OptionError(f"telemetry={show(telemetry)}: expected a datapipe.telemetry.Telemetry or None")
        tiers = check_local_tiers(local_tiers, warm_dir)
        refuse_shared_folders([("warm_dir", warm_dir), *((f"local_tiers[{i}]", t.path) for i, t in enumerate(tiers)),
                               ("shared_dir", shared_dir)])
        self.hot_bytes = hot_bytes
        self.warm_dir = os.fspath(warm_dir) if warm_dir is not None else None
        self.warm_bytes = warm_bytes
        self.storage_options = storage_options
        self.max_inflight_bytes = max_inflight_bytes
        self.retry = retry or RetryPolicy()
        self.prefetch_threads = prefetch_threads
        self.pin_wait_s = pin_wait_s
        self.cold_wrapper = cold_wrapper
        self.stats_interval_s = float(stats_interval_s)
        self.shared_dir = os.fspath(shared_dir) if shared_dir is not None else None
        self.shared_bytes = shared_bytes
        self.lease_timeout_s = float(lease_timeout_s)
        self.shared_wait_s = float(shared_wait_s)
        self.cold_concurrency = cold_concurrency
        self.local_tiers = tiers
        self.tier_retry_s = float(tier_retry_s)
        self.tier_deadline_s = None if tier_deadline_s is None else float(tier_deadline_s)
        self.tier_min_mb_s = None if tier_min_mb_s is None else float(tier_min_mb_s)
        self.tier_window_bytes = tier_window_bytes
        #: folders checked at open by the process this cache came from (see Settings)
        self.checked_roots: frozenset[str] = frozenset()
        self._telemetry = telemetry
        self.schedule: Schedule[str] | None = None
        self._warm_urls: tuple[Schedule[str], dict[str, str]] | None = None  # warm file name -> URL
        self.schedule_checksums: dict[str, str] = {}
        self.lookahead = 0
        self._process: ProcessState | None = None
        self._process_lock = threading.Lock()

    # -- per-process state ---------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_process"], state["_process_lock"] = None, None
        state["checked_roots"] = self._checked_here()  # a worker does not check them again
        return state

    def _checked_here(self) -> frozenset[str]:
        """The folders this process, or the one it came from, checked at open and found sound."""
        process = self._process
        if process is None or process.closed:
            return self.checked_roots
        return self.checked_roots | frozenset(process.passed)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._process_lock = threading.Lock()

    def _state(self) -> ProcessState:
        """This process's state, created on first use (a forked child never uses its
        parent's: the pid differs) and afresh after :meth:`close`."""
        state = self._process
        if state is None or state.pid != os.getpid() or state.closed:
            with self._process_lock:
                state = self._process
                if state is None or state.pid != os.getpid() or state.closed:
                    if state is not None and state.pid != os.getpid():  # forked: the parent checked
                        self.checked_roots = self._checked_here()
                    state = self._process = ProcessState(self)
                    state.set_telemetry(self._telemetry)
        return state

    @property
    def telemetry(self) -> Telemetry | None:
        """The :class:`~datapipe.telemetry.Telemetry` this cache records into (bytes and
        seconds of each read per tier, hits, misses, broken tiers, cold retries and throttled
        answers), or None. A loader given a ``telemetry=`` hands it to its cache."""
        return self._telemetry

    @telemetry.setter
    def telemetry(self, telemetry: Telemetry | None) -> None:
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise OptionError(f"telemetry={show(telemetry)}: expected a datapipe.telemetry.Telemetry or None")
        self._telemetry = telemetry
        state = self._current_state()
        if state is not None:
            state.set_telemetry(telemetry)

    def _current_state(self) -> ProcessState | None:
        """This process's live state, without creating one."""
        state = self._process
        if state is None or state.pid != os.getpid() or state.closed:
            return None
        return state

    def _check_hot_fits(self, state: ProcessState, url: str) -> None:
        """Before a download for the hot tier: an object it can never hold is an error
        now, not after its bytes were fetched and kept in warm."""
        if self.hot_bytes > 0:
            self._refuse_over_hot(url, state.tiers.size(url))

    def _refuse_over_hot(self, url: str, size: int) -> None:
        if size > self.hot_bytes:
            raise CacheBudgetError(f"{url} is {size} bytes, more than hot_bytes={self.hot_bytes}; raise "
                                   f"hot_bytes to at least {size} or set it to 0")

    def has_shared_tier(self) -> bool:
        """True when the shared tier opened in this process (else reads go to cold)."""
        return self._state().tiers.shared is not None

    def has_warm_tier(self) -> bool:
        """True when the warm tier opened in this process. A ``warm_dir`` that cannot be
        used warns and reads through, and then :meth:`local_path` is unavailable."""
        return self._state().warm is not None

    # -- the read path -------------------------------------------------------------------
    def read(self, url: str, *, checksum: str | None = None) -> bytes:
        """The whole object at ``url``, from the first tier that has it; verified against
        ``checksum`` when given (a mismatch from cold is fetched once more, then raised)."""
        state = self._state()
        with self._scheduled_read(state, url) as index:
            data = self._from_hot(state, url, checksum)
            if data is not None:
                return data
            data = self._below_hot(state, url, checksum, index)
            self._admit_hot(state, url, data, checksum, index)
            return data

    def _from_hot(self, state: ProcessState, url: str, checksum: str | None) -> bytes | None:
        t0 = time.perf_counter()
        hit = state.hot.get(url)
        if hit is not None:
            data, known = hit
            if checksum is None or checksum == known or checksum_ok(data, checksum):
                state.stats.update(hot_hits=1, hot_bytes=len(data))
                self._record_hot(len(data), t0)
                return data
            state.hot.discard(url)
        state.stats.update(hot_misses=1)
        self._record_hot(None, t0)
        return None

    def _record_hot(self, nbytes: int | None, since: float) -> None:
        """A hit of ``nbytes`` in the memory tier (None: a miss), for the telemetry."""
        tel = self._telemetry
        if tel is None:
            return
        if nbytes is None:
            tel.miss("memory")
        else:
            tel.hit("memory")
            tel.read("memory", nbytes, time.perf_counter() - since)

    def _admit_hot(self, state: ProcessState, url: str, data: bytes, checksum: str | None, index: int | None) -> None:
        if self.hot_bytes <= 0:
            return
        self._refuse_over_hot(url, len(data))
        before = state.hot.evictions
        if not state.hot.admit(url, data, checksum, self._chooser(url, index)):
            state.stats.update(hot_not_admitted=1)
        state.stats.update(hot_evictions=state.hot.evictions - before)

    def _below_hot(self, state: ProcessState, url: str, checksum: str | None, index: int | None) -> bytes:
        chooser = self._dir_chooser(url, index)
        warm = state.tiers.warm_in_path()
        if warm is not None:
            for _attempt in (0, 1):  # once more after re-creating a deleted warm directory
                try:
                    data, _origin = state.tiers.step(warm, url, checksum, chooser,
                                                     before_fill=partial(self._check_hot_fits, state, url))
                    return data
                except OSError as e:
                    if not warm.broken(e):
                        raise
                    if state.tiers.warm is not warm or warm.retry_at is not None:
                        break  # given up (someone else's folder at its path now), or out of the path
        else:
            fut = state.pending.get(url)
            if fut is not None:  # a prefetch of this URL is under way: wait for it
                t0 = time.monotonic()
                fut.exception()
                state.stats.update(wait_seconds=time.monotonic() - t0)
                hit = state.hot.get(url)  # already counted as a hot miss; the wait shows
                if hit is not None and (checksum is None or checksum == hit[1] or checksum_ok(hit[0], checksum)):
                    return hit[0]
        self._check_hot_fits(state, url)
        return state.tiers.read(url, checksum, chooser, into="hot", below=WARM_RANK)

    # -- byte ranges -------------------------------------------------------------------
    def read_range(self, url: str, start: int, end: int, *, checksum: str | None = None) -> bytes:
        """Bytes ``[start, end)``; ``checksum`` is of those bytes. A miss fills the whole
        object into the cache when there is a cache to fill; otherwise one range request.
        A range that fails its checksum drops the cached copy and is read once more."""
        if start < 0 or end < start:
            raise StorageError(f"invalid byte range [{start}, {end}) for {url}")
        state = self._state()
        with self._scheduled_read(state, url, exact=True) as index:
            for attempt in (0, 1):
                # a warm copy whose range fails is dropped there (only that copy, and only
                # when nobody holds it pinned; else the range is read around it)
                part = self._range_once(state, url, start, end, index if attempt == 0 else None, checksum)
                if checksum_ok(part, checksum):
                    return part
                state.stats.update(range_refetches=1)
                state.hot.discard(url)
        verify(part, checksum, f"{url} [{start}, {end})")
        raise AssertionError("unreachable")  # pragma: no cover

    def _range_once(self, state: ProcessState, url: str, start: int, end: int, index: int | None,
                    checksum: str | None = None) -> bytes:
        t0 = time.perf_counter()
        hit = state.hot.get(url)
        if hit is not None:
            state.stats.update(hot_hits=1, hot_bytes=end - start)
            self._record_hot(end - start, t0)
            return _slice(hit[0], start, end, url)
        state.stats.update(hot_misses=1)
        self._record_hot(None, t0)
        warm = state.tiers.warm_in_path()
        if warm is not None:
            for _attempt in (0, 1):  # once more after re-creating a deleted warm directory
                try:
                    return self._range_from_warm(state, warm, url, start, end, index, checksum)
                except OSError as e:
                    if not warm.broken(e):
                        raise
                    if state.tiers.warm is not warm or warm.retry_at is not None:
                        break  # given up (someone else's folder at its path now), or out of the path
        return self._range_from_cold(state, url, start, end, index)

    def _range_from_warm(self, state: ProcessState, warm: LocalTier, url: str, start: int, end: int,
                         index: int | None, checksum: str | None = None) -> bytes:
        """The range from the warm copy; ``checksum`` (of the range): a copy whose range
        fails it is dropped and filled again, or, pinned by another process, read around.
        The copy is trusted as read() trusts it: verified whole (hashed once while its
        identity holds, so later ranges cost one pread), else refused and filled again."""
        found = state.tiers.lookup(warm, url, None, want_bytes=False, keep=True)
        kept = found.kept
        fd = found.fd
        if fd is not None:
            try:
                size = os.fstat(fd).st_size
                if end > size:  # the copy is the whole object: a bad range
                    _slice(b"", start, end, url, size)
                t0 = time.perf_counter()
                part = os.pread(fd, end - start, start)
                seconds = time.perf_counter() - t0
            except BaseException:
                os.close(fd)
                raise
            if len(part) == end - start and checksum_ok(part, checksum):
                os.close(fd)
                warm.count_hit(end - start)
                state.tiers.measured(warm, len(part), seconds)  # for the rule against slow tiers
                return part
            if len(part) != end - start:
                warm.count_corrupt()  # shrunk since it was verified
            kept = not warm.discard(url, fd)
        if kept:  # pinned elsewhere: it stays, so read around it
            warm.count_read_around()
            return self._range_from_cold(state, url, start, end, index)
        warm.count_miss()
        self._check_hot_fits(state, url)
        data, _origin = warm.fill(url, None, state.tiers.route(warm, self._dir_chooser(url, index)))
        self._admit_hot(state, url, data, None, index)
        return _slice(data, start, end, url)

    def _range_from_cold(self, state: ProcessState, url: str, start: int, end: int, index: int | None) -> bytes:
        if self.hot_bytes > 0 or state.tiers.shared is not None:
            self._check_hot_fits(state, url)
            data = state.tiers.read(url, None, self._dir_chooser(url, index), into="hot", below=WARM_RANK)
            self._admit_hot(state, url, data, None, index)
            return _slice(data, start, end, url)
        size = state.cold.size(url)
        if end > size:
            _slice(b"", start, end, url, size)
        return state.cold.fetch_range(url, start, end)

    # -- pinned local copies -------------------------------------------------------------
    def local_path(self, url: str, *, checksum: str | None = None) -> str:
        """The path of a warm copy of ``url``, pinned (never evicted, by any process)
        until :meth:`release`. Each call pins once; release once per call. A copy that is
        not in the tier is always admitted (evicting what is needed furthest in the
        future, or waiting up to ``pin_wait_s`` for unpinned room): the caller needs a
        file. A reader that only needs the bytes calls :meth:`pin_or_read`."""
        out = self._pin(url, checksum, "local_path", read_through=False)
        assert isinstance(out, str)  # without read_through, _pin returns a path or raises
        return out

    def pin_or_read(self, url: str, *, checksum: str | None = None) -> str | bytes:
        """A pinned warm copy of ``url`` when the warm tier has one or admits one, else its
        bytes: the clairvoyant rule's read for a reader that copies the object out anyway
        (the loader). Returns the path of the copy, pinned as by :meth:`local_path`
        (release it with :meth:`release`), or, when the policy does not admit the object
        (its next use comes after that of every resident that would have to go, or the
        room is held by pins and downloads), the whole object read through the tiers below
        (single flight and cold pacing as for :meth:`read`), verified against
        ``checksum``, with nothing pinned and the residents left in place; counted as a
        warm miss and ``warm_not_admitted``. The schedule position moves once per call.
        An object larger than ``warm_bytes`` raises CacheBudgetError, as for :meth:`read`."""
        return self._pin(url, checksum, "pin_or_read", read_through=True)

    def _pin(self, url: str, checksum: str | None, caller: str, *, read_through: bool) -> str | bytes:
        state = self._state()
        warm = state.tiers.warm
        if warm is None:
            raise StorageError(f"{caller}({url}) needs a usable warm_dir; this cache has none")
        with self._scheduled_read(state, url) as index:  # once per call: retries do not move the position again
            if not state.tiers.in_path(warm):
                return self._warm_out(state, warm, url, checksum, index, caller, read_through)
            return self._pin_at(state, warm, url, checksum, index, caller, read_through)

    def _warm_out(self, state: ProcessState, warm: LocalTier, url: str, checksum: str | None, index: int | None,
                  caller: str, read_through: bool) -> bytes:
        """The warm tier is out of the path: ``pin_or_read`` reads through the tiers below
        it; ``local_path``, which needs a file there, cannot have one."""
        if read_through:
            warm.count_miss()
            return state.tiers.read(url, checksum, self._dir_chooser(url, index), into="warm", below=WARM_RANK)
        raise StorageError(f"{caller}({url}): warm cache {warm.dir.root} is out of the path ({warm.out_error}); "
                           "a local copy needs a writable warm_dir (it is probed again every "
                           f"{self.tier_retry_s:g} s, or read with read()/pin_or_read(), which read through)")

    def _pin_at(self, state: ProcessState, warm: LocalTier, url: str, checksum: str | None, index: int | None,
                caller: str, read_through: bool) -> str | bytes:
        broken: OSError | None = None
        route = state.tiers.route(warm, self._dir_chooser(url, index, force=not read_through))
        for _attempt in (0, 1, 2):
            try:
                found = state.tiers.lookup(warm, url, checksum, want_bytes=False, keep=True)
                fd = found.fd
                if found.kept:  # a corrupt copy pinned elsewhere
                    return self._pinned_elsewhere(state, url, checksum, index, caller, read_through)
                tel = self._telemetry  # the pinned copy's bytes are timed by its reader (the loader)
                if fd is not None:
                    warm.count_hit()
                    if tel is not None:
                        tel.hit(warm.telemetry_name)
                else:
                    warm.count_miss()
                    if tel is not None:
                        tel.miss(warm.telemetry_name)
                    got = warm.pin(url, checksum, route, read_through=read_through)
                    if not isinstance(got, int):  # not an fd: not admitted, read through, verified below
                        return got
                    fd = got
                    if warm.verify(url, fd, checksum, want_bytes=False) is None:  # another's fill, found corrupt
                        if not warm.discard(url, fd):  # fill again, unless pinned elsewhere
                            return self._pinned_elsewhere(state, url, checksum, index, caller, read_through)
                        continue
                with state.lock:
                    state.pins.setdefault(url, []).append(fd)
                return warm.path(url)
            except OSError as e:
                if broken is None and warm.broken(e):
                    broken = e  # re-created (or not): one more try
                    if state.tiers.warm is warm and warm.retry_at is not None:
                        return self._warm_out(state, warm, url, checksum, index, caller, read_through)
                    if state.tiers.warm is warm:
                        continue
                    raise StorageError(f"{caller}({url}): warm cache {warm.dir.root} is unusable (its path "
                                       "holds someone else's folder now); a local copy needs a "
                                       "warm_dir of its own") from e
                if broken is not None and not isinstance(e, DatapipeError) and e.errno in BROKEN_DIR_ERRNOS:
                    if read_through:  # it answered the probe but not the fill: read around it
                        return self._warm_out(state, warm, url, checksum, index, caller, read_through)
                    raise StorageError(f"{caller}({url}): warm cache {warm.dir.root} is unusable "
                                       f"({e}); a local copy needs a writable warm_dir") from e
                raise
        raise StorageError(f"could not obtain a verified local copy of {url}")

    def _pinned_elsewhere(self, state: ProcessState, url: str, checksum: str | None, index: int | None,
                          caller: str, read_through: bool) -> bytes:
        """The warm copy fails verification but another process holds it pinned, so it
        stays as it is: ``pin_or_read`` reads the object around it; ``local_path``, which
        needs that very file, cannot have one."""
        warm = state.tiers.warm
        if warm is not None:
            warm.count_read_around()
        if read_through:
            return state.tiers.read(url, checksum, self._dir_chooser(url, index), into="warm", below=WARM_RANK)
        path = warm.path(url) if warm is not None else url
        raise StorageError(
            f"{caller}({url}): the warm copy {path} does not match "
            f"{'checksum ' + checksum if checksum else 'its fill record'} and another process holds it "
            "pinned, so it is neither removed nor replaced until that process releases it; pass the "
            "checksum of the object as it is now, or use read()/pin_or_read(), which read around it")

    def note_read(self, url: str, nbytes: int, seconds: float) -> None:
        """Report a read of the pinned warm copy of ``url`` that :meth:`pin_or_read` or
        :meth:`local_path` returned: ``nbytes`` read in ``seconds`` by the caller (the
        loader times its read of the file). The cache does not read a copy it hands out as
        a path, so this is how such reads reach the rule against slow tiers
        (``tier_min_mb_s``): they count in the warm tier's window as its own hits do."""
        nbytes = check_int("nbytes", nbytes, min=0, error=CacheOptionError)
        seconds = check_float("seconds", seconds, min=0, max=1e9, error=CacheOptionError)
        state = self._state()
        warm = state.tiers.warm
        if warm is not None and warm.retry_at is None:  # out of the path: its window waits for its probe
            state.tiers.measured(warm, nbytes, seconds)

    def release(self, url: str) -> None:
        """Drop one pin taken by :meth:`local_path` (or by :meth:`pin_or_read`, when it
        returned a path)."""
        state = self._state()
        with state.lock:
            fds = state.pins.get(url)
            if not fds:
                raise StorageError(f"release({url}): it is not pinned in this process")
            fd = fds.pop()
            if not fds:
                del state.pins[url]
        os.close(fd)
        state.room.notify()  # a pin waiting for room may fit now

    @contextmanager
    def pinned(self, url: str, *, checksum: str | None = None) -> Iterator[str]:
        """``with cache.pinned(url) as path:`` a local copy for the block's duration."""
        path = self.local_path(url, checksum=checksum)
        try:
            yield path
        finally:
            self.release(url)

    # -- prefetch ------------------------------------------------------------------------
    def prefetch(self, urls: Sequence[str], *,
                 checksums: Sequence[str | None] | dict[str, str | None] | None = None) -> list[Future[None]]:
        """Fetch ``urls`` into the cache in the background (warm tier, or hot without
        one), at most ``max_inflight_bytes`` downloading at a time. Returns the futures;
        a failed prefetch only counts in ``stats()['prefetch_errors']``: the later read
        retries and raises."""
        if isinstance(checksums, dict):
            cks = [checksums.get(u) for u in urls]
        else:
            cks = list(checksums) if checksums is not None else [None] * len(urls)
            if len(cks) != len(urls):
                raise OptionError(f"prefetch: {len(urls)} urls but {len(cks)} checksums")
        state = self._state()
        return [self._submit_prefetch(state, u, c, None) for u, c in zip(urls, cks)]

    def _submit_prefetch(self, state: ProcessState, url: str, checksum: str | None, at: int | None) -> Future[None]:
        with state.lock:
            fut = state.pending.get(url)
            if fut is None:
                ticket = state.turns.issue() if at is not None and state.tiers.warm is not None else None
                fut = state.pool.submit(self._prefetch_one, state, url, checksum, at, ticket)
                if ticket is not None:  # a cancelled task must not hold up the queue
                    fut.add_done_callback(partial(_release_turn, state, ticket))
                state.pending[url] = fut
                fut.add_done_callback(partial(_prefetch_done, state, url))
        return fut

    def _prefetch_one(self, state: ProcessState, url: str, checksum: str | None, at: int | None,
                      ticket: int | None = None) -> None:
        try:
            warm = state.tiers.warm_in_path()
            if warm is not None:
                self._prefetch_warm(state, warm, url, checksum, at, ticket)
            elif state.tiers.warm is not None and self.hot_bytes <= 0:
                return  # the warm tier is out and no memory tier holds a prefetch: nothing to fill
            elif url not in state.hot:
                self._check_hot_fits(state, url)
                data = state.tiers.read(url, checksum, self._dir_chooser(url, None, prefetch_at=at), into="hot",
                                        below=WARM_RANK, background=True)
                self._admit_hot(state, url, data, checksum, at)
            state.stats.update(prefetched=1)
        except Exception as e:
            state.stats.update(prefetch_errors=1)
            state.last_prefetch_error = f"{type(e).__name__}: {e}"
        if state.counters is not None and len(state.pending) <= 1:
            state.counters.file.flush(state.stats)  # the last of a pass (ours leaves pending after this)

    def _prefetch_warm(self, state: ProcessState, warm: LocalTier, url: str, checksum: str | None, at: int | None,
                       ticket: int | None) -> None:
        """Fill the warm tier in the background; downloads nothing when the policy would not
        admit the object (``at``: its index in the schedule; ``ticket``: its place in the
        order in which scheduled prefetches reserve space)."""
        route = state.tiers.route(warm, self._dir_chooser(url, None, prefetch_at=at), background=True)
        if ticket is None:
            warm.prefetch(url, checksum, route)
            return
        try:
            state.tiers.size(url)  # the HEAD request overlaps; only reservations go in turn
            if not state.turns.wait(ticket):
                return
            s = self.schedule
            if s is not None and at is not None and at < s.position:
                return  # the reader got there first
            warm.prefetch(url, checksum, route, room_decided=partial(state.turns.done, ticket))
        finally:
            state.turns.done(ticket)

    # -- the access schedule -------------------------------------------------------------
    def set_schedule(self, urls: Sequence[str], *, checksums: dict[str, str] | None = None,
                     position: int = 0, lookahead: int = 8, window: int = 64) -> None:
        """Hand over this process's future reads, in order (repeats allowed). Eviction in
        both tiers becomes clairvoyant, and a background thread prefetches the next
        ``lookahead`` scheduled objects that are not cached (0: no prefetch). Reads move
        the position (see the class docstring); so does :meth:`advance`. ``checksums``
        (url -> checksum) verify prefetched objects. ``set_schedule([])`` or
        :meth:`clear_schedule` returns to LRU."""
        lookahead = check_int("lookahead", lookahead, min=0, max=MAX_COUNT,
                              hint="how many scheduled objects to prefetch ahead (0: none)")
        state = self._state()
        with state.lock:
            self.schedule = Schedule(list(urls), position, window) if len(urls) else None
            self.schedule_checksums = dict(checksums or {})
            self.lookahead = lookahead
            state.refused = {}
        self._publish_future(state, force=True)
        if self.schedule is not None and lookahead and state.prefetcher is None:
            state.prefetcher = threading.Thread(target=self._prefetch_loop, args=(state,),
                                                name="datapipe-schedule-prefetch", daemon=True)
            state.prefetcher.start()
        self._wake()

    def clear_schedule(self) -> None:
        self.set_schedule([])

    def advance(self, n: int = 1) -> int:
        """Move the schedule position ``n`` reads forward (reads the caller skipped or
        served elsewhere); returns the new position."""
        if self.schedule is None:
            raise StorageError("advance(): no schedule set; call set_schedule(urls) first")
        state = self._state()
        with state.lock:
            pos = self.schedule.advance(n)
        self._publish_future(state)
        self._wake()
        return pos

    def _publish_future(self, state: ProcessState, *, force: bool = False) -> None:
        """Publish this process's next reads for the node's merged future (see future.py)
        when the position moved far enough since the last time, or ``force``."""
        board = state.future
        if board is None:
            return
        s = self.schedule
        if s is None:
            if force:
                board.withdraw()
            return
        pos = s.frontier  # reads still in flight (behind the position) need their objects too
        if force or board.due(pos):
            board.publish([url_key(u) for u in s.keys[pos:pos + board.limit]], pos)

    @property
    def schedule_position(self) -> int | None:
        return None if self.schedule is None else self.schedule.position

    def _wake(self) -> None:
        """The schedule or its position changed: the prefetch thread looks again."""
        state = self._current_state()
        if state is not None:
            state.notify_prefetcher()

    def _prefetch_loop(self, state: ProcessState) -> None:
        while not state.closed:
            s = self.schedule
            if s is not None and self.lookahead:
                with state.lock:
                    upcoming = s.upcoming(self.lookahead)
                    pos = s.position
                # Objects fetched ahead occupy the tier before they are used, shrinking it
                # for everything else; beyond the next object, look ahead only while that
                # stays within a quarter of the tier (sizes known from earlier HEADs).
                warm = state.tiers.warm_in_path()
                room = (self.warm_bytes if warm is not None else self.hot_bytes) // 4
                ahead = 0
                for n, (i, url) in enumerate(upcoming):
                    ahead += state.cold.sizes.get(url, 0)
                    if n and ahead > room:
                        break
                    if len(state.pending) >= self.prefetch_threads or state.closed:
                        break
                    if url in state.pending or url in state.hot or state.refused.get(url) == pos:
                        continue
                    if warm is not None and os.path.exists(warm.path(url)):
                        continue
                    state.refused[url] = pos  # tried at this position; retried once it moves
                    self._submit_prefetch(state, url, self.schedule_checksums.get(url), i)
            state.wait_for_work()

    # -- eviction choices against the schedule --------------------------------------
    @contextmanager
    def _scheduled_read(self, state: ProcessState, url: str, *, exact: bool = False) -> Iterator[int | None]:
        """The schedule index of a read (see :meth:`_locate`), marked served when the
        block ends: until then eviction keeps the object for it, even when reads of later
        indexes (other fetch threads) decide first."""
        s = self.schedule
        index = self._locate(state, s, url, exact=exact)
        try:
            yield index
        finally:
            if s is not None and index is not None:
                with state.lock:  # the read's own state: a close() since then must not start a new one
                    s.finish(index)

    def _locate(self, state: ProcessState, s: Schedule[str] | None, url: str, *, exact: bool = False) -> int | None:
        if s is None:
            return None
        with state.lock:
            if exact:
                i = s.position if s.position < len(s) and s.keys[s.position] == url else None
            else:
                i = s.locate(url)
            if i is not None:
                s.claim(i)
        if i is not None:
            current = self._current_state()
            if current is not None:
                self._publish_future(current)
            self._wake()
        return i

    def _chooser(self, url: str, index: int | None, *, prefetch_at: int | None = None,
                 to_url: Callable[[str], str] = lambda k: k, force: bool = False,
                 node: bool = False) -> VictimChooser:
        """choose(cands, need) for the tier: LRU, or Belady against the schedule (``force``:
        a pin that must have its copy, ``local_path``: always admitted); with
        ``node`` (the directories), against the futures of every live process of the
        node merged with this one's (future.py)."""
        s = self.schedule
        if s is None:
            def lru(cands: list[tuple[str, int, float]], need: int, *_: object) -> list[str] | None:
                return choose_victims(cands, need, url)

            return lru
        horizon: int  # where residents' next uses are counted from
        start: int  # where the incoming object's next use is counted from
        nxt: float
        if prefetch_at is not None:
            # the frontier: the reads still in flight (the one that moved the position
            # included) may not hold their objects yet; the background must not evict them
            horizon, nxt = s.frontier, prefetch_at
            start = horizon
        else:
            start = (index + 1) if index is not None else s.position
            nxt = s.next_use(url, start)
            # the frontier: reads of earlier indexes still in flight (fetch threads run out
            # of order) need their objects; reads already served are skipped by next_use
            horizon = min(start, s.frontier)

        future: NextUses[str] = s
        if node:
            state = self._current_state()
            others = state.future.others() if state is not None and state.future is not None else None
            if others:
                # every live process of the node: kept if any of them reads it soon
                future = MergedFuture(s, others, _future_key_of)
                nxt = min(nxt, future.next_use(url, start))

        def belady(cands: list[tuple[str, int, float]], need: int, *_: object) -> list[str] | None:
            named = [(to_url(k), size, rec) for k, size, rec in cands]
            back = {to_url(k): k for k, _s, _r in cands}
            # force (local_path: the reader needs a file): always admitted, and what goes
            # is still what is needed furthest in the future
            v = choose_victims(named, need, url, schedule=future, incoming_next=nxt, horizon=horizon, admit=force)
            return None if v is None else [back[u] for u in v]

        return belady

    def _dir_chooser(self, url: str, index: int | None, *, prefetch_at: int | None = None,
                     force: bool = False) -> Callable[[], VictimChooser]:
        """The victim chooser of the directory tiers for one read (asked afresh each round
        of a fill): against the node's merged future, by URL."""
        return lambda: self._chooser(url, index, prefetch_at=prefetch_at, force=force,
                                     to_url=self._warm_key_to_url(), node=True)

    def _warm_key_to_url(self) -> Callable[[str], str]:
        """Warm files are named by a hash of the URL; the schedule speaks URLs."""
        s = self.schedule
        if s is None:
            return lambda k: k
        if self._warm_urls is None or self._warm_urls[0] is not s:
            self._warm_urls = (s, {url_key(u): u for u in s.distinct_keys()})
        table = self._warm_urls[1]
        return lambda k: table.get(k, k)

    # -- metrics and shutdown ------------------------------------------------------------
    def stats(self, node: bool = False) -> dict[str, Any]:
        """This process's counters (hits, misses and bytes per tier, evictions, bytes
        from cold, retries, seconds waited, ...) and the tiers' current use.

        ``node=True``: the same counters summed over every process that has used this
        warm directory since it was last cleared (DataLoader workers, other ranks, exited
        processes; see ``node_stats``), with ``processes`` (how many) and the warm tier's
        use. This process's counters are written first, so they are current; another
        live process's are at most ``stats_interval_s`` old. Without a usable warm
        directory: this process's counters, with ``processes`` = 1."""
        state = self._state()
        if node:
            return self._node_stats(state)
        counts = state.stats.snapshot()
        out: dict[str, Any] = {k: counts.get(k, 0) for k in COUNTER_KEYS}
        out.update({k: v for k, v in counts.items() if k not in out})
        out["wait_seconds"] = float(out["wait_seconds"])
        out["hot_used_bytes"] = state.hot.used
        out["hot_budget_bytes"] = self.hot_bytes
        out["warm_budget_bytes"] = self.warm_bytes
        out["warm_used_bytes"] = state.warm_usage()
        for t in state.tiers.lower:
            out[f"{t.name}_budget_bytes"] = t.dir.budget
            try:
                out[f"{t.name}_used_bytes"] = t.dir.usage()
            except OSError:
                out[f"{t.name}_used_bytes"] = 0
        out["shared_budget_bytes"] = self.shared_bytes
        out["shared_used_bytes"] = state.shared_usage()
        out["inflight_peak_bytes"] = state.cold.inflight.peak
        out["cold_pacing"] = state.cold.pacer.limits() if state.cold.pacer is not None else {}
        out["pinned"] = state.pin_count()
        out["schedule_position"] = self.schedule_position
        if state.last_prefetch_error:
            out["last_prefetch_error"] = state.last_prefetch_error
        return out

    def _node_stats(self, state: ProcessState) -> dict[str, Any]:
        if state.counters is None or state.warm is None:
            out = self.stats()
            out["processes"] = 1
            return out
        state.counters.file.flush(state.stats, force=True)
        summed = sum_counter_files(state.warm.root)
        out = dict(summed["counters"])
        out["processes"] = summed["processes"]
        if summed["unreadable"]:
            out["unreadable_counter_files"] = summed["unreadable"]
        out["warm_budget_bytes"] = self.warm_bytes
        out["warm_used_bytes"] = state.warm_usage()
        return out

    def close(self) -> None:
        """Stop background work, drop pins and the hot tier, and write this process's
        counters for ``stats(node=True)``. A later call starts afresh."""
        state = self._current_state()
        if state is not None:
            state.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slice(data: bytes, start: int, end: int, url: str, size: int | None = None) -> bytes:
    size = len(data) if size is None else size
    if end > size:
        raise StorageError(f"range [{start}, {end}) runs past the end of {url} ({size} bytes)")
    return data[start:end]


def _future_key_of(name: str) -> str:
    """The published key of a name the warm chooser ranks: a URL (this process's schedule
    knows it) or a warm key (a copy no URL of ours names)."""
    return future_key(url_key(name) if "/" in name else name)


def _release_turn(state: ProcessState, ticket: int, _fut: Future[None]) -> None:
    state.turns.done(ticket)


def _prefetch_done(state: ProcessState, url: str, fut: Future[None]) -> None:
    with state.lock:
        if state.pending.get(url) is fut:
            del state.pending[url]
    state.notify_prefetcher()  # a prefetch slot is free
