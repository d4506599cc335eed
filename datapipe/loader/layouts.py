"""What is found once per shard and kept: where each field of each sample lies, and, shared
by the processes reading a dataset, which shard files were verified.

Parsing a sample's tar headers costs a dozen Python operations per member, every epoch.
The layout of a shard (recorded in the index, or found by
:func:`datapipe.format.layout.find_layout`) is checked when the shard is first fetched, on
the prefetch thread, and kept in a bounded :class:`LayoutCache` across epochs; the reader
then cuts each sample with lookups. A layout is only ever used on bytes verified against
the index. A second bounded cache of the same kind keeps each shard's checked sample table
(its rows of ``samples.parquet``), so a later pass neither decodes nor checks them again.

:class:`ShardMemo` is what the processes of one dataset (the main process and its
DataLoader workers) found about its shard files: that the bytes of a file at one identity
(device, inode, size, mtime, ctime) matched the shard's checksum, and that the index's
recorded layout was borne out by them. A fresh DataLoader worker (PyTorch restarts them at
every epoch by default) then neither hashes a shard nor checks its layout again while the
file keeps the identity another worker saw: it reads the bytes and goes on.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
from collections import OrderedDict
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd
from typing import Any

__all__ = ["LayoutCache", "ShardMemo"]


class LayoutCache:
    """What was found per shard (layouts; checked sample tables), by key, least recently
    used first out, holding at most ``max_samples`` samples' worth: a layout's
    ``samples`` (16 bytes per field per sample), or the ``cost`` :meth:`put` is given;
    ``max_samples=0`` keeps none."""

    def __init__(self, max_samples: int = 1 << 20) -> None:
        self._start(max_samples)

    def _start(self, max_samples: int) -> None:
        self.max_samples = int(max_samples)
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # a worker process builds its own; shipping the positions would cost more
        return {"max_samples": self.max_samples}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._start(state["max_samples"])

    def __len__(self) -> int:
        """Layouts held."""
        with self._lock:
            return len(self._items)

    def get(self, key: Any) -> Any:
        with self._lock:
            got = self._items.get(key)
            if got is None:
                return None
            self._items.move_to_end(key)
            return got[0]

    def put(self, key: Any, item: Any, cost: int | None = None) -> None:
        n = int(item.samples if cost is None else cost)
        if n > self.max_samples:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._held -= old[1]
            self._items[key] = (item, n)
            self._held += n
            while self._held > self.max_samples:
                _, (_, out) = self._items.popitem(last=False)
                self._held -= out


#: one slot per shard: the file identity (device, inode, size, mtime, ctime), the shard's
#: checksum, and the checksum of the index whose recorded layout the bytes bore out (zeros
#: for none), each as its own number: a slot written by two processes at once reads as
#: neither's, never as a record of bytes nobody verified
_SLOT = struct.Struct("<5q8s8s")
_NONE = bytes(8)


def _digest(checksum: str) -> bytes:
    """The 8 bytes of an ``xxh3_64:<hex>`` checksum (zeros if it is not one)."""
    try:
        return bytes.fromhex(checksum.partition(":")[2])[:8].ljust(8, b"\0")
    except ValueError:
        return _NONE


class ShardMemo:
    """A block of memory shared by the processes reading one dataset (forked DataLoader
    workers inherit it, spawned ones receive its descriptor as they start; any other copy,
    a deep copy or a Ray task, gets a block of its own): per shard, the identity of the
    file whose bytes a process read, hashed and found to match the shard's checksum, and
    whether the index's recorded layout was borne out by them. Only a file whose status is
    settled is noted (see :meth:`ShardSource._read_local`); any write, truncation or
    replacement changes the identity, and the next reader checks again."""

    def __init__(self, shards: int) -> None:
        self.shards = int(shards)
        self._fd = os.memfd_create("datapipe-shard-memo", os.MFD_CLOEXEC)
        size = max(1, self.shards) * _SLOT.size
        os.ftruncate(self._fd, size)  # sparse: a slot's page is allocated when first written
        self._mm = mmap.mmap(self._fd, size)
        weakref.finalize(self, os.close, self._fd)

    def __reduce__(self) -> tuple[Any, ...]:
        if get_spawning_popen() is None:  # not a worker being started: a block of its own
            return ShardMemo, (self.shards,)
        return _attach, (DupFd(self._fd), self.shards)

    def _slot(self, g: int) -> tuple[Any, ...]:
        return _SLOT.unpack_from(self._mm, g * _SLOT.size)

    def verified(self, g: int, identity: tuple[int, ...], checksum: str) -> bool:
        """Whether a process found the bytes of shard ``g``'s file at ``identity`` to
        match ``checksum``."""
        slot = self._slot(g)
        return slot[:5] == identity and slot[5] == _digest(checksum) != _NONE

    def laid_out(self, g: int, identity: tuple[int, ...], checksum: str, index: str) -> bool:
        """Whether, besides, the layout of index ``index`` (its manifest's checksum) was
        borne out by those bytes."""
        return self.verified(g, identity, checksum) and self._slot(g)[6] == _digest(index) != _NONE

    def note(self, g: int, identity: tuple[int, ...], checksum: str, index: str | None = None) -> None:
        """Shard ``g``'s file at ``identity`` matched ``checksum`` (and bore out the layout
        of ``index``)."""
        _SLOT.pack_into(self._mm, g * _SLOT.size, *identity, _digest(checksum),
                        _NONE if index is None else _digest(index))


def _attach(fd: Any, shards: int) -> ShardMemo:
    memo = ShardMemo.__new__(ShardMemo)
    memo.shards = shards
    memo._fd = fd.detach()
    memo._mm = mmap.mmap(memo._fd, max(1, shards) * _SLOT.size)
    weakref.finalize(memo, os.close, memo._fd)
    return memo
