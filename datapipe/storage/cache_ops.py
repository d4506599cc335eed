"""TieredCache's operations beyond whole-object reads: byte ranges, pinned local copies,
prefetch, the access schedule, async twins, metrics and shutdown. A mixin, so that cache.py stays readable;
every method here works on the per-process state that ``TieredCache._proc`` creates."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable

from ..checksum import checksum as compute_checksum, verify
from ..errors import DatapipeError, StorageError
from .eviction import Schedule, choose_victims
from .node_stats import COUNTER_KEYS, sum_counter_files
from .retry import fetch_range
from .warm import BROKEN_DIR_ERRNOS, fill_record, url_key

__all__ = ["CacheOpsMixin"]


class CacheOpsMixin:
    # -- byte ranges -------------------------------------------------------------------
    def read_range(self, url: str, start: int, end: int, *, checksum: str | None = None) -> bytes:
        """Bytes ``[start, end)``; ``checksum`` is of those bytes. A miss fills the whole
        object into the cache when there is a cache to fill; otherwise one range request.
        A range that fails its checksum drops the cached copy and is read once more."""
        if start < 0 or end < start:
            raise StorageError(f"invalid byte range [{start}, {end}) for {url}")
        p = self._proc()
        index = self._locate(url, exact=True)
        for attempt in (0, 1):
            part = self._range_once(p, url, start, end, index if attempt == 0 else None)
            if _ok(part, checksum):
                return part
            p.stats.update(range_refetches=1)
            p.hot.discard(url)
            if p.warm is not None:
                p.warm.discard(url_key(url))
        verify(part, checksum, f"{url} [{start}, {end})")
        raise AssertionError("unreachable")  # pragma: no cover

    def _range_once(self, p, url: str, start: int, end: int, index: int | None) -> bytes:
        hit = p.hot.get(url)
        if hit is not None:
            p.stats.update(hot_hits=1, hot_bytes=end - start)
            return _slice(hit[0], start, end, url)
        p.stats.update(hot_misses=1)
        if p.warm is not None:
            for _attempt in (0, 1):  # once more after re-creating a deleted warm directory
                try:
                    return self._range_from_warm(p, url, start, end, index)
                except OSError as e:
                    if not self._warm_broken(p, e):
                        raise
        return self._range_from_cold(p, url, start, end, index)

    def _range_from_warm(self, p, url: str, start: int, end: int, index: int | None) -> bytes:
        key = url_key(url)
        fd = p.warm.open_pinned(key)
        if fd is not None:
            try:
                size = os.fstat(fd).st_size
                record = fill_record(fd)
                if record is not None and record[0] != size:
                    pass  # a copy truncated or grown in place: never a hit
                elif end <= size:
                    part = os.pread(fd, end - start, start)
                    if len(part) == end - start:
                        p.stats.update(warm_hits=1, warm_bytes=end - start)
                        return part
                elif record is not None or size == self._size(p, url):  # the copy is whole: a bad range
                    _slice(b"", start, end, url, size)
                p.stats.update(warm_corrupt=1)  # a copy shorter than the object
                p.warm.discard(key, fd)
                fd = None
            finally:
                if fd is not None:
                    os.close(fd)
        p.stats.update(warm_misses=1)
        self._check_hot_fits(p, url)
        data = self._fill(p, url, None, index)
        self._admit_hot(p, url, data, None, index)
        return _slice(data, start, end, url)

    def _range_from_cold(self, p, url: str, start: int, end: int, index: int | None) -> bytes:
        if self.hot_bytes > 0:
            self._check_hot_fits(p, url)
            data = self._fetch_cold(p, url, None)
            self._admit_hot(p, url, data, None, index)
            return _slice(data, start, end, url)
        size = self._size(p, url)
        if end > size:
            _slice(b"", start, end, url, size)
        store, key = self._cold(p, url)
        part = fetch_range(store, key, start, end, self.retry, pool=p.parts,
                           on_retry=lambda e: p.stats.update(cold_retries=1))
        p.stats.update(cold_reads=1, cold_bytes=len(part))
        return part

    # -- pinned local copies -------------------------------------------------------------
    def local_path(self, url: str, *, checksum: str | None = None) -> str:
        """The path of a warm copy of ``url``, pinned (never evicted, by any process)
        until :meth:`release`. Each call pins once; release once per call."""
        p = self._proc()
        if p.warm is None:
            raise StorageError(f"local_path({url}) needs a usable warm_dir; this cache has none")
        key = url_key(url)
        index = self._locate(url)
        broken: OSError | None = None
        for _attempt in (0, 1, 2):
            try:
                fd = p.warm.open_pinned(key)
                if fd is not None:
                    p.stats.update(warm_hits=1)
                else:
                    p.stats.update(warm_misses=1)
                    fd = self._fill(p, url, checksum, index, pin=True)
                if self._read_pinned(p, url, fd, checksum, want_bytes=False) is not None:
                    with p.lock:
                        p.pins.setdefault(url, []).append(fd)
                    return p.warm.path(key)
                p.warm.discard(key, fd)  # corrupt copy: fill again
            except OSError as e:
                if broken is None and self._warm_broken(p, e):
                    broken = e  # re-created (or not): one more try
                    continue
                if broken is not None and not isinstance(e, DatapipeError) and e.errno in BROKEN_DIR_ERRNOS:
                    raise StorageError(f"local_path({url}): warm cache {p.warm.root} is unusable "
                                       f"({e}); a local copy needs a writable warm_dir") from e
                raise
        raise StorageError(f"could not obtain a verified local copy of {url}")

    def release(self, url: str) -> None:
        """Drop one pin taken by :meth:`local_path`."""
        p = self._proc()
        with p.lock:
            fds = p.pins.get(url)
            if not fds:
                raise StorageError(f"release({url}): it is not pinned in this process")
            fd = fds.pop()
            if not fds:
                del p.pins[url]
        os.close(fd)

    @contextmanager
    def pinned(self, url: str, *, checksum: str | None = None) -> Iterator[str]:
        """``with cache.pinned(url) as path:`` a local copy for the block's duration."""
        path = self.local_path(url, checksum=checksum)
        try:
            yield path
        finally:
            self.release(url)

    # -- prefetch ------------------------------------------------------------------------
    def prefetch(self, urls: Sequence[str], *, checksums: Sequence[str | None] | dict | None = None) -> list[Future]:
        """Fetch ``urls`` into the cache in the background (warm tier, or hot without
        one), at most ``max_inflight_bytes`` downloading at a time. Returns the futures;
        a failed prefetch only counts in ``stats()['prefetch_errors']``: the later read
        retries and raises."""
        if isinstance(checksums, dict):
            cks = [checksums.get(u) for u in urls]
        else:
            cks = list(checksums) if checksums is not None else [None] * len(urls)
            if len(cks) != len(urls):
                raise ValueError(f"prefetch: {len(urls)} urls but {len(cks)} checksums")
        p = self._proc()
        return [self._submit_prefetch(p, u, c, None) for u, c in zip(urls, cks)]

    def _submit_prefetch(self, p, url: str, checksum: str | None, at: int | None) -> Future:
        with p.lock:
            fut = p.pending.get(url)
            if fut is None:
                ticket = p.turns.issue() if at is not None and p.warm is not None else None
                fut = p.pool.submit(self._prefetch_one, p, url, checksum, at, ticket)
                if ticket is not None:  # a cancelled task must not hold up the queue
                    fut.add_done_callback(lambda f, t=ticket: p.turns.done(t))
                p.pending[url] = fut
                fut.add_done_callback(lambda f, u=url: p.pending.pop(u, None) if p.pending.get(u) is f else None)
        return fut

    def _prefetch_one(self, p, url: str, checksum: str | None, at: int | None,
                      ticket: int | None = None) -> None:
        try:
            if p.warm is not None:
                self._fill(p, url, checksum, None, prefetch=True, prefetch_at=at, ticket=ticket)
            elif url not in p.hot:
                self._check_hot_fits(p, url)
                self._admit_hot(p, url, self._fetch_cold(p, url, checksum), checksum, at)
            p.stats.update(prefetched=1)
        except Exception as e:
            p.stats.update(prefetch_errors=1)
            p.last_prefetch_error = f"{type(e).__name__}: {e}"
        if p.counters is not None and len(p.pending) <= 1:
            p.counters.file.flush(p.stats)  # the last of a pass (ours leaves pending after this)

    # -- the access schedule -------------------------------------------------------------
    def set_schedule(self, urls: Sequence[str], *, checksums: dict[str, str] | None = None,
                     position: int = 0, lookahead: int = 8, window: int = 64) -> None:
        """Hand over this process's future reads, in order (repeats allowed). Eviction in
        both tiers becomes clairvoyant, and a background thread prefetches the next
        ``lookahead`` scheduled objects that are not cached (0: no prefetch). Reads move
        the position (see the class docstring); so does :meth:`advance`. ``checksums``
        (url -> checksum) verify prefetched objects. ``set_schedule([])`` or
        :meth:`clear_schedule` returns to LRU."""
        if lookahead < 0:
            raise ValueError("lookahead must be >= 0")
        p = self._proc()
        with p.lock:
            self.schedule = Schedule(list(urls), position, window) if len(urls) else None
            self.schedule_checksums = dict(checksums or {})
            self.lookahead = lookahead
            p.refused = {}
        if self.schedule is not None and lookahead and p.prefetcher is None:
            p.prefetcher = threading.Thread(target=self._prefetch_loop, args=(p,),
                                            name="datapipe-schedule-prefetch", daemon=True)
            p.prefetcher.start()
        self._wake()

    def clear_schedule(self) -> None:
        self.set_schedule([])

    def advance(self, n: int = 1) -> int:
        """Move the schedule position ``n`` reads forward (reads the caller skipped or
        served elsewhere); returns the new position."""
        if self.schedule is None:
            raise StorageError("advance(): no schedule set; call set_schedule(urls) first")
        with self._proc().lock:
            pos = self.schedule.advance(n)
        self._wake()
        return pos

    @property
    def schedule_position(self) -> int | None:
        return None if self.schedule is None else self.schedule.position

    def _wake(self) -> None:
        p = self._p
        if p is not None and p.pid == os.getpid():
            with p.wake:
                p.wake.notify_all()

    def _prefetch_loop(self, p) -> None:
        while not p.closed:
            s = self.schedule
            if s is not None and self.lookahead:
                with p.lock:
                    upcoming = s.upcoming(self.lookahead)
                    pos = s.position
                # Objects fetched ahead occupy the tier before they are used, shrinking it
                # for everything else; beyond the next object, look ahead only while that
                # stays within a quarter of the tier (sizes known from earlier HEADs).
                room = (self.warm_bytes if p.warm is not None else self.hot_bytes) // 4
                ahead = 0
                for n, (i, url) in enumerate(upcoming):
                    ahead += p.sizes.get(url, 0)
                    if n and ahead > room:
                        break
                    if len(p.pending) >= self.prefetch_threads or p.closed:
                        break
                    if url in p.pending or url in p.hot or p.refused.get(url) == pos:
                        continue
                    if p.warm is not None and os.path.exists(p.warm.path(url_key(url))):
                        continue
                    p.refused[url] = pos  # tried at this position; retried once it moves
                    self._submit_prefetch(p, url, self.schedule_checksums.get(url), i)
            with p.wake:
                p.wake.wait(timeout=0.05)

    # -- eviction choices against the schedule --------------------------------------
    def _locate(self, url: str, *, exact: bool = False) -> int | None:
        s = self.schedule
        if s is None:
            return None
        with self._proc().lock:
            if exact:
                i = s.position if s.position < len(s) and s.keys[s.position] == url else None
            else:
                i = s.locate(url)
            if i is not None:
                s.position = i + 1
        if i is not None:
            self._wake()
        return i

    def _chooser(self, url: str, index: int | None, *, prefetch_at: int | None = None,
                 to_url: Callable[[str], str] = lambda k: k, force: bool = False):
        """choose(cands, need) for the tier: LRU, or Belady against the schedule."""
        s = self.schedule
        if s is None or force:
            return lambda cands, need, *_: choose_victims(cands, need, url)
        if prefetch_at is not None:
            # position - 1: the read that moved the position may not have opened (pinned)
            # its object yet; the background must not evict it under the reader.
            horizon, nxt = max(0, s.position - 1), prefetch_at
        else:
            horizon = (index + 1) if index is not None else s.position
            nxt = s.next_use(url, horizon)

        def choose(cands, need, *_):
            named = [(to_url(k), size, rec) for k, size, rec in cands]
            back = {to_url(k): k for k, _s, _r in cands}
            v = choose_victims(named, need, url, schedule=s, incoming_next=nxt, horizon=horizon)
            return None if v is None else [back[u] for u in v]

        return choose

    def _warm_key_to_url(self) -> Callable[[str], str]:
        s = self.schedule
        if s is None:
            return lambda k: k
        table = getattr(s, "warm_keys", None)
        if table is None:  # warm files are named by hash; the schedule speaks URLs
            table = s.warm_keys = {url_key(u): u for u in s._at}
        return lambda k: table.get(k, k)

    # -- async twins ---------------------------------------------------------------------
    async def aread(self, url: str, *, checksum: str | None = None) -> bytes:
        return await asyncio.to_thread(self.read, url, checksum=checksum)

    async def aread_range(self, url: str, start: int, end: int, *, checksum: str | None = None) -> bytes:
        return await asyncio.to_thread(self.read_range, url, start, end, checksum=checksum)

    async def alocal_path(self, url: str, *, checksum: str | None = None) -> str:
        return await asyncio.to_thread(self.local_path, url, checksum=checksum)

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
        p = self._proc()
        if node:
            return self._node_stats(p)
        counts = p.stats.snapshot()
        out: dict[str, Any] = {k: counts.get(k, 0) for k in COUNTER_KEYS}
        out.update({k: v for k, v in counts.items() if k not in out})
        out["wait_seconds"] = float(out["wait_seconds"])
        out["hot_used_bytes"] = p.hot.used
        out["hot_budget_bytes"] = self.hot_bytes
        out["warm_budget_bytes"] = self.warm_bytes
        out["warm_used_bytes"] = self._warm_usage(p)
        out["inflight_peak_bytes"] = p.inflight.peak
        out["pinned"] = sum(len(v) for v in p.pins.values())
        out["schedule_position"] = self.schedule_position
        if getattr(p, "last_prefetch_error", None):
            out["last_prefetch_error"] = p.last_prefetch_error
        return out

    def _node_stats(self, p) -> dict[str, Any]:
        if p.counters is None:
            out = self.stats()
            out["processes"] = 1
            return out
        p.counters.file.flush(p.stats, force=True)
        summed = sum_counter_files(p.warm.root)
        out = dict(summed["counters"])
        out["processes"] = summed["processes"]
        if summed["unreadable"]:
            out["unreadable_counter_files"] = summed["unreadable"]
        out["warm_budget_bytes"] = self.warm_bytes
        out["warm_used_bytes"] = self._warm_usage(p)
        return out

    def _warm_usage(self, p) -> int:
        """Bytes in the warm tier; 0 (with the one warning) when it is gone or unreadable:
        stats must not fail because the directory did."""
        if p.warm is None:
            return 0
        try:
            return p.warm.usage()
        except OSError as e:
            if not self._warm_broken(p, e):
                raise
            try:
                return p.warm.usage()
            except OSError:
                return 0

    def close(self) -> None:
        """Stop background work, drop pins and the hot tier, and write this process's
        counters for ``stats(node=True)``. A later call starts afresh."""
        p = self._p
        if p is None or p.pid != os.getpid() or p.closed:
            return
        p.closed = True
        p.turns.close()
        self._wake()
        if p.prefetcher is not None:
            p.prefetcher.join(timeout=5)
        p.pool.shutdown(wait=True, cancel_futures=True)
        p.parts.shutdown(wait=True, cancel_futures=True)
        if p.counters is not None:
            p.counters.close()
        with p.lock:
            for fds in p.pins.values():
                for fd in fds:
                    os.close(fd)
            p.pins.clear()
        p.hot.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slice(data: bytes, start: int, end: int, url: str, size: int | None = None) -> bytes:
    size = len(data) if size is None else size
    if end > size:
        raise StorageError(f"range [{start}, {end}) runs past the end of {url} ({size} bytes)")
    return data[start:end]


def _ok(data: bytes | memoryview, expected: str | None) -> bool:
    return expected is None or compute_checksum(data) == expected

