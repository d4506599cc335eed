"""The shards a StreamingDataset reads: one or more dataset indexes as one list of shards,
and fetching one shard's bytes (through a TieredCache, or straight from its store).

A local shard (or a cache's pinned warm copy) is memory-mapped, not read: samples are cut
from the map, and each field is copied exactly once, into the ``bytes`` handed to the user
(bytes, not memoryviews, so samples pickle into DataLoader worker queues and never pin a
map). The first read of a shard in a process checks it against the index's whole-shard
checksum; a shard that passed is not hashed again, and a shard that fails is read sample
by sample, each against its own checksum, so errors name the sample. The maps of verified
local shards stay open across epochs (:class:`MapCache`, at most ``max_mapped_bytes`` of
files, 4 GiB by default), so a warm epoch neither remaps nor page-faults its shards.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..checksum import Hasher, checksum, verify
from ..errors import (
    CorruptShardError,
    DatapipeError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    PlanError,
    StorageError,
)
from ..storage.retry import RetryPolicy, call_with_retry
from ..storage.stores import LocalStore
from ..format.plain import check_members, walk_layout
from .members import LayoutCache
from .. import dataset as _dataset

__all__ = ["ShardData", "ShardSource"]


@dataclass
class ShardData:
    """One fetched shard: its bytes and its sample table."""

    shard: int
    url: str
    buf: memoryview
    keys: list[str]
    offsets: np.ndarray
    lengths: np.ndarray
    checksums: list[str]
    compression: str
    _closer: Any = None
    #: why the shard's bytes could not be had (its table could): every sample read raises it
    error: Exception | None = None
    #: the whole shard matched its checksum: samples need no check of their own
    verified: bool = False
    #: a shared field layout (see .members): field k of sample j is src[table[j, 2k]:table[j, 2k+1]]
    fields: tuple[str, ...] | None = None
    table: np.ndarray | None = None
    #: the shard's tar bytes (from the index): no zstd frame may decompress to more
    tar_bytes: int = 0

    def __post_init__(self) -> None:
        ends = self.offsets + self.lengths
        self.max_end = int(ends.max()) if ends.size else 0
        #: the bytes-like object under ``buf`` (bytes or mmap): slicing it yields bytes
        self.src = self.buf.obj if isinstance(self.buf.obj, (bytes, mmap.mmap)) else bytes(self.buf)
        self._close_lock = threading.Lock()

    # Plain lists for the per-sample path (numpy scalar indexing costs more than the work
    # per sample). Built on first use only: a shard read through its layout never needs them.
    @cached_property
    def offs(self) -> list[int]:
        return self.offsets.tolist()

    @cached_property
    def ends(self) -> list[int]:
        return (self.offsets + self.lengths).tolist()

    @cached_property
    def rows(self) -> list[list[int]] | None:
        return None if self.table is None else self.table.tolist()

    @cached_property
    def key_array(self) -> np.ndarray:
        """The keys as an object array, for gathering a chunk's keys in one step."""
        out = np.empty(len(self.keys), dtype=object)
        out[:] = self.keys
        return out

    @cached_property
    def digests(self) -> list[str] | None:
        prefix = "xxh3_64:"
        if self.checksums and all(c and c.startswith(prefix) for c in self.checksums):
            return [c[len(prefix):] for c in self.checksums]
        return None

    def where(self, j: int) -> str:
        off = int(self.offsets[j])
        return f"{self.url} sample {self.keys[j]!r} (#{j}, bytes {off}..{off + int(self.lengths[j])})"

    def sample_bytes(self, j: int) -> memoryview:
        """Stored bytes of sample ``j``, checked against its checksum."""
        if self.error is not None:
            raise CorruptShardError(f"{self.url} sample {self.keys[j]!r} (#{j}): {self.error}") from self.error
        off, ln = int(self.offsets[j]), int(self.lengths[j])
        if off + ln > len(self.buf):
            raise CorruptShardError(
                f"{self.url} sample {self.keys[j]!r} (#{j}): shard is truncated, the sample needs "
                f"bytes {off}..{off + ln} but the shard holds {len(self.buf)}"
            )
        data = self.buf[off : off + ln]
        if self.checksums:
            verify(data, self.checksums[j] or None, f"{self.url} sample {self.keys[j]!r} (#{j})")
        return data

    def close(self) -> None:
        """Release the bytes and what holds them (a map, a cache pin) once, from any
        thread; returns when that is done, even if another thread's close() did it."""
        with self._close_lock:
            buf, self.buf = self.buf, memoryview(b"")
            buf.release()
            closer, self._closer = self._closer, None
            if closer is not None:
                closer()


def _mmap_file(path: str) -> tuple[memoryview, Any]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return memoryview(b""), None
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def close() -> None:
        try:
            mm.close()
        except BufferError:  # a caller still holds a zero-copy slice: the GC closes it later
            pass

    return memoryview(mm), close


def _has_warm_tier(cache: Any) -> bool:
    """Whether ``cache`` can pin local copies in this process. A TieredCache says so itself
    (its ``warm_dir`` may have failed to open here, and it then reads through); any other
    cache object is taken at its ``warm_dir`` setting."""
    has = getattr(cache, "has_warm_tier", None)
    if has is not None:
        return bool(has())
    return bool(getattr(cache, "warm_dir", None))


def _open_map(path: str) -> mmap.mmap | None:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class MapCache:
    """Open read-only maps of verified local shard files by (path, size, mtime, inode),
    least recently used first out, mapping at most ``max_bytes`` of files, one per path.

    A warm epoch then reads through page tables an earlier epoch filled: remapping a shard
    every epoch costs a page fault per 64 KiB touched and an munmap, about as much as the
    reader's own work per sample. The maps are of files already in the page cache: they
    hold address space, not memory of their own (the kernel may drop clean pages at any
    time). An evicted map is not closed here: readers still slicing it keep it alive, and
    it unmaps when the last of them lets go.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[tuple, mmap.mmap] = OrderedDict()
        self._by_path: dict[Any, tuple] = {}
        self._held = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes}  # maps do not pickle: a worker opens its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_bytes"])

    def get(self, key: tuple) -> mmap.mmap | None:
        with self._lock:
            mm = self._items.get(key)
            if mm is not None:
                self._items.move_to_end(key)
            return mm

    def discard(self, path: Any) -> None:
        """Forget the map of ``path`` (``key[0]``), if one is kept."""
        with self._lock:
            stale = self._by_path.pop(path, None)
            if stale is not None:
                self._held -= len(self._items.pop(stale))

    def put(self, key: tuple, mm: mmap.mmap) -> None:
        size = len(mm)
        if size > self.max_bytes:
            return
        with self._lock:
            # an older map of the same path (the file was replaced or changed since) goes:
            # it would keep a deleted file's blocks allocated
            stale = self._by_path.pop(key[0], None)
            if stale is not None:
                self._held -= len(self._items.pop(stale))
            self._items[key] = mm
            self._by_path[key[0]] = key
            self._held += size
            while self._held > self.max_bytes:
                out_key, out = self._items.popitem(last=False)
                del self._by_path[out_key[0]]
                self._held -= len(out)


_local = threading.local()


def _hash_file(path: str) -> str:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(1 << 20))
    h = Hasher()
    with open(path, "rb", buffering=0) as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):  # only a hint
            pass
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


class ShardSource:
    """The shards of one or more datasets, numbered globally in the order given."""

    def __init__(self, urls: list[str], storage_options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
                 retry: RetryPolicy | None = None, max_mapped_bytes: int = 4 << 30) -> None:
        if not urls:
            raise PlanError("a StreamingDataset needs at least one dataset URL")
        self.urls = list(urls)
        options = storage_options if isinstance(storage_options, list) else [storage_options] * len(self.urls)
        if len(options) != len(self.urls):
            raise PlanError(f"{len(self.urls)} dataset URLs but {len(options)} storage_options")
        self.indexes = [_dataset.open_index(u, o) for u, o in zip(self.urls, options)]
        self.retry = retry or RetryPolicy()
        counts = [ix.sample_counts.astype(np.int64) for ix in self.indexes]
        self.counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        self.source_of = np.repeat(np.arange(len(counts)), [c.size for c in counts])
        self.shard_base = np.concatenate(([0], np.cumsum([c.size for c in counts]))).astype(np.int64)
        self.num_samples = int(self.counts.sum())
        #: local shard files whose bytes matched their checksum in this process, by
        #: (path, size, mtime): later epochs skip per-sample checks, as the cache does
        self._verified: set[tuple[str, int, int]] = set()
        #: field layouts of verified shards, kept across epochs (bounded; see .members)
        self.layouts = LayoutCache()
        #: verified shards without a layout whose members were checked against the index
        self._walked: set[tuple[int, int, str]] = set()
        #: open read-only maps of verified local shard files, kept across epochs (bounded)
        self._maps = MapCache(max_mapped_bytes)
        if self.num_samples == 0:
            raise PlanError(f"{', '.join(self.urls)}: the dataset holds no sample; nothing to stream")

    @property
    def num_shards(self) -> int:
        return int(self.counts.size)

    def identity(self) -> str:
        """What makes these datasets these datasets (for resume checks): a checksum of their
        manifests and shard checksums, so a re-packed or different dataset does not match."""
        import json

        parts = [json.dumps(ix.manifest, sort_keys=True, default=str) + "\n" +
                 "\n".join(str(s.checksum) for s in ix.shards) for ix in self.indexes]
        return checksum("\0".join(parts).encode())

    def info(self, g: int) -> tuple[Any, Any]:
        s = int(self.source_of[g])
        ix = self.indexes[s]
        return ix, ix.shards[g - int(self.shard_base[s])]

    def url(self, g: int) -> str:
        return self.info(g)[1].url

    def shard_bytes(self, g: int) -> int:
        return int(self.info(g)[1].bytes)

    def fetch(self, g: int, cache: Any = None) -> ShardData:
        """Shard ``g``'s bytes and sample table (blocking; run it off the event loop)."""
        ix, info = self.info(g)
        local = g - int(self.shard_base[int(self.source_of[g])])
        try:
            # the sample table is read in row groups from the store: retried like shard bytes
            table = call_with_retry(lambda: ix.shard_samples(local), f"{ix.url} sample table", self.retry)
        except DatapipeError:
            raise
        except Exception as e:  # pyarrow errors on a damaged samples.parquet
            raise FormatError(f"{ix.url}: cannot read the sample table of {info.url}: {e}") from e
        if len(table.keys) != info.samples:
            raise FormatError(f"{info.url}: index lists {len(table.keys)} samples, expected {info.samples}")
        error: Exception | None = None
        try:
            buf, closer, verified = self._bytes(ix, info, cache)
        except (IntegrityError, CorruptShardError) as e:
            buf, closer, error, verified = memoryview(b""), None, e, False
        data = ShardData(g, info.url, buf, list(table.keys), np.asarray(table.offsets, np.int64),
                         np.asarray(table.lengths, np.int64), list(table.checksums or []),
                         ix.compression, closer, error, verified, tar_bytes=info.tar_bytes)
        if verified and data.compression == "none" and data.max_end <= len(data.buf):
            key = (g, len(data.buf), info.checksum)
            lay = self.layouts.get(key)
            if lay is None:
                lay = walk_layout(data.src, data.offs, data.ends, data.keys)
                if lay is not None:
                    self.layouts.put(key, lay)
            if lay is not None and lay.samples == len(data.keys):
                data.fields, data.table = lay.fields, lay.table
            elif key not in self._walked:
                # no shared layout vouches for the index's ranges: walk every member once
                try:
                    check_members(data.src, data.offs, data.ends, data.keys, info.url)
                    self._walked.add(key)
                except CorruptShardError as e:
                    data.error = e
        return data

    def _bytes(self, ix: Any, info: Any, cache: Any) -> tuple[memoryview, Any, bool]:
        """(bytes, closer, verified). A shard that fails its whole-shard checksum is still
        returned, unverified: its samples are then checked one by one, so the error (or the
        skip) names the bad sample and the good ones still read."""
        if cache is not None:
            # the cache verifies what it serves against the checksum passed here
            if _has_warm_tier(cache):
                try:
                    path = cache.local_path(info.url, checksum=info.checksum)
                except IntegrityError as e:
                    raise CorruptShardError(f"shard fails its checksum: {e}") from e
                try:
                    buf, close = _mmap_file(path)
                except BaseException as e:
                    cache.release(info.url)  # the pin (and its fd) would outlive the shard
                    if isinstance(e, OSError):
                        raise StorageError(f"cannot map the warm copy of {info.url} at {path}: {e}") from e
                    raise

                def release() -> None:
                    if close is not None:
                        close()
                    cache.release(info.url)

                return buf, release, bool(info.checksum)
            try:
                return memoryview(cache.read(info.url, checksum=info.checksum)), None, bool(info.checksum)
            except IntegrityError as e:
                raise CorruptShardError(f"shard fails its checksum: {e}") from e
        if isinstance(ix.store, LocalStore):
            path = ix.store.path(info.name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self._maps.discard(path)
                raise ObjectNotFoundError(f"shard {info.url} is missing (listed in {ix.url})") from None
            seen = (path, st.st_size, st.st_mtime_ns)
            ok = seen in self._verified
            if ok:
                mm = self._maps.get(seen + (st.st_ino,))
                if mm is not None:  # mapped in an earlier epoch: no page faults, no munmap
                    return memoryview(mm), None, True
            self._maps.discard(path)  # a map of what the file was before it changed
            if not ok and info.checksum:
                # First read in this process: stream the file through a small reused buffer
                # and hash it on the way. read() releases the GIL while the disk works, where
                # hashing a cold mmap would stall every thread on page faults.
                ok = _hash_file(path) == info.checksum
                if ok:
                    self._verified.add(seen)
            if ok:
                mm = _open_map(path)
                if mm is not None:
                    self._maps.put(seen + (st.st_ino,), mm)
                    return memoryview(mm), None, True
            buf, close = _mmap_file(path)
            return buf, close, ok
        # Transient failures are retried; a shard shorter than the index says is not
        # (asking again cannot lengthen it) and shows as truncated samples when read.
        data = call_with_retry(lambda: ix.store.get(info.name), info.url, self.retry)
        return memoryview(data), None, bool(info.checksum) and checksum(data) == info.checksum
