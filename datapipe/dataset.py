"""A packed dataset read from any URL: its index (for planning) and random access by
position or key, one range read per sample."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from .checksum import checksum, verify
from .decode import make_decoder
from .errors import CorruptIndexError, CorruptShardError, DatapipeError, ObjectNotFoundError, OptionError
from .format import (
    BLOCK,
    MANIFEST,
    SAMPLE_BASE,
    TAR_INDEX,
    SampleRecords,
    SampleRows,
    StoredLayout,
    check_shard_rows,
    decode_sample,
    is_checksum,
    next_member_name,
    parse_manifest,
    read_shard_columns,
    sample_checksums,
    sample_rows,
    stored_layout,
)
from .options import check_int, check_mapping, check_path, show
from .storage import SeekableFile, Store, is_local_url, open_store, split_url

__all__ = ["ShardInfo", "ShardInfos", "SampleTable", "DatasetIndex", "Dataset", "open_index"]


@dataclass(frozen=True)
class ShardInfo:
    name: str
    url: str
    bytes: int
    samples: int
    checksum: str
    first_sample: int
    tar_bytes: int


class SampleTable:
    """The samples of one shard, in stored order: its index rows, checked to tile it.
    ``keys``, ``offsets``, ``lengths``; ``checksums`` (made ``str`` on first use: a reader
    of a shard verified whole needs none); ``key_bytes``: the keys' UTF-8 and where each
    starts in it; ``layout``: the member layout the index records (None for a version 1
    index, or a shard whose writer recorded none), not yet checked against the shard."""

    def __init__(self, rows: SampleRows | None = None, layout: StoredLayout | None = None,
                 checksums: Callable[[], list[str]] | None = None) -> None:
        self._rows = rows
        self._checksums = checksums
        self.layout = layout
        empty = np.zeros(0, dtype=np.int64)
        self.keys: list[str] = rows.keys if rows is not None else []
        self.offsets: NDArray[np.int64] = rows.offset if rows is not None else empty
        self.lengths: NDArray[np.int64] = rows.length if rows is not None else empty
        self.key_bytes: tuple[NDArray[np.uint8], NDArray[np.int64]] = \
            (rows.key_data, rows.key_offsets) if rows is not None else (np.zeros(0, np.uint8), np.zeros(1, np.int64))

    def __len__(self) -> int:
        return len(self.keys)

    @cached_property
    def checksums(self) -> list[str]:
        if self._checksums is not None:
            return self._checksums()  # read (and checked) now: the first reader that needs them
        return self._rows.checksums if self._rows is not None else []

    def records(self) -> SampleRecords:
        """These rows as a writer records them (``join`` writes them into another index)."""
        lay = self.layout
        if lay is None:
            return SampleRecords(self.keys, self.offsets.tolist(), self.lengths.tolist(), self.checksums)
        joined = ["/".join(f) for f in lay.shapes]
        return SampleRecords(self.keys, self.offsets.tolist(), self.lengths.tolist(), self.checksums,
                             [joined[i] for i in lay.shape.tolist()], lay.bounds.tolist())


class ShardInfos(Sequence[ShardInfo]):
    """The shards of an index, each :class:`ShardInfo` made when asked for: an index of
    10^4 shards opens without making 10^4 objects."""

    def __init__(self, index: DatasetIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return self._index.num_shards

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, i: slice) -> list[ShardInfo]: ...

    def __getitem__(self, i: int | slice) -> ShardInfo | list[ShardInfo]:
        n = len(self)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(n))]
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"shard {i} out of range ({n} shards)")
        return self._index.shard_info(j)


class _VerifiedFile(SeekableFile):
    """A seekable read-only file over ranged reads of one object, for pyarrow, that hands
    out only bytes verified against the manifest's per-block checksums of that object:
    a read fetches the whole blocks it touches and checks each before copying from it."""

    def __init__(self, store: Store, key: str, digest: dict[str, Any], where: str) -> None:
        super().__init__(digest["bytes"])
        self._store, self._key, self._where = store, key, where
        self._block, self._sums = digest["block"], digest["blocks"]
        self._cache: OrderedDict[int, bytes] = OrderedDict()

    def _get(self, b: int) -> bytes:
        data = self._cache.get(b)
        if data is not None:
            self._cache.move_to_end(b)
            return data
        lo = b * self._block
        hi = min(self._size, lo + self._block)
        data = bytes(self._store.get_range(self._key, lo, hi))
        if len(data) != hi - lo or checksum(data) != self._sums[b]:
            raise CorruptIndexError(
                f"checksum mismatch for {self._where} (bytes {lo}..{hi}): the index file is damaged "
                "or was replaced (re-run the pack that wrote it)"
            )
        self._cache[b] = data
        while len(self._cache) > 4:
            self._cache.popitem(last=False)
        return data

    def readinto(self, b: Any) -> int:
        end = min(self._size, self._pos + len(b))
        n = 0
        while self._pos < end:
            blk = self._pos // self._block
            data = self._get(blk)
            lo = self._pos - blk * self._block
            take = min(end - self._pos, len(data) - lo)
            b[n : n + take] = data[lo : lo + take]
            n += take
            self._pos += take
        return n


def _index_error(where: str, e: BaseException) -> CorruptIndexError:
    return CorruptIndexError(f"{where}: unreadable index file ({type(e).__name__}: {e}); "
                             "re-run the pack that wrote it")


def _check_statistics(md: Any, g: int, where: str, num_shards: int) -> None:
    """Refuse, from the footer alone, a row group of the sample table whose column ranges
    no valid row has (an empty checksum, a shard number out of range, a negative offset),
    before any of its rows is decoded (checked as the group is first read, not at open:
    at 10^7 samples the footer holds 1,221 groups of 7 columns, 33 ms of Python to walk)."""
    group = md.row_group(g)
    for c in range(group.num_columns):
        col = group.column(c)
        st = col.statistics
        if st is None or not st.has_min_max:
            continue
        name, lo, hi = col.path_in_schema, st.min, st.max
        bad = (name == "checksum" and not (is_checksum(lo) and is_checksum(hi))) \
            or (name == "shard" and not (0 <= lo and hi < num_shards)) \
            or (name == "offset" and lo < 0) or (name == "length" and lo <= 0) \
            or (name == "key" and not lo)
        if bad or (st.has_null_count and st.null_count and name in SAMPLE_BASE):  # the layout may be null
            raise CorruptIndexError(
                f"{where}: column {name!r} of row group {g} holds values no valid index has "
                f"({lo!r}..{hi!r}); the index is damaged (re-run the pack that wrote it)"
            )


class DatasetIndex:
    """``manifest.json`` and ``shards.parquet`` of a dataset; per-sample rows on demand.

    Every reader (random access, ``verify``, the streaming loader, ``join``) opens a dataset
    here: the manifest is checked against its own checksum and every field validated,
    ``shards.parquet`` is checked whole against the manifest, and each block of
    ``samples.parquet`` is checked when it is first read; each shard's rows are checked to
    tile that shard. No offset is used before all of that passed."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = check_path("url", url).rstrip("/")
        self.storage_options = None if storage_options is None else check_mapping("storage_options", storage_options)
        self.store = open_store(self.url, storage_options)
        try:
            manifest_bytes = self.store.get(MANIFEST)
        except ObjectNotFoundError:
            if self.store.local_path("") is None or not os.path.isfile(self.store.root):
                raise ObjectNotFoundError(_no_manifest_message(self.url, self.store)) from None
            raise ObjectNotFoundError(  # a local file given where a dataset folder belongs
                f"no dataset at {self.url}: it is a file, not a dataset folder. For tar shards, pass "
                "the shard URLs (or a pattern such as shard-{000000..000099}.tar) to open_dataset / "
                "StreamingDataset, which index them on first use, or run `datapipe index URL... "
                "--index-to DEST` and open DEST"
            ) from None
        self.manifest = parse_manifest(manifest_bytes, self.store.url(MANIFEST))
        self.compression: str = self.manifest["compression"]
        shards_file = self.manifest["shards_file"]
        self._index_files: dict[str, dict[str, Any]] = self.manifest["index_files"]
        self._index_checksums: dict[str, str] = self.manifest["index_checksums"]
        table = self.store.get(shards_file)
        where = self.store.url(shards_file)
        if len(table) != self._index_files[shards_file]["bytes"] \
                or checksum(table) != self._index_checksums[shards_file]:
            raise CorruptIndexError(
                f"checksum mismatch for {where}: it is not the shard table the manifest "
                "names (damaged or replaced; re-run the pack that wrote it)"
            )
        cols = read_shard_columns(table, where, self.manifest)
        #: an index of existing tars (`datapipe index`): shards stay where they are
        self.tar_index = self.manifest.get("origin") == TAR_INDEX
        #: the index format's version (1: no member layouts recorded)
        self.version: int = self.manifest["version"]
        self._shard_stores: dict[str, Store] = {}
        self._cols = cols
        counts = cols.samples
        self.sample_counts = counts
        #: stored bytes and checksum of each shard (what ``shards[i]`` also says)
        self.shard_sizes: NDArray[np.int64] = cols.bytes
        self.shard_checksums: list[str] = cols.checksums
        self.first_samples = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
        self.num_shards = len(cols)
        self.shards = ShardInfos(self)
        self.num_samples = int(counts.sum())
        self._row_group = int(self.manifest["sample_row_group"])
        self._samples_file = self.manifest["samples_file"]
        self._samples_where = self.store.url(self._samples_file)
        self._groups: OrderedDict[int, pa.Table] = OrderedDict()
        self._sums: OrderedDict[int, pa.Table] = OrderedDict()  # each row group's checksum column, read apart
        self._checked: set[int] = set()  # row groups whose footer statistics passed
        self._lock = threading.Lock()
        # the footer now, so that a damaged or inconsistent sample table fails at open
        self._pq: pq.ParquetFile | None = self._samples_parquet()

    def _shard_url(self, name: str) -> str:
        if self.tar_index and (name.startswith("/") or "://" in name):
            return name  # an existing shard, where it lies
        return self.store.url(name)

    def shard_info(self, i: int) -> ShardInfo:
        """Shard ``i`` (``shards[i]``)."""
        c = self._cols
        name = c.names[i]
        return ShardInfo(name, self._shard_url(name), int(c.bytes[i]), int(c.samples[i]), c.checksums[i],
                         int(self.first_samples[i]), int(c.tar_bytes[i]))

    def shard_location(self, info: ShardInfo) -> tuple[Store, str]:
        """(store, key) to read shard ``info`` from: the dataset's store, or for a shard of
        an index of existing tars that lies elsewhere, a store of its folder (opened with
        this index's storage options, once per folder)."""
        if not self.tar_index or info.url == self.store.url(info.name):  # a packed shard: its own folder
            return self.store, info.name
        folder, key = split_url(info.url)
        store = self._shard_stores.get(folder)
        if store is None:
            opts = None if is_local_url(folder) else self.storage_options
            store = self._shard_stores[folder] = open_store(folder, opts)
        return store, key

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pq"], state["_groups"], state["_sums"], state["_lock"] = None, OrderedDict(), OrderedDict(), None
        state["_shard_stores"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _samples_parquet(self) -> pq.ParquetFile:
        """``samples.parquet`` through verified blocks, its row groups checked against the
        manifest's row count and ``sample_row_group``."""
        where = self._samples_where
        digest = self._index_files[self._samples_file]
        size = self.store.size(self._samples_file)
        if size != digest["bytes"]:
            raise CorruptIndexError(
                f"{where} has {size} bytes, the manifest says {digest['bytes']} (damaged or replaced; "
                "re-run the pack that wrote it)"
            )
        try:
            f = pq.ParquetFile(_VerifiedFile(self.store, self._samples_file, digest, where), pre_buffer=False)
            md = f.metadata
            rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        except DatapipeError:
            raise
        except Exception as e:
            raise _index_error(where, e) from None
        rg, n = self._row_group, self.num_samples
        expect = [min(rg, n - g * rg) for g in range(-(-n // rg))]
        if rows != expect:
            raise CorruptIndexError(
                f"{where}: row groups of {rows[:4]}... rows do not match {n} samples in groups of "
                f"{rg} (sample_row_group in {MANIFEST}); re-run the pack that wrote it"
            )
        return f

    def _group(self, g: int, checksums: bool = False) -> pa.Table:
        """Row group ``g`` of ``samples.parquet`` (read through verified blocks; a few kept),
        without its ``checksum`` column unless asked for: a reader of a shard verified whole
        needs no sample's checksum, and they are the largest column (read apart, on demand)."""
        with self._lock:
            cache = self._sums if checksums else self._groups
            table = cache.get(g)
            if table is not None:
                cache.move_to_end(g)
                return table
            if self._pq is None:
                self._pq = self._samples_parquet()
            if g not in self._checked:
                _check_statistics(self._pq.metadata, g, self._samples_where, self.num_shards)
                self._checked.add(g)
            names = self._pq.schema_arrow.names
            columns = ["checksum"] if checksums else [c for c in names if c != "checksum"]
            try:
                # no Arrow pool: see read_shard_columns
                table = self._pq.read_row_group(g, columns=columns, use_threads=False)
            except DatapipeError:
                raise
            except Exception as e:
                raise _index_error(self._samples_where, e) from None
            cache[g] = table
            while len(cache) > 8:
                cache.popitem(last=False)
            return table

    def _slice(self, start: int, stop: int, checksums: bool = False) -> pa.Table:
        """Global sample rows ``[start, stop)`` of ``samples.parquet`` (its checksums only, if
        asked): each row group is sliced to the rows asked for, so the cost follows the rows,
        not the row groups."""
        rg = self._row_group
        pieces = []
        for g in range(start // rg, (stop - 1) // rg + 1):
            lo, hi = max(start, g * rg) - g * rg, min(stop, (g + 1) * rg) - g * rg
            pieces.append(self._group(g, checksums).slice(lo, hi - lo))
        return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)

    def _rows(self, start: int, stop: int, checksums: bool = False) -> SampleRows:
        """Global sample rows ``[start, stop)``, checked (:func:`datapipe.format.index.sample_rows`)."""
        table = self._slice(start, stop)
        if checksums:
            table = table.append_column("checksum", self._slice(start, stop, checksums=True).column("checksum"))
        return sample_rows(table, f"{self._samples_where} rows {start}..{stop}", self.num_shards)

    def _checksums(self, start: int, stop: int) -> list[str]:
        """The checked sample checksums of rows ``[start, stop)``."""
        column = self._slice(start, stop, checksums=True).column("checksum")
        out: list[str] = sample_checksums(column, f"{self._samples_where} rows {start}..{stop}").to_pylist()
        return out

    def shard_samples(self, i: int) -> SampleTable:
        """The rows of shard ``i``, checked to tile the shard (see
        :func:`datapipe.format.index.check_shard_rows`), with the member layout the index
        records for it (see :class:`SampleTable`)."""
        info = self.shards[i]
        if info.samples == 0:
            return SampleTable()
        rows = self._rows(info.first_sample, info.first_sample + info.samples)
        check_shard_rows(rows, i, info, self.compression, self._samples_where, gaps=self.tar_index)
        tar_bytes = None if self.compression == "none" else info.tar_bytes
        layout = stored_layout(rows, f"{self._samples_where} (shard #{i}, {info.name})", tar_bytes)
        return SampleTable(rows, layout, partial(self._checksums, info.first_sample, info.first_sample + info.samples))

    def locate(self, i: int) -> tuple[int, str, int, int, str]:
        """``(shard, key, offset, length, checksum)`` of global sample ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.url} ({self.num_samples} samples)")
        c = self._rows(i, i + 1, checksums=True)
        shard, off, ln = int(c.shard[0]), int(c.offset[0]), int(c.length[0])
        info = self.shards[shard]
        if not info.first_sample <= i < info.first_sample + info.samples or off + ln > info.bytes:
            raise CorruptIndexError(
                f"{self._samples_where}: row {i} names shard #{shard} ({info.name}) bytes {off}..{off + ln}, "
                "outside that shard; the index is damaged (re-run the pack that wrote it)"
            )
        return shard, c.keys[0], off, ln, c.checksums[0]

    def verify_sample_table(self) -> None:
        """Check ``samples.parquet`` whole against the checksum in the manifest."""
        data = self.store.get(self._samples_file)
        if checksum(data) != self._index_checksums[self._samples_file]:
            raise CorruptIndexError(f"checksum mismatch for {self._samples_where}: the sample table is "
                                    "damaged or was replaced (re-run the pack that wrote it)")

    def keys(self) -> list[str]:
        n, rg, keys = self.num_samples, self._row_group, []
        for g in range(-(-n // rg)):
            keys.extend(self._rows(g * rg, min(n, (g + 1) * rg)).keys)
        return keys


def _no_manifest_message(url: str, store: Store) -> str:
    """Why there is no dataset at ``url``, and what to run: `datapipe index` for a folder
    of existing tar shards, else the pack that did not finish."""
    try:
        folder = store.local_path("")
        names = sorted(os.listdir(folder)) if folder is not None else store.list()
        tars = [k for k in names if k.endswith(".tar") and "/" not in k][:3]
        packing = any(k == "_pack" or k.startswith("_pack/") for k in names)  # an unfinished pack's journal
    except (DatapipeError, OSError):
        tars, packing = [], False
    if tars and not packing:
        return (f"no dataset at {url}: {MANIFEST} is missing, and the folder holds tar shards ({', '.join(tars)}"
                f"{', ...' if len(tars) == 3 else ''}). Index them where they are with `datapipe index "
                f"{url}` (or `datapipe index {url} --index-to DEST` for a folder you may not write) and open "
                "that index, or pass the shard URLs themselves, which are indexed on first use")
    return (f"no dataset at {url}: {MANIFEST} is missing (not packed, or packing did not finish: run the "
            "same `datapipe pack` command again; for existing tar shards, run `datapipe index`)")


def open_index(url: str, storage_options: dict[str, Any] | None = None) -> DatasetIndex:
    return DatasetIndex(url, storage_options)


class Dataset:
    """Random access to a packed dataset: ``len(ds)``, ``ds[i]``, ``ds.get(key)``.
    Each sample is one range read of its shard, verified against its checksum, then decoded
    as ``decode`` says (:mod:`datapipe.decode`; default None: bytes)."""

    def __init__(self, index: DatasetIndex, decode: Any = None) -> None:
        if not isinstance(index, DatasetIndex):
            raise OptionError(f"index={show(index)}: expected a DatasetIndex (open_index(url)); or call "
                              "datapipe.open_dataset(url)")
        self.index = index
        self._decode = make_decoder(decode)
        self._key_to_pos: dict[str, int] | None = None

    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        # an int; out of range is an IndexError, as for any sequence (iteration relies on it)
        i = check_int("i", i, hint="a sample's position; ds.get(key) reads by key")
        if i < 0:
            i += len(self)
        shard, key, offset, length, expected = self.index.locate(i)
        info = self.index.shards[shard]
        where = f"{info.url} sample {key!r} (bytes {offset}..{offset + length})"
        plain = self.index.compression == "none"
        # uncompressed: one more block, the header after the sample, must not continue it
        extra = BLOCK if plain and offset + length + BLOCK <= info.bytes else 0
        store, name = self.index.shard_location(info)
        data = store.get_range(name, offset, offset + length + extra)
        data, after = data[:length], bytes(data[length:])
        verify(data, expected, where)
        sample = decode_sample(data, self.index.compression, where, limit=info.tar_bytes)
        if sample["__key__"] != key:
            raise CorruptShardError(f"{where}: the tar members name key {sample['__key__']!r}, the index {key!r}")
        # the next member's whole name (PAX path, GNU long name, ustar prefix); a name
        # "<key>.<...>/..." is another sample's: foo.v2/img.txt after foo.txt
        nxt = next_member_name(after, lambda a, b: store.get_range(name, a, b), offset + length, info.bytes,
                               where) if extra else None
        if nxt is not None and nxt.startswith(key + ".") and "/" not in nxt[len(key) + 1 :]:
            raise CorruptShardError(f"{where}: the member after the sample's range has its key too: "
                                    "the index cuts the sample short")
        return sample if self._decode.is_identity else self._decode(sample, info.url)

    def get(self, key: str) -> dict[str, Any]:
        """The sample with key ``key``. Packed datasets have unique keys; an index of
        existing tars may hold a key twice (WebDataset allows it), and such a key is
        refused here rather than answered with one of its samples."""
        if not isinstance(key, str):
            raise OptionError(f"key={show(key)}: expected a sample's key (a str); ds[i] reads by position")
        if self._key_to_pos is None:
            positions: dict[str, int] = {}
            for i, k in enumerate(self.index.keys()):
                positions[k] = -1 if k in positions else i  # -1: the key is held more than once
            self._key_to_pos = positions
        pos = self._key_to_pos.get(key)
        if pos is None:
            raise KeyError(f"no sample with key {key!r} in {self.index.url}")
        if pos < 0:
            raise KeyError(f"{self.index.url} holds more than one sample with key {key!r} (its shards repeat "
                           "the key); read them by position (dataset[i]) or iterate")
        return self[pos]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]
