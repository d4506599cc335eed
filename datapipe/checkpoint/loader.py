"""Loading: find the newest complete checkpoint (or a given step), verify every byte
read, rebuild the state with torch tensors and numpy arrays. JSON and raw bytes only:
nothing read from storage is ever executed.

``latest`` is a hint written after a commit, never the truth: the manifests are, so the
loader scans them, newest step first, and skips (with a warning naming it) any
checkpoint that is incomplete or fails verification.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from ..checksum import checksum
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectNotFoundError,
    StorageError,
    TopologyError,
)
from ..storage import Store, open_store
from ..topology import Topology
from .commit import scan_steps
from .flatten import torch_dtype_from_name, unflatten
from .format import (
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PART_BYTES,
    chunk_key,
    decode_doc,
    manifest_key,
    parse_attempt,
    part_key,
)
from .gcpause import collections_paused

MAX_WORLD_SIZE = 1 << 20
MAX_NDIM = 64

__all__ = ["CheckpointInfo", "list_checkpoints", "load_checkpoint"]


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory: ``complete`` means its manifest exists and verifies."""

    step: int
    complete: bool
    world_size: int | None = None
    data_bytes: int | None = None
    reason: str | None = None  # why it is not complete

    def __iter__(self) -> Iterator[Any]:  # so that `for step, complete in list_checkpoints(url)` works
        return iter((self.step, self.complete))


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 62) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _confine(store: Store, key: str, where: str) -> None:
    """Refuse to open ``key`` unless it lies inside the checkpoint folder. Keys are
    compared with the names the format defines before this (so no ``..``, absolute path,
    backslash or empty segment gets here); on a local disk a symlink could still lead
    out, so the resolved path is checked too."""
    path = store.local_path(key)
    if path is not None:
        root = os.path.realpath(store.local_path("") or path)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise CorruptCheckpointError(
                f"{where}: {path} resolves to {real}, outside the checkpoint folder {root}"
            )


def _read_doc_bytes(store: Store, key: str, kind: str, max_bytes: int) -> bytes:
    """A document's bytes, its size probed before it is read."""
    url = store.url(key)
    _confine(store, key, url)
    size = store.size(key)
    if size > max_bytes:
        raise CorruptCheckpointError(f"{url}: {size} bytes, more than a {kind} may hold ({max_bytes})")
    data = store.get(key)
    if len(data) > max_bytes:
        raise CorruptCheckpointError(f"{url}: grew past {max_bytes} bytes while read")
    return data


def _read_doc(store: Store, key: str, kind: str, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """A document's bytes and its verified JSON, its size probed before it is read."""
    data = _read_doc_bytes(store, key, kind, max_bytes)
    return data, decode_doc(data, kind, store.url(key))


def _part_of(pdata: bytes, entry: dict[str, Any], step: int, attempt: str, r: int, ws: int, url: str,
             where: str) -> dict[str, Any]:
    """The part document ``pdata`` that the manifest's ``entry`` names (read from its file,
    or sliced out of the parts index): checked against the entry's checksum before it is
    parsed, then its shape and chunk layout checked."""
    if checksum(pdata) != entry["checksum"]:
        raise CorruptCheckpointError(f"{where}: part {url} does not match its manifest checksum")
    part = decode_doc(pdata, "part", url)
    _check_part(part, entry, step, attempt, r, ws, where)
    return part


def _read_manifest(store: Store, step: int) -> dict[str, Any]:
    """The manifest of ``step``, its shape checked field by field: every key it names is
    the one the format defines for that step, attempt and rank."""
    key = manifest_key(step)
    url = store.url(key)
    _data, doc = _read_doc(store, key, "manifest", MAX_MANIFEST_BYTES)

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{url}: {msg}; the checkpoint is skipped")

    if doc.get("step") != step or not _is_int(doc.get("step")):
        raise bad(f"manifest names step {doc.get('step')!r:.40}")
    attempt, ws, parts = doc.get("attempt"), doc.get("world_size"), doc.get("parts")
    if not isinstance(attempt, str) or parse_attempt(attempt) is None:
        raise bad(f"attempt {attempt!r:.80} is not <run_id>-<n>")
    if not _is_int(ws, 1, MAX_WORLD_SIZE):
        raise bad(f"world_size {ws!r:.40} is not an int in [1, {MAX_WORLD_SIZE}]")
    if not isinstance(parts, list) or len(parts) != ws:
        raise bad(f"parts is not a list of {ws} entries")
    for r, p in enumerate(parts):
        if not isinstance(p, dict):
            raise bad(f"part {r} is not an object")
        if p.get("rank") != r or not _is_int(p.get("rank")):
            raise bad(f"part {r} names rank {p.get('rank')!r:.40}")
        if p.get("key") != part_key(step, attempt, r):
            raise bad(f"part {r} key {p.get('key')!r:.120} is not {part_key(step, attempt, r)}")
        if not isinstance(p.get("checksum"), str):
            raise bad(f"part {r} has no checksum")
        if not (_is_int(p.get("data_bytes")) and _is_int(p.get("stored_bytes"))):
            raise bad(f"part {r} sizes {p.get('data_bytes')!r:.40}/{p.get('stored_bytes')!r:.40} are not ints >= 0")
    for field in ("data_bytes", "stored_bytes"):
        if doc.get(field) != sum(p[field] for p in parts) or not _is_int(doc.get(field)):
            raise bad(f"{field} {doc.get(field)!r:.40} is not the sum over its parts")
    return doc


#: listings one read of a checkpoint URL makes while a writer's retention deletes what the
#: listing before showed (each further one means the writer committed again meanwhile)
MAX_LISTINGS = 64
_NO_MANIFEST = "no manifest (never committed, or deleted by retention)"


@dataclass
class _Listing:
    """One listing of a checkpoint URL's step folders, and the manifests of those at or
    above the newest one it showed (``top``; -1 if none), read after it (``read``: step ->
    manifest, or the error reading it; a step whose manifest is absent is not there)."""

    by_step: dict[int, list[str]]
    top: int
    read: dict[int, dict[str, Any] | Exception]

    def listed(self, step: int) -> bool:
        return manifest_key(step) in self.by_step[step]


def _list_once(store: Store) -> _Listing:
    """List ``store``'s step folders, then read the manifests at and above the newest one
    the listing showed, oldest first (see :func:`_listings`)."""
    by_step = scan_steps(store)
    listed = [s for s in sorted(by_step) if manifest_key(s) in by_step[s]]
    listing = _Listing(by_step, listed[-1] if listed else -1, {})
    for s in sorted(by_step):  # oldest first
        if s >= listing.top:
            try:
                listing.read[s] = _read_manifest(store, s)
            except ObjectNotFoundError:
                continue
            except (CorruptCheckpointError, StorageError) as e:
                listing.read[s] = e
    return listing


def _listings(store: Store, url: str) -> Iterator[_Listing]:
    """Listings of the step folders from which a writer's retention, running meanwhile,
    cannot have hidden both the step it deleted and the one it committed; the caller asks
    for the next when a step it chose vanished since (deleted after a newer commit).

    Retention deletes a step's manifest only after a newer step's manifest is written and
    listed (commit.py). A listing is no snapshot (a local folder is walked in no set order,
    an object store's listing comes in pages): it may show a step's folder before its
    commit and an older step's after its deletion. So the manifests at and above the newest
    one it showed are read again after it, oldest first: a manifest found missing there was
    deleted after a newer one was written, whose folder existed by then and is read later
    in the same pass, or was made after the listing: then, with no manifest found, the
    folder is listed again (two listings alike without one say there is none: an empty
    folder too, as a walk misses a folder deleted before it got there). Every listing past
    the first means the writer committed again; the listings end after
    :data:`MAX_LISTINGS`, and the caller then raises :func:`_churn`."""
    seen: set[int] | None = None
    for _ in range(MAX_LISTINGS):
        listing = _list_once(store)
        if listing.read or (listing.top < 0 and set(listing.by_step) == seen):
            yield listing
            seen = None
        else:
            seen = set(listing.by_step)


def _churn(url: str) -> CheckpointError:
    """What a read says when every step it chose vanished (never "no checkpoint": each
    vanished step proved a newer commit)."""
    return CheckpointError(
        f"{url}: its checkpoints kept being deleted while they were read ({MAX_LISTINGS} listings): a writer's "
        "retention deletes each step as it commits a newer one, faster than this read. Read again, or have "
        "the writer keep more steps (keep_last >= 2) while others read"
    )


def list_checkpoints(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every step directory under ``url``, oldest first, with whether it is complete.
    Checks manifests only; tensor data is verified by :func:`load_checkpoint`. A writer's
    retention deleting steps meanwhile never hides every complete step (see
    :func:`_listings`)."""
    store = open_store(url, storage_options)
    for listing in _listings(store, url):
        out = []
        vanished = False
        for step in sorted(listing.by_step):
            doc: dict[str, Any] | Exception | None = listing.read.get(step)
            if doc is None and step < listing.top and listing.listed(step):
                try:  # below the newest listed manifest: read now
                    doc = _read_manifest(store, step)
                except ObjectNotFoundError:
                    vanished = True  # deleted after a newer commit
                except (CheckpointError, StorageError) as e:
                    doc = e
            if doc is None:
                out.append(CheckpointInfo(step, False, reason=_NO_MANIFEST))
            elif isinstance(doc, Exception):
                out.append(CheckpointInfo(step, False, reason=str(doc)))
            else:
                out.append(CheckpointInfo(step, True, doc["world_size"], doc.get("data_bytes")))
        if not vanished or any(info.complete for info in out):
            return out
    raise _churn(url)


def _resolve_rank(rank: int | None, world_size: int, where: str) -> int:
    """The part this process reads: ``rank`` if given, else torch.distributed's rank when a
    process group of the checkpoint's world size is initialised, else 0 for a one-rank
    checkpoint."""
    if rank is None:
        live = Topology.distributed()
        if live is not None:
            if live.world_size != world_size:
                raise CheckpointError(
                    f"{where} was saved by {world_size} ranks, this job has {live.world_size}; "
                    "pass rank= to read one rank's part, or into=<this rank's state> to reshard"
                )
            rank = live.rank
        elif world_size == 1:
            rank = 0
        else:
            raise CheckpointError(f"{where} was saved by {world_size} ranks: pass rank=")
    try:
        return Topology.checked(rank, world_size).rank
    except TopologyError:
        raise CheckpointError(f"{where}: rank {rank!r} out of range for world_size {world_size}") from None


def _check_part(part: dict[str, Any], entry: dict[str, Any], step: int, attempt: str, r: int,
                ws: int, where: str) -> None:
    """The part's shape, and a chunk layout that covers ``[0, data_bytes)`` exactly with
    the keys the format defines for this step, attempt and rank."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: part {entry['key']}: {msg}")

    ident = (part.get("step"), part.get("attempt"), part.get("rank"), part.get("world_size"))
    if ident != (step, attempt, r, ws) or not all(_is_int(v) for v in ident[::2] + ident[3:]):
        raise bad(f"is for step {part.get('step')!r:.40} attempt {part.get('attempt')!r:.80} "
                  f"rank {part.get('rank')!r:.40}/{part.get('world_size')!r:.40}")
    compression, cb = part.get("compression"), part.get("chunk_bytes")
    if compression not in (None, "zstd"):
        raise bad(f"unknown compression {compression!r:.40}")
    if not _is_int(cb, 1, MAX_CHUNK_BYTES):
        raise bad(f"chunk_bytes {cb!r:.40} is not an int in [1, {MAX_CHUNK_BYTES}]")
    total, stored = part.get("data_bytes"), part.get("stored_bytes")
    if not (_is_int(total) and _is_int(stored)) or total != entry["data_bytes"] or stored != entry["stored_bytes"]:
        raise bad(f"sizes {total!r:.40}/{stored!r:.40} differ from the manifest's "
                  f"{entry['data_bytes']}/{entry['stored_bytes']}")
    chunks, leaves = part.get("chunks"), part.get("leaves")
    if not isinstance(chunks, list) or not isinstance(leaves, list) or "tree" not in part:
        raise bad("chunks, leaves or tree missing")
    pos = stored_sum = 0
    for i, c in enumerate(chunks):
        if not isinstance(c, dict):
            raise bad(f"chunk {i} is not an object")
        key, off, n, sb = c.get("key"), c.get("offset"), c.get("bytes"), c.get("stored_bytes")
        if key != chunk_key(step, attempt, r, i):
            raise bad(f"chunk {i} key {key!r:.120} is not {chunk_key(step, attempt, r, i)}")
        if not _is_int(off) or off != pos or not _is_int(n, 1, cb) or not _is_int(sb, 0, MAX_CHUNK_BYTES + (1 << 20)):
            raise bad(f"chunk {key} at offset {off!r:.40}, {n!r:.40} bytes ({sb!r:.40} stored) breaks the layout")
        raw_checksum_missing = compression == "zstd" and not isinstance(c.get("raw_checksum"), str)
        if not isinstance(c.get("checksum"), str) or raw_checksum_missing:
            raise bad(f"chunk {key} has no checksum")
        if compression is None and sb != n:
            raise bad(f"uncompressed chunk {key} stores {sb} of {n} bytes")
        pos += n
        stored_sum += sb
    if pos != total or stored_sum != stored:
        raise bad(f"chunks cover {pos} of {total} bytes ({stored_sum} of {stored} stored)")


def _check_frame(head: Any, c: dict[str, Any], url: str, where: str) -> None:
    """The zstd frame header ``head`` (a chunk's first 18 bytes: the longest header) declares
    the raw size chunk ``c`` records."""
    import zstandard

    try:
        raw = zstandard.frame_content_size(head)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk {url} of {where}: bad zstd frame header ({e})") from None
    if raw != c["bytes"]:
        raise CorruptCheckpointError(
            f"chunk {url} of {where}: its zstd frame declares {raw} raw bytes, its part records {c['bytes']}"
        )


def _probe_chunk(store: Store, c: dict[str, Any], compressed: bool, where: str) -> None:
    """Sizes from the store, before a byte of the rank's buffer is allocated: the file
    holds exactly the recorded stored bytes, and a zstd frame declares the raw size."""
    key = c["key"]
    _confine(store, key, where)
    size = store.size(key)
    if size != c["stored_bytes"]:
        raise CorruptCheckpointError(
            f"chunk {store.url(key)} of {where} holds {size} bytes, its part records {c['stored_bytes']}"
        )
    if compressed:
        _check_frame(store.get_range(key, 0, min(size, 18)), c, store.url(key), where)


def _read_chunk(store: Store, c: dict[str, Any], dst: memoryview, compressed: bool, where: str) -> None:
    key = c["key"]
    if compressed:
        # the probed size, not the whole object: one that grew since cannot make us read more
        _check_chunk(c, dst, store.get_range(key, 0, c["stored_bytes"]), store.url(key), where)
        return
    got = store.readinto(key, dst)
    if got != c["bytes"]:
        raise CorruptCheckpointError(f"chunk {store.url(key)} of {where} is not {c['bytes']} bytes long")
    _check_chunk(c, dst, None, store.url(key), where)


def _check_chunk(c: dict[str, Any], dst: memoryview, stored: Any, url: str, where: str) -> None:
    """Check chunk ``c`` against its checksums: its raw bytes already in ``dst``
    (``stored`` None), or its ``stored`` zstd bytes, decompressed into ``dst`` here."""
    if stored is not None:
        dst[:] = _unzstd_chunk(c, stored, url, where)
    elif checksum(dst) != c["checksum"]:
        raise CorruptCheckpointError(f"checksum mismatch in chunk {url} of {where}")


def _unzstd_chunk(c: dict[str, Any], stored: Any, url: str, where: str) -> bytes:
    """The raw bytes of the zstd chunk ``c`` from its ``stored`` bytes, the stored and the
    raw checksum both checked."""
    import zstandard

    if checksum(stored) != c["checksum"]:
        raise CorruptCheckpointError(f"checksum mismatch in chunk {url} of {where}")
    # the frame's declared size first: python-zstandard allocates what a frame header
    # declares, whatever max_output_size says (a forged chunk would allocate terabytes)
    _check_frame(memoryview(stored)[:18], c, url, where)
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=c["bytes"])
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"chunk {url} of {where}: bad zstd data ({e})") from e
    if len(raw) != c["bytes"] or checksum(raw) != c.get("raw_checksum"):
        raise CorruptCheckpointError(f"checksum mismatch after decompressing chunk {url} of {where}")
    return raw


def _read_data(store: Store, part: dict[str, Any], where: str, threads: int = 4) -> Any:
    """The rank's staged bytes as one torch uint8 tensor, every chunk verified; chunks are
    read ``threads`` at a time (object stores answer concurrent requests faster). The
    buffer is allocated only after every chunk's size was probed in the store, so a
    document that claims more bytes than its files hold never allocates them."""
    import torch

    chunks = part["chunks"]
    compressed = part.get("compression") == "zstd"
    with cf.ThreadPoolExecutor(max(1, min(threads, len(chunks))), thread_name_prefix="datapipe-ckpt-load") as pool:
        for f in [pool.submit(_probe_chunk, store, c, compressed, where) for c in chunks]:
            f.result()  # the first failure, in chunk order; the pool waits for the rest
        buf = torch.empty(part["data_bytes"], dtype=torch.uint8)
        view = buf.numpy().data
        futs = [pool.submit(_read_chunk, store, c, view[c["offset"] : c["offset"] + c["bytes"]],
                            compressed, where) for c in chunks]
        for f in futs:
            f.result()
    return buf


def _leaf_dtype(kind: Any, dtype: Any, path: Any, where: str) -> tuple[str, int]:
    """The leaf's dtype name and item size, checked."""
    if not isinstance(dtype, str) or len(dtype) > 64:
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} has a malformed dtype {dtype!r:.60}")
    if kind == "torch":
        return dtype, int(torch_dtype_from_name(dtype, where).itemsize)
    if kind in ("numpy", "npscalar"):
        try:
            dt = np.dtype(dtype)
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: leaf {path!r:.100}: numpy dtype {dtype!r}: {e}") from None
        if dt.hasobject or dt.names is not None or dt.kind == "V":
            raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} has a forbidden numpy dtype {dtype!r}")
        return dtype, int(dt.itemsize)
    raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} of unknown kind {kind!r:.40}")


def _build_leaf(buf: Any, spec: Any, where: str, map_location: Any) -> Any:
    import torch

    from .flatten import dense_permuted

    if not isinstance(spec, dict):
        raise CorruptCheckpointError(f"{where}: malformed leaf record {spec!r:.100}")
    kind, dtype, shape, path = spec.get("kind"), spec.get("dtype"), spec.get("shape"), spec.get("path")
    off, nbytes, strides = spec.get("offset"), spec.get("nbytes"), spec.get("strides")
    if not isinstance(path, str):
        raise CorruptCheckpointError(f"{where}: malformed leaf record {spec!r:.100}")
    dtype, itemsize = _leaf_dtype(kind, dtype, path, where)
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d) for d in shape)):
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} has a malformed shape {shape!r:.100}")
    numel = 1
    for d in shape:
        numel *= d
    if not (_is_int(off) and _is_int(nbytes) and off + nbytes <= buf.numel()):
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} lies outside the data")
    if numel * itemsize != nbytes:
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100}: shape {shape} of {dtype} is not {nbytes} bytes")
    if strides is not None and not (isinstance(strides, list) and len(strides) == len(shape)
                                    and all(_is_int(x, 1) for x in strides)
                                    and dense_permuted(tuple(shape), tuple(strides))):
        # empty_strided would size its storage from these strides: only a permutation
        # of the dense layout is allowed, which holds exactly nbytes
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} has malformed strides {strides!r:.100}")
    shape = tuple(shape)
    raw = buf[off : off + nbytes]
    try:
        if kind == "torch":
            t = raw.view(torch_dtype_from_name(dtype, where)).view(shape)
            if strides is not None:
                t = torch.empty_strided(shape, tuple(strides), dtype=t.dtype).copy_(t)
            if map_location is not None:
                t = t.to(map_location)
            return t
        a = raw.numpy().view(np.dtype(dtype)).reshape(shape)
        if kind == "npscalar":
            return a[()]
        return np.asfortranarray(a) if strides is not None else a
    except (RuntimeError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: leaf {path!r} ({kind} {dtype} {list(shape)}): {e}") from e


def _load_step(store: Store, step: int, rank: int | None, map_location: Any, into: Any = None,
               doc: dict[str, Any] | None = None) -> Any:
    """Step ``step``'s state; ``doc``: its manifest, if already read and checked."""
    with collections_paused():
        return _load_step_paused(store, step, rank, map_location, into, doc)


def _load_step_paused(store: Store, step: int, rank: int | None, map_location: Any, into: Any,
                      doc: dict[str, Any] | None) -> Any:
    where = f"checkpoint step {step} at {store.root}"
    if doc is None:
        doc = _read_manifest(store, step)
    if into is not None:  # any world size: global tensors are read by overlap (reshard.py)
        from .reshard import load_into

        return load_into(store, step, doc, into, rank, map_location)
    r = _resolve_rank(rank, doc["world_size"], where)
    part = _checked_part(store, doc, r, where)
    if doc["world_size"] > 1 and any(isinstance(s, dict) and "global" in s for s in part["leaves"]):
        # pieces of global tensors (replicas this rank did not store): they come back whole
        from .reshard import load_part_full

        return load_part_full(store, step, doc, r, map_location)
    return _part_state(part, _read_data(store, part, f"{where} rank {r}"), where, map_location)


def _checked_part(store: Store, doc: dict[str, Any], r: int, where: str) -> dict[str, Any]:
    """The part of rank ``r`` named by the verified manifest ``doc``: its checksum, shape
    and chunk layout checked; a one-part checkpoint must hold every leaf's bytes."""
    entry = doc["parts"][r]
    pdata = _read_doc_bytes(store, entry["key"], "part", MAX_PART_BYTES)
    part = _part_of(pdata, entry, doc["step"], doc["attempt"], r, doc["world_size"], store.url(entry["key"]), where)
    if doc["world_size"] == 1:
        empty = [s.get("path") for s in part["leaves"] if isinstance(s, dict) and isinstance(s.get("global"), dict)
                 and s["global"].get("replica") is True]
        if empty:
            raise CorruptCheckpointError(
                f"{where}: a one-part checkpoint holds replica leaves without bytes ({empty[:5]!r:.300}): "
                "another rank stored their values (a node-local part written by a datapipe from before "
                "node-local parts held replicated values, or a one-rank save of a LocalShard marked "
                "replica); load this step from a shared tier"
            )
    return part


def _part_state(part: dict[str, Any], buf: Any, where: str, map_location: Any) -> Any:
    """The state a checked part describes, its leaves built on ``buf`` (its verified bytes)."""
    leaves = [_build_leaf(buf, spec, where, map_location) for spec in part["leaves"]]
    return unflatten(part["tree"], leaves, where)


def load_checkpoint(url: str | None = None, step: int | None = None, map_location: Any = None,
                    storage_options: dict[str, Any] | None = None, rank: int | None = None,
                    into: Any = None, *, tiers: list[Any] | None = None, ranks_per_node: int | None = None) -> Any:
    """The state of the newest complete checkpoint under ``url`` (or of ``step``).

    Every chunk is checked against its checksum. With ``step=None`` a checkpoint that is
    incomplete or fails verification is skipped with a warning naming it, and the next
    older one is tried; with an explicit ``step`` the error is raised. ``map_location``
    is a device (``"cpu"``, ``"cuda:0"``) for every tensor; ``rank`` picks a part of a
    multi-rank checkpoint (default: this torch.distributed rank). Global tensors
    (DTensors, ``LocalShard``, arrays in ``Replicated``) of that part come back whole.

    ``into``: a target state on any world size or mesh. Each of its DTensors,
    ``LocalShard``s and plain tensors/arrays (= the whole tensor) is filled in place with
    the bytes of the saved global tensor at the same path that overlap it (only those
    are read, checked block by block); the result has ``into``'s structure, with every
    value that is not a tensor (and every saved key ``into`` lacks that holds no array)
    taken from rank 0's part (else from the lowest rank's that has it). A plain tensor
    saved per rank loads into the same rank only. Bytes are checked before they reach
    ``into``: a load that fails leaves no unverified bytes there (but may leave checked
    bytes of the step that failed; load again before using ``into``).

    ``tiers=[Tier(...), ...]`` (instead of ``url``): the newest step every rank can load
    from any tier, each rank's part from its own node-local copy, else its peer's
    replica, else a shared tier (:func:`datapipe.checkpoint.restore_checkpoint`, which
    also says where each part came from). Not with ``into``.

    Python's cyclic garbage collector is paused while a step loads (and enabled again
    after, if it was): the load's own metadata would otherwise tip full collections of
    the whole heap into it.
    """
    if tiers is not None:
        if url is not None or step is not None or storage_options is not None or into is not None:
            raise CheckpointError("load_checkpoint(tiers=...) takes no url, step, storage_options or into "
                                  "(each Tier has its own store; resharding from tiers is not supported)")
        from .restore import restore_checkpoint

        return restore_checkpoint(tiers, rank=rank, ranks_per_node=ranks_per_node,
                                  map_location=map_location).state
    if url is None:
        raise CheckpointError("load_checkpoint needs a url or tiers=[Tier(...), ...]")
    store = open_store(url, storage_options)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        try:
            return _load_step(store, step, rank, map_location, into)
        except ObjectNotFoundError as e:
            raise NoCheckpointError(f"no complete checkpoint for step {step} at {url}: {e}") from e
    # A writer's retention may delete the step this load chose while it reads (it deletes
    # only steps older than a newer commit, so a fresh listing finds that commit): when a
    # chosen step vanishes, list again. A step gone is never "no checkpoint".
    for listing in _listings(store, url):
        if not listing.by_step:
            raise NoCheckpointError(f"no checkpoint at {url}")
        vanished = False
        for s in sorted(listing.by_step, reverse=True):
            doc: dict[str, Any] | Exception | None = listing.read.get(s)
            try:
                if doc is None and s < listing.top and listing.listed(s):
                    doc = _read_manifest(store, s)  # below the newest listed manifest: read now
                if doc is None:
                    warnings.warn(f"skipping incomplete checkpoint step {s} at {url} (no manifest)", stacklevel=2)
                    continue
                if isinstance(doc, Exception):
                    raise doc
                try:
                    return _load_step(store, s, rank, map_location, into, doc)
                except ObjectNotFoundError as e:
                    if not _replaced(store, s, doc):  # still committed: the step is damaged
                        raise CorruptCheckpointError(f"a file it names is missing ({e})") from e
                    raise
            except ObjectNotFoundError:
                vanished = True  # deleted, or saved again, after a newer commit: list again
                break
            except (CorruptCheckpointError, StorageError) as e:
                # A wrong rank= or world size is the caller's error and propagates.
                warnings.warn(f"skipping checkpoint step {s} at {url}: {e}", stacklevel=2)
        if not vanished:
            raise NoCheckpointError(
                f"no complete, verifiable checkpoint at {url} (steps seen: {sorted(listing.by_step)})")
    raise _churn(url)


def _replaced(store: Store, step: int, doc: dict[str, Any]) -> bool:
    """Whether the manifest ``doc`` of ``step`` is gone from ``store`` or was replaced (a file
    it names vanished: retention deleted the step, or the older attempt of a step saved
    again) rather than still there, naming a file that is missing (the step is damaged)."""
    try:
        now = _read_manifest(store, step)
    except ObjectNotFoundError:
        return True
    except (CheckpointError, StorageError):
        return True  # rewritten since, and not readable now: not the one this load read
    return (now["attempt"], now.get("created_unix")) != (doc["attempt"], doc.get("created_unix"))
