"""`DatapipeDatasink`: a Ray Data sink that writes a datapipe dataset, and :func:`write`.

Each write task rolls its own shards, named from its task index (``shard-TTTTTT-NNNNNN``):
a retried task is the same task with the same input, so it rewrites the same names, and
every shard is published by an atomic rename (or an upload that publishes on completion).
Before a shard's first byte, the task journals its name under ``_pack/`` (with this
write's token); after publishing it, the task reads it back and checks its checksum; it
returns the index rows of its shards. On the driver, ``on_write_complete`` merges the
tasks' rows, checks every key is held once and every shard has the size its rows say,
deletes the journaled shards no task returned (written by an attempt that failed) and the
temporaries named with this write's token, then commits as ``pack`` does: the index, the
manifest last, then the journal's removal. A failed write removes exactly what its
journal and token name. The destination's writer lock is held on the driver throughout.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import ray
from ray.data.block import Block, BlockAccessor
from ray.data.datasource.datasink import Datasink, WriteResult

from ..checksum import checksum
from ..errors import (
    CorruptShardError,
    DatapipeError,
    DuplicateKeyError,
    EmptyInputError,
    InputFileError,
    PackError,
)
from ..format import MANIFEST, flatten_bytes_structs, key_text, row_fields, shard_name
from ..packing import FileSample, PackResult, check_table_columns, commit_shards, pack_shard, plan_shards
from ..publish import (
    SHARD_FILES,
    Journal,
    ShardSeries,
    WriterLock,
    bad_option,
    check_destination,
    fingerprint,
    journal_name,
    option_flag,
    writer_options,
)
from ..storage import MemoryStore, Store, open_store

__all__ = ["DatapipeDatasink", "write", "ROW_KINDS", "FILE_COLUMNS"]

#: what a row is: "samples" (``__key__`` plus fields: bytes, str, numbers, dicts/lists as
#: JSON; nulls left out) or "files" (a sample listed by ``datapipe.packing.list_directory``: its
#: files are read inside the write task; the columns are :data:`FILE_COLUMNS`)
ROW_KINDS = ("samples", "files")
FILE_COLUMNS = ("__key__", "__fields__", "__paths__", "__sizes__", "__tar_bytes__")

# a shard name this sink gives: shard-<task>-<n>.tar[.zst]
_OUR_SHARD = re.compile(r"shard-\d{6,}-\d{6}\.tar(\.zst)?")


class DatapipeDatasink(Datasink[dict[str, Any]]):
    """``ds.write_datasink(DatapipeDatasink(dest))``: write the rows of a Ray Dataset as a
    datapipe dataset at ``dest`` (a local path or any fsspec URL reachable from every
    node). ``options`` as :class:`datapipe.ShardWriter`'s (``shard_bytes``/``shard_samples``
    or another spelling of them, ``compression``, ``level``, ``storage_options``,
    ``overwrite``: checked by :func:`datapipe.publish.writer_options`); ``rows`` as
    :data:`ROW_KINDS`;
    ``skip_errors`` (rows="files"): skip unreadable files, as ``pack --skip-errors``.
    After the write, ``result`` is the :class:`~datapipe.PackResult` and ``task_nodes``
    maps each write task's index to the Ray node id it ran on. One sink writes once."""

    def __init__(self, dest: str, *, rows: str = "samples", skip_errors: bool = False, **options: Any) -> None:
        if not isinstance(rows, str) or rows not in ROW_KINDS:
            raise bad_option("rows", rows, f"must be one of {', '.join(ROW_KINDS)}")
        o = writer_options(dest, **options)
        self.dest, self.storage_options, self.limits = o.dest, o.storage_options, o.limits
        self.compression, self.level, self.overwrite = o.compression, o.level, o.overwrite
        self.rows, self.skip_errors = rows, option_flag(skip_errors, "skip_errors")
        base = open_store(self.dest, self.storage_options)
        if isinstance(base, MemoryStore) or getattr(base, "protocol", None) == "memory":
            raise bad_option("dest", self.dest, "Ray write tasks run in other processes, where this process's "
                             "memory store does not exist; write to a path or URL every node can reach")
        # Made here, taken in begin(): its token names this write's temporaries and is in
        # the sink that Ray sends to the write tasks, whenever Ray serializes it.
        self._lock: WriterLock | None = WriterLock(base)
        self.token = self._lock.token
        self._journal: Journal | None = None
        self.result: PackResult | None = None
        self.task_nodes: dict[int, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = state["_journal"] = None  # the lock stays with the driver
        return state

    @property
    def min_bytes_per_write(self) -> int | None:
        """Rows of samples: Ray bundles input blocks up to a shard's bytes per write task,
        so that tasks write full shards rather than one small shard per small block.
        Rows of files: each block is one planned shard already."""
        return self.limits.shard_bytes if self.rows == "samples" else None

    # -- driver ------------------------------------------------------------------------
    def begin(self) -> None:
        """Take the destination's writer lock and start this write's journal (Ray calls it
        through ``on_write_start``; a caller may call it earlier to fail fast)."""
        if self._journal is not None:
            return
        lock = self._lock
        if lock is None:
            raise PackError(f"this DatapipeDatasink has written {self.dest} already: make a new one per write")
        lock.__enter__()
        try:
            check_destination(lock.store, self.overwrite, files=SHARD_FILES)
            self._journal = Journal(lock.store, fingerprint({"ray-datasink": self.token}), self.overwrite)
        except BaseException:
            self._end()
            raise

    def on_write_start(self, schema: Any = None) -> None:
        self.begin()

    def on_write_complete(self, write_result: WriteResult[dict[str, Any]]) -> None:
        self.begin()  # an empty dataset starts no write task, and Ray may not call on_write_start
        lock, journal = self._held()
        returns = [r for r in write_result.write_returns if r]
        self.task_nodes = {int(r["task"]): str(r["node"]) for r in returns}
        done = {res["name"]: res for r in returns for res in r["shards"]}
        names = sorted(done)
        if not any(done[n]["record"] for n in names):
            raise EmptyInputError(f"nothing written to {self.dest}: the dataset has no rows"
                                  + (" that could be read" if names else ""))
        _check_keys_once(self.dest, names, done)
        base = lock.base
        for name in names:
            record = done[name]["record"]
            if record is not None and base.size(name) != record["bytes"]:
                raise CorruptShardError(f"{base.url(name)} has {base.size(name)} bytes, its write task recorded "
                                        f"{record['bytes']}: it was replaced after it was written (write again)")
        self._remove_ours(keep=set(names))
        empty = PackResult(self.dest, 0, 0, 0, 0, 0.0)
        self.result = commit_shards(lock, journal, names, done, self.compression, empty,
                                    shard_bytes=self.limits.shard_bytes)
        self._end()

    def on_write_failed(self, error: Exception) -> None:
        """Remove what this write wrote (the shards its journal names, its temporaries, the
        journal), unless its manifest is published: then only the journal goes."""
        if self._journal is None:
            return
        lock, journal = self._held()
        try:
            if not lock.base.exists(MANIFEST):
                self._remove_ours(keep=set())
            journal.remove()
        finally:
            self._end()

    def _held(self) -> tuple[WriterLock, Journal]:
        if self._lock is None or self._journal is None:
            raise PackError(f"the write to {self.dest} has not begun (or has ended): call begin() first")
        return self._lock, self._journal

    def _remove_ours(self, keep: set[str]) -> None:
        """Delete the shards this write journaled that are not in ``keep`` (written by an
        attempt that failed, or by a write that failed) and this write's temporaries."""
        lock, journal = self._held()
        journal.discard(self.token, _OUR_SHARD, keep)
        lock.remove_temporaries()

    def _end(self) -> None:
        lock, self._lock, self._journal = self._lock, None, None
        if lock is not None:
            lock.release()

    # -- write task ----------------------------------------------------------------------
    def write(self, blocks: Iterable[Block], ctx: Any) -> dict[str, Any]:
        """One write task: its shards, each journaled before its first byte, published,
        then read back and checked. Returns their index rows."""
        task = int(ctx.task_idx)
        store = open_store(self.dest, self.storage_options).for_writer(self.token)
        prefix = f"shard-{task:06d}"

        def names(j: int) -> str:
            return shard_name(j, self.compression, prefix=prefix)

        def journal(name: str) -> None:
            journal_name(store, name, self.token, task=task)

        if self.rows == "files":
            results = self._write_files(store, blocks, names, journal)
        else:
            results = self._write_samples(store, blocks, names, journal, task)
        for res in results:
            if res["record"] is not None:
                _check_published(store, res["record"])
        return {"task": task, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "shards": results}

    def _write_samples(self, store: Store, blocks: Iterable[Block], names: Any, journal: Any,
                       task: int) -> list[dict[str, Any]]:
        series = ShardSeries(store, self.limits, self.compression, self.level, names, journal)
        try:
            for row in self.rows_of(blocks):
                series.write(_sample(row, task))
            series.close()
        except BaseException as e:
            try:
                series.abort(e)
            except Exception as cleanup:
                e.add_note(f"discarding the partial shard also failed: {cleanup!r}")
            raise
        return [dict(res, name=res["record"]["name"]) for res in series.results]

    def rows_of(self, blocks: Iterable[Block]) -> Iterator[dict[str, Any]]:
        """The rows of ``blocks`` as dicts of Python values, a batch at a time (struct
        columns holding bytes, such as Hugging Face images, flattened as ``pack``
        flattens them). A column no sample could keep is refused as ``pack`` refuses it
        in a table (:func:`~datapipe.packing.check_table_columns`: a ``__`` name other
        than ``__key__``, bytes inside a list), never dropped."""
        where = f"the rows written to {self.dest}"
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            check_table_columns(table.schema, where)
            table = flatten_bytes_structs(table, where, InputFileError)
            for batch in table.to_batches(max_chunksize=1024):
                yield from batch.to_pylist()

    def _write_files(self, store: Store, blocks: Iterable[Block], names: Any, journal: Any) -> list[dict[str, Any]]:
        samples = []
        for block in blocks:
            cols = BlockAccessor.for_block(block).to_arrow().select(list(FILE_COLUMNS)).to_pydict()
            for key, fields, paths, sizes, tar_bytes in zip(*(cols[c] for c in FILE_COLUMNS)):
                samples.append(FileSample(key, list(zip(fields, paths, sizes)), tar_bytes))
        results = []
        for j, group in enumerate(plan_shards(samples, self.limits.shard_bytes, self.limits.shard_samples)):
            name = names(j)
            journal(name)
            res = pack_shard((store, name, self.compression, self.level, group, self.skip_errors))
            results.append(dict(res, name=name))
        return results


def _sample(row: dict[str, Any], task: int) -> dict[str, Any]:
    key = row.pop("__key__", None)
    if key is None:
        raise PackError(f"write task {task}: a row without '__key__' ({sorted(row)[:8]}): every row must name "
                        "its sample (add a '__key__' column, e.g. with map or add_column)")
    return {"__key__": key_text(key, f"write task {task}", None, PackError), **row_fields(row)}


def _check_published(store: Store, record: dict[str, Any]) -> None:
    """Read a shard this task published back and check it against what the task wrote."""
    name = record["name"]
    data = store.get(name)
    if len(data) != record["bytes"] or checksum(data) != record["checksum"]:
        raise CorruptShardError(f"{store.url(name)} reads back as {len(data)} bytes with checksum {checksum(data)}, "
                                f"not the {record['bytes']} bytes with {record['checksum']} just written: "
                                "the store lost or changed it (write again)")


def _check_keys_once(dest: str, names: list[str], done: dict[str, dict[str, Any]]) -> None:
    where: dict[str, str] = {}
    for name in names:
        record = done[name]
        if record["record"] is None:
            continue
        for key in record["samples"]["keys"]:
            other = where.setdefault(key, name)
            if other != name:
                raise DuplicateKeyError(f"sample key {key!r} is in two rows of the dataset written to {dest} "
                                        f"(shards {other} and {name}): keys must be unique (nothing was committed)")


def ray_cause(error: BaseException) -> BaseException:
    """The :class:`DatapipeError` behind a Ray task error (Ray wraps a task's exception,
    traceback and all), else ``error`` itself."""
    seen: set[int] = set()
    e: BaseException | None = error
    found: BaseException = error
    while e is not None and id(e) not in seen:  # the innermost one that is not Ray's wrapper
        seen.add(id(e))
        if isinstance(e, DatapipeError) and not isinstance(e, ray.exceptions.RayError):
            found = e
        cause = getattr(e, "cause", None)
        e = cause if isinstance(cause, BaseException) else e.__cause__
    return found


def write(ds: Any, dest: str, *, ray_remote_args: dict[str, Any] | None = None, concurrency: int | None = None,
          **options: Any) -> PackResult:
    """Write the Ray Dataset ``ds`` (rows: ``__key__`` plus fields) as a datapipe dataset at
    ``dest`` through :class:`DatapipeDatasink` (``options`` are its options). A write task
    whose worker dies is retried (Ray Data retries tasks lost to system failures, without
    limit unless ``ray_remote_args`` sets ``max_retries``). Returns the
    :class:`~datapipe.PackResult`; a datapipe error raised in a task is raised here as
    itself."""
    t0 = time.perf_counter()
    result = write_through(ds, DatapipeDatasink(dest, **options), ray_remote_args=ray_remote_args,
                           concurrency=concurrency)
    result.seconds = time.perf_counter() - t0
    return result


def write_through(ds: Any, sink: DatapipeDatasink, **kwargs: Any) -> PackResult:
    """``ds.write_datasink(sink, **kwargs)`` and the sink's result. On failure (Ctrl-C too)
    the sink removes what this write wrote, and a datapipe error raised in a task is raised
    here as itself, not wrapped in Ray's errors."""
    try:
        ds.write_datasink(sink, **kwargs)
    except Exception as e:
        sink.on_write_failed(e)
        cause = ray_cause(e)
        if cause is e:
            raise
        raise cause from None
    except BaseException as e:
        sink.on_write_failed(RuntimeError(repr(e)))
        raise
    if sink.result is None:  # pragma: no cover - Ray returned without calling on_write_complete
        raise PackError(f"Ray finished writing {sink.dest} without committing it")
    return sink.result
