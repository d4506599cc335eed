"""The cold tier as one process reads it: a store per root URL, sizes and versions probed
once, whole-object downloads pinned to one version of the object and bounded in bytes
in flight, ranged reads; every request through the one retry layer (storage/retry.py) and,
for remote stores, the node's pacing of each prefix (pacing.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..checksum import checksum as compute_checksum
from ..checksum import verify
from ..errors import (
    CacheBudgetError,
    DatapipeError,
    ObjectChangedError,
    ObjectNotFoundError,
    StorageError,
    ThrottledError,
)
from ..storage import (
    FsspecStore,
    RetryPolicy,
    Store,
    call_with_retry,
    fetch_object,
    fetch_range,
    is_local_url,
    open_store,
    single_layer_options,
    split_url,
)
from ..telemetry import Telemetry
from .hot import InflightBytes
from .pacing import ColdPacer, PacedStore

__all__ = ["ColdReader", "SizeChanged", "CHANGE_RESTARTS", "checksum_ok"]

#: how often one read starts over because the object changed while it was downloaded
CHANGE_RESTARTS = 3


class SizeChanged(Exception):
    """The object's size is not the one the caller reserved room for (``fixed_size``)."""


def checksum_ok(data: bytes | memoryview, expected: str | None) -> bool:
    return expected is None or compute_checksum(data) == expected


class ColdReader:
    """Reads of cold objects by URL, for one process (it holds a thread pool and the
    filesystem objects of fsspec, which do not cross fork). ``count(**counters)`` receives
    the reader's counters (cold_reads, cold_bytes, cold_retries, cold_refetches,
    cold_changed, wait_seconds)."""

    def __init__(self, *, storage_options: dict[str, Any], retry: RetryPolicy, max_inflight_bytes: int,
                 cold_wrapper: Callable[[Store], Store] | None, count: Callable[..., None]) -> None:
        self.storage_options = storage_options
        self.retry = retry
        self.cold_wrapper = cold_wrapper
        self.count = count
        self.pacer: ColdPacer | None = None  # set by the process state once its warm dir is known
        self.telemetry: Telemetry | None = None  # each read's bytes and seconds, as tier "cold"
        self.stores: dict[str, Store] = {}  # per root, as opened (and wrapped by cold_wrapper)
        self._paced: dict[str, Store] = {}  # the same, as requests use them (paced if remote)
        self.sizes: dict[str, int] = {}
        self.versions: dict[str, str | None] = {}  # the version each size was probed at
        self.inflight = InflightBytes(max_inflight_bytes)
        self.parts = ThreadPoolExecutor(retry.max_parts + 1, thread_name_prefix="datapipe-cold")
        self._lock = threading.Lock()

    def close(self) -> None:
        # Not waiting: what still runs here is only attempts that were abandoned (timed
        # out, results dropped); one stalled on a dead server must not hang close().
        self.parts.shutdown(wait=False, cancel_futures=True)
        if self.pacer is not None:
            self.pacer.close()

    def store_for(self, url: str) -> tuple[Store, str]:
        """The store of ``url``'s folder (created once per process) and the key in it."""
        root, name = split_url(url)
        with self._lock:
            store = self._paced.get(root)
            if store is None:
                opts = self.storage_options
                if not is_local_url(root):
                    opts = single_layer_options(root.split("://", 1)[0], opts, self.retry)
                store = open_store(root, opts)
                if isinstance(store, FsspecStore):
                    store.backend_retries = 1  # ours is the one retry layer
                if self.cold_wrapper is not None:
                    store = self.cold_wrapper(store)
                self.stores[root] = store
                if self.pacer is not None and not is_local_url(root):
                    # outermost: it sees every answer
                    store = PacedStore(store, self.pacer, self.retry.deadline_s)
                self._paced[root] = store
        return store, name

    def size(self, url: str) -> int:
        return self.stat(url)[0]

    def known_size(self, url: str, *, probe: bool) -> int | None:
        """The size remembered from an earlier probe; without one, a probe when ``probe``,
        else None."""
        size = self.sizes.get(url)
        if size is None and probe:
            size = self.size(url)
        return size

    def stat(self, url: str, *, fresh: bool = False) -> tuple[int, str | None]:
        """(size, version) of the cold object, remembered per process; ``fresh`` asks again
        (after a mismatch: the object may have changed since)."""
        if not fresh and url in self.sizes:
            return self.sizes[url], self.versions.get(url)
        store, key = self.store_for(url)
        size, version = call_with_retry(lambda: store.stat(key), f"{url} (size probe)", self.retry,
                                        pool=self.parts, on_retry=lambda e: self.count(cold_retries=1))
        self.sizes[url], self.versions[url] = size, version
        return size, version

    def fetch(self, url: str, checksum: str | None, *, fixed_size: int | None = None,
              background: bool = False) -> bytes:
        """The whole cold object, every part of it one version of it; verified against
        ``checksum`` (a mismatch is fetched once more, then raised). An object that changes
        while it downloads is downloaded again (at most CHANGE_RESTARTS times); one whose
        size changed since it was probed is probed again. ``fixed_size``: the size room was
        reserved for; another size raises SizeChanged. ``background``: a prefetch, whose
        waits for bytes in flight are not the reader's ``wait_seconds``."""
        store, key = self.store_for(url)
        fresh = False
        for _restart in range(CHANGE_RESTARTS + 1):
            size, version = self.stat(url, fresh=fresh)
            if fixed_size is not None and size != fixed_size:
                raise SizeChanged()
            try:
                return self._fetch_version(url, store, key, size, version, checksum, background)
            except ObjectChangedError as e:
                last: DatapipeError = e
            except StorageError as e:
                if isinstance(e, (ObjectNotFoundError, CacheBudgetError, ThrottledError)):
                    raise  # (throttled for a whole deadline: no probe asks the store again)
                # A failure may come from a size or version remembered from before the
                # object changed (a range past its new end): ask once, compare.
                if self.stat(url, fresh=True) == (size, version):
                    raise
                last = e
            self.count(cold_changed=1)
            fresh = True
        raise ObjectChangedError(
            f"{url} changed {CHANGE_RESTARTS + 1} times while being downloaded; nothing was "
            f"cached. Stop rewriting it while it is read, or retry later (last: {last})") from last

    def _fetch_version(self, url: str, store: Store, key: str, size: int, version: str | None,
                       checksum: str | None, background: bool) -> bytes:
        waited = self.inflight.acquire(size, url)
        if not background:
            self.count(wait_seconds=waited)
        try:
            for attempt in (0, 1):
                t0 = time.perf_counter()
                data = fetch_object(store, key, size, self.retry, pool=self.parts, version=version,
                                    on_retry=lambda e: self.count(cold_retries=1))
                self.count(cold_reads=1, cold_bytes=len(data))
                self.record(len(data), t0)
                if checksum_ok(data, checksum):
                    return data
                if attempt:
                    verify(data, checksum, url)  # raises ChecksumError naming the URL
                self.count(cold_refetches=1)
        finally:
            self.inflight.release(size)
        raise AssertionError("unreachable")  # pragma: no cover

    def fetch_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one ranged request (the caller checked the size)."""
        store, key = self.store_for(url)
        t0 = time.perf_counter()
        part = fetch_range(store, key, start, end, self.retry, pool=self.parts,
                           on_retry=lambda e: self.count(cold_retries=1))
        self.count(cold_reads=1, cold_bytes=len(part))
        self.record(len(part), t0)
        return part

    def record(self, nbytes: int, since: float) -> None:
        """A read of ``nbytes`` from the cold store that began at ``since`` (perf_counter)."""
        tel = self.telemetry
        if tel is not None:
            tel.read("cold", nbytes, time.perf_counter() - since)
