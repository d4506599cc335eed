"""The geometry of global tensors, and nothing else: no I/O, no torch, no checkpoint files.

A global tensor (:class:`GlobalTensor`) is stored as pieces (:class:`Piece`): boxes of it,
each row-major at a byte offset of one rank's data. :func:`tiling_defect` says why a set
of pieces does not cover the tensor exactly once (or None); :func:`plan_copies` intersects
a target box with every piece and cuts each overlap into copies of contiguous runs
(:class:`Copy`), each reading only bytes inside its piece and writing only bytes inside
the target. The step reader (step.py) checks the pieces a checkpoint describes with the
first; the resharding load (reshard.py) runs the copies the second plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Piece", "GlobalTensor", "Copy", "tiling_defect", "plan_copies", "row_major_strides", "SLAB_BYTES"]

SLAB_BYTES = 16 << 20  # source span one copy covers at most (memory in flight: threads x this)


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a row-major (C-contiguous) array of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


@dataclass(frozen=True)
class Piece:
    """A stored box of a global tensor: ``shape`` elements from ``start``, row-major at
    ``data_offset`` of ``rank``'s data."""

    rank: int
    data_offset: int
    start: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class GlobalTensor:
    path: str
    kind: str  # "torch" | "numpy"
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    where: str = ""  # the part file that first named it


def tiling_defect(gt: GlobalTensor, urls: list[str]) -> str | None:
    """Why the stored pieces do not tile the global tensor exactly, or None (``urls``: the
    part file of each rank, to name the pieces by). Volumes must sum to the tensor's, and
    no two non-empty pieces may overlap (a sweep along the dimension with the most
    distinct starts keeps the comparisons near-linear for the usual grid of shards)."""
    pieces = [p for p in gt.pieces if all(n > 0 for n in p.shape)]
    total = math.prod(gt.shape)
    if sum(math.prod(p.shape) for p in pieces) != total:
        holders = sorted({p.rank for p in gt.pieces})
        where = (f"pieces in {', '.join(urls[r] for r in holders[:8])}{' ...' if len(holders) > 8 else ''}"
                 if holders else "no part stores a piece of it")
        return f"its stored pieces hold {sum(math.prod(p.shape) for p in pieces)} of {total} elements ({where})"
    if len(gt.shape) == 0 or len(pieces) < 2:
        return None
    d = max(range(len(gt.shape)), key=lambda i: len({p.start[i] for p in pieces}))
    pieces.sort(key=lambda p: p.start[d])
    active: list[Piece] = []
    for p in pieces:
        active = [q for q in active if q.start[d] + q.shape[d] > p.start[d]]
        for q in active:
            if all(max(p.start[i], q.start[i]) < min(p.start[i] + p.shape[i], q.start[i] + q.shape[i])
                   for i in range(len(gt.shape))):
                return (f"the pieces in {urls[q.rank]} (at {list(q.start)}) and {urls[p.rank]} "
                        f"(at {list(p.start)}) overlap")
        active.append(p)
    return None


@dataclass
class Copy:
    """One read task: bytes of one piece, copied as ``outer`` x ``run`` bytes. Byte
    ``src_first + sum(i[k] * src_strides[k]) + j`` of the piece goes to byte
    ``dst_first + sum(i[k] * dst_strides[k]) + j`` of ``dst``, for every index ``i`` of
    ``outer`` and ``j < run``."""

    piece: Piece
    src_first: int  # byte of the first element, relative to the piece
    src_strides: tuple[int, ...]  # byte strides of the outer dims in the piece
    dst: np.ndarray[Any, Any]  # the target's flat bytes
    dst_first: int
    dst_strides: tuple[int, ...]
    outer: tuple[int, ...]
    run: int  # contiguous bytes per outer index

    def span(self) -> int:
        """Bytes of the piece from the first one read to the last."""
        return sum((n - 1) * s for n, s in zip(self.outer, self.src_strides)) + self.run


def plan_copies(gt: GlobalTensor, dst: np.ndarray[Any, Any], t_start: tuple[int, ...],
                t_shape: tuple[int, ...], slab: int = SLAB_BYTES) -> list[Copy]:
    """Read tasks that fill the box ``t_start``/``t_shape`` of ``gt`` into ``dst`` (its
    row-major bytes): one per piece it overlaps, split in slabs of at most ``slab``
    source bytes along the box's first dimension (or along its single run)."""
    isz, ndim = gt.itemsize, len(gt.shape)
    mst = row_major_strides(t_shape)
    out: list[Copy] = []
    for p in gt.pieces:
        lo = tuple(max(a, b) for a, b in zip(p.start, t_start))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(p.start, p.shape, t_start, t_shape))
        if any(x >= y for x, y in zip(lo, hi)):
            continue
        box = tuple(y - x for x, y in zip(lo, hi))
        pst = row_major_strides(p.shape)
        src_first = sum((x - s) * st for x, s, st in zip(lo, p.start, pst)) * isz
        dst_first = sum((x - s) * st for x, s, st in zip(lo, t_start, mst)) * isz
        # k: the dims after k are whole in the piece and in the target, so each index of
        # the dims before k is one contiguous run in both
        k = ndim - 1
        while k > 0 and box[k] == p.shape[k] == t_shape[k]:
            k -= 1
        run = (box[k] * math.prod(box[k + 1:]) if ndim else 1) * isz
        outer = box[:k] if ndim else ()
        sst = tuple(s * isz for s in pst[:k])
        dstr = tuple(s * isz for s in mst[:k])
        if not outer:  # one run: split it by bytes
            for a in range(0, run, slab):
                n = min(slab, run - a)
                out.append(Copy(p, src_first + a, (), dst, dst_first + a, (), (), n))
            continue
        rows = max(1, slab // max(1, sst[0]))
        for a in range(0, outer[0], rows):
            n = min(rows, outer[0] - a)
            out.append(Copy(p, src_first + a * sst[0], sst, dst, dst_first + a * dstr[0], dstr,
                            (n, *outer[1:]), run))
    return out
