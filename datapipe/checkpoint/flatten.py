"""Walk a nested training state into a JSON tree plus a flat list of array leaves.

The tree keeps everything that is not an array (dict keys in order, list vs tuple,
ints, floats, strings, None, bytes) as tagged JSON; arrays become ``{"leaf": i}``
and their bytes travel separately. Anything else is refused with its path in the
state (``optim.state.3.exp_avg``), before a byte is written.

torch is never imported here: a tensor can only exist if torch is already loaded.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedStateError
from ..topology import Topology
from .dtensor import Replicated, choose_holders, is_placed, local_data, place
from .leaf import Leaf, dense_permuted, torch_copyable, torch_dtype_name

__all__ = ["flatten", "unflatten", "MAX_STATE_DEPTH", "MAX_INT_BITS", "MAX_TREE_PAYLOAD"]

# What a save accepts is what a load can read back (format.py bounds the reader):
# containers nested at most this deep (each encodes as up to three JSON levels) ...
MAX_STATE_DEPTH = 100
# ... ints Python's JSON reader parses back (it refuses more than 4,300 digits;
# 13,000 bits are at most 3,914) ...
MAX_INT_BITS = 13_000
# ... and str/bytes in the tree that keep the part document under MAX_PART_BYTES
# (bytes grow by 4/3 in base64); large blobs belong in a numpy uint8 array.
MAX_TREE_PAYLOAD = 128 << 20


def _path(parent: str, key: Any) -> str:
    return f"{parent}.{key}" if parent else str(key)


def _torch_leaf(t: Any, path: str, torch: Any, allow_meta: bool = False) -> Leaf:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedStateError(
            f"state path {path!r}: tensor subclass {type(t).__name__} is not supported "
            "(convert it to a plain tensor first, e.g. DTensor.to_local())"
        )
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise UnsupportedStateError(f"state path {path!r}: {t.layout} / quantized / nested tensors are not supported")
    if t.device.type == "meta" and not allow_meta:
        raise UnsupportedStateError(f"state path {path!r}: a meta tensor has no data to save")
    shape = tuple(t.shape)
    strides = None
    if (not t.is_contiguous() and t.numel() > 0 and torch_copyable(t.dtype)
            and dense_permuted(shape, tuple(t.stride()))):
        strides = tuple(t.stride())
    return Leaf(path, "torch", torch_dtype_name(t.dtype), shape, t.numel() * t.element_size(),
                strides, t, str(t.device))


def _numpy_leaf(a: np.ndarray[Any, Any], path: str, kind: str) -> Leaf:
    if a.dtype.hasobject or a.dtype.names is not None or a.dtype.kind == "V":
        raise UnsupportedStateError(
            f"state path {path!r}: numpy dtype {a.dtype} (objects or structured records) is not supported"
        )
    strides = None
    if kind == "numpy" and a.ndim > 1 and not a.flags.c_contiguous and a.flags.f_contiguous:
        strides = tuple(s // a.itemsize for s in a.strides)
    return Leaf(path, kind, a.dtype.str, tuple(a.shape), int(a.nbytes), strides, a)


def flatten(state: Any, *, allow_meta: bool = False, rank: int | None = None) -> tuple[Any, list[Leaf]]:
    """``(tree, leaves)``; raises :class:`UnsupportedStateError` naming the first bad path.
    ``allow_meta`` admits meta tensors, which describe a layout without data (prepare()).
    DTensors, :class:`~.dtensor.LocalShard` and arrays inside :class:`~.dtensor.Replicated`
    become leaves of global tensors (dtensor.place); ``rank`` (default: torch.distributed's,
    else 0) decides which rank stores a replicated array."""
    if rank is None:
        live = Topology.distributed()
        rank = live.rank if live is not None else 0
    leaves: list[Leaf] = []
    torch = sys.modules.get("torch")
    seen: set[int] = set()
    payload = [0]
    memo: dict[Any, Any] = {}  # dtensor.place: what DTensors alike share

    def count(n: int, path: str) -> None:
        payload[0] += n
        if payload[0] > MAX_TREE_PAYLOAD:
            raise UnsupportedStateError(
                f"state path {path or '<root>'!r}: the state holds more than {MAX_TREE_PAYLOAD} bytes of "
                "str/bytes outside arrays; store large blobs as numpy uint8 arrays"
            )

    def check_int(v: int, path: str) -> int:
        if v.bit_length() > MAX_INT_BITS:
            raise UnsupportedStateError(
                f"state path {path or '<root>'!r}: an int of {v.bit_length()} bits is too large to store "
                f"(at most {MAX_INT_BITS} bits, which JSON readers parse back); store it as a str"
            )
        return int(v)

    def walk(x: Any, path: str, depth: int = 0, replicated: bool = False) -> Any:
        if x is None or isinstance(x, bool):
            return x
        if isinstance(x, Replicated):  # a marker, not a node: the tree holds its value
            return walk(x.value, path, depth, True)
        placed = x
        if is_placed(x):
            x = local_data(x)
        if isinstance(x, str):
            count(len(x), path)
            return x
        if isinstance(x, np.generic):  # before int/float: np.float64 subclasses float
            leaves.append(_numpy_leaf(np.asarray(x), path, "npscalar"))
            return {"leaf": len(leaves) - 1}
        if isinstance(x, int):
            return check_int(x, path)
        if isinstance(x, float):
            return float(x) if math.isfinite(x) else {"float": repr(float(x))}
        if torch is not None and isinstance(x, torch.Tensor):
            leaves.append(place(_torch_leaf(x, path, torch, allow_meta), placed, rank, replicated, memo))
            return {"leaf": len(leaves) - 1}
        if isinstance(x, np.ndarray):
            leaves.append(place(_numpy_leaf(x, path, "numpy"), placed, rank, replicated, memo))
            return {"leaf": len(leaves) - 1}
        if isinstance(x, (bytes, bytearray)):
            count(len(x) * 4 // 3, path)
            return {"bytes": base64.b64encode(bytes(x)).decode()}
        if isinstance(x, (dict, list, tuple)):
            if depth >= MAX_STATE_DEPTH:
                raise UnsupportedStateError(
                    f"state path {path!r:.200}: containers nested deeper than {MAX_STATE_DEPTH} levels"
                )
            if id(x) in seen:
                raise UnsupportedStateError(f"state path {path!r}: the state contains itself (a cycle)")
            seen.add(id(x))
            try:
                if isinstance(x, dict):
                    items = []
                    for k, v in x.items():
                        if isinstance(k, bool) or not isinstance(k, (str, int)):
                            raise UnsupportedStateError(
                                f"state path {_path(path, k)!r}: dict key {k!r} of type "
                                f"{type(k).__name__} is not supported (use str or int keys)"
                            )
                        if isinstance(k, str):
                            count(len(k), path)
                        else:
                            k = check_int(k, path)  # a huge key cannot even be printed in a path
                        items.append([k, walk(v, _path(path, k), depth + 1, replicated)])
                    return {"odict" if isinstance(x, OrderedDict) else "dict": items}
                if type(x) is tuple or type(x) is list:
                    tag = "tuple" if type(x) is tuple else "list"
                    return {tag: [walk(v, _path(path, i), depth + 1, replicated) for i, v in enumerate(x)]}
            finally:
                seen.discard(id(x))
        where = path or "<root>"
        raise UnsupportedStateError(
            f"state path {where!r}: cannot store an object of type {type(x).__module__}.{type(x).__qualname__} "
            "(supported: tensors, numpy arrays, dict/list/tuple, int, float, bool, str, bytes, None)"
        )

    tree = walk(state, "")
    choose_holders(memo)
    return tree, leaves


def unflatten(tree: Any, leaves: list[Any], where: str) -> Any:
    """Rebuild the state from a tree and its loaded leaves; malformed trees raise
    :class:`CorruptCheckpointError` naming ``where``."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed state tree: {msg}")

    def build(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, dict) and len(node) == 1:
            (tag, val), = node.items()
            if tag == "leaf":
                if not isinstance(val, int) or not 0 <= val < len(leaves):
                    raise bad(f"leaf index {val!r} out of range")
                return leaves[val]
            if tag in ("dict", "odict"):
                if not isinstance(val, list):
                    raise bad("dict items are not a list")
                out = OrderedDict() if tag == "odict" else {}
                for item in val:
                    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                        raise bad(f"bad dict item {item!r:.80}")
                    out[item[0]] = build(item[1])
                return out
            if tag in ("list", "tuple") and isinstance(val, list):
                items = [build(v) for v in val]
                return tuple(items) if tag == "tuple" else items
            if tag == "float" and val in ("nan", "inf", "-inf"):
                return float(val)
            if tag == "bytes" and isinstance(val, str):
                try:
                    return base64.b64decode(val.encode(), validate=True)
                except (binascii.Error, UnicodeEncodeError) as e:
                    raise bad(f"bytes node is not base64 ({e})") from None
        raise bad(f"unknown node {node!r:.80}")

    return build(tree)
