"""One array of a training state as a checkpoint sees it (:class:`Leaf`: its path, kind,
dtype, shape, bytes and, for a piece of a global tensor, its place), and what a leaf's dtype
and strides mean: torch dtype names to and from torch's (a whitelist of real dtypes, never
a free ``getattr`` on a name read from storage), whether torch can copy a dtype, and which
strides are a permutation of a dense layout.

The walk that makes leaves (flatten.py), the pieces of global tensors (dtensor.py), the
staging buffer and the step reader all use these; this module imports none of them.
torch is never imported here unless a dtype is looked up.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["Leaf", "torch_copyable", "torch_dtype_name", "torch_dtype_from_name", "dense_permuted"]


@dataclass
class Leaf:
    """One array of the state: where it sits and what its bytes mean."""

    path: str
    kind: str  # "torch" | "numpy" | "npscalar"
    dtype: str  # torch dtype name ("bfloat16") or numpy dtype str ("<f4")
    shape: tuple[int, ...]
    nbytes: int
    strides: tuple[int, ...] | None  # element strides of a dense permuted layout, else None
    obj: Any = None  # the live array (save side only)
    device: str = "cpu"
    # a piece of a global tensor (dtensor.place): {shape, offset, region, replica}
    shard: dict[str, Any] | None = None
    # a replica (shard["replica"]) keeps here the leaf of this rank's own copy of its bytes
    # (region == shape, replica False): stored only in node-local parts, which must be whole
    # on their own (writer.py stages it after the shared layout, and only when one is due)
    copy: Leaf | None = None

    def spec(self, offset: int) -> dict[str, Any]:
        d: dict[str, Any] = {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "offset": offset,
        }
        if self.strides is not None:
            d["strides"] = list(self.strides)
        if self.shard is not None:
            d["global"] = self.shard
        return d


def torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype_from_name(name: str, where: str) -> Any:
    value = _torch_dtype(name)
    if value is None:
        raise CorruptCheckpointError(f"{where}: unknown torch dtype {name!r}")
    return value


@functools.lru_cache(maxsize=64)  # a load looks up each leaf's dtype; the names are few
def _torch_dtype(name: str) -> Any:
    import torch

    # A whitelist of real dtypes, never a free getattr on a name read from storage.
    value = getattr(torch, name, None) if name.isidentifier() else None
    return value if isinstance(value, torch.dtype) else None


_COPYABLE: dict[Any, bool] = {}


def torch_copyable(dtype: Any) -> bool:
    """Whether torch's copy kernel handles ``dtype``; sub-byte types such as ``int4``
    have none and are moved as raw bytes instead."""
    ok = _COPYABLE.get(dtype)
    if ok is None:
        import torch

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.empty(2, dtype=dtype).copy_(torch.empty(2, dtype=dtype))
            ok = True
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _COPYABLE[dtype] = ok
    return ok


def dense_permuted(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True if the strides are a permutation of a contiguous layout: no gaps, no overlap."""
    expected = 1
    for d in sorted(range(len(shape)), key=lambda d: strides[d]):
        if shape[d] == 1:
            continue
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True
