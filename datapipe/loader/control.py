"""What the main process and DataLoader workers tell each other through shared memory.

:class:`PassControl`: what the main process tells persistent DataLoader workers at the
start of each pass.

A persistent worker keeps the dataset copy it was started with, so ``set_epoch()`` and
``load_state_dict()`` on the main process's dataset would never reach it (every epoch would
repeat one order). The :class:`~.dataloader.StreamingDataLoader` therefore writes the
dataset's epoch and resume state into a small shared-memory block before each pass, and
each worker's copy reads it when its pass starts. Workers resume only after the main
process has sent them the next pass through a pipe, so the write is complete when read.

:class:`WorkerPasses`: what workers tell the main process's dataset: that a pass of theirs
started. A dataset read through a plain DataLoader with workers is iterated only in copies
(forked, or pickled into spawned workers), so without it the main process's object cannot
know that its own ``state_dict()`` describes a pass nobody there has read.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd
from typing import Any

from ..errors import LoaderOptionError

__all__ = ["PassControl", "WorkerPasses"]

_SIZE = 1 << 16
_LEN = struct.Struct("<Q")
_COUNT = struct.Struct("<Q")


class PassControl:
    """A shared block holding one JSON document: ``{"epoch": e, "resume": state or None}``."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("datapipe-pass-control", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _SIZE)
        self._mm = mmap.mmap(self._fd, _SIZE)
        _close_with(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # travels into spawned workers with the dataset: the descriptor is passed, not copied
        return _attach, (DupFd(self._fd),)

    def write(self, epoch: int, resume: dict[str, Any] | None) -> None:
        doc = json.dumps({"epoch": epoch, "resume": resume}).encode()
        if _LEN.size + len(doc) > _SIZE:
            raise LoaderOptionError(f"resume state of {len(doc)} bytes does not fit the {_SIZE}-byte pass control "
                                    "block of persistent DataLoader workers: resume from it with "
                                    "StreamingDataLoader(..., persistent_workers=False)")
        self._mm[_LEN.size : _LEN.size + len(doc)] = doc
        self._mm[: _LEN.size] = _LEN.pack(len(doc))

    def read(self) -> tuple[int, dict[str, Any] | None] | None:
        """(epoch, resume state) last written, or None before the first write."""
        (n,) = _LEN.unpack(self._mm[: _LEN.size])
        if n == 0:
            return None
        doc = json.loads(self._mm[_LEN.size : _LEN.size + n])
        return int(doc["epoch"]), doc["resume"]


def _attach(fd: Any) -> PassControl:
    control = PassControl.__new__(PassControl)
    control._fd = fd.detach()
    control._mm = mmap.mmap(control._fd, _SIZE)
    _close_with(control)
    return control


def _close_with(control: PassControl) -> None:
    # the descriptor is kept for pickling (the map holds its own): close it with the block,
    # or every loader made and dropped (one per epoch, say) leaks one
    weakref.finalize(control, os.close, control._fd)


class WorkerPasses:
    """A shared counter of passes that DataLoader worker processes started on copies of one
    dataset: forked workers share the block by inheritance, spawned ones receive its
    descriptor as they are started. Pickled for anything else (a deep copy, a Ray task), the
    copy gets a block of its own: its passes are not this dataset's workers'.

    Each worker adds one when its pass starts; the main process compares :attr:`count` with
    the count it last saw. Two workers adding at once may count one: the count still
    moves, and that is all that is asked of it."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("datapipe-worker-passes", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _COUNT.size)
        self._mm = mmap.mmap(self._fd, _COUNT.size)
        weakref.finalize(self, os.close, self._fd)

    def __reduce__(self) -> tuple[Any, ...]:
        if get_spawning_popen() is None:  # not a worker being started: a block of its own
            return WorkerPasses, ()
        return _attach_passes, (DupFd(self._fd),)

    @property
    def count(self) -> int:
        (n,) = _COUNT.unpack(self._mm[: _COUNT.size])
        return int(n)

    def started(self) -> None:
        """A worker's pass starts (called in the worker)."""
        self._mm[: _COUNT.size] = _COUNT.pack((self.count + 1) & 0xFFFFFFFFFFFFFFFF)


def _attach_passes(fd: Any) -> WorkerPasses:
    passes = WorkerPasses.__new__(WorkerPasses)
    passes._fd = fd.detach()
    passes._mm = mmap.mmap(passes._fd, _COUNT.size)
    weakref.finalize(passes, os.close, passes._fd)
    return passes
