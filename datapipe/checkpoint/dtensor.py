"""Tensors that are pieces of a larger, global tensor: what a rank holds of it and where.

A state may hold three kinds of arrays (docs/CHECKPOINT_FORMAT.md, "Global tensors"):

- a ``torch.distributed.tensor.DTensor``: its local shard is a box of the global tensor,
  found from its mesh and placements (``Shard``/``Replicate``; ``Partial`` and strided
  shards are refused, redistribute first);
- :class:`LocalShard`: the same described by hand (a local tensor, the global shape and
  its offset in it), for code that shards without DTensor;
- a plain tensor or array inside :class:`Replicated`: the whole global tensor, the same on
  every rank of the writer.

Each becomes a leaf with a ``global`` record (global shape, offset, region). A region that
several ranks hold (replicas) is stored once, by one of them (:func:`choose_holders`: the
boxes of one set of holders dealt out by size, so each holder writes its share of the
bytes); the others record it with ``replica: true`` and store no bytes in a shared tier. A node-local part is a one-part
checkpoint that must be whole on its own, so there every holder stores its copy
(``Leaf.copy``, staged only when a node-local tier is due). Plain tensors outside
:class:`Replicated` stay per-rank leaves, as before.

No collective is used: mesh coordinates and rank lists are local knowledge.
torch is never imported here unless a DTensor exists (then torch.distributed.tensor is
already loaded).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

from ..errors import UnsupportedStateError
from .leaf import Leaf

__all__ = ["Replicated", "LocalShard", "Box", "dtensor_type", "dtensor_box", "is_placed", "local_data", "place",
           "choose_holders"]


class Replicated:
    """Marks ``value`` (a tensor, an array, or any container of them) as the same on every
    rank: each plain tensor or array inside is stored once, by rank 0, as a whole global
    tensor, and loads onto any world size. DTensors inside keep their own placements.

    ``writer.save(step, {"model": model.state_dict(), "optim": Replicated(optim.state_dict())})``
    stores the optimizer's per-parameter ``step`` counters once (its ``exp_avg`` DTensors
    stay sharded). On load, ``into=`` may hold a ``Replicated`` too; the result holds the
    value itself."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Replicated({self.value!r:.80})"


class LocalShard:
    """One rank's box of a global tensor, described by hand: ``tensor`` holds the elements
    ``[offset[d], offset[d] + tensor.shape[d])`` of every dimension ``d`` of a global tensor
    of ``global_shape``. ``replica=True`` says that another rank holds and stores the same
    box (this rank stores nothing for it). In ``into=`` of a load, it asks for that box."""

    __slots__ = ("global_shape", "offset", "replica", "tensor")

    def __init__(self, tensor: Any, global_shape: tuple[int, ...] | list[int],
                 offset: tuple[int, ...] | list[int], *, replica: bool = False) -> None:
        self.tensor = tensor
        self.global_shape = tuple(int(d) for d in global_shape)
        self.offset = tuple(int(d) for d in offset)
        self.replica = bool(replica)

    def __repr__(self) -> str:
        return (f"LocalShard(shape={tuple(self.tensor.shape)}, global_shape={self.global_shape}, "
                f"offset={self.offset}, replica={self.replica})")


def dtensor_type() -> Any:
    """torch's DTensor class if torch.distributed.tensor is loaded (else no DTensor exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_placed(x: Any) -> bool:
    """Whether ``x`` is a DTensor or a :class:`LocalShard` (an array with a global place)."""
    if isinstance(x, LocalShard):
        return True
    dt = dtensor_type()
    return dt is not None and isinstance(x, dt)


def local_data(x: Any) -> Any:
    """The array whose bytes this rank holds: a DTensor's local shard, a LocalShard's tensor."""
    if isinstance(x, LocalShard):
        return x.tensor
    return x.to_local().detach()


class Box(NamedTuple):
    """Where a DTensor's local shard lies in its global tensor (:func:`dtensor_box`)."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    holders: tuple[int, ...]  # the ranks that hold it, in rank order (more than one: a Replicate
    #                           placement over a mesh dimension of size > 1)
    rank: int  # this rank

    @property
    def shared(self) -> bool:
        return len(self.holders) > 1


def _mesh_facts(mesh: Any, memo: dict[Any, Any]) -> tuple[Any, Any, int]:
    """``(coordinate, rank table as a numpy array, rank)`` of a mesh. Reading
    ``DeviceMesh.mesh`` rebuilds the table on every access (about 0.2 ms): a save of
    hundreds of DTensors on one mesh reads it once."""
    key = ("mesh", id(mesh))  # the state holds the mesh while the memo lives: the id is stable
    facts = memo.get(key)
    if facts is None:
        facts = memo[key] = (mesh.get_coordinate(), mesh.mesh.numpy(), mesh.get_rank())
    return facts


def dtensor_box(x: Any, path: str, memo: dict[Any, Any] | None = None,
                local_shape: tuple[int, ...] | None = None) -> Box:
    """Where a DTensor's local shard on this rank lies, and which ranks hold the same box
    (they differ from this rank only in coordinates of ``Replicate`` mesh dimensions; which
    of them stores it is :func:`choose_holders`'s choice). ``memo``: a dict that
    lives through one walk of a state, sharing the work of DTensors alike (same mesh,
    placements and global shape). ``local_shape``: the shape of ``x.to_local()`` where the
    caller has it already (each ``to_local`` is an autograd call, a cost per DTensor)."""
    memo = {} if memo is None else memo
    mesh, placements = x.device_mesh, tuple(x.placements)
    global_shape = tuple(int(d) for d in x.shape)
    key = (id(mesh), placements, global_shape)
    facts = memo.get(key)
    if facts is None:
        facts = memo[key] = _box_facts(mesh, placements, global_shape, path, memo)
    offset, shape, holders, rank = facts
    if local_shape is None:
        local_shape = tuple(int(d) for d in x.to_local().shape)
    if local_shape != shape:
        raise UnsupportedStateError(
            f"state path {path!r}: the DTensor's local tensor has shape {local_shape}, its "
            f"placements give {shape} (padded shards are not supported)"
        )
    return Box(global_shape, offset, shape, tuple(holders), rank)


def _box_facts(mesh: Any, placements: tuple[Any, ...], global_shape: tuple[int, ...], path: str,
               memo: dict[Any, Any]) -> tuple[tuple[int, ...], tuple[int, ...], list[int], int]:
    """``(offset, local shape, holders in rank order, this rank)`` of a box: what every
    DTensor of this mesh, placements and global shape shares."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in placements:
        # _StridedShard (FSDP2 + TP on one dim) subclasses Shard: its local data is not one box
        if type(p) is not Shard and type(p) is not Replicate:
            raise UnsupportedStateError(
                f"state path {path!r}: DTensor placement {type(p).__name__} ({p}) is not supported (only "
                "Shard and Replicate hold a box of the global tensor); redistribute it to Shard/Replicate "
                "placements (dtensor.redistribute(...)) or save dtensor.full_tensor()"
            )
    coord, table, rank = _mesh_facts(mesh, memo)
    if coord is None:
        raise UnsupportedStateError(f"state path {path!r}: this rank is not in the DTensor's mesh")
    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    holders = table[tuple(slice(None) if isinstance(p, Replicate) else coord[i] for i, p in enumerate(placements))]
    ranks = sorted(int(r) for r in holders.reshape(-1).tolist())
    return tuple(int(o) for o in offset), tuple(int(d) for d in local_shape), ranks, int(rank)


def _check_box(path: str, global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
    if len(global_shape) != len(shape) or len(offset) != len(shape):
        raise UnsupportedStateError(
            f"state path {path!r}: a local shard of {len(shape)} dims, global shape {list(global_shape)} "
            f"and offset {list(offset)} must have as many dims"
        )
    for d, (g, o, n) in enumerate(zip(global_shape, offset, shape)):
        if g < 0 or o < 0 or o + n > g:
            raise UnsupportedStateError(
                f"state path {path!r}: dim {d}: elements [{o}, {o + n}) lie outside the global size {g}"
            )


def place(leaf: Leaf, x: Any, rank: int, replicated: bool, memo: dict[Any, Any] | None = None) -> Leaf:
    """Give ``leaf`` (built from ``local_data(x)`` or from ``x`` itself) its global record
    when ``x`` is placed or ``replicated``; a replica becomes an empty leaf (no bytes) that
    still records its box. Other leaves are returned unchanged (per-rank). ``memo``: see
    :func:`dtensor_box`."""
    if leaf.kind == "npscalar" or not (replicated or is_placed(x)):
        return leaf
    pending = None
    if isinstance(x, LocalShard):
        gshape, offset, replica = x.global_shape, x.offset, x.replica
        _check_box(leaf.path, gshape, offset, leaf.shape)
    elif is_placed(x):
        box = dtensor_box(x, leaf.path, memo, local_shape=leaf.shape)  # the leaf is of x.to_local()
        gshape, offset, replica = box.global_shape, box.offset, False
        if box.shared:  # its holder is chosen once the walk has met every box (choose_holders)
            pending = (box.holders, box.rank)
    else:  # a plain array the caller declared replicated: all of it, stored by rank 0
        gshape, offset, replica = leaf.shape, (0,) * len(leaf.shape), rank != 0
    leaf.shard = {"shape": list(gshape), "offset": list(offset), "region": list(leaf.shape), "replica": replica}
    if pending is not None:
        if memo is None:
            raise UnsupportedStateError(f"state path {leaf.path!r}: a box several ranks hold needs the walk's memo "
                                        "(a datapipe bug: please report it)")
        memo.setdefault(_SHARED, []).append((leaf, *pending))
    elif replica:
        _as_replica(leaf)
    return leaf


#: the memo's key for the boxes several ranks hold, met so far in a walk: (leaf, holders, rank)
_SHARED = ("shared boxes",)


def choose_holders(memo: dict[Any, Any]) -> None:
    """After a walk (its ``memo`` given to :func:`place`): which holder stores each box that
    several ranks hold; on the others its leaf becomes a replica. For each set of holders,
    its boxes by size (largest first, then by path) each go to the holder with the fewest
    bytes so far (then the first in rank order): every holder deals the same boxes alike,
    in whatever order its walk met them (paths, shapes and the mesh are the same there), and
    writes about its share of the bytes. (A choice by a hash of the path spread them
    unevenly: 8 of 12 equal boxes on one of two holders, whose writes then took 4/3 of the
    time.)"""
    groups: dict[tuple[int, ...], list[tuple[Leaf, int]]] = {}
    for leaf, holders, rank in memo.pop(_SHARED, ()):
        groups.setdefault(holders, []).append((leaf, rank))
    for holders, boxes in groups.items():
        load = [0] * len(holders)
        for leaf, rank in sorted(boxes, key=lambda b: (-b[0].nbytes, b[0].path)):
            k = min(range(len(holders)), key=lambda i: (load[i], i))
            load[k] += leaf.nbytes
            if holders[k] != rank:
                leaf.shard = dict(leaf.shard or {}, replica=True)
                _as_replica(leaf)


def _as_replica(leaf: Leaf) -> None:
    """This rank holds the bytes too: a node-local part stores them (it must be whole on its
    own); a shared part records the box and stores nothing (its holder does)."""
    leaf.copy = dataclasses.replace(leaf, shard=dict(leaf.shard or {}, replica=False))
    if leaf.kind == "torch":
        import torch

        leaf.obj = torch.empty(0, dtype=leaf.obj.dtype)
    else:
        import numpy as np

        leaf.obj = np.empty(0, dtype=leaf.obj.dtype)
    leaf.shape, leaf.nbytes, leaf.strides, leaf.device = (0,), 0, None, "cpu"
