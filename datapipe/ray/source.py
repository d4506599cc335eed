"""`read(url)`: a datapipe dataset (or tar shards indexed by ``datapipe index``) as a Ray
Dataset, one read task per shard range.

The driver opens the index (``open_index``: the manifest and index files checked before
any offset is used) to plan the tasks; each task opens it again the same way, reads each
of its shards whole, checks its size and checksum against the index, and only then cuts
it into samples by the index's rows (checked to tile the shard), each parsed by the
strict tar parser and checked to hold the key its row names. A row is ``__key__`` plus
one binary column per field of the dataset (null where a sample lacks that field).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource.datasource import Datasource, ReadTask

from ..checksum import verify
from ..dataset import DatasetIndex, open_index
from ..errors import CorruptShardError
from ..format import decode_sample

__all__ = ["DatapipeDatasource", "read"]


def _schema(fields: list[str]) -> pa.Schema:
    return pa.schema([("__key__", pa.string()), *((f, pa.binary()) for f in fields)])


class DatapipeDatasource(Datasource):
    """The Ray Datasource of the dataset at ``url`` (a dataset or index folder, or tar
    shards: a URL, a pattern or a list, indexed on first use as ``datapipe inspect``
    does). One read task per range of consecutive shards: as many tasks as Ray asks for, at
    most one per shard, or ``shards_per_task`` shards each."""

    def __init__(self, url: str | list[str], storage_options: dict[str, Any] | None = None,
                 shards_per_task: int | None = None) -> None:
        super().__init__()
        from ..tarindex import open_dataset

        # what open_dataset opens (a list of tar shards is one dataset, indexed on first
        # use), opened the same way: the tasks open the index it resolved to
        ix = open_dataset(url, storage_options).index
        self.url = ix.url
        self.storage_options = storage_options
        self.shards_per_task = shards_per_task
        self._shards = [(s.url, s.samples, s.tar_bytes) for s in ix.shards]
        self.fields: list[str] = sorted(ix.manifest.get("fields") or [])

    def get_name(self) -> str:
        return "Datapipe"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(tar for _, _, tar in self._shards)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        n = len(self._shards)
        if self.shards_per_task:
            ranges = [(a, min(n, a + self.shards_per_task)) for a in range(0, n, self.shards_per_task)]
        else:
            k = max(1, min(n, parallelism))
            ranges = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        tasks = []
        for a, b in ranges:
            if a == b:
                continue
            part = self._shards[a:b]
            meta = BlockMetadata(num_rows=sum(s for _, s, _ in part), size_bytes=sum(t for _, _, t in part),
                                 input_files=tuple(u for u, _, _ in part), exec_stats=None)
            tasks.append(ReadTask(partial(_read_shards, self.url, self.storage_options, a, b, self.fields),
                                  meta, schema=_schema(self.fields), per_task_row_limit=per_task_row_limit))
        return tasks


def _read_shards(url: str, storage_options: dict[str, Any] | None, start: int, stop: int,
                 fields: list[str]) -> Iterator[pa.Table]:
    ix = open_index(url, storage_options)
    for i in range(start, stop):
        yield shard_table(ix, i, fields)


def shard_table(ix: DatasetIndex, i: int, fields: list[str]) -> pa.Table:
    """Shard ``i`` of ``ix`` as a table of its samples, verified: the whole shard against
    its size and checksum, then each sample parsed and matched to its row's key."""
    info = ix.shards[i]
    store, name = ix.shard_location(info)
    data = store.get(name)
    if len(data) != info.bytes:
        raise CorruptShardError(f"{info.url} has {len(data)} bytes, the index says {info.bytes} "
                                "(truncated or replaced; pack or index it again)")
    verify(data, info.checksum, info.url)
    rows = ix.shard_samples(i)  # checked to tile the shard
    view = memoryview(data)
    cols: dict[str, list[Any]] = {"__key__": [], **{f: [] for f in fields}}
    for key, off, length in zip(rows.keys, rows.offsets.tolist(), rows.lengths.tolist()):
        where = f"{info.url} sample {key!r} (bytes {off}..{off + length})"
        sample = decode_sample(view[off : off + length], ix.compression, where, limit=info.tar_bytes)
        if sample.pop("__key__") != key:
            raise CorruptShardError(f"{where}: the tar members name another key than the index")
        extra = sample.keys() - cols.keys()
        if extra:
            raise CorruptShardError(f"{where}: fields {sorted(extra)} are not among the dataset's fields {fields} "
                                    "(the manifest lists every field; the index is damaged)")
        cols["__key__"].append(key)
        for f in fields:
            cols[f].append(sample.get(f))
    return pa.Table.from_pydict(cols, schema=_schema(fields))


def read(url: str | list[str], *, storage_options: dict[str, Any] | None = None,
         shards_per_task: int | None = None, override_num_blocks: int | None = None,
         ray_remote_args: dict[str, Any] | None = None) -> Any:
    """The dataset at ``url`` (a dataset or index URL, or tar shards: a URL, pattern or list
    of them, as :func:`datapipe.open_dataset` takes) as a ``ray.data.Dataset`` of rows
    ``{"__key__": str, field: bytes | None, ...}``: see :class:`DatapipeDatasource`. Every
    shard is verified against the index before any of its rows is produced."""
    import ray.data

    return ray.data.read_datasource(DatapipeDatasource(url, storage_options, shards_per_task),
                                    override_num_blocks=override_num_blocks, ray_remote_args=ray_remote_args or {})
