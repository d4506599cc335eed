"""Loading: find the newest complete checkpoint (or a given step), verify every byte
read, rebuild the state with torch tensors and numpy arrays. JSON and raw bytes only:
nothing read from storage is ever executed.

``latest`` is a hint written after a commit, never the truth: the manifests are, so the
loader scans them, newest step first, and skips (with a warning naming it) any
checkpoint that is incomplete or fails verification.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checksum import checksum
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectNotFoundError,
    StorageError,
)
from ..storage import Store, open_store
from .commit import scan_steps
from .flatten import torch_dtype_from_name, unflatten
from .format import decode_doc, manifest_key, step_dir

__all__ = ["CheckpointInfo", "list_checkpoints", "load_checkpoint"]


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory: ``complete`` means its manifest exists and verifies."""

    step: int
    complete: bool
    world_size: int | None = None
    data_bytes: int | None = None
    reason: str | None = None  # why it is not complete

    def __iter__(self):  # so that `for step, complete in list_checkpoints(url)` works
        return iter((self.step, self.complete))


def _read_manifest(store: Store, step: int) -> dict[str, Any]:
    key = manifest_key(step)
    doc = decode_doc(store.get(key), "manifest", store.url(key))
    if doc.get("step") != step or not isinstance(doc.get("parts"), list):
        raise CorruptCheckpointError(f"{store.url(key)}: manifest names step {doc.get('step')!r}")
    if len(doc["parts"]) != doc.get("world_size"):
        raise CorruptCheckpointError(f"{store.url(key)}: {len(doc['parts'])} parts for world_size {doc.get('world_size')}")
    return doc


def list_checkpoints(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every step directory under ``url``, oldest first, with whether it is complete.
    Checks manifests only; tensor data is verified by :func:`load_checkpoint`."""
    store = open_store(url, storage_options)
    out = []
    for step, keys in sorted(scan_steps(store).items()):
        if manifest_key(step) not in keys:
            out.append(CheckpointInfo(step, False, reason="no manifest (never committed)"))
            continue
        try:
            doc = _read_manifest(store, step)
        except (CheckpointError, StorageError) as e:
            out.append(CheckpointInfo(step, False, reason=str(e)))
            continue
        out.append(CheckpointInfo(step, True, doc["world_size"], doc.get("data_bytes")))
    return out


def _resolve_rank(rank: int | None, world_size: int, where: str) -> int:
    if rank is None:
        torch = sys.modules.get("torch")
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != world_size:
                raise CheckpointError(
                    f"{where} was saved by {world_size} ranks, this job has {dist.get_world_size()}; "
                    "pass rank= to read one rank's part"
                )
            rank = dist.get_rank()
        elif world_size == 1:
            rank = 0
        else:
            raise CheckpointError(f"{where} was saved by {world_size} ranks: pass rank=")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CheckpointError(f"{where}: rank {rank!r} out of range for world_size {world_size}")
    return rank


def _read_chunk(store: Store, c: dict[str, Any], dst: memoryview, compressed: bool, where: str) -> None:
    key, n = c["key"], c["bytes"]
    if compressed:
        import zstandard

        stored = store.get(key)
        if checksum(stored) != c["checksum"]:
            raise CorruptCheckpointError(f"checksum mismatch in chunk {store.url(key)} of {where}")
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=n)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"chunk {store.url(key)} of {where}: bad zstd data ({e})") from e
        if len(raw) != n or checksum(raw) != c.get("raw_checksum"):
            raise CorruptCheckpointError(
                f"checksum mismatch after decompressing chunk {store.url(key)} of {where}"
            )
        dst[:] = raw
        return
    got = store.readinto(key, dst)
    if got != n or store.size(key) != n:
        raise CorruptCheckpointError(f"chunk {store.url(key)} of {where} is not {n} bytes long")
    if checksum(dst) != c["checksum"]:
        raise CorruptCheckpointError(f"checksum mismatch in chunk {store.url(key)} of {where}")


def _read_data(store: Store, part: dict[str, Any], where: str, threads: int = 4) -> Any:
    """The rank's staged bytes as one torch uint8 tensor, every chunk verified; chunks are
    read ``threads`` at a time (object stores answer concurrent requests faster)."""
    import torch

    prefix = step_dir(part["step"]) + "/"
    total = part["data_bytes"]
    pos = 0
    for c in part["chunks"]:
        key, off, n = c["key"], c["offset"], c["bytes"]
        if not (isinstance(key, str) and key.startswith(prefix) and ".." not in key.split("/")):
            raise CorruptCheckpointError(f"{where}: chunk key {key!r} lies outside {prefix}")
        if off != pos or n < 0 or off + n > total:
            raise CorruptCheckpointError(f"{where}: chunk {key} at [{off}, {off + n}) breaks the layout")
        pos = off + n
    if pos != total:
        raise CorruptCheckpointError(f"{where}: chunks cover {pos} of {total} bytes")
    buf = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    compressed = part.get("compression") == "zstd"
    chunks = part["chunks"]
    if len(chunks) <= 1:
        for c in chunks:
            _read_chunk(store, c, view[c["offset"] : c["offset"] + c["bytes"]], compressed, where)
        return buf
    with cf.ThreadPoolExecutor(min(threads, len(chunks)), thread_name_prefix="datapipe-ckpt-load") as pool:
        futs = [pool.submit(_read_chunk, store, c, view[c["offset"] : c["offset"] + c["bytes"]],
                            compressed, where) for c in chunks]
        for f in futs:
            f.result()  # the first failure, in chunk order; the pool waits for the rest
    return buf


def _build_leaf(buf: Any, spec: dict[str, Any], where: str, map_location: Any) -> Any:
    import torch

    try:
        kind, dtype, shape = spec["kind"], spec["dtype"], tuple(spec["shape"])
        off, nbytes, path = spec["offset"], spec["nbytes"], spec["path"]
    except (KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed leaf record {spec!r:.100}") from e
    if not (isinstance(off, int) and isinstance(nbytes, int) and 0 <= off and off + nbytes <= buf.numel()):
        raise CorruptCheckpointError(f"{where}: leaf {path!r} lies outside the data")
    raw = buf[off : off + nbytes]
    try:
        if kind == "torch":
            t = raw.view(torch_dtype_from_name(dtype, where)).view(shape)
            strides = spec.get("strides")
            if strides is not None:
                t = torch.empty_strided(shape, tuple(strides), dtype=t.dtype).copy_(t)
            if map_location is not None:
                t = t.to(map_location)
            return t
        if kind in ("numpy", "npscalar"):
            dt = np.dtype(dtype)
            if dt.hasobject or dt.names is not None:
                raise CorruptCheckpointError(f"{where}: leaf {path!r} has a forbidden numpy dtype {dtype!r}")
            a = raw.numpy().view(dt).reshape(shape)
            if kind == "npscalar":
                return a[()]
            return np.asfortranarray(a) if spec.get("strides") is not None else a
    except (RuntimeError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: leaf {path!r} ({kind} {dtype} {list(shape)}): {e}") from e
    raise CorruptCheckpointError(f"{where}: leaf {path!r} of unknown kind {kind!r}")


def _load_step(store: Store, step: int, rank: int | None, map_location: Any) -> Any:
    where = f"checkpoint step {step} at {store.root}"
    doc = _read_manifest(store, step)
    r = _resolve_rank(rank, doc["world_size"], where)
    entry = doc["parts"][r]
    pdata = store.get(entry["key"])
    if checksum(pdata) != entry.get("checksum"):
        raise CorruptCheckpointError(f"{where}: part {store.url(entry['key'])} does not match its manifest checksum")
    part = decode_doc(pdata, "part", store.url(entry["key"]))
    if part.get("rank") != r or part.get("step") != step:
        raise CorruptCheckpointError(f"{where}: part {entry['key']} is for rank {part.get('rank')} step {part.get('step')}")
    buf = _read_data(store, part, f"{where} rank {r}")
    leaves = [_build_leaf(buf, spec, where, map_location) for spec in part["leaves"]]
    return unflatten(part["tree"], leaves, where)


def load_checkpoint(url: str, step: int | None = None, map_location: Any = None,
                    storage_options: dict[str, Any] | None = None, rank: int | None = None) -> Any:
    """The state of the newest complete checkpoint under ``url`` (or of ``step``).

    Every chunk is checked against its checksum. With ``step=None`` a checkpoint that is
    incomplete or fails verification is skipped with a warning naming it, and the next
    older one is tried; with an explicit ``step`` the error is raised. ``map_location``
    is a device (``"cpu"``, ``"cuda:0"``) for every tensor; ``rank`` picks a part of a
    multi-rank checkpoint (default: this torch.distributed rank).
    """
    store = open_store(url, storage_options)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        try:
            return _load_step(store, step, rank, map_location)
        except ObjectNotFoundError as e:
            raise NoCheckpointError(f"no complete checkpoint for step {step} at {url}: {e}") from e
    by_step = scan_steps(store)
    if not by_step:
        raise NoCheckpointError(f"no checkpoint at {url}")
    for s in sorted(by_step, reverse=True):
        if manifest_key(s) not in by_step[s]:
            warnings.warn(f"skipping incomplete checkpoint step {s} at {url} (no manifest)", stacklevel=2)
            continue
        try:
            return _load_step(store, s, rank, map_location)
        except (CorruptCheckpointError, StorageError) as e:
            # A wrong rank= or world size is the caller's error and propagates.
            warnings.warn(f"skipping checkpoint step {s} at {url}: {e}", stacklevel=2)
    raise NoCheckpointError(f"no complete, verifiable checkpoint at {url} (steps seen: {sorted(by_step)})")
