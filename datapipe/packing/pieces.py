"""A planned shard written by several worker processes at once.

A shard is one task when the work has many shards; with few, large ones (128 MiB at the
defaults: a 130 MB input is one full shard and a small one) one process would write
almost all of it while the others wait. A shard's layout is known before a byte is read:
each sample's tar bytes follow from its listed sizes and member names (:func:`tar_bytes`).
So a large uncompressed shard is cut into pieces at known offsets (:func:`cut_pieces`),
each worker writes its piece into the shard's one temporary file at its offset
(``packer.pack_piece``), and the pack process (:class:`ShardAssembly`) reads the pieces
back in order as they finish into the shard's checksum, appends the end-of-archive
blocks, makes the file durable and publishes it by rename: the bytes and index records of
one process writing the whole shard. A piece that meets an input it has to skip
(``skip_errors``) moves every later offset: its shard is written again, whole, by one
worker."""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ..checksum import Hasher
from ..errors import PackError
from ..format import END_OF_ARCHIVE, ShardRecord, members_tar_bytes
from ..storage import LocalStore, temporary_name
from .sources import FileSample

__all__ = ["Piece", "cut_pieces", "tar_bytes", "ShardAssembly", "PIECES_PER_WORKER", "MIN_PIECE_COST", "FILE_COST"]

#: pieces per worker process over the whole pack: the last piece to finish leaves the other
#: workers idle for at most about a quarter of a worker's share
PIECES_PER_WORKER = 4
#: below this cost a shard is not cut (a piece costs a task, an open and a read back)
MIN_PIECE_COST = 4 << 20
#: what a file costs beyond its bytes (open, status, read, close), counted as bytes
FILE_COST = 8 << 10


@dataclass(frozen=True)
class Piece:
    """Samples ``[start, stop)`` of planned shard ``shard``, at bytes ``[offset, end)`` of it."""

    shard: int
    start: int
    stop: int
    offset: int
    end: int


def tar_bytes(sample: FileSample) -> int:
    """The exact bytes of ``sample``'s members in a tar (``FileSample.tar_bytes``
    overestimates the header of a name longer than 100 bytes)."""
    return members_tar_bytes(sample.key, ((field, size) for field, _, size in sample.files))


def _cost(sample: FileSample) -> int:
    return sample.tar_bytes + FILE_COST * len(sample.files)


def cut_pieces(plan: list[list[FileSample]], todo: list[int], workers: int) -> dict[int, list[Piece]]:
    """The shards of ``todo`` (indexes into ``plan``) worth writing in pieces by ``workers``
    processes, each cut into pieces of about equal cost: about :data:`PIECES_PER_WORKER`
    pieces per worker over the whole pack, none cheaper than :data:`MIN_PIECE_COST`. A
    shard not returned is one task."""
    if workers < 2:
        return {}
    costs = {i: sum(map(_cost, plan[i])) for i in todo}
    target = max(MIN_PIECE_COST, sum(costs.values()) // (PIECES_PER_WORKER * workers))
    out: dict[int, list[Piece]] = {}
    for i in todo:
        n = min(round(costs[i] / target), len(plan[i]))
        if n < 2:
            continue
        pieces: list[Piece] = []
        start = offset = spent = piece_offset = 0
        for j, s in enumerate(plan[i]):
            spent += _cost(s)
            offset += tar_bytes(s)
            if spent * n >= costs[i] * (len(pieces) + 1) and j + 1 < len(plan[i]):
                pieces.append(Piece(i, start, j + 1, piece_offset, offset))
                start, piece_offset = j + 1, offset
        pieces.append(Piece(i, start, len(plan[i]), piece_offset, offset))
        out[i] = pieces
    return out


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages mapped in one call, not one fault each


_sync_file_range: Any = None  # Linux's sync_file_range(2), looked up on first use; False where there is none


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing bytes ``[offset, offset + length)`` of ``fd`` to disk
    now, without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the shard's
    fsync then waits for its last piece, not for all of it (at 120 MB/s, a second for a
    128 MiB shard, at the end of the pack). Advice only: anything else does nothing."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                f = ctypes.CDLL(None, use_errno=True).sync_file_range
                f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _sync_file_range = f
            except (OSError, AttributeError):
                pass
    if _sync_file_range:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure is only advice lost


class ShardAssembly:
    """A shard written in ``pieces`` at ``store`` (a local folder) under the writer's
    temporary name for ``name``, assembled in the pack process: created here before any
    piece is written (so a worker only opens it), hashed piece by piece in order as the
    pieces are reported (:meth:`add`), then ended and published (:meth:`publish`), or
    deleted (:meth:`discard`)."""

    def __init__(self, store: LocalStore, name: str, pieces: list[Piece]) -> None:
        if store.writer_token is None:
            raise PackError(f"{store.root}: a shard is assembled through a writer's store (a datapipe bug)")
        self.name, self.pieces = name, pieces
        self.path = store.path(temporary_name(store.writer_token, name))
        self._final = store.path(name)
        self._durable = store.durable
        self._results: dict[int, dict[str, Any]] = {}
        self._hashed = 0  # pieces hashed, in order
        self._hash = Hasher()
        self.redo = False  # a piece skipped an input: the shard is written again, whole
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)

    @property
    def complete(self) -> bool:
        return len(self._results) == len(self.pieces)

    def add(self, k: int, result: dict[str, Any]) -> None:
        """Piece ``k`` is written (``result``: its ``pack_piece`` record); hash what is
        now written in order from the start."""
        self._results[k] = result
        if result.get("redo"):
            self.redo = True
        while not self.redo and self._hashed in self._results:
            p = self.pieces[self._hashed]
            self._hash_range(p.offset, p.end)
            if self._durable and self._fd is not None:
                _start_writeback(self._fd, p.offset, p.end - p.offset)
            self._hashed += 1

    def _hash_range(self, start: int, end: int) -> None:
        """Hash bytes ``[start, end)`` of the file, all written: mapped, not copied out."""
        if self._fd is None:
            raise PackError(f"shard {self.name} is closed (a datapipe bug)")
        if os.fstat(self._fd).st_size < end:  # a mapped page past the end would be a SIGBUS
            raise PackError(f"{self.path}: ends before its pieces' end {end} (a datapipe bug)")
        at = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self._fd, end - at, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=at)
        try:
            with memoryview(mapped) as view:
                self._hash.update(view[start - at :])
        finally:
            mapped.close()

    def publish(self) -> dict[str, Any]:
        """End the shard, make it durable and publish it; its journal record (as
        ``pack_shard`` returns it)."""
        if self._fd is None or not self.complete or self.redo:
            raise PackError(f"shard {self.name} is not complete (a datapipe bug)")
        end = self.pieces[-1].end
        os.pwrite(self._fd, END_OF_ARCHIVE, end)
        self._hash.update(END_OF_ARCHIVE)
        size = end + len(END_OF_ARCHIVE)
        if os.fstat(self._fd).st_size != size:
            raise PackError(f"{self.path}: {os.fstat(self._fd).st_size} bytes, its pieces make {size} "
                            "(a datapipe bug)")
        if self._durable:
            os.fsync(self._fd)
        self._close()
        os.replace(self.path, self._final)
        if self._durable:
            fd = os.open(os.path.dirname(self._final), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        samples: dict[str, list[Any]] = {"keys": [], "offsets": [], "lengths": [], "checksums": [],
                                         "member_fields": [], "member_bounds": []}
        fields: set[str] = set()
        for k in range(len(self.pieces)):
            res = self._results[k]
            for column, values in res["samples"].items():
                if values is not None:
                    samples[column].extend(values)
            fields.update(res["fields"])
        if len(samples["member_fields"]) != len(samples["keys"]):  # a piece without its layout: none recorded
            del samples["member_fields"], samples["member_bounds"]
        record = ShardRecord(self.name, size, len(samples["keys"]), self._hash.hexdigest(), size)
        return {"record": asdict(record), "samples": samples, "fields": sorted(fields), "skipped": []}

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Give the file up to a writer of the whole shard (whose write replaces it)."""
        self._close()

    def discard(self) -> None:
        """Delete the unpublished file (a pack that failed)."""
        self._close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
