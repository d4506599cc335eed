"""The batch stage of a pass, and its columnar batches: what a batched
:class:`~.dataset.StreamingDataset` yields and what a :class:`~.dataloader.StreamingDataLoader`
hands out.

:func:`batch_chunks` is the last stage: for each chunk the stages before it read (and
decoded), what the pass hands out: its samples, or :class:`Batch` es of ``batch_size``
(chunks hold whole batches of the plan; the last batch of the pass may be shorter), cut
from the shards' layouts with numpy where the read stage gave the chunk as rows
(:func:`cut_batches`), else collated from its samples.

A :class:`Batch` looks like the dict that torch's ``default_collate`` makes of a list of
samples (``batch["__key__"]`` is the list of keys, ``batch["jpg"][i]`` sample ``i``'s bytes),
without a ``bytes`` object per sample: each bytes field is a :class:`Column`, the fields'
bytes where they lie (the shard buffers the batch was cut from, or one shared-memory slot of
the loader's ring) plus where each sample's bytes start and end. Indexing a column gives a
zero-copy ``memoryview``; :meth:`Column.as_tensor` gives one ``uint8`` tensor and the
offsets; :meth:`Column.tolist` gives ``bytes``. Other fields follow ``default_collate``:
numbers and equally shaped arrays or tensors become one tensor, anything else a list.

The bytes a column views never change while it, or any view taken from it, lives: shard
buffers and ring slots are reused only once nothing views them (:mod:`.source`,
:mod:`.ring`). Holding a batch therefore holds the memory it views; drop it (or copy what
you keep with :meth:`Column.tolist`) to let that memory be reused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .pass_state import Progress, Skipped, split_skipped

if TYPE_CHECKING:
    from .readers import ChunkRead, LaidOutRows

__all__ = ["Batch", "BatchGroup", "Column", "LazyRows", "LazyTensor", "array_dtype", "batch_chunks", "cut_batches",
           "distinct"]

_BYTES = (bytes, bytearray, memoryview)
_MISSING = object()
#: up to this many bytes a sample on average, :meth:`Column.gather_into` joins the samples'
#: slices into one bytes and copies that (about 2x faster per sample than a slice
#: assignment each at 16 B-1 KiB samples, 1.2x at 4 KiB, measured here); above it, the
#: extra copy costs more than the loop it saves
_JOIN_BYTES_PER_SAMPLE = 4096


class Column:
    """One bytes field of a batch: sample ``i``'s bytes are
    ``buffers[which[i]][starts[i]:ends[i]]`` (``which`` is None when there is one buffer).

    Not a ``Sequence`` subclass on purpose: torch's ``pin_memory`` would pin it element by
    element; it calls :meth:`pin_memory` instead.
    """

    __slots__ = ("_views", "buffers", "ends", "starts", "which")

    def __init__(self, buffers: Sequence[NDArray[np.uint8]], starts: NDArray[np.int64], ends: NDArray[np.int64],
                 which: NDArray[np.intp] | None = None) -> None:
        self.buffers = tuple(buffers)
        self.starts = starts
        self.ends = ends
        self.which = which if which is not None and len(self.buffers) > 1 else None
        self._views: list[memoryview] | None = None

    @classmethod
    def from_bytes(cls, values: Sequence[bytes | bytearray | memoryview]) -> Column:
        """A contiguous column holding a copy of ``values`` (a memoryview's bytes are all of
        its bytes, whatever its format or strides)."""
        if any(isinstance(v, memoryview) and not v.c_contiguous for v in values):
            values = [v.tobytes() if isinstance(v, memoryview) and not v.c_contiguous else v for v in values]
        # len() of a memoryview counts items, not bytes
        lengths = np.fromiter((v.nbytes if isinstance(v, memoryview) else len(v) for v in values), dtype=np.int64,
                              count=len(values))
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # joined into a bytearray: writable, as a slot's columns are (torch warns on tensors
        # over read-only arrays)
        data = np.frombuffer(bytearray().join(values), dtype=np.uint8) if values else np.zeros(0, np.uint8)
        return cls([data], offsets[:-1], offsets[1:])

    # -- the sequence of samples -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.starts)

    def _buffer_views(self) -> list[memoryview]:
        if self._views is None:
            self._views = [memoryview(b.data).cast("B") for b in self.buffers]
        return self._views

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            which = None if self.which is None else self.which[i]
            return Column(self.buffers, self.starts[i], self.ends[i], which)
        n = len(self.starts)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of a column of {n}")
        views = self._buffer_views()
        buf = views[0] if self.which is None else views[int(self.which[i])]
        return buf[int(self.starts[i]) : int(self.ends[i])]

    def __iter__(self) -> Iterator[memoryview]:
        views = self._buffer_views()
        which = [0] * len(self) if self.which is None else self.which.tolist()
        for w, a, b in zip(which, self.starts.tolist(), self.ends.tolist()):
            yield views[w][a:b]

    def tolist(self) -> list[bytes]:
        """Each sample's bytes as ``bytes`` (a copy that does not hold the batch's memory)."""
        return [bytes(v) for v in self]

    def __repr__(self) -> str:
        return f"Column({len(self)} samples, {self.nbytes} bytes, {len(self.buffers)} buffer(s))"

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as its samples' bytes alone, never the whole buffers it views (an array
        # pickles only the bytes it spans, and unpickles writable)
        data, offsets = self.contiguous()
        return _contiguous_column, (data, offsets)

    # -- as one buffer ---------------------------------------------------------------------
    @property
    def lengths(self) -> NDArray[np.int64]:
        return self.ends - self.starts

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def is_contiguous(self) -> bool:
        """Whether the samples' bytes lie one after the other in one buffer, from its start."""
        if len(self.buffers) != 1 or len(self.starts) == 0:
            return len(self.starts) == 0
        return bool(self.starts[0] == 0 and np.array_equal(self.starts[1:], self.ends[:-1]))

    def gather_into(self, out: memoryview) -> NDArray[np.int64]:
        """Copy the samples' bytes one after the other into ``out`` (at least :attr:`nbytes`
        long); returns the ``n + 1`` offsets of the samples in it."""
        lengths = self.lengths
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        views = self._buffer_views()
        if self.is_contiguous():
            out[: int(offsets[-1])] = views[0][: int(offsets[-1])]
            return offsets
        starts, ends = self.starts.tolist(), self.ends.tolist()
        total = int(offsets[-1])
        if total <= _JOIN_BYTES_PER_SAMPLE * len(starts):
            # small samples: one C loop (join) and one copy, not a slice assignment each
            if self.which is None:
                v = views[0]
                parts = [v[a:b] for a, b in zip(starts, ends)]
            else:
                parts = [views[w][a:b] for w, a, b in zip(self.which.tolist(), starts, ends)]
            out[:total] = b"".join(parts)
            return offsets
        which = [0] * len(self) if self.which is None else self.which.tolist()
        for w, a, b, o, p in zip(which, starts, ends, offsets[:-1].tolist(), offsets[1:].tolist()):
            out[o:p] = views[w][a:b]
        return offsets

    def contiguous(self) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
        """(data, offsets): every sample's bytes in one array, sample ``i`` at
        ``data[offsets[i]:offsets[i + 1]]``; no copy when they already lie so."""
        if self.is_contiguous() and len(self.starts):
            end = int(self.ends[-1])
            offsets = np.empty(len(self.starts) + 1, dtype=np.int64)
            offsets[:-1] = self.starts
            offsets[-1] = end
            return self.buffers[0][:end], offsets
        data = np.empty(self.nbytes, dtype=np.uint8)
        offsets = self.gather_into(data.data)
        return data, offsets

    def as_tensor(self) -> tuple[Any, Any]:
        """(``uint8`` tensor of every sample's bytes, ``int64`` tensor of the ``n + 1``
        offsets); the data tensor views the column's memory when it is contiguous."""
        import torch

        data, offsets = self.contiguous()
        return torch.from_numpy(data), torch.from_numpy(offsets)

    def pin_memory(self, device: Any = None) -> Column:
        """A contiguous copy in pinned (page-locked) memory, for fast copies to the GPU."""
        import torch

        data, offsets = self.contiguous()
        tensor = torch.from_numpy(data)
        pinned = tensor.pin_memory(device) if device is not None else tensor.pin_memory()
        return Column([pinned.numpy()], offsets[:-1], offsets[1:])


def _contiguous_column(data: NDArray[np.uint8], offsets: NDArray[np.int64]) -> Column:
    return Column([data], offsets[:-1], offsets[1:])


_ARRAY_DTYPES: dict[Any, np.dtype[Any] | None] = {}


def array_dtype(dtype: Any) -> np.dtype[Any] | None:
    """The numpy dtype that torch ``dtype`` reads as itself through ``torch.from_numpy``,
    or None (bfloat16, float8, ...: numpy has none); remembered, since torch has no cheap
    way to say it."""
    if dtype not in _ARRAY_DTYPES:
        import torch

        try:
            got: np.dtype[Any] | None = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            got = None
        _ARRAY_DTYPES[dtype] = got
    return _ARRAY_DTYPES[dtype]


class LazyTensor:
    """A tensor field of a :class:`Batch` written where it is read: a loader's ring writes it
    straight into its shared-memory slot (:meth:`fill_array`), which saves making it and
    copying it there; anything else gets it made once (:meth:`tensor`, and pickling, which
    sends the tensor). ``fill(array)`` writes the values into a numpy array of ``shape`` and
    ``dtype`` (a torch dtype that numpy has); it must keep alive whatever it reads (its
    references are dropped once the tensor is made)."""

    __slots__ = ("_fill", "_tensor", "dtype", "nbytes", "row_bytes", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: Any, fill: Any) -> None:
        self.shape, self.dtype, self._fill = tuple(shape), dtype, fill
        self._tensor: Any = None
        # asked twice a batch in a worker: computed once (a torch.empty(0) to learn the
        # element size cost more than cutting the rows)
        self.row_bytes = math.prod(self.shape[1:]) * int(dtype.itemsize)
        self.nbytes = self.row_bytes * self.shape[0] if self.shape else int(dtype.itemsize)

    @property
    def array_dtype(self) -> np.dtype[Any] | None:
        """The numpy dtype :meth:`fill_array` writes (None: numpy has none, see :func:`array_dtype`)."""
        return array_dtype(self.dtype)

    def fill_array(self, out: NDArray[Any]) -> None:
        """Write the values into ``out``, a numpy array of this shape and :attr:`array_dtype`
        (a view of a ring's slot: no tensor is made, which costs more than a batch's rows
        take to cut)."""
        if self._tensor is not None:
            np.copyto(out, self._tensor.numpy())
        elif out.size:
            self._fill(out)

    def tensor(self) -> Any:
        if self._tensor is None:
            import torch

            t = torch.empty(self.shape, dtype=self.dtype)
            if t.numel():
                self._fill(t.numpy())
            self._tensor, self._fill = t, None
        return self._tensor

    def rows(self, start: int, stop: int) -> LazyRows:
        """Rows ``[start, stop)`` of this tensor, a field of one batch of a group."""
        return LazyRows(self, start, stop)

    def __reduce__(self) -> tuple[Any, ...]:
        return _identity, (self.tensor(),)


class LazyRows:
    """Rows ``[start, stop)`` of a :class:`LazyTensor` (``whole``) that the batches of a
    :class:`BatchGroup` share: the group's rows are cut in one pass, and a ring writes
    ``whole`` once into its slot, each batch's field viewing its rows there (cutting batch
    by batch cost more in Python than the rows took to copy). Anything else gets the rows
    as a tensor of their own (:meth:`tensor`, and pickling)."""

    __slots__ = ("dtype", "nbytes", "shape", "start", "stop", "whole")

    def __init__(self, whole: LazyTensor, start: int, stop: int) -> None:
        self.whole, self.start, self.stop = whole, int(start), int(stop)
        self.shape = (self.stop - self.start, *whole.shape[1:])
        self.dtype = whole.dtype
        self.nbytes = whole.row_bytes * (self.stop - self.start)

    def tensor(self) -> Any:
        return self.whole.tensor()[self.start:self.stop].clone()

    def __reduce__(self) -> tuple[Any, ...]:
        return _identity, (self.tensor(),)


def _identity(value: Any) -> Any:
    return value


class BatchGroup(tuple):  # type: ignore[type-arg]  # a tuple of Batch es; typed by its items' use
    """Consecutive batches of one DataLoader worker's stream sent as one message (a
    :class:`~.dataloader.StreamingDataLoader` hands them out one by one): torch's worker
    queue costs about 0.3 ms of the main process's CPU a message (two queues, their feeder
    threads, a wakeup each side), more than a batch of token sequences takes to cut. ``of``: the batches a full
    group holds (a shorter one is the worker's last of its pass)."""

    of: int

    def __new__(cls, batches: Iterable[Batch], of: int) -> BatchGroup:
        group = super().__new__(cls, batches)
        group.of = of
        return group

    def __reduce__(self) -> tuple[Any, ...]:
        return BatchGroup, (tuple(self), self.of)

    @property
    def steps(self) -> int:
        return sum(b.steps for b in self)

    def pin_memory(self, device: Any = None) -> BatchGroup:
        """Each batch pinned (torch's pin-memory thread calls it on a group sent pickled)."""
        return BatchGroup((b.pin_memory(device) for b in self), self.of)

    @property
    def full(self) -> bool:
        """Whether it holds ``of`` batches of one size (else it ends the worker's pass)."""
        return len(self) == self.of and all(b.steps == self[0].steps for b in self)


def _collate(values: list[Any]) -> Any:
    """One field of a list of samples, as ``default_collate`` would, except that bytes
    become a :class:`Column`."""
    first = values[0]
    if isinstance(first, _BYTES) and all(isinstance(v, _BYTES) for v in values):
        return Column.from_bytes(values)
    if isinstance(first, str):
        return values
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is installed in the test environment
        return values
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) and v.shape == first.shape
                                               for v in values):
        return torch.stack(values)
    if isinstance(first, np.ndarray) and first.dtype.kind in "biuf" and all(
            isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype for v in values):
        return torch.from_numpy(np.stack(values))
    if isinstance(first, (bool, int, float)) and all(type(v) is type(first) for v in values):
        return torch.tensor(values)
    return values


class Batch:
    """A batch of samples by field (see the module docstring). ``len(batch)`` is the
    number of samples; ``batch[field]``, ``field in batch``, ``batch.keys()``/``items()``
    and iteration work as on the dict ``default_collate`` makes. ``steps`` is the number of
    the plan's steps it covers and ``skipped`` the :class:`~.pass_state.Skipped` markers of
    samples skipped among them (``on_error="skip"``)."""

    __slots__ = ("__weakref__", "_fields", "form", "size", "skipped", "steps")

    def __init__(self, fields: dict[str, Any], size: int, steps: int | None = None,
                 skipped: tuple[Any, ...] = (), form: str = "dict") -> None:
        self._fields = fields
        self.size = size
        self.steps = size + len(skipped) if steps is None else steps
        self.skipped = skipped
        #: what each sample was: "dict", "tuple" (fields "0", "1", ...) or "single" (field "0")
        self.form = form

    @classmethod
    def from_samples(cls, samples: list[Any], skipped: tuple[Any, ...] = ()) -> Batch:
        """A batch of ``samples``: dicts (a field that some samples lack is a list with None
        for them), tuples of the same length (a ``map=`` returning ``(x, y)``), or single
        values (a ``map=`` returning a tensor)."""
        if not samples:
            return cls({}, 0, len(skipped), skipped)
        first = samples[0]
        if isinstance(first, tuple) and all(isinstance(s, tuple) and len(s) == len(first) for s in samples):
            by_position = {str(k): _collate([s[k] for s in samples]) for k in range(len(first))}
            return cls(by_position, len(samples), None, skipped, "tuple")
        if not all(isinstance(s, dict) for s in samples):
            return cls({"0": _collate(samples)}, len(samples), None, skipped, "single")
        names = list(dict.fromkeys(name for sample in samples for name in sample))
        fields: dict[str, Any] = {}
        for name in names:
            values = [sample.get(name, _MISSING) for sample in samples]
            if any(v is _MISSING for v in values):  # an optional field: None where a sample lacks it
                fields[name] = [None if v is _MISSING else v for v in values]
            else:
                fields[name] = _collate(values)
        return cls(fields, len(samples), None, skipped)

    def __len__(self) -> int:
        return self.size

    def unwrap(self) -> Any:
        """What ``default_collate`` would have made: this batch for dict samples, a tuple of
        the collated positions for tuple samples, the collated value for single values."""
        if self.form == "tuple":
            return tuple(self._fields[str(k)] for k in range(len(self._fields)))
        if self.form == "single":
            return self._fields["0"]
        return self

    def __getitem__(self, field: str) -> Any:
        return self._fields[field]

    def __contains__(self, field: object) -> bool:
        return field in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def keys(self) -> Any:
        return self._fields.keys()

    def items(self) -> Any:
        return self._fields.items()

    def values(self) -> Any:
        return self._fields.values()

    def get(self, field: str, default: Any = None) -> Any:
        return self._fields.get(field, default)

    def samples(self) -> Iterator[dict[str, Any]]:
        """The batch as one dict per sample (bytes fields as memoryviews): for inspection."""
        for i in range(self.size):
            yield {k: v[i] for k, v in self._fields.items()}

    def pin_memory(self, device: Any = None) -> Batch:
        """Called by torch's DataLoader with ``pin_memory=True``: columns and tensors in
        pinned memory."""
        from torch.utils.data._utils.pin_memory import pin_memory as pin

        out = {k: v.pin_memory(device) if isinstance(v, Column) else pin(v, device)  # type: ignore[no-untyped-call]  # torch's own helper is untyped
               for k, v in self._fields.items()}
        return Batch(out, self.size, self.steps, self.skipped, self.form)

    def __repr__(self) -> str:
        return f"Batch({self.size} samples: {', '.join(self._fields)})"


def distinct(which: NDArray[Any], n: int) -> tuple[list[int], NDArray[np.intp]]:
    """(the distinct values of ``which``, all in ``[0, n)``, in increasing order; each
    entry's place among them): ``np.unique(which, return_inverse=True)`` by marking, not
    sorting (half the time for a batch of 256 over a few dozen buffers, measured here)."""
    present = np.zeros(n, dtype=bool)
    present[which] = True
    place = np.cumsum(present, dtype=np.intp) - 1
    return np.flatnonzero(present).tolist(), place[which]


def cut_batches(rows: LaidOutRows, batch_size: int, positions: bool) -> Iterator[Batch]:
    """The rows of a chunk as batches of ``batch_size`` (the last may be shorter): each bytes
    field a :class:`Column` viewing the shard buffers, no Python work per sample.
    ``positions``: ``__shard__``/``__sample__`` tensors, as ``default_collate`` makes of the
    samples' numbers."""
    if positions:
        import torch
    table, keys, samples = rows.table, rows.keys, rows.samples
    # numpy views of the shard buffers: while a batch views one, the buffer pool cannot
    # resize (so never refills) it
    buffers = [np.frombuffer(src, dtype=np.uint8) for src in rows.srcs]
    which = rows.loc.astype(np.intp) if len(buffers) > 1 else None
    shard_ids = rows.shards[rows.loc] if positions else None
    for i in range(0, len(samples), batch_size):
        j = min(i + batch_size, len(samples))
        fields: dict[str, Any] = {"__key__": keys[i:j].tolist()}
        mine, w = buffers, None
        if which is not None:  # only the buffers this batch reads: a batch held pins no others
            used, w = distinct(which[i:j], len(buffers))
            mine = [buffers[u] for u in used]
        for k, name in enumerate(rows.fields):
            fields[name] = Column(mine, table[i:j, 2 * k], table[i:j, 2 * k + 1], w)
        if shard_ids is not None:
            fields["__shard__"] = torch.from_numpy(shard_ids[i:j].copy())
            fields["__sample__"] = torch.from_numpy(samples[i:j].astype(np.int64))
        yield Batch(fields, j - i)


def _counted(batches: Iterator[Batch], progress: Progress) -> Iterator[Batch]:
    for batch in batches:
        progress.steps += batch.steps
        yield batch


def _collated(items: Iterator[Any], batch_size: int, markers: bool) -> Iterator[Batch]:
    while True:
        group = list(islice(items, batch_size))  # the stages before advance progress sample by sample
        if not group:
            return
        samples, skipped = split_skipped(group)
        if samples or markers:  # a batch of skips only tells a loader about them
            yield Batch.from_samples(samples, skipped)


def _without_markers(items: Iterator[Any]) -> Iterator[Any]:
    return (x for x in items if x.__class__ is not Skipped)


def batch_chunks(reads: Iterable[ChunkRead], progress: Progress, *, batch_size: int | None, positions: bool,
                 markers: bool, skips: bool) -> Iterator[Iterator[Any]]:
    """The batch stage: for each chunk, what the pass hands out. ``batch_size`` None: its
    items, the :class:`~.pass_state.Skipped` markers (``skips``: samples may be skipped)
    taken out unless ``markers`` (a :class:`~.dataloader.StreamingDataLoader` takes them
    out itself and reports them); else
    its :class:`Batch` es, each counting its skipped samples in ``steps`` (a batch of skips
    only with ``markers``). ``positions``: columns cut from rows get ``__shard__`` and
    ``__sample__``."""
    for read in reads:
        if read.rows is not None:
            yield _counted(cut_batches(read.rows, batch_size or 1, positions), progress)
            continue
        items = read.items
        if items is None:
            continue
        if batch_size is None:
            yield _without_markers(items) if skips and not markers else items
        else:
            yield _collated(items, batch_size, markers)
