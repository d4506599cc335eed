"""Reading the samples of one fetched shard: one reader per kind of shard, chosen once,
when the shard is fetched (LitData's strategy object per chunk), never per sample.

Every reader has the same method, ``items(samples, steps, progress, on_error, positions)``:
for the shard's sample indices ``samples`` (a chunk's samples of this shard, in stream
order) it yields exactly one thing per sample, the raw sample ``{"__key__": key, field:
bytes, ...}`` (plus ``__shard__``/``__sample__`` when ``positions``) or, for a sample that
cannot be read and is skipped, the :class:`Skipped` marker that ``on_error`` returns. Just
before it hands out sample ``samples[i]`` it sets ``progress.steps = steps[i]``, the plan
step of that sample, so a resume state taken between two items is exact.

- :class:`LaidOutShardReader`: a verified uncompressed shard whose samples all have the
  same fields (:class:`~datapipe.format.layout.ShardLayout`): a chunk's rows are gathered
  from the layout table with numpy, then one ``zip`` step, one dict display and one slice
  per field per sample, in a loop written out for 1 to 6 fields (a general one for more).
- :class:`MemberWalkReader`: a verified uncompressed shard whose samples differ in their
  fields (:class:`~datapipe.format.layout.MemberTable`).
- :class:`CheckedSampleReader`: everything else, sample by sample: a shard that failed its
  whole-shard checksum, a zstd shard (one frame per sample), a truncated one. Each sample
  is checked against its own checksum and parsed by the strict tar parser.
- :class:`FailedShardReader`: a shard whose fetch raised.

:func:`chunk_items` reads a chunk (samples of several shards, interleaved by the shuffle)
through its shards' readers; where all of them are laid out alike it reads the whole chunk
in one such loop, which is where the cost per sample matters most.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import count, repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..errors import CorruptIndexError, CorruptShardError, DatapipeError, FormatError, MissingDependencyError
from ..format import decode_sample
from ..format.layout import MemberTable, ShardLayout
from ..format.rows import python_rows, row_fields
from .batch import Batch, Column

if TYPE_CHECKING:
    from .source import ShardData

__all__ = ["Skipped", "split_skipped", "Progress", "ErrorPolicy", "ShardReader", "LaidOutShardReader",
           "MemberWalkReader", "CheckedSampleReader", "TableRowsReader", "FailedShardReader", "reader_for",
           "chunk_items", "laid_out_batches"]


class Skipped(NamedTuple):
    """A skipped sample's place in the stream, yielded instead of the sample only while a
    :class:`~datapipe.loader.StreamingDataLoader` iterates (it takes it out of the batch and
    reports it in the main process): batches stay aligned with the plan's batches, so the
    loader's resume count stays exact with worker processes."""

    url: str
    key: str | None
    why: str


def split_skipped(items: Iterable[Any]) -> tuple[list[Any], tuple[Skipped, ...]]:
    """(the items that are samples, the :class:`Skipped` markers among them), in order."""
    samples: list[Any] = []
    skipped: list[Skipped] = []
    for x in items:
        (skipped if x.__class__ is Skipped else samples).append(x)
    return samples, tuple(skipped)


class Progress:
    """Plan steps the consumer has taken in the current pass (skipped samples count too):
    readers set :attr:`steps` to a sample's step just before they hand it out."""

    __slots__ = ("steps",)

    def __init__(self, steps: int = 0) -> None:
        self.steps = steps


class ErrorPolicy:
    """The dataset's ``on_error``, applied in this one place: ``policy(url, key, error)``
    re-raises ``error`` ("raise"), or records ``(url, key, why)`` in ``skipped`` and returns
    the :class:`Skipped` marker that takes the sample's place ("skip")."""

    def __init__(self, skip: bool, skipped: list[tuple[str, str | None, str]]) -> None:
        self.skip = skip
        self.skipped = skipped

    def __call__(self, url: str, key: str | None, error: BaseException, why: str | None = None) -> Skipped:
        if not self.skip or not isinstance(error, DatapipeError) \
                or isinstance(error, (CorruptIndexError, MissingDependencyError)):
            raise error  # an index that fails, a package missing: not one sample's fault, never skipped
        marker = Skipped(url, key, str(error) if why is None else why)
        self.skipped.append((marker.url, marker.key, marker.why))
        return marker


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


def laid_out_batches(readers: Sequence[ShardReader], loc: NDArray[Any], samples: NDArray[Any],
                     batch_size: int, positions: bool) -> Iterator[Batch] | None:
    """The samples of a chunk as :class:`~.batch.Batch` es of ``batch_size`` (the last may
    be shorter), cut from the shards' layout tables with numpy: each bytes field a
    :class:`~.batch.Column` viewing the shard buffers, no Python work per sample. None when
    the chunk's shards are not all laid out with the same fields (then read it sample by
    sample)."""
    fields = {r.layout.fields if isinstance(r, LaidOutShardReader) else None for r in readers}
    if len(fields) != 1 or None in fields:
        return None
    laid = [r for r in readers if isinstance(r, LaidOutShardReader)]
    return _cut_batches(laid, loc, samples, batch_size, positions)


def _distinct(which: NDArray[Any], n: int) -> tuple[list[int], NDArray[np.intp]]:
    """(the distinct values of ``which``, all in ``[0, n)``, in increasing order; each
    entry's place among them): ``np.unique(which, return_inverse=True)`` by marking, not
    sorting (half the time for a batch of 256 over a few dozen buffers, measured here)."""
    present = np.zeros(n, dtype=bool)
    present[which] = True
    place = np.cumsum(present, dtype=np.intp) - 1
    return np.flatnonzero(present).tolist(), place[which]


def _cut_batches(readers: list[LaidOutShardReader], loc: NDArray[Any], samples: NDArray[Any], batch_size: int,
                 positions: bool) -> Iterator[Batch]:
    if positions:
        import torch
    table, keys = _chunk_rows(readers, loc, samples)
    names = readers[0].layout.fields
    # numpy views of the shard buffers: while a batch views one, the buffer pool cannot
    # resize (so never refills) it
    buffers = [np.frombuffer(r.data.src, dtype=np.uint8) for r in readers]
    which = loc.astype(np.intp) if len(readers) > 1 else None
    shard_ids = np.array([r.shard for r in readers], dtype=np.int64)[loc] if positions else None
    for i in range(0, len(samples), batch_size):
        j = min(i + batch_size, len(samples))
        fields: dict[str, Any] = {"__key__": keys[i:j].tolist()}
        mine, w = buffers, None
        if which is not None:  # only the buffers this batch reads: a batch held pins no others
            used, w = _distinct(which[i:j], len(buffers))
            mine = [buffers[u] for u in used]
        for k, name in enumerate(names):
            fields[name] = Column(mine, table[i:j, 2 * k], table[i:j, 2 * k + 1], w)
        if shard_ids is not None:  # tensors, as default_collate makes of the samples' numbers
            fields["__shard__"] = torch.from_numpy(shard_ids[i:j].copy())
            fields["__sample__"] = torch.from_numpy(samples[i:j].astype(np.int64))
        yield Batch(fields, j - i)


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

    def __init__(self, shard: int, url: str, table: Any, keys: list[str]) -> None:
        self.shard, self.url, self.table, self.keys = shard, url, table, keys

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


def reader_for(data: ShardData, layout: ShardLayout | MemberTable | None) -> ShardReader:
    """The reader of a fetched shard: by its layout when it has one (a verified
    uncompressed shard), else sample by sample."""
    if isinstance(layout, ShardLayout) and layout.samples == len(data.keys):
        return LaidOutShardReader(data, layout)
    if isinstance(layout, MemberTable) and layout.samples == len(data.keys):
        return MemberWalkReader(data, layout)
    return CheckedSampleReader(data)
