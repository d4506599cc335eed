"""Reading global tensors onto any world size or mesh: each rank reads, from every part
that stored a piece of a tensor, only the bytes that overlap the box it asks for.

A step's parts together describe each global tensor as pieces (dtensor.py): a piece is a
box of the global tensor, stored row-major at a byte offset of one rank's data. For a
target box (a DTensor's local shard on the new mesh, a :class:`~.dtensor.LocalShard`, or a
whole plain tensor) the copies that fill it are planned by overlap (overlap.py) and each
reads its byte span from the chunk files through the step reader (``SavedStep.read_into``
/ ``read_range`` / ``read_through``, step.py: checked block by block). Reads run on a
thread pool, in slabs of at most ``overlap.SLAB_BYTES`` of source span each, so memory in
flight is bounded by threads x slab; a contiguous run passes through its thread's scratch
buffer (``SCRATCH_BYTES``) instead.

Two loads go through here: ``load_checkpoint(into=...)`` (:func:`load_into`: the tensors
of ``into`` filled in place, every other value taken from the checkpoint) and the load of
a sharded part without ``into=`` (:func:`load_part_full`: each global tensor whole). The
pieces themselves, and every part document, are checked by ``SavedStep`` before a byte is
read.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import CheckpointError, CheckpointOptionError
from ..storage import Store
from ..topology import Topology
from .dtensor import LocalShard, Replicated, dtensor_box, dtensor_type
from .flatten import unflatten
from .leaf import torch_copyable, torch_dtype_from_name
from .overlap import Copy, GlobalTensor, Piece, plan_copies
from .step import SavedStep, build_leaf, is_int, leaf_dtype

__all__ = ["fill_into", "load_into", "load_part_full", "parts_overlapping", "run_copies", "whole_state"]


#: bytes of the buffer each reading thread checks blocks in before it copies them out: one
#: block of the writer's (``format.BLOCK_BYTES``), small enough to stay in the CPU's cache
#: between the read, the check and the copy (with 4 MiB a 384 MiB step resharded onto 4 ranks
#: loaded 15-30% slower here; with a new buffer per copy, 1.5-2x slower on a process's first load)
SCRATCH_BYTES = 1 << 20
_thread = threading.local()


def _thread_buffer(n: int) -> np.ndarray[Any, Any]:
    """``n`` bytes of this reading thread's buffer, grown when a copy needs more: a contiguous
    run's ``SCRATCH_BYTES``, or a strided copy's span (a slab and the blocks around it, or
    whole chunks where they have no blocks). A thread's copies read into memory it touched
    already, one copy at a time; what is read there is copied into the target before the
    next copy."""
    buf = getattr(_thread, "buf", None)
    if buf is None or len(buf) < n:
        buf = _thread.buf = np.empty(n, np.uint8)
    return buf[:n]


def _run_copy(saved: SavedStep, c: Copy) -> int:
    start = c.piece.data_offset + c.src_first
    if not c.outer:  # one run (at most a slab): read and checked block by block in this
        # thread's scratch buffer, then copied; never checked in the target itself: a failed
        # check would leave unverified bytes in the caller's tensors (and a load with
        # step=None goes on to an older step)
        saved.read_through(c.piece.rank, start, start + c.run, c.dst[c.dst_first : c.dst_first + c.run],
                           _thread_buffer(SCRATCH_BYTES))
    else:
        buf, base = saved.read_range(c.piece.rank, start, start + c.span(), _thread_buffer)
        src = buf[start - base :]
        shape = (*c.outer, c.run)
        sv = as_strided(src, shape=shape, strides=(*c.src_strides, 1), writeable=False)
        dv = as_strided(c.dst[c.dst_first :], shape=shape, strides=(*c.dst_strides, 1))
        np.copyto(dv, sv)
    return c.span()


def run_copies(saved: SavedStep, copies: list[Copy]) -> int:
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
            raise CheckpointOptionError(f"into: {path!r} is a read-only numpy array: pass a writeable one ({where})")
        if _shares_memory(local.shape, local.strides, local.itemsize):
            raise CheckpointOptionError(
                f"into: {path!r} is an array whose elements share memory (shape {list(local.shape)}, strides "
                f"{list(local.strides)}: a broadcast view): pass an array that holds each element, e.g. "
                f"its .copy() ({where})")
        if local.flags.c_contiguous:
            return local.reshape(-1).view(np.uint8), None
        host: np.ndarray[Any, Any] = np.empty(local.shape, local.dtype)
        return host.reshape(-1).view(np.uint8), lambda: np.copyto(local, host)
    import torch

    if not torch_copyable(local.dtype):
        raise CheckpointOptionError(f"into: {path!r}: dtype {local.dtype} cannot be filled in place")
    t = local.detach()
    if t.device.type == "meta":
        raise CheckpointOptionError(
            f"into: {path!r} is a meta tensor, which has no memory to load into: allocate it first "
            f"(an FSDP2 model: model.to_empty(device=...); then load) ({where})")
    if _shares_memory(tuple(t.shape), tuple(t.stride()), 1):
        raise CheckpointOptionError(
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
    dt = dtensor_type()
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


class _StateBuilder:
    """The state one rank loads from a SavedStep: its arrays read whole (``materialize``) or
    into the targets of ``into=`` (``fill``: copies planned, run by ``load_into``)."""

    def __init__(self, saved: SavedStep, rank: int, map_location: Any) -> None:
        self.saved, self.rank, self.map_location = saved, rank, map_location
        self.copies: list[Copy] = []
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
            return build_leaf(raw, dict(spec, offset=0), where, self.map_location)
        for p in gt.pieces:  # probe the files before allocating what the documents claim
            for i in range(len(saved.parts[p.rank]["chunks"])):
                saved.chunk_size(p.rank, i)
        if gt.kind == "torch":
            import torch

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

    def value_ranks(self, keys: tuple[Any, ...]) -> set[int]:
        """The ranks whose data the saved value at ``keys`` reads, found as :meth:`fill`
        finds a value of ``into`` that is not a tensor (none where there is none)."""
        found = self._find(keys)
        if found is None:
            return set()
        r, node = found
        out: set[int] = set()
        for i in _leaf_indices(node):
            leaves = self.saved.parts[r]["leaves"]
            spec = leaves[i] if is_int(i) and i < len(leaves) else None
            path = spec.get("path") if isinstance(spec, dict) else None
            gt = self.saved.tensors.get(path) if (r, path) not in self.saved.per_rank else None  # type: ignore[arg-type]
            out |= {p.rank for p in gt.pieces} if gt is not None else {r}
        return out

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
                    raise CheckpointOptionError(
                        f"into: {path!r} was saved per rank by ranks {holders[:8]} (a plain tensor), and "
                        f"rank {self.rank} has none; save it inside Replicated(...) if it is the same on "
                        f"every rank, or as a DTensor, to load it onto another world size ({saved.where})")
                raise CheckpointOptionError(f"into: {path!r} is not in the checkpoint ({saved.where})")
            spec = saved.parts[self.rank]["leaves"][idx]
            gt = GlobalTensor(path, spec["kind"], spec["dtype"], 0, tuple(spec["shape"]),
                              [Piece(self.rank, spec["offset"], (0,) * len(spec["shape"]), tuple(spec["shape"]))],
                              saved.part_urls[self.rank])
            gt.itemsize = leaf_dtype(spec["kind"], spec["dtype"], path, gt.where)[1]
        if _dtype_name(t.local) != gt.dtype:
            raise CheckpointOptionError(
                f"into: {path!r} is {_dtype_name(t.local)}, the checkpoint holds {gt.dtype} ({saved.where})")
        if _target_global_shape(t) != gt.shape:
            raise CheckpointOptionError(
                f"into: {path!r} has global shape {list(_target_global_shape(t))}, "
                f"the checkpoint's is {list(gt.shape)} ({saved.where})")
        start = t.start if t.start is not None else (0,) * len(gt.shape)
        if len(start) != len(gt.shape) or any(s + n > g for s, n, g in zip(start, t.shape, gt.shape)):
            raise CheckpointOptionError(
                f"into: {path!r}: box {list(start)} + {list(t.shape)} lies outside {list(gt.shape)} ({saved.where})")
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
            if set(n) == {"leaf"} and is_int(n["leaf"]):
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
            raise CheckpointOptionError(f"rank must be an int >= 0, got {rank!r}")
        return rank
    live = Topology.distributed()
    return live.rank if live is not None else 0


def load_into(store: Store, step: int, manifest: dict[str, Any], into: Any, rank: int | None,
              map_location: Any) -> Any:
    """Fill the tensors of ``into`` in place from step ``step`` and return ``into``'s
    structure with every other value taken from the checkpoint (see ``load_checkpoint``)."""
    where = f"checkpoint step {step} at {store.root}"
    return fill_into(SavedStep(store, step, manifest, where), into, _own_rank(rank), map_location)


def fill_into(saved: SavedStep, into: Any, rank: int, map_location: Any) -> Any:
    """``into``'s tensors filled in place from ``saved`` (read by overlap), every other value
    taken from the checkpoint; ``rank``: whose per-rank leaves ``into`` asks for."""
    builder = _StateBuilder(saved, rank, map_location)
    result = builder.fill(into, (), "")
    run_copies(saved, builder.copies)
    for path, back in builder.finish:
        try:
            back()
        except (RuntimeError, TypeError, ValueError) as e:  # torch's or numpy's word on that target
            raise CheckpointError(f"into: {path!r}: the loaded bytes could not be copied into it "
                                  f"({type(e).__name__}: {e}) ({saved.where})") from e
    return result


def whole_state(saved: SavedStep, rank: int, map_location: Any) -> Any:
    """Rank ``rank``'s saved tree with each global tensor whole (read from every part)."""
    builder = _StateBuilder(saved, rank, map_location)
    return _rebuild(saved.parts[rank]["tree"], lambda i: builder.materialize(rank, i), saved.part_urls[rank])


def parts_overlapping(saved: SavedStep, into: Any, rank: int) -> set[int]:
    """The ranks of ``saved`` whose stored bytes filling ``into`` reads (``rank``: this
    rank's index among the saved ones, whose per-rank leaves ``into`` may ask for, if it
    is one): the parts whose pieces overlap a box of ``into``'s tensors, ``rank``, and the
    parts a value of ``into`` that is not a tensor is read from (its saved value, found as
    :meth:`_StateBuilder.fill` finds it, may hold arrays)."""
    builder = _StateBuilder(saved, rank, None)
    boxes: dict[Any, Any] = {}
    out = {rank} if rank < saved.world_size else set()
    stack: list[tuple[Any, tuple[Any, ...], str]] = [(into, (), "")]
    while stack:
        x, keys, path = stack.pop()
        if isinstance(x, Replicated):
            stack.append((x.value, keys, path))
            continue
        t = _target(x, path, boxes)
        if t is not None:
            gt = saved.tensors.get(path)
            start = t.start if t.start is not None else (0,) * len(t.shape)
            for p in gt.pieces if gt is not None and len(start) == len(gt.shape) else []:
                if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(start, t.shape, p.start, p.shape)):
                    out.add(p.rank)
        elif isinstance(x, dict):
            stack.extend((v, (*keys, k), _path(path, k)) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, (*keys, i), _path(path, i)) for i, v in enumerate(x))
        else:
            out |= builder.value_ranks(keys)
    return out


def load_part_full(store: Store, step: int, manifest: dict[str, Any], rank: int, map_location: Any) -> Any:
    """Rank ``rank``'s saved state with each global tensor whole (``load_checkpoint``
    without ``into=`` of a checkpoint holding DTensors or Replicated arrays)."""
    where = f"checkpoint step {step} at {store.root}"
    return whole_state(SavedStep(store, step, manifest, where), rank, map_location)
