"""The read stage of a pass: each fetched chunk's items, read by one reader per unit
(LitData's strategy object per chunk), chosen once per shard of the chunk, never per sample.

Every reader has the same method, ``items(samples, steps, progress, on_error, positions)``:
for the shard's sample indices ``samples`` (a chunk's samples of this shard, in stream
order) it yields exactly one thing per sample, the raw sample ``{"__key__": key, field:
bytes, ...}`` (plus ``__shard__``/``__sample__`` when ``positions``) or, for a sample that
cannot be read and is skipped, the :class:`~.pass_state.Skipped` marker that ``on_error``
returns. Just before it hands out sample ``samples[i]`` it sets ``progress.steps =
steps[i]``, the plan step of that sample, so a resume state taken between two items is exact.

- :class:`LaidOutShardReader`: a verified uncompressed shard whose samples all have the
  same fields (:class:`~datapipe.format.layout.ShardLayout`): a chunk's rows are gathered
  from the layout table with numpy, then one ``zip`` step, one dict display and one slice
  per field per sample, in a loop written out for 1 to 6 fields (a general one for more).
- :class:`MemberWalkReader`: a verified uncompressed shard whose samples differ in their
  fields (:class:`~datapipe.format.layout.MemberTable`).
- :class:`CheckedSampleReader`: everything else, sample by sample: a shard that failed its
  whole-shard checksum, a zstd shard (one frame per sample), a truncated one. Each sample
  is checked against its own checksum and parsed by the strict tar parser.
- :class:`TableRowsReader`: a row group of a Parquet table.
- :class:`FailedShardReader`: a shard whose fetch raised.

:func:`read_chunks` is the stage: for each chunk the fetch stage hands on, a
:class:`ChunkRead` holding its items in stream order (:func:`chunk_items`: samples of
several shards, interleaved by the shuffle; where all of them are laid out alike one such
loop reads the whole chunk, which is where the cost per sample matters most), or, for
columnar batches, the chunk's rows in the shards' layouts (:class:`LaidOutRows`), which the
batch stage cuts into columns without Python work per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count, repeat
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..errors import CorruptShardError, DatapipeError, FormatError
from ..format import MemberTable, ShardLayout, decode_sample, python_rows, row_fields
from .chunks import Chunk
from .pass_state import ErrorPolicy, Progress
from .source import ShardData, TableRows

__all__ = ["ShardReader", "LaidOutShardReader", "MemberWalkReader", "CheckedSampleReader", "TableRowsReader",
           "FailedShardReader", "reader_for", "chunk_readers", "chunk_items", "laid_out_rows", "LaidOutRows",
           "ChunkRead", "read_chunks"]


class ShardReader:
    """What every reader offers (see the module docstring)."""

    shard: int
    url: str

    def items(self, samples: NDArray[Any], steps: Sequence[int], progress: Progress, on_error: ErrorPolicy,
              positions: bool) -> Iterator[Any]:
        raise NotImplementedError


# -- laid-out shards: loops written out by number of fields ------------------------------------
# Each yields {"__key__": keys[i], field_k: srcs[i][a:b], ...} with a, b from the start and end
# columns of field k in ``cols``, setting progress.steps to steps[i] before each item. A dict
# display per number of fields: a loop over the fields costs about twice as much per sample.

def _items_1(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    (f0,) = fields
    for progress.steps, s, k, a0, b0 in zip(steps, srcs, keys, *cols):
        yield {"__key__": k, f0: s[a0:b0]}


def _items_2(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    f0, f1 = fields
    for progress.steps, s, k, a0, b0, a1, b1 in zip(steps, srcs, keys, *cols):
        yield {"__key__": k, f0: s[a0:b0], f1: s[a1:b1]}


def _items_3(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    f0, f1, f2 = fields
    for progress.steps, s, k, a0, b0, a1, b1, a2, b2 in zip(steps, srcs, keys, *cols):
        yield {"__key__": k, f0: s[a0:b0], f1: s[a1:b1], f2: s[a2:b2]}


def _items_4(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    f0, f1, f2, f3 = fields
    for progress.steps, s, k, a0, b0, a1, b1, a2, b2, a3, b3 in zip(steps, srcs, keys, *cols):
        yield {"__key__": k, f0: s[a0:b0], f1: s[a1:b1], f2: s[a2:b2], f3: s[a3:b3]}


def _items_5(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    f0, f1, f2, f3, f4 = fields
    for progress.steps, s, k, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4 in zip(steps, srcs, keys, *cols):
        yield {"__key__": k, f0: s[a0:b0], f1: s[a1:b1], f2: s[a2:b2], f3: s[a3:b3], f4: s[a4:b4]}


def _items_6(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    f0, f1, f2, f3, f4, f5 = fields
    for progress.steps, s, k, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5 in zip(steps, srcs, keys, *cols):
        yield {"__key__": k, f0: s[a0:b0], f1: s[a1:b1], f2: s[a2:b2], f3: s[a3:b3], f4: s[a4:b4], f5: s[a5:b5]}


def _items_n(srcs: Iterable[Any], fields: Sequence[str], keys: list[str], cols: list[list[int]],
             steps: Iterable[int], progress: Progress) -> Iterator[dict[str, Any]]:
    for progress.steps, s, k, row in zip(steps, srcs, keys, zip(*cols)):
        item = {"__key__": k}
        i = 0
        for f in fields:
            item[f] = s[row[i] : row[i + 1]]
            i += 2
        yield item


_LOOPS: dict[int, Callable[..., Iterator[dict[str, Any]]]] = {
    1: _items_1, 2: _items_2, 3: _items_3, 4: _items_4, 5: _items_5, 6: _items_6}


def _with_positions(items: Iterator[dict[str, Any]], shards: Iterable[int],
                    samples: Iterable[int]) -> Iterator[dict[str, Any]]:
    for item, g, j in zip(items, shards, samples):
        item["__shard__"], item["__sample__"] = g, j
        yield item


def _chunk_rows(readers: Sequence[LaidOutShardReader], loc: NDArray[Any],
                samples: NDArray[Any]) -> tuple[NDArray[Any], NDArray[Any]]:
    """(layout rows, keys) of samples ``samples`` (of shard ``readers[loc[i]]`` each): each
    reader's rows are gathered from its table in one numpy step, never the whole tables."""
    if len(readers) == 1:
        (r,) = readers
        return r.layout.table[samples], r.data.key_array[samples]
    table = np.empty((len(samples), readers[0].layout.table.shape[1]), dtype=np.int64)
    keys = np.empty(len(samples), dtype=object)
    for i, r in enumerate(readers):
        mine = np.flatnonzero(loc == i)
        if mine.size:
            rows = samples[mine]
            table[mine] = r.layout.table[rows]
            keys[mine] = r.data.key_array[rows]
    return table, keys


def _laid_out_items(readers: Sequence[LaidOutShardReader], loc: NDArray[Any], samples: NDArray[Any],
                    steps: Iterable[int], progress: Progress, positions: bool) -> Iterator[dict[str, Any]]:
    """The items of samples ``samples`` (of shard ``readers[loc[i]]`` each), all laid out
    with the same fields."""
    table, keys = _chunk_rows(readers, loc, samples)
    srcs: Iterable[Any]
    if len(readers) == 1:
        srcs = repeat(readers[0].data.src)
    else:
        by_reader = np.empty(len(readers), dtype=object)
        for i, r in enumerate(readers):  # one by one: numpy would read an mmap as an array
            by_reader[i] = r.data.src
        srcs = by_reader[loc].tolist()
    fields = readers[0].layout.fields
    loop: Callable[..., Iterator[dict[str, Any]]] = _LOOPS.get(len(fields), _items_n)
    items = loop(srcs, fields, keys.tolist(), table.T.tolist(), steps, progress)
    if positions:
        shard_ids = np.array([r.shard for r in readers], dtype=np.int64)
        return _with_positions(items, shard_ids[loc].tolist(), samples.tolist())
    return items


class LaidOutRows(NamedTuple):
    """A chunk's samples as rows of its shards' layout tables (all laid out with the same
    ``fields``): sample i lies in ``srcs[loc[i]]`` (the bytes of shard ``shards[loc[i]]``),
    field k at ``table[i, 2k]:table[i, 2k + 1]``; ``samples`` are the samples' indices in
    their shards."""

    fields: tuple[str, ...]
    table: NDArray[Any]
    keys: NDArray[Any]
    srcs: list[Any]
    shards: NDArray[Any]
    loc: NDArray[Any]
    samples: NDArray[Any]


def laid_out_rows(readers: Sequence[ShardReader], loc: NDArray[Any], samples: NDArray[Any]) -> LaidOutRows | None:
    """The chunk's rows (see :class:`LaidOutRows`), or None when its shards are not all laid
    out with the same fields (then it is read sample by sample)."""
    fields = {r.layout.fields if isinstance(r, LaidOutShardReader) else None for r in readers}
    if len(fields) != 1 or None in fields:
        return None
    laid = [r for r in readers if isinstance(r, LaidOutShardReader)]
    table, keys = _chunk_rows(laid, loc, samples)
    return LaidOutRows(tuple(laid[0].layout.fields), table, keys, [r.data.src for r in laid],
                       np.array([r.shard for r in laid], dtype=np.int64), loc, samples)


class LaidOutShardReader(ShardReader):
    """A verified uncompressed shard whose samples share one field layout."""

    def __init__(self, data: ShardData, layout: ShardLayout) -> None:
        self.shard, self.url, self.data, self.layout = data.shard, data.url, data, layout

    def items(self, samples: NDArray[Any], steps: Sequence[int], progress: Progress, on_error: ErrorPolicy,
              positions: bool) -> Iterator[Any]:
        return _laid_out_items([self], np.zeros(len(samples), np.int64), samples, steps, progress, positions)


class MemberWalkReader(ShardReader):
    """A verified uncompressed shard whose samples differ in their fields."""

    def __init__(self, data: ShardData, members: MemberTable) -> None:
        self.shard, self.url, self.data, self.members = data.shard, data.url, data, members

    def items(self, samples: NDArray[Any], steps: Sequence[int], progress: Progress, on_error: ErrorPolicy,
              positions: bool) -> Iterator[Any]:
        data, m = self.data, self.members
        src, keys, shapes, bounds = data.src, data.keys, m.shapes, m.bounds
        for progress.steps, j, shape, first in zip(steps, samples.tolist(), m.shape[samples].tolist(),
                                                   m.first[samples].tolist()):
            if shape < 0:  # a field held twice: the strict decode raises what is wrong
                try:
                    decode_sample(data.sample_bytes(j), "none", data.where(j), data.tar_bytes)
                    raise CorruptShardError(f"{data.where(j)}: a field is held twice")
                except DatapipeError as e:
                    yield on_error(self.url, keys[j], e)
                    continue
            fields = shapes[shape]
            row = bounds[first : first + 2 * len(fields)].tolist()
            item: dict[str, Any] = {"__key__": keys[j]}
            for f, a, b in zip(fields, row[0::2], row[1::2]):
                item[f] = src[a:b]
            if positions:
                item["__shard__"], item["__sample__"] = self.shard, j
            yield item


class CheckedSampleReader(ShardReader):
    """Sample by sample: each checked against its own checksum (a zstd frame decompressed
    within the shard's tar size), parsed by the strict tar parser, its key checked against
    the index. A shard whose bytes could not be had raises (or skips) at each sample."""

    def __init__(self, data: ShardData) -> None:
        self.shard, self.url, self.data = data.shard, data.url, data

    def items(self, samples: NDArray[Any], steps: Sequence[int], progress: Progress, on_error: ErrorPolicy,
              positions: bool) -> Iterator[Any]:
        data = self.data
        for progress.steps, j in zip(steps, samples.tolist()):
            try:
                sample = decode_sample(data.sample_bytes(j), data.compression, data.where(j), data.tar_bytes)
                if sample["__key__"] != data.keys[j]:  # the tar header must agree with the index
                    raise CorruptShardError(f"{data.where(j)}: the tar members name key {sample['__key__']!r}")
            except DatapipeError as e:
                yield on_error(self.url, data.keys[j], e)
                continue
            if positions:
                sample["__shard__"], sample["__sample__"] = self.shard, j
            yield sample


class TableRowsReader(ShardReader):
    """A row group of a Parquet table (:mod:`datapipe.tables`): each sample a row, its
    columns fields (:func:`~datapipe.format.rows.row_fields`). A row holding a value Python
    cannot hold (a timestamp past ``datetime``'s years, a string that is not UTF-8) is that
    row's :class:`~datapipe.errors.FormatError`, raised or skipped where the stream reaches it."""

    def __init__(self, rows: TableRows) -> None:
        self.shard, self.url, self.table, self.keys = rows.shard, rows.url, rows.table, rows.keys

    def items(self, samples: NDArray[Any], steps: Sequence[int], progress: Progress, on_error: ErrorPolicy,
              positions: bool) -> Iterator[Any]:
        keys = self.keys
        chosen = self.table.take(samples)
        try:
            rows: list[dict[str, Any]] | None = python_rows(chosen, self.url)
        except FormatError:
            rows = None  # some row does not convert: row by row, so only that one fails
        for progress.steps, i, j in zip(steps, count(), samples.tolist()):
            if rows is not None:
                row = rows[i]
            else:
                try:
                    (row,) = python_rows(chosen.slice(i, 1), self.url, first=j)
                except FormatError as e:
                    yield on_error(self.url, keys[j], e)
                    continue
            sample = {"__key__": keys[j], **row_fields(row)}
            if positions:
                sample["__shard__"], sample["__sample__"] = self.shard, j
            yield sample


class FailedShardReader(ShardReader):
    """A shard whose fetch raised ``error``: each sample raises it, or is skipped."""

    def __init__(self, shard: int, url: str, error: BaseException) -> None:
        self.shard, self.url, self.error = shard, url, error

    def items(self, samples: NDArray[Any], steps: Sequence[int], progress: Progress, on_error: ErrorPolicy,
              positions: bool) -> Iterator[Any]:
        for progress.steps, j in zip(steps, samples.tolist()):
            yield on_error(self.url, None, self.error, f"sample #{j}: {self.error}")


def chunk_items(readers: Sequence[ShardReader], loc: NDArray[Any], samples: NDArray[Any], first: int,
                progress: Progress, on_error: ErrorPolicy, positions: bool) -> Iterator[Any]:
    """The items of a chunk in stream order: sample ``samples[i]`` of the shard that
    ``readers[loc[i]]`` reads, its plan step ``first + i``. Each reader reads the chunk's
    samples of its shard and the streams are taken in the chunk's order; when every shard of
    the chunk is laid out with the same fields (the common case, where the cost per sample
    matters most) one loop reads them all, without interleaving streams."""
    fields = {r.layout.fields if isinstance(r, LaidOutShardReader) else None for r in readers}
    if len(fields) == 1 and None not in fields:
        laid = [r for r in readers if isinstance(r, LaidOutShardReader)]
        return _laid_out_items(laid, loc, samples, count(first), progress, positions)
    order = np.argsort(loc, kind="stable")
    cuts = np.cumsum(np.bincount(loc, minlength=len(readers)))[:-1]
    streams = np.empty(len(readers), dtype=object)
    for i, (mine, steps) in enumerate(zip(np.split(samples[order], cuts), np.split(order + first, cuts))):
        streams[i] = readers[i].items(mine, steps.tolist(), progress, on_error, positions)
    # each stream yields exactly one thing per sample, so this takes them in the chunk's order
    return map(next, streams[loc].tolist())


def reader_for(data: ShardData | TableRows) -> ShardReader:
    """The reader of a fetched shard: by its layout when it has one (a verified
    uncompressed shard), else sample by sample; a row group's rows."""
    if isinstance(data, TableRows):
        return TableRowsReader(data)
    layout = data.layout
    if isinstance(layout, ShardLayout) and layout.samples == len(data.keys):
        return LaidOutShardReader(data, layout)
    if isinstance(layout, MemberTable) and layout.samples == len(data.keys):
        return MemberWalkReader(data, layout)
    return CheckedSampleReader(data)


def chunk_readers(chunk: Chunk, url_of: Callable[[int], str]) -> tuple[list[ShardReader], NDArray[Any]]:
    """The readers of the chunk's shards (distinct, in order of first use), from what their
    fetches gave (``chunk.fetched``: a fetch that raised is raised, or skipped, at each of
    its samples, where the stream reaches them; ``url_of`` names its shard), and each
    sample's place among them."""
    readers: list[ShardReader] = []
    for g, got in zip(chunk.shards, chunk.fetched):
        if isinstance(got, BaseException):
            if not isinstance(got, Exception):
                raise got
            readers.append(FailedShardReader(g, url_of(g), got))
        else:
            readers.append(reader_for(got))
    ids = np.asarray(chunk.shards, dtype=np.int64)
    low, span = int(ids.min()), int(ids.max()) - int(ids.min()) + 1
    if span <= 64 * len(ids):  # a table from shard number to place: one gather
        lookup = np.empty(span, dtype=np.int64)
        lookup[ids - low] = np.arange(len(ids))
        return readers, lookup[chunk.shard - low]
    sorter = np.argsort(ids)  # shards far apart (a global shuffle): a search
    return readers, sorter[np.searchsorted(ids, chunk.shard, sorter=sorter)]


@dataclass
class ChunkRead:
    """The read stage's output for one chunk: its ``items`` in stream order (raw samples and
    :class:`~.pass_state.Skipped` markers), or its ``rows`` (columnar batches of a chunk laid
    out alike); ``urls``: each of its shards' URL."""

    chunk: Chunk
    urls: dict[int, str]
    items: Iterator[Any] | None = None
    rows: LaidOutRows | None = None


def read_chunks(chunks: Iterable[Chunk], url_of: Callable[[int], str], progress: Progress, on_error: ErrorPolicy, *,
                positions: bool, columnar: bool) -> Iterator[ChunkRead]:
    """The read stage: each fetched chunk read by its shards' readers. ``positions``: add
    ``__shard__``/``__sample__`` to each item; ``columnar``: give a chunk laid out alike as
    rows (the batch stage cuts them), else as items. A chunk's items are counted from the
    step after the last one handed out (the consumer reads a chunk to its end before it
    asks for the next)."""
    for chunk in chunks:
        readers, loc = chunk_readers(chunk, url_of)
        urls = {r.shard: r.url for r in readers}
        rows = laid_out_rows(readers, loc, chunk.sample) if columnar else None
        if rows is not None:
            yield ChunkRead(chunk, urls, rows=rows)
        else:
            yield ChunkRead(chunk, urls, chunk_items(readers, loc, chunk.sample, progress.steps + 1, progress,
                                                     on_error, positions))
