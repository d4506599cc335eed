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

from ..checksum import checksum as compute_checksum, verify
from ..errors import CacheBudgetError, DatapipeError, ObjectChangedError, ObjectNotFoundError, StorageError
from .cache_ops import CacheOpsMixin, _ok
from .cache_proc import CacheProc
from .eviction import Schedule
from .node_stats import FLUSH_INTERVAL_S
from .retry import RetryPolicy, call_with_retry, fetch_object, single_layer_options
from .stores import FsspecStore, Store, is_local_url, open_store, split_url
from .warm import BROKEN_DIR_ERRNOS, DISK_FULL_ERRNOS, fill_record, url_key

__all__ = ["TieredCache"]

#: how often one read starts over because the object changed while it was downloaded
CHANGE_RESTARTS = 3


class _SizeChanged(Exception):
    """Internal: the object's size changed after warm space was reserved for it."""


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
    than a tier's budget, checked before it is downloaded, or no unpinned room for a pin),
    ObjectChangedError (the object kept changing while it was downloaded: every part of
    one download reads one version, and a change starts the download over, at most
    ``CHANGE_RESTARTS`` times). A warm tier that cannot be written (full disk, read-only,
    deleted) warns once and reads through; a deleted one is re-created."""

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
            opts = self.storage_options
            if not is_local_url(root):
                opts = single_layer_options(root.split("://", 1)[0], opts, self.retry)
            store = open_store(root, opts)
            if isinstance(store, FsspecStore):
                store.backend_retries = 1  # ours is the one retry layer
            if self.cold_wrapper is not None:
                store = self.cold_wrapper(store)
            p.stores[root] = store
        return store, name

    def _size(self, p: CacheProc, url: str) -> int:
        return self._stat(p, url)[0]

    def _stat(self, p: CacheProc, url: str, *, fresh: bool = False) -> tuple[int, str | None]:
        """(size, version) of the cold object, remembered per process; ``fresh`` asks again
        (after a mismatch: the object may have changed since)."""
        if not fresh and url in p.sizes:
            return p.sizes[url], p.versions.get(url)
        store, key = self._cold(p, url)
        size, version = call_with_retry(lambda: store.stat(key), f"{url} (size probe)", self.retry,
                                        pool=p.parts, on_retry=lambda e: p.stats.update(cold_retries=1))
        p.sizes[url], p.versions[url] = size, version
        return size, version

    def _check_hot_fits(self, p: CacheProc, url: str) -> None:
        """Before a download for the hot tier: an object it can never hold is an error
        now, not after its bytes were fetched and kept in warm."""
        if self.hot_bytes > 0:
            size = self._size(p, url)
            if size > self.hot_bytes:
                raise CacheBudgetError(
                    f"{url} is {size} bytes, more than hot_bytes={self.hot_bytes}; raise "
                    f"hot_bytes to at least {size} or set it to 0")

    def _warm_broken(self, p: CacheProc, e: OSError) -> bool:
        """True when ``e`` says the warm directory itself is gone or unwritable (deleted,
        remounted read-only): it is re-created if it can be, a warning is given once,
        and the caller reads through."""
        if isinstance(e, DatapipeError) or e.errno not in BROKEN_DIR_ERRNOS or p.warm is None:
            return False
        p.stats.update(warm_errors=1)
        try:
            p.warm.repair()
            repaired = ""
        except OSError as e2:
            repaired = f"; it cannot be re-created ({e2})"
        self._warn(p, "warm_broken", f"warm cache {p.warm.root} failed ({e}){repaired}; "
                   "reading through to the cold tier")
        return True

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

    def _no_room_for_pin(self, p: CacheProc, url: str, size: int, waited: float) -> CacheBudgetError:
        warm = p.warm
        try:
            pinned, mine = warm.pinned_bytes(), sum(len(v) for v in p.pins.values())
        except OSError:
            pinned, mine = 0, 0
        return CacheBudgetError(
            f"no room in warm cache {warm.root} ({warm.budget} bytes) for {url} ({size} bytes) "
            f"after waiting {waited:.1f} s (pin_wait_s={self.pin_wait_s}): {pinned} bytes are "
            f"pinned ({mine} pin(s) held by this process), the rest downloading. Every "
            f"process's pins must fit at once: raise warm_bytes to at least {pinned + size}, "
            "or release pins before taking new ones")

    def _read_pinned(self, p: CacheProc, url: str, fd: int, checksum: str | None, *,
                     want_bytes: bool = True) -> bytes | None:
        """The whole pinned copy (b"" when not ``want_bytes``), or None if it fails
        verification: against ``checksum``, and against the size and digest the copy was
        filled with (or, without that record, the cold object's size). This process skips
        hashing a copy it verified before only while its size, mtime and ctime are
        unchanged, so a copy damaged or truncated in place is verified again."""
        st = os.fstat(fd)
        record = fill_record(fd)
        if record is not None:
            if record[0] != st.st_size:
                p.stats.update(warm_corrupt=1)
                return None
        elif p.warm.records:  # this filesystem keeps records: the copy is not a fill's
            p.stats.update(warm_corrupt=1)
            return None
        else:
            expected = p.sizes.get(url)
            if expected is None and checksum is None:
                expected = self._size(p, url)
            if expected is not None and expected != st.st_size:
                p.stats.update(warm_corrupt=1)
                return None
        wants = {d for d in (checksum, record[1] if record else None) if d}
        known = all(p.warm.is_verified(st, d) for d in wants)
        if known and not want_bytes:
            return b""
        data = os.pread(fd, st.st_size, 0)
        if len(data) == st.st_size:
            if known:
                return data
            digest = compute_checksum(data) if wants else None
            if all(d == digest for d in wants):
                for d in wants:
                    p.warm.mark_verified(st, d)
                return data
        p.stats.update(warm_corrupt=1)
        return None

    def _below_hot(self, p: CacheProc, url: str, checksum: str | None, index: int | None) -> bytes:
        if p.warm is not None:
            for _attempt in (0, 1):  # once more after re-creating a deleted warm directory
                try:
                    return self._from_warm(p, url, checksum, index)
                except OSError as e:
                    if not self._warm_broken(p, e):
                        raise
            self._check_hot_fits(p, url)
            return self._fetch_cold(p, url, checksum)
        fut = p.pending.get(url)
        if fut is not None:  # a prefetch of this URL is under way: wait for it
            t0 = time.monotonic()
            fut.exception()
            p.stats.update(wait_seconds=time.monotonic() - t0)
            hit = p.hot.get(url)  # already counted as a hot miss; the wait shows
            if hit is not None and (checksum is None or checksum == hit[1] or _ok(hit[0], checksum)):
                return hit[0]
        self._check_hot_fits(p, url)
        return self._fetch_cold(p, url, checksum)

    def _from_warm(self, p: CacheProc, url: str, checksum: str | None, index: int | None) -> bytes:
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
        self._check_hot_fits(p, url)
        return self._fill(p, url, checksum, index)

    def _fetch_cold(self, p: CacheProc, url: str, checksum: str | None, *,
                    fixed_size: int | None = None) -> bytes:
        """The whole cold object, every part of it one version of it; verified against
        ``checksum`` (a mismatch is fetched once more, then raised). An object that changes
        while it downloads is downloaded again (at most CHANGE_RESTARTS times); one whose
        size changed since it was probed is probed again. ``fixed_size``: the size warm
        space was reserved for; another size raises _SizeChanged to the filler."""
        store, key = self._cold(p, url)
        fresh = False
        for _restart in range(CHANGE_RESTARTS + 1):
            size, version = self._stat(p, url, fresh=fresh)
            if fixed_size is not None and size != fixed_size:
                raise _SizeChanged()
            try:
                return self._fetch_version(p, url, store, key, size, version, checksum)
            except ObjectChangedError as e:
                last: DatapipeError = e
            except StorageError as e:
                if isinstance(e, (ObjectNotFoundError, CacheBudgetError)):
                    raise
                # A failure may come from a size or version remembered from before the
                # object changed (a range past its new end): ask once, compare.
                if self._stat(p, url, fresh=True) == (size, version):
                    raise
                last = e
            p.stats.update(cold_changed=1)
            fresh = True
        raise ObjectChangedError(
            f"{url} changed {CHANGE_RESTARTS + 1} times while being downloaded; nothing was "
            f"cached. Stop rewriting it while it is read, or retry later (last: {last})") from last

    def _fetch_version(self, p: CacheProc, url: str, store: Store, key: str, size: int,
                       version: str | None, checksum: str | None) -> bytes:
        waited = p.inflight.acquire(size, url)
        if not threading.current_thread().name.startswith("datapipe-prefetch"):
            p.stats.update(wait_seconds=waited)  # the reader's waits, not the background's
        try:
            for attempt in (0, 1):
                data = fetch_object(store, key, size, self.retry, pool=p.parts, version=version,
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
        t_start = time.monotonic()
        deadline = t_start + self.pin_wait_s
        resized = 0
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
                        raise self._no_room_for_pin(p, url, size, time.monotonic() - t_start)
                    time.sleep(0.05)  # until a pin is released or a download lands
                    continue
                if res is None:
                    p.stats.update(warm_not_admitted=1)
                    return self._fetch_cold(p, url, checksum)
                data = None
                try:
                    data = self._fetch_cold(p, url, checksum, fixed_size=size)
                    res.write_and_publish(data, checksum or compute_checksum(data))
                except _SizeChanged:
                    res.abort()
                    resized += 1
                    if resized > CHANGE_RESTARTS:
                        raise ObjectChangedError(
                            f"{url} changed size {resized} times while being cached; stop "
                            "rewriting it while it is read, or retry later") from None
                    continue  # reserve room for the size it has now
                except OSError as e:
                    res.abort()
                    if isinstance(e, DatapipeError) or data is None:
                        raise
                    if e.errno in DISK_FULL_ERRNOS:
                        self._warn(p, "warm_full", f"warm cache {warm.root} is full ({e}); reading through")
                        if pin:
                            raise CacheBudgetError(f"cannot keep a local copy of {url}: {e}") from e
                        return data
                    if e.errno in BROKEN_DIR_ERRNOS and not pin:
                        self._warm_broken(p, e)
                        return data
                    raise StorageError(f"warm cache {warm.root}: could not keep the copy of "
                                       f"{url} ({e})") from e
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
