"""The shards a StreamingDataset reads: one or more dataset indexes as one list of shards,
and fetching one shard's bytes (through a TieredCache, or straight from its store): the
sample loader's ``fetch`` for the fetch stage (:mod:`.prefetch`), run on its threads. What
it returns (:class:`ShardData`, :class:`TableRows`) is what the read stage (:mod:`.readers`)
reads. With a
warm tier the cache hands over a pinned warm copy when its clairvoyant rule keeps the
shard, else the shard's verified bytes read through (``TieredCache.pin_or_read``): a copy
forced into a small tier would evict the shards it keeps for the next reads.

A local shard (or a cache's pinned warm copy) is read into private memory, never served
from a map of the file: a ``MAP_SHARED`` (or ``MAP_PRIVATE``) map shows whatever another
process writes into the file after it was verified, and a file truncated under a map kills
the reader with SIGBUS on the next touch of a lost page, which no ``on_error`` can catch.
Bytes copied into anonymous memory can change only if we change them, and a short read is
an error we can name. The copy goes into buffers reused across shards and epochs
(:class:`BufferPool`), so a warm epoch costs one copy out of the page cache per shard (about
2 ms per 16 MB here), no page faults; idle buffers stay within ``max_pooled_bytes`` (the
dataset's ``prefetch_bytes``), held ones within the prefetch budget. Samples are cut from
that buffer, and each field is copied once more, into the ``bytes`` handed to the user
(bytes, not memoryviews, so samples pickle into DataLoader worker queues and never pin a
buffer).

The first read of a shard in a process checks the bytes read against the index's
whole-shard checksum; a shard that fails is read sample by sample, each against its own
checksum, so errors name the sample. A shard that passed is not hashed again while its
file keeps the identity it had then (see :meth:`ShardSource._read_local`). Where each field
of each sample lies comes from the index (version 2 records it), checked against the
shard's tar headers in one vectorised pass (:func:`datapipe.format.check_layout`); an
older index records none, and it is found from the headers (:func:`datapipe.format.find_layout`).
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..checksum import checksum, verify
from ..dataset import DatasetIndex, SampleTable, ShardInfo, open_index
from ..errors import (
    CorruptShardError,
    DatapipeError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    PlanError,
    StorageError,
)
from ..format import MemberTable, ShardLayout, check_layout, find_layout
from ..storage import RetryPolicy, call_with_retry, is_throttle, open_regular
from ..tables import ParquetTable, is_parquet_source
from ..telemetry import Telemetry
from .layouts import LayoutCache, ShardMemo

__all__ = ["BufferPool", "ShardData", "ShardSource", "TableRows"]


@dataclass
class ShardData:
    """One fetched shard: its bytes and its sample table (``keys``, ``offsets`` and
    ``lengths`` are the table's)."""

    shard: int
    url: str
    buf: memoryview
    table: SampleTable
    compression: str
    _closer: Any = None
    #: why the shard's bytes could not be had (its table could): every sample read raises it
    error: Exception | None = None
    #: the whole shard matched its checksum: samples need no check of their own
    verified: bool = False
    #: the shard's tar bytes (from the index): no zstd frame may decompress to more
    tar_bytes: int = 0
    #: where each field of each sample lies (verified uncompressed bytes only), found when
    #: the shard is fetched: the read stage picks its reader by it
    layout: ShardLayout | MemberTable | None = None
    keys: list[str] = field(init=False)
    offsets: NDArray[np.int64] = field(init=False)
    lengths: NDArray[np.int64] = field(init=False)

    def __post_init__(self) -> None:
        self.keys, self.offsets, self.lengths = self.table.keys, self.table.offsets, self.table.lengths
        ends = self.offsets + self.lengths
        self.max_end = int(ends.max()) if ends.size else 0
        #: the bytes-like object under ``buf`` (bytes or mmap): slicing it yields bytes
        self.src = self.buf.obj if isinstance(self.buf.obj, (bytes, mmap.mmap)) else bytes(self.buf)
        self._close_lock = threading.Lock()

    @cached_property
    def key_array(self) -> NDArray[Any]:
        """The keys as an object array, for gathering a chunk's keys in one step."""
        out = np.empty(len(self.keys), dtype=object)
        out[:] = self.keys
        return out

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
        verify(data, self.table.checksums[j], f"{self.url} sample {self.keys[j]!r} (#{j})")
        return data

    def close(self) -> None:
        """Release the bytes and what holds them (a map, a cache pin) once, from any
        thread; returns when that is done, even if another thread's close() did it."""
        with self._close_lock:
            buf, self.buf = self.buf, memoryview(b"")
            self.src = b""  # a pooled buffer is refilled with another shard once returned
            buf.release()
            closer, self._closer = self._closer, None
            if closer is not None:
                closer()


class TableRows:
    """One row group of a Parquet table, read (what the prefetcher holds for it): its rows
    as a pyarrow table and their keys."""

    def __init__(self, shard: int, url: str, table: Any, keys: list[str]) -> None:
        self.shard, self.url, self.table, self.keys = shard, url, table, keys

    def close(self) -> None:
        self.table, self.keys = None, []  # the rows go with the last reference


def _open_source(url: str, storage_options: dict[str, Any] | None) -> Any:
    """The index of a packed dataset, or a Parquet table read in place."""
    if is_parquet_source(url, storage_options):
        return ParquetTable(url, storage_options)
    return open_index(url, storage_options)


def _shard_sizes(ix: Any) -> NDArray[np.int64]:
    if isinstance(ix, DatasetIndex):
        return ix.shard_sizes
    return np.array([s.bytes for s in ix.shards], dtype=np.int64)


def _shard_checksums(ix: Any) -> list[str]:
    if isinstance(ix, DatasetIndex):
        return ix.shard_checksums
    return [s.checksum for s in ix.shards]


def _has_warm_tier(cache: Any) -> bool:
    """Whether ``cache`` can pin local copies in this process. A TieredCache says so itself
    (its ``warm_dir`` may have failed to open here, and it then reads through); any other
    cache object is taken at its ``warm_dir`` setting."""
    has = getattr(cache, "has_warm_tier", None)
    if has is not None:
        return bool(has())
    return bool(getattr(cache, "warm_dir", None))


class BufferPool:
    """Anonymous-memory buffers for shard bytes, kept for reuse when a shard is closed,
    while the buffers in use and idle together stay within ``max_bytes`` (the prefetch
    budget, which bounds those in use: so the pool adds no memory of its own beyond it).
    The ones closest in size to what is asked for are reused first (a buffer is resized
    to the exact shard size, so a shard's ``src`` never holds another shard's tail).
    Reusing a buffer skips the page faults and zeroing of fresh memory, which cost two to
    five times the copy itself. A buffer something still views (a memoryview or numpy
    export: a :class:`~.batch.Batch` cut from it) cannot be resized, so it is not refilled
    while viewed: it stays idle until the view is gone.
    """

    def __init__(self, max_bytes: int) -> None:
        self._start(max_bytes)

    def _start(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._idle: list[mmap.mmap] = []
        self._held = 0  # bytes of idle buffers
        self._in_use: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes}  # buffers do not pickle: a worker has its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._start(state["max_bytes"])

    def take(self, size: int) -> mmap.mmap:
        """A buffer of exactly ``size`` (> 0) bytes, contents undefined."""
        mm = None
        with self._lock:
            # closest in size first; a buffer a batch still views stays idle until it is not
            for i in sorted(range(len(self._idle)), key=lambda k: abs(len(self._idle[k]) - size)):
                candidate = self._idle[i]
                held = len(candidate)
                try:
                    candidate.resize(size)  # also when equal: it refuses a buffer still viewed
                except BufferError:
                    continue
                except (OSError, SystemError, TypeError, ValueError):  # no mremap here: drop it
                    self._idle.pop(i)
                    self._held -= held
                    break
                self._idle.pop(i)
                self._held -= held
                mm = candidate
                break
        if mm is None:
            # private: Python's default anonymous map is shared memory of a fixed size, which
            # mremap can grow only into pages past its end (SIGBUS on touch)
            mm = _fresh_buffer(size)
        with self._lock:
            self._in_use[mm] = size
        return mm

    def give(self, mm: mmap.mmap) -> None:
        with self._lock:
            self._in_use.pop(mm, None)
            if self._held + sum(self._in_use.values()) + len(mm) <= self.max_bytes:
                self._idle.append(mm)
                self._held += len(mm)
                return
        try:
            mm.close()
        except BufferError:  # still viewed somewhere: the GC unmaps it when that ends
            pass


# MAP_POPULATE: a fresh buffer is faulted in by one call, not one trap per page (2x faster)
_ANON_PRIVATE = (getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
                 | getattr(mmap, "MAP_POPULATE", 0))

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def huge_pages_without_stalls(defrag: str | None) -> bool:
    """Whether memory advised ``MADV_HUGEPAGE`` gets huge pages without stalling its page
    faults, given the kernel's transparent huge page ``defrag`` setting (the text of
    /sys/kernel/mm/transparent_hugepage/defrag, the chosen one in brackets; None: unknown).
    With ``always``, ``madvise`` or ``defer+madvise`` an advised fault compacts memory
    directly when no huge page is free: on a busy machine that costs two to three times the
    plain pages' faults and the copy together, in every fresh buffer of a first epoch. Free
    huge pages are no cure in a virtual machine whose host backs guest memory as it is
    first touched: here (``madvise``, 8 GB of free order-9 blocks in /proc/buddyinfo, a
    new process) the fetch of one 110 MB shard took 443-530 ms advised against 155-175 ms
    populated in small pages, and the first epoch of a new dataset 19-29k against
    45-49k samples/s (2026-12-03, three runs each, alternating)."""
    if defrag is None or "[" not in defrag:
        return False
    return defrag.split("[", 1)[1].split("]", 1)[0] in ("defer", "never")


def _thp_defrag() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/defrag") as f:
            return f.read()
    except OSError:
        return None


#: read once, at import: the setting is the machine's
_ASK_HUGE = _MADV_HUGEPAGE is not None and huge_pages_without_stalls(_thp_defrag())


def _fresh_buffer(size: int) -> mmap.mmap:
    """A new private buffer. One of 2 MB or more asks for huge pages where the kernel gives
    them without stalling (:func:`huge_pages_without_stalls`): samples are read at random
    places in it (a 4 KB page costs a TLB miss per read), and faulting it in takes one trap
    per 2 MB instead of per 4 KB; it is then not populated up front (that would map small
    pages before the advice could apply). Elsewhere it is populated in one call."""
    if size >= _HUGE_PAGE and _ASK_HUGE and _MADV_HUGEPAGE is not None:
        mm = mmap.mmap(-1, size, flags=_ANON_PRIVATE & ~getattr(mmap, "MAP_POPULATE", 0))
        try:
            mm.madvise(_MADV_HUGEPAGE)
        except OSError:  # only a hint
            pass
        return mm
    return mmap.mmap(-1, size, flags=_ANON_PRIVATE)


#: a shard of this many bytes or more has its sample table read on a thread of its own,
#: beside the read of its bytes (:meth:`ShardSource.fetch`): in a new process a 110 MB
#: shard's bytes took 120 ms (fresh pages, the copy) and its sample table 55 ms, one after
#: the other; side by side its whole fetch took 100-136 ms against 155-175 ms (2026-12-03)
BESIDE_BYTES = 16 << 20


class _Beside:
    """``fn()`` on a thread of its own, started now; :meth:`result` waits for it and
    returns what it returned or raises what it raised."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="datapipe-table", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


#: A file whose status changed this recently (ns) is hashed again at its next read:
#: status times come from a coarse clock (a jiffy here, a second or two on some file
#: systems), so a write in the same tick as our read could leave them unchanged.
_RACY_NS = 2_000_000_000


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # ctime is the one field no caller can set back (utime sets atime/mtime and moves ctime
    # to now); with inode and device it changes on every write, truncate and replacement
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)



def _read_into(path: str, limit: int, pool: BufferPool) -> tuple[mmap.mmap | None, os.stat_result, os.stat_result]:
    """(the first ``min(size, limit)`` bytes of ``path`` in a pooled buffer, or None when
    there are none; the file's status before and after the read). A file that shrinks while
    it is read gives a shorter buffer, never an error or a signal."""
    f, st0 = open_regular(path)  # a FIFO or device where a shard was: refused, never waited on
    with f:
        want = max(0, min(st0.st_size, limit))
        if want == 0:
            return None, st0, os.fstat(f.fileno())
        try:
            os.posix_fadvise(f.fileno(), 0, want, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):  # only a hint
            pass
        mm = pool.take(want)
        try:
            got = 0
            with memoryview(mm) as view:
                while got < want:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
            st1 = os.fstat(f.fileno())
            if got < want:
                if got == 0:
                    pool.give(mm)
                    return None, st0, st1
                mm.resize(got)
        except BaseException:
            pool.give(mm)
            raise
    return mm, st0, st1


class ShardSource:
    """The shards of one or more datasets, numbered globally in the order given."""

    def __init__(self, urls: list[str], storage_options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
                 retry: RetryPolicy | None = None, max_pooled_bytes: int = 512 << 20) -> None:
        if not urls:
            raise PlanError("a StreamingDataset needs at least one dataset URL")
        self.urls = list(urls)
        options = storage_options if isinstance(storage_options, list) else [storage_options] * len(self.urls)
        if len(options) != len(self.urls):
            raise PlanError(f"{len(self.urls)} dataset URLs but {len(options)} storage_options")
        self.indexes = [_open_source(u, o) for u, o in zip(self.urls, options)]
        #: which indexes lie on a local filesystem
        self._local_index = [isinstance(ix, DatasetIndex) and ix.store.local_path("") is not None
                             for ix in self.indexes]
        #: every shard is read from a local filesystem (an index of existing tars may name
        #: shards elsewhere: not counted as local)
        self.local = all(self._local_index) and not any(getattr(ix, "tar_index", False) for ix in self.indexes)
        self.retry = retry or RetryPolicy()
        counts = [ix.sample_counts.astype(np.int64) for ix in self.indexes]
        self.counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        #: stored bytes of each shard (what the prefetch budget counts)
        self.sizes = np.concatenate([_shard_sizes(ix) for ix in self.indexes]).astype(np.int64)
        self.source_of = np.repeat(np.arange(len(counts)), [c.size for c in counts])
        self.shard_base = np.concatenate(([0], np.cumsum([c.size for c in counts]))).astype(np.int64)
        self.num_samples = int(self.counts.sum())
        #: local shard files whose bytes matched their checksum in this process: path ->
        #: (file identity, checksum); see _read_local
        self._verified: dict[str, tuple[tuple[int, ...], str]] = {}
        #: what this process and the others reading these datasets with it (DataLoader
        #: workers) found: shard files verified, recorded layouts borne out (see .layouts)
        self.memo = ShardMemo(self.num_shards)
        #: field layouts of verified shards, kept across epochs (bounded; see .layouts)
        self.layouts = LayoutCache()
        #: checked sample tables by shard, for the passes after the first: 2^18 rows of the
        #: sample table held at most (about 260 bytes each, Python and Arrow)
        self.tables = LayoutCache(1 << 18)
        #: False: no layout is looked for, every sample is checked and parsed on its own by
        #: the strict tar parser (the reference the laid-out readers are tested against)
        self.find_layouts = True
        #: idle private buffers for local shard bytes, reused across shards and epochs
        self.buffers = BufferPool(max_pooled_bytes)
        #: shards said to have changed since they were indexed (warned once each)
        self._changed: set[str] = set()
        #: a :class:`datapipe.telemetry.Telemetry` counting the retried shard reads and the
        #: throttled answers of reads without a cache (the dataset's; a cache counts its own)
        self.telemetry: Telemetry | None = None
        if self.num_samples == 0:
            raise PlanError(f"{', '.join(self.urls)}: the dataset holds no sample; nothing to stream")

    @property
    def num_shards(self) -> int:
        return int(self.counts.size)

    def identity(self) -> str:
        """What makes these datasets these datasets (for resume checks): a checksum of their
        manifests and shard checksums, so a re-packed or different dataset does not match."""
        parts = [json.dumps(ix.manifest, sort_keys=True, default=str) + "\n" + "\n".join(map(str, _shard_checksums(ix)))
                 for ix in self.indexes]
        return checksum("\0".join(parts).encode())

    def info(self, g: int) -> tuple[DatasetIndex, ShardInfo]:
        s = int(self.source_of[g])
        ix = self.indexes[s]
        return ix, ix.shards[g - int(self.shard_base[s])]

    def url(self, g: int) -> str:
        return self.info(g)[1].url

    def shard_bytes(self, g: int) -> int:
        return int(self.sizes[g])

    def fetch(self, g: int, cache: Any = None) -> ShardData | TableRows:
        """Shard ``g``'s bytes and sample table (blocking; run it off the event loop); for
        a Parquet table, its rows."""
        ix, info = self.info(g)
        local = g - int(self.shard_base[int(self.source_of[g])])
        if isinstance(ix, ParquetTable):
            table, keys = call_with_retry(lambda: ix.read_row_group(local, self.buffers.max_bytes), info.url,
                                          self.retry)
            return TableRows(g, info.url, table, keys)
        # the sample table is read in row groups from the store: retried like shard bytes;
        # a local one is read as local shard bytes are, without the retry layer's attempt
        # threads (its timeouts are for requests that hang on a network)
        if self._local_index[int(self.source_of[g])]:
            read_table = partial(ix.shard_samples, local)
        else:
            read_table = partial(call_with_retry, partial(ix.shard_samples, local), f"{ix.url} sample table",
                                 self.retry)
        # a table read before (an earlier pass) is kept, checked; a large shard's table is
        # read beside its bytes: both wait on the kernel (fresh pages, the copy, pyarrow's
        # decode) more than on the GIL
        kept: SampleTable | None = self.tables.get(g)
        side = _Beside(read_table) if kept is None and info.bytes >= BESIDE_BYTES else None
        error: Exception | None = None
        identity: tuple[int, ...] | None = None
        closer: Any = None
        try:
            if kept is not None:
                table = kept
            elif side is None:
                table = self._table(read_table, ix, info)
            try:
                buf, closer, verified, identity = self._bytes(ix, info, cache, g)
            except (IntegrityError, CorruptShardError) as e:
                buf, closer, error, verified = memoryview(b""), None, e, False
            if side is not None:
                table = self._table(side.result, ix, info)
            if kept is None:
                # its arrays are slices of the row groups they were read from, which stay
                # held while it is: charged as its rows and two whole groups
                self.tables.put(g, table, len(table) + 2 * int(ix.manifest["sample_row_group"]))
        except BaseException:
            if side is not None:
                side.join()  # its table is dropped; nothing of it is held
            if closer is not None:
                closer()
            raise
        if not verified and error is None and info.checksum and info.url not in self._changed:
            self._changed.add(info.url)
            warnings.warn(f"shard {info.url} no longer matches its index (its checksum or its size of "
                          f"{info.bytes} bytes): it changed since it was indexed. Each sample is checked on "
                          "its own; members added since are not read. Index or pack it again",
                          RuntimeWarning, stacklevel=2)
        data = ShardData(g, info.url, buf, table, ix.compression, closer, error, verified, tar_bytes=info.tar_bytes)
        if verified and self.find_layouts and data.compression == "none" and data.max_end <= len(data.buf):
            key = (g, len(data.buf), info.checksum)
            data.layout = self.layouts.get(key)
            if data.layout is None:
                ends = data.offsets + data.lengths
                index = str(ix.manifest["manifest_checksum"])
                try:
                    if table.layout is None:  # an index that records none (version 1): found from the headers
                        data.layout = find_layout(data.src, data.offsets.tolist(), ends.tolist(), data.keys,
                                                  info.url)
                    elif identity is not None and self.memo.laid_out(g, identity, info.checksum, index):
                        data.layout = table.layout.placed(data.offsets)  # these very bytes bore it out
                    else:  # recorded by the writer: the shard's headers must bear it out
                        data.layout = check_layout(data.src, table.layout, data.offsets, ends, *table.key_bytes,
                                                   data.keys, info.url)
                        if identity is not None:
                            self.memo.note(g, identity, info.checksum, index)
                except CorruptShardError as e:  # every sample raises it (or is skipped)
                    data.error = e
                else:
                    self.layouts.put(key, data.layout)
        return data

    @staticmethod
    def _table(read: Any, ix: Any, info: Any) -> SampleTable:
        """Shard ``info``'s sample table from ``read()``, checked to list its samples."""
        try:
            table: SampleTable = read()
        except DatapipeError:
            raise
        except Exception as e:  # pyarrow errors on a damaged samples.parquet
            raise FormatError(f"{ix.url}: cannot read the sample table of {info.url}: {e}") from e
        if len(table.keys) != info.samples:
            raise FormatError(f"{info.url}: index lists {len(table.keys)} samples, expected {info.samples}")
        return table

    def _bytes(self, ix: Any, info: Any, cache: Any, g: int) -> tuple[memoryview, Any, bool, tuple[int, ...] | None]:
        """(bytes, closer, verified, identity of the settled local file they were read
        from, else None). A shard that fails its whole-shard checksum is still returned,
        unverified: its samples are then checked one by one, so the error (or the skip)
        names the bad sample and the good ones still read."""
        if cache is not None:
            # the cache verifies what it serves against the checksum passed here
            if _has_warm_tier(cache):
                # pin_or_read: a pinned warm copy when the cache keeps one, else (the
                # clairvoyant rule would not admit the shard) its bytes read through, held
                # in our memory like a copy read out (the prefetch budget covers both);
                # local_path for a cache without it (always a pinned copy)
                pin_or_read = getattr(cache, "pin_or_read", None)
                try:
                    if pin_or_read is not None:
                        got = pin_or_read(info.url, checksum=info.checksum)
                    else:
                        got = cache.local_path(info.url, checksum=info.checksum)
                except IntegrityError as e:
                    raise CorruptShardError(f"shard fails its checksum: {e}") from e
                if isinstance(got, bytes):
                    return memoryview(got), None, bool(info.checksum), None
                path = got
                try:
                    # read while pinned; the private copy needs no pin once read
                    t0 = time.perf_counter()
                    read = self._read_local(path, info, f"the warm copy of {info.url} at {path}", ix.url, g)
                    seconds = time.perf_counter() - t0
                    tel = getattr(cache, "telemetry", None)  # the warm tier's bytes, as its reader timed them
                    if tel is not None:
                        tel.read("warm", len(read[0]), seconds)
                    note_read = getattr(cache, "note_read", None)  # and for its rule against slow tiers
                    if note_read is not None:
                        note_read(info.url, len(read[0]), seconds)
                    return read
                finally:
                    cache.release(info.url)
            try:
                return memoryview(cache.read(info.url, checksum=info.checksum)), None, bool(info.checksum), None
            except IntegrityError as e:
                raise CorruptShardError(f"shard fails its checksum: {e}") from e
        store, name = ix.shard_location(info)  # an index of existing tars names shards elsewhere
        local = store.local_path(name)
        if local is not None:
            return self._read_local(local, info, f"shard {info.url}", ix.url, g)
        # Transient failures are retried; a shard shorter than the index says is not
        # (asking again cannot lengthen it) and shows as truncated samples when read.
        data = call_with_retry(lambda: store.get(name), info.url, self.retry, on_retry=self._retried)
        return memoryview(data), None, bool(info.checksum) and checksum(data) == info.checksum, None

    def _retried(self, error: BaseException) -> None:
        tel = self.telemetry
        if tel is not None:
            tel.cold_retry()
            if is_throttle(error):
                tel.throttled()

    def _read_local(self, path: str, info: Any, what: str, listed_in: str,
                    g: int) -> tuple[memoryview, Any, bool, tuple[int, ...] | None]:
        """(bytes, closer, verified, the file's identity if it is settled and the bytes
        verified, else None) of the local file ``path`` holding shard ``g`` (``info``).

        What is returned is a private copy, and "verified" is a claim about that copy:
        either its own hash matched, or the file's identity (device, inode, size, mtime,
        ctime) was, before and after this read, the one it had when a read of it was
        hashed and matched, in this process or in another reading the dataset with it
        (:class:`.layouts.ShardMemo`: the DataLoader workers of this dataset). Any write,
        truncate, ``utime`` or replacement of the file changes its ctime (or inode), so a
        file changed since then is hashed again; a write racing this read moves ctime
        before its bytes land, so the status taken after the read sees it. A match is
        remembered only for a file whose ctime was older than the read by more than the
        clock's granularity (``_RACY_NS``), else a later write in the same tick could keep
        the identity: such a file is hashed at every read until it settles. Not covered:
        writes through another process's writable map of the file, which move ctime only
        when a page is first dirtied.
        """
        t0 = time.time_ns()
        try:
            mm, st0, st1 = _read_into(path, int(info.bytes), self.buffers)
        except StorageError as e:  # a directory, FIFO or device where the file was (open_regular)
            self._verified.pop(path, None)
            raise StorageError(f"cannot read {what}: {e}") from None
        except FileNotFoundError:
            self._verified.pop(path, None)
            raise ObjectNotFoundError(f"{what} is missing (listed in {listed_in})") from None
        except OSError as e:
            raise StorageError(f"cannot read {what}: {e}") from e
        buf = memoryview(b"") if mm is None else memoryview(mm)
        pool = self.buffers

        def close() -> None:
            if mm is not None:
                pool.give(mm)

        before, after = _identity(st0), _identity(st1)
        # a file longer than the index says holds members the index never saw: the first
        # bytes may still match, but the shard is not the one indexed
        whole = len(buf) == int(info.bytes) == st0.st_size and bool(info.checksum)
        stable = whole and before == after
        known = stable and (self._verified.get(path) == (before, info.checksum)
                            or self.memo.verified(g, before, info.checksum))
        ok = known or (whole and checksum(buf) == info.checksum)
        settled = ok and stable and st0.st_ctime_ns < t0 - _RACY_NS
        if settled and self._verified.get(path) != (before, info.checksum):
            self._verified[path] = (before, info.checksum)
            if not self.memo.verified(g, before, info.checksum):
                self.memo.note(g, before, info.checksum)
        elif not ok:
            self._verified.pop(path, None)
        return buf, close, ok, before if settled else None
