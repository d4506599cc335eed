"""Reading global tensors onto any world size or mesh: each rank reads, from every part
that stored a piece of a tensor, only the bytes that overlap the box it asks for.

A step's parts together describe each global tensor as pieces (dtensor.py): a piece is a
box of the global tensor, stored row-major at a byte offset of one rank's data. For a
target box (a DTensor's local shard on the new mesh, a :class:`~.dtensor.LocalShard`, or a
whole plain tensor) the reader intersects it with every piece, turns each intersection
into copies of contiguous runs, and reads each run's byte span from the chunk files:
ranged reads (``pread`` on a local disk, ``Range`` requests on object stores), checked
block by block against the chunk's ``blocks`` checksums, so checking costs what is read
(at most one block more at each end of a span). A compressed chunk, or one without block
checksums, is read and checked whole. Reads run on a thread pool, in slabs of at most
``SLAB_BYTES`` of source span each, so memory in flight is bounded by threads x slab.

Everything the parts say about pieces is checked before a byte is read: one record per
path and rank, the same dtype and global shape in every part, boxes inside the global
shape, a stored piece holding exactly its box's bytes inside its rank's data, and the
stored pieces of a tensor tiling it exactly (no overlap, nothing missing). A defect is a
:class:`CorruptCheckpointError` naming the part file.

The part documents come from the step's parts index when the manifest names one (one
request per reader instead of one per saved rank), each document sliced out of it and
checked against the checksum the manifest records for that part file; an index that is
missing or fails a check is a warning naming it, and the parts are then read one by one.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import math
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..checksum import checksum
from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from ..storage import Store
from ..topology import Topology
from .dtensor import LocalShard, Replicated, _dtensor_type, dtensor_box
from .flatten import unflatten
from .format import MAX_CHUNK_BYTES, MAX_PART_BYTES, parts_index_key
from .loader import (
    MAX_NDIM,
    _build_leaf,
    _confine,
    _is_int,
    _leaf_dtype,
    _part_of,
    _read_doc_bytes,
    _unzstd_chunk,
)

__all__ = ["SavedStep", "load_into", "load_part_full", "is_sharded", "SLAB_BYTES"]

SLAB_BYTES = 16 << 20  # source span one read task covers (memory in flight: threads x this)
READ_THREADS = 8
INDEX_FRAMING_BYTES = 4096  # a parts index's bytes besides its part documents (plus 2 per part)


def is_sharded(part: dict[str, Any]) -> bool:
    """Whether a part holds pieces of global tensors (it then loads through this module)."""
    leaves = part.get("leaves")
    return isinstance(leaves, list) and any(isinstance(s, dict) and "global" in s for s in leaves)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
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


def _tiles(gt: GlobalTensor, urls: list[str]) -> str | None:
    """Why the stored pieces do not tile the global tensor exactly, or None. Volumes must
    sum to the tensor's, and no two non-empty pieces may overlap (a sweep along the
    dimension with the most distinct starts keeps the comparisons near-linear for the
    usual grid of shards)."""
    pieces = [p for p in gt.pieces if all(n > 0 for n in p.shape)]
    total = math.prod(gt.shape)
    if sum(math.prod(p.shape) for p in pieces) != total:
        holders = sorted({p.rank for p in gt.pieces})
        return (f"its stored pieces hold {sum(math.prod(p.shape) for p in pieces)} of {total} elements "
                f"(pieces in {', '.join(urls[r] for r in holders[:8])}{' ...' if len(holders) > 8 else ''})")
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


class SavedStep:
    """Every part of one committed step, checked, with an index of its global tensors."""

    def __init__(self, store: Store, step: int, manifest: dict[str, Any], where: str,
                 threads: int = READ_THREADS) -> None:
        self.store, self.step, self.where, self.threads = store, step, where, threads
        ws = manifest["world_size"]
        self.world_size = ws
        parts = self._parts_from_index(manifest)
        if parts is None:
            with cf.ThreadPoolExecutor(max(1, min(threads, ws)), thread_name_prefix="datapipe-ckpt-meta") as pool:
                parts = list(pool.map(lambda r: self._read_part(manifest, r), range(ws)))
        self.parts = parts
        self.part_urls = [store.url(e["key"]) for e in manifest["parts"]]
        self.chunk_starts = [[c["offset"] for c in p["chunks"]] for p in self.parts]
        self._sizes: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self.tensors: dict[str, GlobalTensor] = {}
        self.per_rank: dict[tuple[int, str], int] = {}  # (rank, path) -> leaf index
        for r in range(ws):
            self._index_part(r)
        for (r, path) in self.per_rank:
            gt = self.tensors.get(path)
            if gt is not None:
                raise CorruptCheckpointError(
                    f"{self.part_urls[r]}: {path!r:.100} is a per-rank array here, a global tensor in {gt.where}")
        for gt in self.tensors.values():
            why = _tiles(gt, self.part_urls)
            if why is not None:
                raise CorruptCheckpointError(f"{self.where}: global tensor {gt.path!r:.100}: {why}")

    def _parts_from_index(self, manifest: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every part, checked, from the parts index the manifest names; None when it names
        none (a checkpoint written before the index existed) or the index fails a check
        (a warning names it): the caller then reads each part file."""
        record = manifest.get("parts_index")
        if record is None:
            return None
        key = parts_index_key(self.step, manifest["attempt"])
        try:
            return self._read_parts_index(manifest, record, key)
        except (CorruptCheckpointError, StorageError, OSError) as e:
            # The part files are the truth the manifest commits to; the index is a copy of
            # them for speed, so a damaged or lost copy costs requests, not the checkpoint.
            warnings.warn(f"{self.where}: parts index {self.store.url(key)} not used ({e}); reading the "
                          f"{self.world_size} part documents one by one", stacklevel=2)
            return None

    def _read_parts_index(self, manifest: dict[str, Any], record: Any, key: str) -> list[dict[str, Any]]:
        """The parts sliced out of the index. Before a byte is read: the manifest's record
        names this attempt's index, its slices lie in order inside its size, and the object
        in the store has that size. Then the whole object against the manifest's checksum,
        and each slice against the checksum the manifest records for that part file (so it
        is that file's exact bytes) before it is parsed and checked like a part file."""
        url = self.store.url(key)
        entries = manifest["parts"]
        if not (isinstance(record, dict) and record.get("key") == key and _is_int(record.get("bytes"))
                and isinstance(record.get("checksum"), str)):
            raise CorruptCheckpointError(f"the manifest's record of it is malformed ({record!r:.200})")
        size = record["bytes"]
        end = 0
        for r, e in enumerate(entries):
            off, n = e.get("index_offset"), e.get("doc_bytes")
            if not (_is_int(off) and _is_int(n, 1, MAX_PART_BYTES) and off >= end and off + n <= size):
                raise CorruptCheckpointError(
                    f"part {r} lies at {off!r:.40} + {n!r:.40} bytes, not after byte {end} inside its {size} bytes")
            end = off + n
        framing = size - sum(e["doc_bytes"] for e in entries)
        if framing > INDEX_FRAMING_BYTES + 2 * len(entries):
            # the header, separators and end hold a few bytes: reading the index never reads
            # much more than the part files it stands for
            raise CorruptCheckpointError(f"its {size} bytes hold {framing} bytes besides the part documents")
        _confine(self.store, key, url)
        got = self.store.size(key)
        if got != size:
            raise CorruptCheckpointError(f"it holds {got} bytes, the manifest records {size}")
        data = memoryview(self.store.get_range(key, 0, size))  # the probed size, even if it grew since
        if checksum(data) != record["checksum"]:
            raise CorruptCheckpointError("it does not match its manifest checksum")
        parts = []
        for r, e in enumerate(entries):
            doc = bytes(data[e["index_offset"] : e["index_offset"] + e["doc_bytes"]])
            parts.append(_part_of(doc, e, self.step, manifest["attempt"], r, self.world_size,
                                  f"{self.store.url(e['key'])} (part {r}'s bytes in the parts index)", self.where))
        return parts

    def _read_part(self, manifest: dict[str, Any], r: int) -> dict[str, Any]:
        entry = manifest["parts"][r]
        data = _read_doc_bytes(self.store, entry["key"], "part", MAX_PART_BYTES)
        return _part_of(data, entry, self.step, manifest["attempt"], r, manifest["world_size"],
                        self.store.url(entry["key"]), self.where)

    def _index_part(self, r: int) -> None:
        part, url = self.parts[r], self.part_urls[r]
        data_bytes = part["data_bytes"]
        seen: set[str] = set()
        for i, spec in enumerate(part["leaves"]):
            if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
                raise CorruptCheckpointError(f"{url}: malformed leaf record {spec!r:.100}")
            path, kind = spec["path"], spec.get("kind")
            dtype, itemsize = _leaf_dtype(kind, spec.get("dtype"), path, url)
            shape, off, nbytes = spec.get("shape"), spec.get("offset"), spec.get("nbytes")
            if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d) for d in shape)):
                raise CorruptCheckpointError(f"{url}: leaf {path!r:.100} has a malformed shape {shape!r:.100}")
            if not (_is_int(off) and _is_int(nbytes) and off + nbytes <= data_bytes):
                raise CorruptCheckpointError(f"{url}: leaf {path!r:.100} lies outside the rank's data")
            if math.prod(shape) * itemsize != nbytes:
                raise CorruptCheckpointError(
                    f"{url}: leaf {path!r:.100}: shape {shape} of {dtype} is not {nbytes} bytes")
            g = spec.get("global")
            if g is None and (self.world_size > 1 or kind == "npscalar"):
                self.per_rank[(r, path)] = i
                continue
            if kind not in ("torch", "numpy"):
                raise CorruptCheckpointError(f"{url}: leaf {path!r:.100} of kind {kind!r:.40} cannot be global")
            if path in seen:
                raise CorruptCheckpointError(f"{url}: global tensor {path!r:.100} is recorded twice")
            seen.add(path)
            if g is None:  # a one-rank checkpoint: every array is whole
                g = {"shape": shape, "offset": [0] * len(shape), "region": shape, "replica": False}
            gshape, start, region, replica = self._check_global(g, shape, nbytes, path, url)
            gt = self.tensors.get(path)
            if gt is None:
                gt = self.tensors[path] = GlobalTensor(path, kind, dtype, itemsize, gshape, where=url)
            elif (gt.kind, gt.dtype, gt.shape) != (kind, dtype, gshape):
                raise CorruptCheckpointError(
                    f"{url}: global tensor {path!r:.100} is {kind} {dtype} {list(gshape)} here, "
                    f"{gt.kind} {gt.dtype} {list(gt.shape)} in {gt.where}")
            if not replica:
                gt.pieces.append(Piece(r, off, start, region))

    @staticmethod
    def _check_global(g: Any, shape: list[int], nbytes: int, path: str,
                      url: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]:
        def bad(msg: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{url}: global record of {path!r:.100}: {msg}")

        if not isinstance(g, dict):
            raise bad(f"not an object: {g!r:.100}")
        gshape, start, region, replica = g.get("shape"), g.get("offset"), g.get("region"), g.get("replica")
        for name, v in (("shape", gshape), ("offset", start), ("region", region)):
            if not (isinstance(v, list) and len(v) <= MAX_NDIM and all(_is_int(x) for x in v)):
                raise bad(f"{name} {v!r:.100} is not a list of ints >= 0")
        assert isinstance(gshape, list) and isinstance(start, list) and isinstance(region, list)
        if not isinstance(replica, bool):
            raise bad(f"replica {replica!r:.40} is not a bool")
        if not len(gshape) == len(start) == len(region):
            raise bad(f"shape {gshape}, offset {start} and region {region} differ in dims")
        for d, (n, o, k) in enumerate(zip(gshape, start, region)):
            if o + k > n:
                raise bad(f"dim {d}: elements [{o}, {o + k}) lie outside the global size {n}")
        if replica:
            if nbytes != 0:
                raise bad(f"a replica stores no bytes, this one {nbytes}")
        elif region != shape:
            raise bad(f"region {region} is not the stored shape {shape}")
        return tuple(gshape), tuple(start), tuple(region), replica

    # -- verified byte ranges of a rank's data ------------------------------------------------
    def _chunk_size(self, r: int, i: int) -> int:
        """The chunk file's size, probed once; it must be what the part records (so nothing
        is allocated or read on the word of a document alone)."""
        key = (r, i)
        with self._lock:
            size = self._sizes.get(key)
        if size is None:
            c = self.parts[r]["chunks"][i]
            _confine(self.store, c["key"], self.where)
            size = self.store.size(c["key"])
            if size != c["stored_bytes"]:
                raise CorruptCheckpointError(
                    f"chunk {self.store.url(c['key'])} of {self.where} holds {size} bytes, its part "
                    f"{self.part_urls[r]} records {c['stored_bytes']}")
            with self._lock:
                self._sizes[key] = size
        return size

    def _blocks(self, r: int, i: int) -> tuple[int, list[str]] | None:
        part = self.parts[r]
        c = part["chunks"][i]
        b = c.get("blocks")
        if part.get("compression") is not None or b is None:
            return None
        n = b.get("bytes") if isinstance(b, dict) else None
        sums = b.get("checksums") if isinstance(b, dict) else None
        if not (_is_int(n, 1, MAX_CHUNK_BYTES) and isinstance(sums, list)
                and len(sums) == -(-c["bytes"] // n) and all(isinstance(s, str) for s in sums)):
            raise CorruptCheckpointError(f"{self.part_urls[r]}: chunk {c['key']} has malformed block checksums")
        return n, sums

    def _fill(self, r: int, i: int, lo: int, hi: int, dst: np.ndarray[Any, Any]) -> None:
        """Bytes ``[lo, hi)`` of chunk ``i`` of rank ``r`` into ``dst``, checked: ``lo``/``hi``
        fall on block boundaries (or the chunk's ends when it has no blocks)."""
        part = self.parts[r]
        c = part["chunks"][i]
        key, url = c["key"], self.store.url(c["key"])
        self._chunk_size(r, i)
        if part.get("compression") == "zstd":
            raw = _unzstd_chunk(c, self.store.get_range(key, 0, c["stored_bytes"]), url, self.where)
            dst[:] = np.frombuffer(raw, np.uint8, hi - lo, lo)
            return
        got = self.store.readinto(key, dst.data, lo)
        if got != hi - lo:
            raise CorruptCheckpointError(f"chunk {url} of {self.where}: read {got} of bytes [{lo}, {hi})")
        blocks = self._blocks(r, i)
        if blocks is None:
            if checksum(dst.data) != c["checksum"]:
                raise CorruptCheckpointError(f"checksum mismatch in chunk {url} of {self.where}")
            return
        n, sums = blocks
        for j in range(lo // n, -(-hi // n)):
            a, b = j * n - lo, min((j + 1) * n, hi) - lo
            if checksum(dst[a:b].data) != sums[j]:
                raise CorruptCheckpointError(
                    f"checksum mismatch in chunk {url} of {self.where}, bytes [{j * n}, {j * n + b - a})")

    def read_into(self, r: int, start: int, end: int, dst: np.ndarray[Any, Any]) -> None:
        """Bytes ``[start, end)`` of rank ``r``'s data into ``dst``, checked. Blocks that lie
        wholly inside the range are read straight into ``dst`` and checked there; only a
        block cut by an end of the range (or a chunk without blocks, or compressed) goes
        through a buffer of its own."""
        part = self.parts[r]
        chunks = part["chunks"]
        i = bisect.bisect_right(self.chunk_starts[r], start) - 1
        whole = part.get("compression") is not None
        while i < len(chunks) and chunks[i]["offset"] < end:
            c = chunks[i]
            c0, cb = c["offset"], c["bytes"]
            lo, hi = max(start - c0, 0), min(end - c0, cb)
            blocks = None if whole else self._blocks(r, i)
            n = blocks[0] if blocks is not None else cb
            j = lo // n
            while j * n < hi:
                b0, b1 = j * n, min((j + 1) * n, cb)
                if blocks is not None and b0 >= lo and b1 <= hi:
                    k = j  # a run of whole blocks: one read, straight into dst
                    while (k + 1) * n < hi and min((k + 2) * n, cb) <= hi:
                        k += 1
                    b1 = min((k + 1) * n, cb)
                    self._fill(r, i, b0, b1, dst[c0 + b0 - start : c0 + b1 - start])
                    j = k + 1
                    continue
                tmp = np.empty(b1 - b0, np.uint8)
                self._fill(r, i, b0, b1, tmp)
                a, z = max(lo, b0), min(hi, b1)
                dst[c0 + a - start : c0 + z - start] = tmp[a - b0 : z - b0]
                j += 1
            i += 1

    def read_range(self, r: int, start: int, end: int) -> tuple[np.ndarray[Any, Any], int]:
        """``(buf, base)``: checked bytes of rank ``r``'s data covering ``[start, end)``;
        ``buf[k]`` is byte ``base + k`` (whole blocks or chunks around the range)."""
        part = self.parts[r]
        chunks, starts = part["chunks"], self.chunk_starts[r]
        units = []
        i = bisect.bisect_right(starts, start) - 1
        whole = part.get("compression") is not None
        while i < len(chunks) and chunks[i]["offset"] < end:
            c = chunks[i]
            lo, hi = max(start - c["offset"], 0), min(end - c["offset"], c["bytes"])
            blocks = None if whole else self._blocks(r, i)
            if blocks is None:
                lo, hi = 0, c["bytes"]
            else:
                lo, hi = lo // blocks[0] * blocks[0], min(c["bytes"], -(-hi // blocks[0]) * blocks[0])
            units.append((i, lo, hi))
            i += 1
        if not units:
            raise CorruptCheckpointError(f"{self.part_urls[r]}: bytes [{start}, {end}) lie outside the chunks")
        base = chunks[units[0][0]]["offset"] + units[0][1]
        buf = np.empty(chunks[units[-1][0]]["offset"] + units[-1][2] - base, np.uint8)
        for i, lo, hi in units:
            at = chunks[i]["offset"] + lo - base
            self._fill(r, i, lo, hi, buf[at : at + hi - lo])
        return buf, base


# -- copy plans: runs of bytes from pieces into a target box ----------------------------------

@dataclass
class _Copy:
    """One read task: bytes of one piece, copied as ``outer`` x ``run`` bytes."""

    piece: Piece
    src_first: int  # byte of the first element, relative to the piece
    src_strides: tuple[int, ...]  # byte strides of the outer dims in the piece
    dst: np.ndarray[Any, Any]  # the target's flat bytes
    dst_first: int
    dst_strides: tuple[int, ...]
    outer: tuple[int, ...]
    run: int  # contiguous bytes per outer index

    def span(self) -> int:
        return sum((n - 1) * s for n, s in zip(self.outer, self.src_strides)) + self.run


def plan_copies(gt: GlobalTensor, dst: np.ndarray[Any, Any], t_start: tuple[int, ...],
                t_shape: tuple[int, ...], slab: int = SLAB_BYTES) -> list[_Copy]:
    """Read tasks that fill the box ``t_start``/``t_shape`` of ``gt`` into ``dst`` (its
    row-major bytes): one per piece it overlaps, split in slabs of at most ``slab``
    source bytes along the box's first dimension (or along its single run)."""
    isz, ndim = gt.itemsize, len(gt.shape)
    mst = _strides(t_shape)
    out: list[_Copy] = []
    for p in gt.pieces:
        lo = tuple(max(a, b) for a, b in zip(p.start, t_start))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(p.start, p.shape, t_start, t_shape))
        if any(x >= y for x, y in zip(lo, hi)):
            continue
        box = tuple(y - x for x, y in zip(lo, hi))
        pst = _strides(p.shape)
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
                out.append(_Copy(p, src_first + a, (), dst, dst_first + a, (), (), n))
            continue
        rows = max(1, slab // max(1, sst[0]))
        for a in range(0, outer[0], rows):
            n = min(rows, outer[0] - a)
            out.append(_Copy(p, src_first + a * sst[0], sst, dst, dst_first + a * dstr[0], dstr,
                             (n, *outer[1:]), run))
    return out


def _run_copy(saved: SavedStep, c: _Copy) -> int:
    start = c.piece.data_offset + c.src_first
    if not c.outer:  # one run (at most a slab): read and check in a scratch buffer, then copy
        # never into the target itself: a failed check would leave unverified bytes in the
        # caller's tensors (and a load with step=None goes on to an older step)
        tmp = np.empty(c.run, np.uint8)
        saved.read_into(c.piece.rank, start, start + c.run, tmp)
        c.dst[c.dst_first : c.dst_first + c.run] = tmp
    else:
        buf, base = saved.read_range(c.piece.rank, start, start + c.span())
        src = buf[start - base :]
        shape = (*c.outer, c.run)
        sv = as_strided(src, shape=shape, strides=(*c.src_strides, 1), writeable=False)
        dv = as_strided(c.dst[c.dst_first :], shape=shape, strides=(*c.dst_strides, 1))
        np.copyto(dv, sv)
    return c.span()


def run_copies(saved: SavedStep, copies: list[_Copy]) -> int:
    """Run the read tasks on the thread pool; the first failure is raised. Returns the
    source bytes spanned."""
    if not copies:
        return 0
    # the largest first: the pool stays busy to the end
    copies = sorted(copies, key=lambda c: -c.span())
    threads = max(1, min(saved.threads, len(copies)))
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="datapipe-ckpt-load") as pool:
        futs = [pool.submit(_run_copy, saved, c) for c in copies]
        total = 0
        try:
            for f in futs:
                total += f.result()
        except BaseException:
            for f in futs:
                f.cancel()
            raise
    return total


# -- targets: what a rank asks for ------------------------------------------------------------

@dataclass
class _Target:
    """A tensor or array of ``into`` and the box of its global tensor it asks for."""

    path: str
    obj: Any
    local: Any  # the array to fill (a DTensor's local tensor, a LocalShard's tensor, itself)
    start: tuple[int, ...] | None  # None: the whole tensor
    shape: tuple[int, ...]


def _shares_memory(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether two elements of a strided view may be one place in memory (an ``expand()``ed
    tensor, a broadcast array): with the dimensions of more than one element ordered by
    stride, each must step past everything the ones before it span. (A few layouts only
    ``as_strided`` makes interleave without overlap and are counted as overlapping.)"""
    span = itemsize
    for stride, n in sorted((abs(st), n) for n, st in zip(shape, strides) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def _flat_bytes(local: Any, path: str, where: str) -> tuple[np.ndarray[Any, Any], Callable[[], None] | None]:
    """Row-major bytes of ``local`` to write into, and what to do after (copy back from a
    host buffer when ``local`` is not a contiguous host array). Refused, before anything is
    read: a target with no memory of its own to fill (a ``meta`` tensor) or whose elements
    share memory (an ``expand()``ed view): either would take the load and keep nothing."""
    if isinstance(local, np.ndarray):
        if not local.flags.writeable:
            raise CheckpointError(f"into: {path!r} is a read-only numpy array: pass a writeable one ({where})")
        if _shares_memory(local.shape, local.strides, local.itemsize):
            raise CheckpointError(
                f"into: {path!r} is an array whose elements share memory (shape {list(local.shape)}, strides "
                f"{list(local.strides)}: a broadcast view): pass an array that holds each element, e.g. "
                f"its .copy() ({where})")
        if local.flags.c_contiguous:
            return local.reshape(-1).view(np.uint8), None
        host: np.ndarray[Any, Any] = np.empty(local.shape, local.dtype)
        return host.reshape(-1).view(np.uint8), lambda: np.copyto(local, host)
    import torch

    from .flatten import torch_copyable

    if not torch_copyable(local.dtype):
        raise CheckpointError(f"into: {path!r}: dtype {local.dtype} cannot be filled in place")
    t = local.detach()
    if t.device.type == "meta":
        raise CheckpointError(
            f"into: {path!r} is a meta tensor, which has no memory to load into: allocate it first "
            f"(an FSDP2 model: model.to_empty(device=...); then load) ({where})")
    if _shares_memory(tuple(t.shape), tuple(t.stride()), 1):
        raise CheckpointError(
            f"into: {path!r} is a tensor whose elements share memory (shape {list(t.shape)}, strides "
            f"{list(t.stride())}: an expand()ed view): pass a tensor that holds each element, e.g. its "
            f".clone() ({where})")
    if t.device.type == "cpu" and t.is_contiguous():
        # the same elements with stride 1: a dimension of one element may carry any stride,
        # which a byte view refuses
        return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy(), None
    tmp = torch.empty(tuple(t.shape), dtype=t.dtype)

    def back() -> None:
        with torch.no_grad():
            t.copy_(tmp)

    return tmp.reshape(-1).view(torch.uint8).numpy(), back


def _target(x: Any, path: str, memo: dict[Any, Any]) -> _Target | None:
    dt = _dtensor_type()
    if dt is not None and isinstance(x, dt):
        box = dtensor_box(x, path, memo)
        return _Target(path, x, x.to_local(), box.offset, box.shape)
    if isinstance(x, LocalShard):
        return _Target(path, x, x.tensor, x.offset, tuple(int(d) for d in x.tensor.shape))
    torch_mod = sys.modules.get("torch")
    if isinstance(x, np.ndarray) or (torch_mod is not None and isinstance(x, torch_mod.Tensor)):
        return _Target(path, x, x, None, tuple(int(d) for d in x.shape))
    return None


def _target_global_shape(t: _Target) -> tuple[int, ...]:
    if isinstance(t.obj, LocalShard):
        return t.obj.global_shape
    return tuple(int(d) for d in t.obj.shape)  # a DTensor's shape is the global one


def _dtype_name(local: Any) -> str:
    if isinstance(local, np.ndarray):
        return str(local.dtype.str)
    return str(local.dtype).removeprefix("torch.")


# -- the saved trees: values that are not tensors ---------------------------------------------

def _path(parent: str, key: Any) -> str:
    return f"{parent}.{key}" if parent else str(key)


class _Loader:
    """One ``load_checkpoint(into=...)`` on one rank."""

    def __init__(self, saved: SavedStep, rank: int, map_location: Any) -> None:
        self.saved, self.rank, self.map_location = saved, rank, map_location
        self.copies: list[_Copy] = []
        self.finish: list[tuple[str, Callable[[], None]]] = []  # (path, copy back into its target)
        self._index: dict[int, dict[Any, Any] | list[Any] | None] = {}
        self._boxes: dict[Any, Any] = {}  # dtensor_box's memo over `into`

    # a saved leaf, whole, as a new object (values of `into` that are not arrays)
    def materialize(self, r: int, index: int) -> Any:
        saved = self.saved
        spec = saved.parts[r]["leaves"][index]
        where = saved.part_urls[r]
        gt = saved.tensors.get(spec["path"]) if (r, spec["path"]) not in saved.per_rank else None
        if gt is None:
            off, nbytes = spec["offset"], spec["nbytes"]
            import torch

            if nbytes:
                buf, base = saved.read_range(r, off, off + nbytes)
                raw = torch.from_numpy(buf[off - base : off - base + nbytes].copy())
            else:
                raw = torch.empty(0, dtype=torch.uint8)
            return _build_leaf(raw, dict(spec, offset=0), where, self.map_location)
        for p in gt.pieces:  # probe the files before allocating what the documents claim
            for i in range(len(saved.parts[p.rank]["chunks"])):
                saved._chunk_size(p.rank, i)
        if gt.kind == "torch":
            import torch

            from .flatten import torch_dtype_from_name

            out: Any = torch.empty(gt.shape, dtype=torch_dtype_from_name(gt.dtype, where))
            flat = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
        else:
            out = np.empty(gt.shape, np.dtype(gt.dtype))
            flat = out.reshape(-1).view(np.uint8)
        run_copies(saved, plan_copies(gt, flat, (0,) * len(gt.shape), gt.shape))
        if gt.kind == "torch" and self.map_location is not None:
            out = out.to(self.map_location)
        return out

    def _children(self, node: Any) -> dict[Any, Any] | list[Any] | None:
        """A saved container node's children, indexed once (dict lookups, not scans)."""
        key = id(node)
        if key not in self._index:
            kids: dict[Any, Any] | list[Any] | None = None
            if isinstance(node, dict) and len(node) == 1:
                (tag, val), = node.items()
                if tag in ("dict", "odict") and isinstance(val, list):
                    kids = {item[0]: item[1] for item in val
                            if isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))}
                elif tag in ("list", "tuple") and isinstance(val, list):
                    kids = val
            self._index[key] = kids
        return self._index[key]

    def _find(self, keys: tuple[Any, ...]) -> tuple[int, Any] | None:
        """``(rank, node)`` at ``keys`` in the saved trees: rank 0's, else the lowest rank's
        that has it (pipeline stages hold different parts of the state)."""
        for r, part in enumerate(self.saved.parts):
            node: Any = part["tree"]
            for k in keys:
                kids = self._children(node)
                if isinstance(kids, dict) and k in kids:
                    node = kids[k]
                elif isinstance(kids, list) and isinstance(k, int) and 0 <= k < len(kids):
                    node = kids[k]
                else:
                    break
            else:
                return r, node
        return None

    def saved_value(self, r: int, node: Any) -> Any:
        """A saved tree node of rank ``r`` as a value, its arrays read whole."""
        return _rebuild(node, lambda i: self.materialize(r, i), self.saved.part_urls[r])

    def fill(self, x: Any, keys: tuple[Any, ...], path: str) -> Any:
        """The result for ``x``, the value of ``into`` at ``keys`` (``path`` in the state)."""
        if isinstance(x, Replicated):
            return self.fill(x.value, keys, path)
        t = _target(x, path, self._boxes)
        if t is not None:
            self.fill_target(t)
            return x
        if isinstance(x, dict):
            out = OrderedDict() if isinstance(x, OrderedDict) else {}
            for k, v in x.items():
                out[k] = self.fill(v, (*keys, k), _path(path, k))
            # saved keys `into` does not name come back if they hold no arrays (loader
            # state, counters); arrays are read only where `into` asks for them
            found = self._find(keys)
            kids = self._children(found[1]) if found is not None else None
            if found is not None and isinstance(kids, dict):
                for k, node in kids.items():
                    if k not in out and not _has_leaf(node):
                        out[k] = self.saved_value(found[0], node)
            return out
        if isinstance(x, (list, tuple)):
            items = [self.fill(v, (*keys, i), _path(path, i)) for i, v in enumerate(x)]
            return tuple(items) if type(x) is tuple else items
        found = self._find(keys)
        if found is None:
            return x  # a value the checkpoint does not have: `into` keeps its own
        return self.saved_value(*found)

    def fill_target(self, t: _Target) -> None:
        saved, path = self.saved, t.path
        gt = saved.tensors.get(path)
        if gt is None:
            idx = saved.per_rank.get((self.rank, path))
            if idx is None:
                holders = sorted(r for r, p in saved.per_rank if p == path)
                if holders:
                    raise CheckpointError(
                        f"into: {path!r} was saved per rank by ranks {holders[:8]} (a plain tensor), and "
                        f"rank {self.rank} has none; save it inside Replicated(...) if it is the same on "
                        f"every rank, or as a DTensor, to load it onto another world size ({saved.where})")
                raise CheckpointError(f"into: {path!r} is not in the checkpoint ({saved.where})")
            spec = saved.parts[self.rank]["leaves"][idx]
            gt = GlobalTensor(path, spec["kind"], spec["dtype"], 0, tuple(spec["shape"]),
                              [Piece(self.rank, spec["offset"], (0,) * len(spec["shape"]), tuple(spec["shape"]))],
                              saved.part_urls[self.rank])
            gt.itemsize = _leaf_dtype(spec["kind"], spec["dtype"], path, gt.where)[1]
        if _dtype_name(t.local) != gt.dtype:
            raise CheckpointError(f"into: {path!r} is {_dtype_name(t.local)}, the checkpoint holds {gt.dtype}")
        if _target_global_shape(t) != gt.shape:
            raise CheckpointError(
                f"into: {path!r} has global shape {list(_target_global_shape(t))}, "
                f"the checkpoint's is {list(gt.shape)}")
        start = t.start if t.start is not None else (0,) * len(gt.shape)
        if len(start) != len(gt.shape) or any(s + n > g for s, n, g in zip(start, t.shape, gt.shape)):
            raise CheckpointError(f"into: {path!r}: box {list(start)} + {list(t.shape)} lies outside {list(gt.shape)}")
        if math.prod(t.shape) == 0:
            return
        flat, back = _flat_bytes(t.local, path, saved.where)
        self.copies += plan_copies(gt, flat, start, t.shape)
        if back is not None:
            self.finish.append((path, back))


def _leaf_indices(node: Any) -> list[int]:
    """The ``{"leaf": i}`` indices under a saved tree node (iteratively: trees are deep)."""
    indices: list[int] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if set(n) == {"leaf"} and _is_int(n["leaf"]):
                indices.append(n["leaf"])
            else:
                stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return indices


def _has_leaf(node: Any) -> bool:
    return bool(_leaf_indices(node))


def _rebuild(node: Any, leaf: Callable[[int], Any], where: str) -> Any:
    """A saved tree node as a Python value, its leaves built by ``leaf(index)``."""
    table: dict[int, Any] = {i: leaf(i) for i in sorted(set(_leaf_indices(node)))}
    size = max(table, default=-1) + 1
    return unflatten(node, [table.get(i) for i in range(size)], where)


def _own_rank(rank: int | None) -> int:
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise CheckpointError(f"rank must be an int >= 0, got {rank!r}")
        return rank
    live = Topology.distributed()
    return live.rank if live is not None else 0


def load_into(store: Store, step: int, manifest: dict[str, Any], into: Any, rank: int | None,
              map_location: Any) -> Any:
    """Fill the tensors of ``into`` in place from step ``step`` and return ``into``'s
    structure with every other value taken from the checkpoint (see ``load_checkpoint``)."""
    where = f"checkpoint step {step} at {store.root}"
    saved = SavedStep(store, step, manifest, where)
    loader = _Loader(saved, _own_rank(rank), map_location)
    result = loader.fill(into, (), "")
    run_copies(saved, loader.copies)
    for path, back in loader.finish:
        try:
            back()
        except (RuntimeError, TypeError, ValueError) as e:  # torch's or numpy's word on that target
            raise CheckpointError(f"into: {path!r}: the loaded bytes could not be copied into it "
                                  f"({type(e).__name__}: {e}) ({where})") from e
    return result


def load_part_full(store: Store, step: int, manifest: dict[str, Any], rank: int, map_location: Any) -> Any:
    """Rank ``rank``'s saved state with each global tensor whole (``load_checkpoint``
    without ``into=`` of a checkpoint holding DTensors or Replicated arrays)."""
    where = f"checkpoint step {step} at {store.root}"
    saved = SavedStep(store, step, manifest, where)
    loader = _Loader(saved, rank, map_location)
    return _rebuild(saved.parts[rank]["tree"], lambda i: loader.materialize(rank, i), saved.part_urls[rank])
