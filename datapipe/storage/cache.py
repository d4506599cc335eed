"""TieredCache: read-through hot (memory) -> warm (shared local directory) -> cold (any URL).

    cache = TieredCache(hot_bytes=2 << 30, warm_dir="/local/cache", warm_bytes=500 << 30)
    data = cache.read("s3://bucket/ds/shard-00007.tar", checksum=index_checksum)
    with cache.pinned(url) as path: ...        # a local file, never evicted while pinned
    cache.set_schedule(epoch_order)            # clairvoyant eviction + prefetch in that order

The object holds configuration only; threads, stores, file descriptors and counters are
created in each process on first use (checked by pid), so a cache is picklable and safe in
forked or spawned DataLoader workers. Budgets: the warm directory never holds more than
``warm_bytes`` (downloads reserve their size first); this process's memory holds at most
``hot_bytes`` in the hot tier plus ``max_inflight_bytes`` being downloaded.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Callable

from ..checksum import verify
from ..errors import CacheBudgetError, DatapipeError, StorageError
from .cache_ops import CacheOpsMixin, _ok
from .cache_proc import CacheProc
from .eviction import Schedule
from .node_stats import FLUSH_INTERVAL_S
from .retry import RetryPolicy, call_with_retry, fetch_object
from .stores import Store, open_store, split_url
from .warm import DISK_FULL_ERRNOS, url_key

__all__ = ["TieredCache"]


class TieredCache(CacheOpsMixin):
    """Read-through cache of whole objects by URL, in three tiers (see the module docstring).

    Schedules: ``set_schedule(urls)`` hands over this process's future reads in order
    (repeats allowed). Eviction then keeps what is needed soonest (Belady) and does not
    admit an object that would be evicted before its next use; a background thread
    prefetches the next ``lookahead`` scheduled objects, within ``max_inflight_bytes``.
    The reader's position moves by itself: a ``read(url)`` whose URL occurs at most
    ``window`` places ahead moves the position past that occurrence (``read_range`` only
    when the URL is exactly the next one, so many ranges of one shard count once). Call
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

    Errors: ObjectNotFoundError (no object at the URL), RemoteError (retries exhausted),
    ChecksumError (a fill failed its checksum twice), CacheBudgetError (an object larger
    than a tier's budget, or no unpinned room for a pin). A warm tier that cannot be
    written (full disk, read-only) warns once and reads through."""

    def __init__(
        self,
        hot_bytes: int = 0,
        warm_dir: str | os.PathLike | None = None,
        warm_bytes: int = 0,
        *,
        storage_options: dict[str, Any] | None = None,
        max_inflight_bytes: int = 1 << 30,
        retry: RetryPolicy | None = None,
        prefetch_threads: int = 4,
        pin_wait_s: float = 60.0,
        cold_wrapper: Callable[[Store], Store] | None = None,
        stats_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        for name, v in (("hot_bytes", hot_bytes), ("warm_bytes", warm_bytes),
                        ("max_inflight_bytes", max_inflight_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CacheBudgetError(f"{name} must be a non-negative int, got {v!r}")
        if warm_dir is not None and warm_bytes <= 0:
            raise CacheBudgetError(f"warm_dir={warm_dir!s} needs warm_bytes > 0")
        if warm_dir is None and warm_bytes:
            raise CacheBudgetError("warm_bytes given without warm_dir")
        if max_inflight_bytes <= 0:
            raise CacheBudgetError("max_inflight_bytes must be > 0")
        if prefetch_threads < 1:
            raise ValueError("prefetch_threads must be >= 1")
        if not isinstance(stats_interval_s, (int, float)) or not stats_interval_s > 0:
            raise ValueError(f"stats_interval_s must be a number > 0, got {stats_interval_s!r}")
        self.hot_bytes = hot_bytes
        self.warm_dir = os.fspath(warm_dir) if warm_dir is not None else None
        self.warm_bytes = warm_bytes
        self.storage_options = dict(storage_options or {})
        self.max_inflight_bytes = max_inflight_bytes
        self.retry = retry or RetryPolicy()
        self.prefetch_threads = prefetch_threads
        self.pin_wait_s = pin_wait_s
        self.cold_wrapper = cold_wrapper
        self.stats_interval_s = float(stats_interval_s)
        self.schedule: Schedule | None = None
        self.schedule_checksums: dict[str, str] = {}
        self.lookahead = 0
        self._p: CacheProc | None = None
        self._plock = threading.Lock()

    # -- per-process state ---------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_p"], state["_plock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plock = threading.Lock()

    def _proc(self) -> CacheProc:
        p = self._p
        if p is None or p.pid != os.getpid() or p.closed:
            with self._plock:
                p = self._p
                if p is None or p.pid != os.getpid() or p.closed:
                    p = self._p = CacheProc(self)  # a forked child never touches its parent's
        return p

    def _warn(self, p: CacheProc, kind: str, msg: str) -> None:
        p.stats.update({f"warnings_{kind}": 1})
        if kind not in p.warned:
            p.warned.add(kind)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _cold(self, p: CacheProc, url: str) -> tuple[Store, str]:
        root, name = split_url(url)
        store = p.stores.get(root)
        if store is None:
            store = open_store(root, self.storage_options)
            if self.cold_wrapper is not None:
                store = self.cold_wrapper(store)
            p.stores[root] = store
        return store, name

    def _size(self, p: CacheProc, url: str) -> int:
        size = p.sizes.get(url)
        if size is None:
            store, key = self._cold(p, url)
            size = call_with_retry(lambda: store.size(key), url, self.retry,
                                   on_retry=lambda e: p.stats.update(cold_retries=1))
            p.sizes[url] = size
        return size

    def has_warm_tier(self) -> bool:
        """True when the warm tier opened in this process. A ``warm_dir`` that cannot be
        used warns and reads through, and then :meth:`local_path` is unavailable."""
        return self._proc().warm is not None

    # -- the read path -------------------------------------------------------------------
    def read(self, url: str, *, checksum: str | None = None) -> bytes:
        """The whole object at ``url``, from the first tier that has it; verified against
        ``checksum`` when given (a mismatch from cold is fetched once more, then raised)."""
        p = self._proc()
        index = self._locate(url)
        data = self._from_hot(p, url, checksum)
        if data is not None:
            return data
        data = self._below_hot(p, url, checksum, index)
        self._admit_hot(p, url, data, checksum, index)
        return data

    def _from_hot(self, p: CacheProc, url: str, checksum: str | None) -> bytes | None:
        hit = p.hot.get(url)
        if hit is not None:
            data, known = hit
            if checksum is None or checksum == known or _ok(data, checksum):
                p.stats.update(hot_hits=1, hot_bytes=len(data))
                return data
            p.hot.discard(url)
        p.stats.update(hot_misses=1)
        return None

    def _admit_hot(self, p: CacheProc, url: str, data: bytes, checksum: str | None, index: int | None) -> None:
        if self.hot_bytes <= 0:
            return
        if len(data) > self.hot_bytes:
            raise CacheBudgetError(
                f"{url} is {len(data)} bytes, more than hot_bytes={self.hot_bytes}; raise "
                f"hot_bytes to at least {len(data)} or set it to 0")
        before = p.hot.evictions
        if not p.hot.admit(url, data, checksum, self._chooser(url, index)):
            p.stats.update(hot_not_admitted=1)
        p.stats.update(hot_evictions=p.hot.evictions - before)

    def _read_pinned(self, p: CacheProc, url: str, fd: int, checksum: str | None, *,
                     want_bytes: bool = True) -> bytes | None:
        """The whole pinned copy (b"" when not ``want_bytes``), or None if it fails
        verification. A copy this process already verified (same inode, size and
        checksum; copies are never rewritten in place, only replaced) is not hashed again,
        so pinning a verified shard costs no read."""
        st = os.fstat(fd)
        expected = p.sizes.get(url)
        if expected is not None and expected != st.st_size:
            p.stats.update(warm_corrupt=1)
            return None
        memo = (st.st_dev, st.st_ino, st.st_size, checksum)
        known = checksum is None or memo in p.verified
        if known and not want_bytes:
            return b""
        data = os.pread(fd, st.st_size, 0)
        if len(data) == st.st_size and (known or _ok(data, checksum)):
            if not known:
                p.verified.add(memo)
            return data
        p.stats.update(warm_corrupt=1)
        return None

    def _below_hot(self, p: CacheProc, url: str, checksum: str | None, index: int | None) -> bytes:
        if p.warm is None:
            fut = p.pending.get(url)
            if fut is not None:  # a prefetch of this URL is under way: wait for it
                t0 = time.monotonic()
                fut.exception()
                p.stats.update(wait_seconds=time.monotonic() - t0)
                hit = p.hot.get(url)  # already counted as a hot miss; the wait shows
                if hit is not None and (checksum is None or checksum == hit[1] or _ok(hit[0], checksum)):
                    return hit[0]
            return self._fetch_cold(p, url, checksum)
        key = url_key(url)
        fd = p.warm.open_pinned(key)
        if fd is not None:
            try:
                data = self._read_pinned(p, url, fd, checksum)
            except BaseException:
                os.close(fd)
                raise
            if data is None:
                p.warm.discard(key, fd)
            else:
                os.close(fd)
                p.stats.update(warm_hits=1, warm_bytes=len(data))
                return data
        p.stats.update(warm_misses=1)
        return self._fill(p, url, checksum, index)

    def _fetch_cold(self, p: CacheProc, url: str, checksum: str | None) -> bytes:
        size = self._size(p, url)
        store, key = self._cold(p, url)
        waited = p.inflight.acquire(size, url)
        if not threading.current_thread().name.startswith("datapipe-prefetch"):
            p.stats.update(wait_seconds=waited)  # the reader's waits, not the background's
        try:
            for attempt in (0, 1):
                data = fetch_object(store, key, size, self.retry, pool=p.parts,
                                    on_retry=lambda e: p.stats.update(cold_retries=1))
                p.stats.update(cold_reads=1, cold_bytes=len(data))
                if _ok(data, checksum):
                    return data
                if attempt:
                    verify(data, checksum, url)  # raises ChecksumError naming the URL
                p.stats.update(cold_refetches=1)
        finally:
            p.inflight.release(size)
        raise AssertionError("unreachable")  # pragma: no cover

    def _fill(self, p: CacheProc, url: str, checksum: str | None, index: int | None, *,
              pin: bool = False, prefetch: bool = False, prefetch_at: int | None = None,
              ticket: int | None = None) -> Any:
        """Fetch ``url`` into the warm tier under the node-wide single-flight lock. Returns
        the bytes, or with ``pin`` an fd pinning the published copy. A prefetch returns
        None, and downloads nothing when the policy would not admit the object
        (``prefetch_at``: its index in the schedule; ``ticket``: its place in the order in
        which scheduled prefetches reserve space)."""
        if ticket is None:
            return self._fill_once(p, url, checksum, index, pin=pin, prefetch=prefetch,
                                   prefetch_at=prefetch_at)
        try:
            self._size(p, url)  # the HEAD request overlaps; only reservations go in turn
            if not p.turns.wait(ticket):
                return None
            s = self.schedule
            if s is not None and prefetch_at is not None and prefetch_at < s.position:
                return None  # the reader got there first
            return self._fill_once(p, url, checksum, index, prefetch=True,
                                   prefetch_at=prefetch_at, ticket=ticket)
        finally:
            p.turns.done(ticket)

    def _fill_once(self, p: CacheProc, url: str, checksum: str | None, index: int | None, *,
                   pin: bool = False, prefetch: bool = False, prefetch_at: int | None = None,
                   ticket: int | None = None) -> Any:
        warm = p.warm
        key = url_key(url)
        deadline = time.monotonic() + self.pin_wait_s
        while True:
            with warm.fill_lock(key) as waited:
                if not prefetch:  # the reader's waits, not the background's
                    p.stats.update(wait_seconds=waited)
                fd = warm.open_pinned(key)
                if fd is not None:  # filled by another thread or process while we waited
                    if pin:
                        return fd
                    if prefetch:
                        os.close(fd)
                        return None
                    data = self._read_pinned(p, url, fd, checksum)
                    if data is not None:
                        os.close(fd)
                        p.stats.update(warm_hits=1, warm_bytes=len(data))
                        return data
                    warm.discard(key, fd)
                size = self._size(p, url)
                if size > warm.budget:
                    raise CacheBudgetError(
                        f"{url} is {size} bytes, more than warm_bytes={warm.budget}; raise "
                        f"warm_bytes to at least {size}")
                choose = self._chooser(url, index, prefetch_at=prefetch_at, force=pin,
                                       to_url=self._warm_key_to_url())
                before = warm.evictions
                try:
                    res = warm.reserve(key, size, choose)
                except OSError as e:
                    if e.errno not in DISK_FULL_ERRNOS:
                        raise
                    self._warn(p, "warm_full", f"warm cache {warm.root} cannot take {url} ({e}); reading through")
                    res = None
                p.stats.update(warm_evictions=warm.evictions - before)
                if ticket is not None:
                    p.turns.done(ticket)  # space decided: the next prefetch may reserve
                if res is None and prefetch:
                    p.stats.update(prefetch_not_admitted=1)
                    return None
                if res is None and pin:
                    if time.monotonic() > deadline:
                        raise CacheBudgetError(
                            f"no room in warm cache {warm.root} ({warm.budget} bytes) for {url} "
                            f"({size} bytes): the rest is pinned or downloading; release pins "
                            f"or raise warm_bytes")
                    time.sleep(0.05)  # until a pin is released or a download lands
                    continue
                if res is None:
                    p.stats.update(warm_not_admitted=1)
                    return self._fetch_cold(p, url, checksum)
                try:
                    data = self._fetch_cold(p, url, checksum)
                    res.write_and_publish(data)
                except OSError as e:
                    res.abort()
                    if isinstance(e, DatapipeError):
                        raise
                    if e.errno not in DISK_FULL_ERRNOS:
                        raise StorageError(f"warm cache {warm.root}: could not keep the copy of "
                                           f"{url} ({e})") from e
                    self._warn(p, "warm_full", f"warm cache {warm.root} is full ({e}); reading through")
                    if pin:
                        raise CacheBudgetError(f"cannot keep a local copy of {url}: {e}") from e
                    return data
                except BaseException:
                    res.abort()
                    raise
                p.stats.update(warm_fills=1)
                if prefetch:
                    return None
                if not pin:
                    return data
                fd = warm.open_pinned(key)
                if fd is not None:
                    return fd
            # evicted between publish and pin (or no room yet): go round again
            time.sleep(0.01)
