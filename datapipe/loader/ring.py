"""Batches from DataLoader worker processes through reused shared memory, not pickles.

A batch pickled through a pipe costs a copy into the pipe, a copy out of it, and page faults
on the fresh memory it lands in (about 0.5 GB/s on some machines: slower than the disk).
Here each worker owns a few *slots*: shared-memory files (``memfd``) it writes whole batches
into. What travels through the DataLoader's queue is a :class:`RingBatch`: the slot's
number, where each field lies in it, and small values; the slot's file descriptor travels
once, with the first batch written into it (and again only if the slot had to grow), and the
main process takes it as it unpickles that batch. The main process maps each slot once and
hands out a :class:`~.batch.Batch` whose columns and tensors view the slot.

A slot is reused only once nothing in the main process views it: every view of a batch
derives from one numpy array per slot, and when that array is collected (the batch, its
columns and every memoryview or tensor taken from them are gone) a finalizer marks the
slot free in its header and releases the worker's semaphore. The worker takes a slot only
after acquiring that semaphore (which also orders the memory accesses between the two
processes), so it never writes a slot the main process still reads. A worker that finds no
free slot (the trainer holds more batches than ``prefetch_factor + 2`` per worker) sends
that batch the ordinary way, pickled: it never waits for the trainer, and nothing deadlocks.

A :class:`~.batch.BatchGroup` (consecutive batches of one worker's stream, the token
loaders' in a worker) goes into one slot as one message: torch's worker queue costs more a
message than a batch of token sequences takes to cut. Its batches are opened together and
view the one slot, which is free again once none of them is viewed.

Slots are created by the worker, sized to the first batch that needs them (and regrown by
half again when a batch does not fit), so their size follows what ``map=`` produces, not
what is stored. They are anonymous: nothing is left in ``/dev/shm`` by a killed process.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np

from ..errors import LoaderOptionError
from .batch import Batch, BatchGroup, Column, LazyRows, LazyTensor, array_dtype

__all__ = ["BatchRing", "RingBatch"]

_HEADER = 64  # state byte, then padding: data starts cache-line aligned
_FREE, _BUSY = 0, 1
_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class RingBatch:
    """A batch written into slot ``slot`` of worker ``worker`` (what the DataLoader's queue
    carries). ``fields``: name -> ("column", data offset, data bytes, offsets offset,
    samples) | ("tensor", offset, dtype name, shape) | ("value", the value itself).
    ``group``: a :class:`~.batch.BatchGroup` written into the slot, the (fields, samples) of
    each of its batches (``fields`` and ``samples`` are then the first's)."""

    worker: int
    slot: int
    generation: int
    size: int  # bytes of the slot's file
    fields: dict[str, tuple[Any, ...]]
    samples: int
    fd: Any = None  # a DupFd with the slot's file, the first time this generation is sent
    form: str = "dict"  # Batch.form
    ring: int = 0  # the id of the ring in the main process (see _MAIN_RINGS)
    opened: bool = False
    group: tuple[tuple[dict[str, tuple[Any, ...]], int], ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "opened"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.opened = False
        self._main = os.getpid()  # unpickled: in the main process (or its pin-memory thread)
        # The slot's file now, while its worker is sure to be alive: it sent this batch
        # before its end-of-pass marker, and torch lets a worker that is not persistent exit
        # once it reads that marker, which can be before this batch (kept back to be handed
        # out in order) is opened.
        self.fd_error: str | None = None
        if self.fd is not None:
            try:
                self.fd = self.fd.detach()
            except OSError as e:
                self.fd, self.fd_error = None, str(e)

    def __del__(self) -> None:
        # A batch the DataLoader drops unopened (a pass ended early; persistent workers
        # reset) must still give its slot back, or its worker loses that slot for good.
        # Only in the process that unpickled it: a forked child collecting its copy of
        # the parent's garbage must not free (or take) the parent's slot.
        if self.opened or self.__dict__.get("_main") != os.getpid():
            return
        try:
            ring = _MAIN_RINGS.get(self.ring)
        except Exception:  # interpreter shutdown: nothing left to give back to
            ring = None
        if ring is not None:
            ring.discard(self)
        elif isinstance(self.fd, int):
            os.close(self.fd)
            self.fd = None


#: rings by id, in the process that opens their batches (weakly: a ring dies with its loader)
_MAIN_RINGS: weakref.WeakValueDictionary[int, BatchRing] = weakref.WeakValueDictionary()
_next_ring = itertools.count(1)


class _Slot:
    __slots__ = ("fd", "generation", "mm", "sent")

    def __init__(self, fd: int, mm: mmap.mmap, generation: int) -> None:
        self.fd, self.mm, self.generation, self.sent = fd, mm, generation, False


def _measure(batches: Sequence[Batch]) -> int:
    """Bytes the batches need in a slot (with alignment; the tensor that a group's
    :class:`~.batch.LazyRows` share, once); fields that are neither columns nor CPU tensors
    travel in the RingBatch itself."""
    need = 0
    wholes: set[int] = set()
    for batch in batches:
        for value in batch.values():
            if isinstance(value, Column):
                need += _aligned(value.nbytes) + _aligned(8 * (len(value) + 1))
            elif isinstance(value, LazyTensor):
                need += _aligned(value.nbytes)
            elif isinstance(value, LazyRows):
                if id(value.whole) not in wholes:
                    wholes.add(id(value.whole))
                    need += _aligned(value.whole.nbytes)
            elif _raw_tensor(value):
                need += _aligned(value.numel() * value.element_size())
    return need


def _write_lazy(mm: mmap.mmap, value: LazyTensor, pos: int) -> None:
    """``value`` written into the slot at ``pos`` (through a numpy view: a torch one costs
    more than a batch's rows take to cut)."""
    if value.nbytes:
        dt = value.array_dtype
        if dt is None:  # the batch goes pickled (see write)
            raise TypeError(f"no numpy dtype for {value.dtype}")
        value.fill_array(np.frombuffer(mm, dtype=dt, count=value.nbytes // dt.itemsize, offset=pos)
                         .reshape(value.shape))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _raw_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor that its bytes, dtype and shape rebuild: dense (strided),
    on the CPU, neither quantized (scale and zero point live outside the bytes) nor nested."""
    import torch

    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided
            and not value.is_quantized and not value.is_nested)


class BatchRing:
    """Shared-memory slots for the batches of ``num_workers`` DataLoader workers, created
    in the main process before the workers start (it pickles into them with the collate
    function): ``write(batch)`` in a worker, ``open(ring_batch)`` in the main process."""

    def __init__(self, num_workers: int, slots_per_worker: int, context: Any) -> None:
        self.slots_per_worker = int(slots_per_worker)
        # one semaphore per worker counting its free slots: released by the main process
        # after it marks a slot free, acquired by the worker before it takes one
        self.free = [context.Semaphore(self.slots_per_worker) for _ in range(num_workers)]
        self.id = next(_next_ring)
        _MAIN_RINGS[self.id] = self
        self._init_local()

    def _init_local(self) -> None:
        self._slots: list[_Slot | None] = [None] * self.slots_per_worker  # worker side
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}  # main side
        #: (main process) batches opened from slots, and batches that came pickled because
        #: their worker found no slot free (counted by the loader); slots opened (a group's
        #: batches come in one)
        self.opened = 0
        self.fallbacks = 0
        self.messages = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"slots_per_worker": self.slots_per_worker, "free": self.free, "id": self.id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_local()

    # -- worker side -------------------------------------------------------------------
    def write(self, worker: int, batch: Batch | BatchGroup) -> RingBatch | None:
        """``batch`` (or a group of batches) written into a free slot of ``worker``'s, or None
        (no slot is free: send the batch itself)."""
        batches = batch if isinstance(batch, BatchGroup) else (batch,)
        need = _measure(batches)
        if not self.free[worker].acquire(block=False):
            return None
        i = next((k for k, s in enumerate(self._slots) if s is None or s.mm[0] == _FREE), -1)
        if i < 0:  # cannot happen while the count matches the headers; never wait on it
            self.free[worker].release()
            return None
        slot = self._slots[i]
        size = _HEADER + max(need, 1)
        if slot is None or len(slot.mm) < size:
            if slot is not None:  # the main process keeps its own map until it sees the new one
                size = max(size, len(slot.mm) * 3 // 2)
                slot.mm.close()
                os.close(slot.fd)
            fd = os.memfd_create(f"datapipe-batch-w{worker}-s{i}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            slot = _Slot(fd, mmap.mmap(fd, size), 0 if slot is None else slot.generation + 1)
            self._slots[i] = slot
        mm = slot.mm
        mm[0] = _BUSY
        try:
            written, pos = [], _HEADER
            placed: dict[int, tuple[LazyTensor, int]] = {}  # LazyRows' wholes written: where
            for b in batches:
                fields, pos = self._fill(mm, b, pos, placed)
                written.append((fields, len(b)))
        except Exception:
            # a value the slot cannot hold after all: the slot stays free (else its worker
            # loses it for good) and the batch goes the ordinary way, pickled, where a value
            # that cannot travel at all raises torch's own error
            mm[0] = _FREE
            self.free[worker].release()
            return None
        out = RingBatch(worker, i, slot.generation, len(mm), written[0][0], written[0][1], form=batches[0].form,
                        ring=self.id, group=tuple(written) if isinstance(batch, BatchGroup) else None)
        if not slot.sent:
            out.fd = DupFd(slot.fd)
            slot.sent = True
        return out

    @staticmethod
    def _fill(mm: mmap.mmap, batch: Batch, pos: int,
              placed: dict[int, tuple[LazyTensor, int]]) -> tuple[dict[str, tuple[Any, ...]], int]:
        """``batch`` written into the slot from ``pos`` on: (its fields, where the next may
        start). ``placed``: the wholes of :class:`~.batch.LazyRows` written so far, and
        where (a batch's rows of one are found there; the first to ask writes it)."""
        import torch

        view = memoryview(mm)
        try:
            fields: dict[str, tuple[Any, ...]] = {}
            for name, value in batch.items():
                if isinstance(value, Column):
                    nbytes = value.nbytes
                    offsets = value.gather_into(view[pos : pos + nbytes])
                    opos = pos + _aligned(nbytes)
                    view[opos : opos + offsets.nbytes] = offsets.view(np.uint8).data
                    fields[name] = ("column", pos, nbytes, opos, len(value))
                    pos = opos + _aligned(offsets.nbytes)
                elif isinstance(value, LazyTensor):  # written straight into the slot
                    _write_lazy(mm, value, pos)
                    fields[name] = ("tensor", pos, _dtype_name(value.dtype), value.shape)
                    pos += _aligned(value.nbytes)
                elif isinstance(value, LazyRows):
                    whole = value.whole
                    at = placed.get(id(whole))
                    if at is None:
                        _write_lazy(mm, whole, pos)
                        placed[id(whole)] = at = (whole, pos)  # holding it: its id stays its own
                        pos += _aligned(whole.nbytes)
                    fields[name] = ("tensor", at[1] + value.start * whole.row_bytes, _dtype_name(value.dtype),
                                    value.shape)
                elif _raw_tensor(value):
                    nbytes = value.numel() * value.element_size()
                    dst = torch.frombuffer(view[pos : pos + nbytes], dtype=value.dtype) if nbytes else None
                    if dst is not None:
                        dst.view(value.shape).copy_(value)
                    fields[name] = ("tensor", pos, _dtype_name(value.dtype), tuple(value.shape))
                    pos += _aligned(nbytes)
                else:
                    fields[name] = ("value", value)
            return fields, pos
        finally:
            view.release()

    # -- main side ---------------------------------------------------------------------
    def open(self, rb: RingBatch, steps: int | None = None, skipped: tuple[Any, ...] = ()) -> Batch:
        """The batch that ``rb`` describes, viewing its slot; the slot is freed for its
        worker when nothing views it any more."""
        if rb.group is not None:
            raise LoaderOptionError(f"BatchRing.open: slot {rb.slot} of worker {rb.worker} holds a group of "
                                    f"{len(rb.group)} batches; open it with open_all()")
        return self.open_all(rb, steps, skipped)[0]

    def open_all(self, rb: RingBatch, steps: int | None = None, skipped: tuple[Any, ...] = ()) -> list[Batch]:
        """The batches that ``rb`` describes (one, or each of a group's, whose ``steps`` are
        their samples), viewing its slot; the slot is freed for its worker when nothing
        views any of them any more."""
        mm = self._map(rb)
        rb.opened = True
        base = np.frombuffer(mm, dtype=np.uint8)
        weakref.finalize(base, _release, mm, self.free[rb.worker], os.getpid())
        self.messages += 1
        if rb.group is None:
            self.opened += 1
            return [Batch(self._fields(base, rb.fields), rb.samples, steps, skipped, rb.form)]
        self.opened += len(rb.group)
        return [Batch(self._fields(base, fields), n, None, (), rb.form) for fields, n in rb.group]

    @staticmethod
    def _fields(base: np.ndarray[Any, Any], specs: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
        import torch

        fields: dict[str, Any] = {}
        for name, spec in specs.items():
            kind = spec[0]
            if kind == "column":
                _, pos, nbytes, opos, n = spec
                offsets = base[opos : opos + 8 * (n + 1)].view(np.int64)
                fields[name] = Column([base[pos : pos + nbytes]], offsets[:-1], offsets[1:])
            elif kind == "tensor":
                _, pos, dtype, shape = spec
                dt = getattr(torch, dtype)
                count = math.prod(shape)
                if not count:
                    fields[name] = torch.empty(shape, dtype=dt)
                    continue
                raw = base[pos : pos + count * int(dt.itemsize)]
                # the tensor holds `base` (through the numpy slice), so the slot stays taken;
                # shaped in numpy where it can be (a torch view costs several times more)
                as_array = array_dtype(dt)
                fields[name] = torch.from_numpy(raw.view(as_array).reshape(shape)) if as_array is not None else \
                    torch.from_numpy(raw).view(dt).view(shape)
            else:
                fields[name] = spec[1]
        return fields

    def _map(self, rb: RingBatch) -> mmap.mmap:
        key = (rb.worker, rb.slot)
        error = getattr(rb, "fd_error", None)
        if rb.fd is not None and not isinstance(rb.fd, int):  # not unpickled: fetch it now
            try:
                rb.fd = rb.fd.detach()  # from the worker, over a socket it serves
            except OSError as e:
                rb.fd, error = None, str(e)
        if error is not None:
            raise RuntimeError(f"batch ring: DataLoader worker {rb.worker} could not hand over its slot "
                               f"{rb.slot} ({error}); the worker process has exited (was it killed?)")
        if rb.fd is not None:
            fd, rb.fd = rb.fd, None
            try:
                mm = mmap.mmap(fd, rb.size)
            finally:
                os.close(fd)
            self._maps[key] = (rb.generation, mm)
        generation, mm = self._maps[key]
        if generation != rb.generation:
            raise RuntimeError(f"batch ring: slot {key} is at generation {generation}, the batch names "
                               f"{rb.generation}")
        return mm

    def discard(self, rb: RingBatch) -> None:
        """A batch dropped unopened: its slot is free again."""
        rb.opened = True
        try:
            mm = self._map(rb)
        except Exception:  # its worker is gone (the fd cannot be fetched): nothing to give back
            return
        _release(mm, self.free[rb.worker])

    def close(self) -> None:
        """Forget the main process's maps (a map still viewed is unmapped when its views go)."""
        self._maps.clear()


def _release(mm: mmap.mmap, free: Any, pid: int | None = None) -> None:
    """Finalizer of a slot's base array: the slot is free for its worker again. Nothing
    in a forked child (``pid`` is the process that opened the batch): the slot is still
    the parent's, which may hold this batch, or one written into the slot since."""
    if pid is not None and os.getpid() != pid:
        return
    try:
        mm[0] = _FREE
    except ValueError:  # the map was closed: the worker has replaced the slot
        return
    free.release()
