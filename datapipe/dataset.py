"""A packed dataset read from any URL: its index (for planning) and random access by
position or key, one range read per sample."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from .checksum import verify
from .errors import FormatError, ObjectNotFoundError
from .format import MANIFEST, decode_sample, parse_manifest, read_shard_table
from .format.index import sample_rows
from .storage import Store, open_store

__all__ = ["ShardInfo", "SampleTable", "DatasetIndex", "Dataset", "open_index", "open_dataset"]


@dataclass(frozen=True)
class ShardInfo:
    name: str
    url: str
    bytes: int
    samples: int
    checksum: str
    first_sample: int
    tar_bytes: int


@dataclass(frozen=True)
class SampleTable:
    """The samples of one shard, in stored order."""

    keys: list[str]
    offsets: np.ndarray
    lengths: np.ndarray
    checksums: list[str]

    def __len__(self) -> int:
        return len(self.keys)


class _RangeFile(io.RawIOBase):
    """A seekable read-only file over ranged reads of one object, for pyarrow."""

    def __init__(self, store: Store, key: str, size: int) -> None:
        self._store, self._key, self._size, self._pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        end = min(self._size, self._pos + len(b))
        if end <= self._pos:
            return 0
        data = self._store.get_range(self._key, self._pos, end)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


class DatasetIndex:
    """``manifest.json`` and ``shards.parquet`` of a dataset; per-sample rows on demand."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.store = open_store(self.url, storage_options)
        try:
            manifest_bytes = self.store.get(MANIFEST)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(
                f"no dataset at {self.url}: {MANIFEST} is missing (not packed, or packing did "
                "not finish: run the same `datapipe pack` command again)"
            ) from None
        self.manifest = parse_manifest(manifest_bytes, self.store.url(MANIFEST))
        self.compression: str = self.manifest["compression"]
        shards_file = self.manifest.get("shards_file", "shards.parquet")
        self._index_checksums: dict[str, str] = self.manifest.get("index_checksums", {})
        table = self.store.get(shards_file)
        verify(table, self._index_checksums.get(shards_file), self.store.url(shards_file))
        records = read_shard_table(table, self.store.url(shards_file))
        counts = np.array([r.samples for r in records], dtype=np.int64)
        self.sample_counts = counts
        self.first_samples = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
        self.shards = [
            ShardInfo(r.name, self.store.url(r.name), r.bytes, r.samples, r.checksum, int(f), r.tar_bytes)
            for r, f in zip(records, self.first_samples)
        ]
        self.num_shards = len(self.shards)
        self.num_samples = int(counts.sum())
        if self.num_samples != self.manifest["num_samples"]:
            raise FormatError(
                f"{self.url}: manifest says {self.manifest['num_samples']} samples, the shard "
                f"table {self.num_samples}"
            )
        self._row_group = int(self.manifest["sample_row_group"])
        self._samples_file = self.manifest.get("samples_file", "samples.parquet")
        self._pq: pq.ParquetFile | None = None
        self._groups: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pq"], state["_groups"], state["_lock"] = None, OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _group(self, g: int) -> dict[str, Any]:
        with self._lock:
            if g in self._groups:
                self._groups.move_to_end(g)
                return self._groups[g]
            if self._pq is None:
                size = self.store.size(self._samples_file)
                self._pq = pq.ParquetFile(_RangeFile(self.store, self._samples_file, size))
            rows = sample_rows(self._pq.read_row_group(g))
            self._groups[g] = rows
            while len(self._groups) > 8:
                self._groups.popitem(last=False)
            return rows

    def _rows(self, start: int, stop: int) -> dict[str, Any]:
        """Columns of global sample rows ``[start, stop)``: each row group is sliced to the
        rows asked for before anything is joined, so the cost follows the rows, not the
        row groups."""
        rg = self._row_group
        pieces = []
        for g in range(start // rg, (stop - 1) // rg + 1):
            lo, hi = max(start, g * rg) - g * rg, min(stop, (g + 1) * rg) - g * rg
            group = self._group(g)
            pieces.append({name: col[lo:hi] for name, col in group.items()})
        if len(pieces) == 1:
            return pieces[0]
        return {
            name: [x for p in pieces for x in p[name]] if isinstance(pieces[0][name], list)
            else np.concatenate([p[name] for p in pieces])
            for name in pieces[0]
        }

    def shard_samples(self, i: int) -> SampleTable:
        info = self.shards[i]
        if info.samples == 0:
            return SampleTable([], np.zeros(0, np.int64), np.zeros(0, np.int64), [])
        c = self._rows(info.first_sample, info.first_sample + info.samples)
        if len(c["key"]) != info.samples or (len(c["shard"]) and (c["shard"] != i).any()):
            raise FormatError(
                f"{self.store.url(self._samples_file)}: rows {info.first_sample}..{info.first_sample + info.samples} "
                f"do not belong to shard {i} ({info.name}); the index is damaged (run `datapipe verify`)"
            )
        return SampleTable(c["key"], np.asarray(c["offset"]), np.asarray(c["length"]), c["checksum"])

    def locate(self, i: int) -> tuple[int, str, int, int, str]:
        """``(shard, key, offset, length, checksum)`` of global sample ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.url} ({self.num_samples} samples)")
        c = self._rows(i, i + 1)
        return int(c["shard"][0]), c["key"][0], int(c["offset"][0]), int(c["length"][0]), c["checksum"][0]

    def verify_sample_table(self) -> None:
        """Check ``samples.parquet`` whole against the checksum in the manifest."""
        verify(self.store.get(self._samples_file), self._index_checksums.get(self._samples_file),
               self.store.url(self._samples_file))

    def keys(self) -> list[str]:
        size = self.store.size(self._samples_file)
        f = pq.ParquetFile(_RangeFile(self.store, self._samples_file, size))
        return f.read(columns=["key"]).column("key").to_pylist()


def open_index(url: str, storage_options: dict[str, Any] | None = None) -> DatasetIndex:
    return DatasetIndex(url, storage_options)


class Dataset:
    """Random access to a packed dataset: ``len(ds)``, ``ds[i]``, ``ds.get(key)``.
    Each sample is one range read of its shard, verified against its checksum."""

    def __init__(self, index: DatasetIndex) -> None:
        self.index = index
        self._key_to_pos: dict[str, int] | None = None

    def __len__(self) -> int:
        return self.index.num_samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < 0:
            i += len(self)
        shard, key, offset, length, expected = self.index.locate(i)
        info = self.index.shards[shard]
        where = f"{info.url} sample {key!r} (bytes {offset}..{offset + length})"
        data = self.index.store.get_range(info.name, offset, offset + length)
        verify(data, expected, where)
        return decode_sample(data, self.index.compression, where)

    def get(self, key: str) -> dict[str, Any]:
        if self._key_to_pos is None:
            self._key_to_pos = {k: i for i, k in enumerate(self.index.keys())}
        try:
            return self[self._key_to_pos[key]]
        except KeyError:
            raise KeyError(f"no sample with key {key!r} in {self.index.url}") from None

    def __iter__(self):  # noqa: ANN204 - sequential convenience
        for i in range(len(self)):
            yield self[i]


def open_dataset(url: str, storage_options: dict[str, Any] | None = None) -> Dataset:
    """Open the dataset packed at ``url`` (a local path or any fsspec URL)."""
    return Dataset(open_index(url, storage_options))
