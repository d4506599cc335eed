"""The step reader: one committed step of a checkpoint URL read and checked, and nothing
trusted before it is. Its manifest (:func:`read_manifest`: every key it names is the one
the format defines), a rank's part (:func:`read_part`: against the manifest's checksum,
its chunk layout covering its bytes exactly), its chunks (:func:`probe_chunk` sizes them
in the store before anything is allocated, :func:`read_data` reads a rank's bytes checking
each against its checksum), its leaves built on verified bytes (:func:`build_leaf`,
:func:`part_state`), and :class:`SavedStep`: every part of a step, checked, with an index
of its global tensors (the pieces checked to tile each, overlap.py) and verified byte
ranges of any rank's data.

Bounds come from format.py; every defect is a :class:`CorruptCheckpointError` naming the
file. JSON and raw bytes only: nothing read from storage is ever executed.

``SavedStep`` reads the part documents from the step's parts index when the manifest names
one (one request per reader instead of one per saved rank), each document sliced out of it
and checked against the checksum the manifest records for that part file; an index that is
missing or fails a check is a warning naming it, and the parts are then read one by one.
A byte range of a rank's data is read with ranged reads (``pread`` on a local disk,
``Range`` requests on object stores), checked block by block against the chunk's
``blocks`` checksums, so checking costs what is read (at most one block more at each end
of a span); a compressed chunk, or one without block checksums, is read and checked whole.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import math
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeGuard

import numpy as np

from ..checksum import checksum
from ..errors import CorruptCheckpointError, StorageError
from ..storage import Store
from .flatten import unflatten
from .format import (
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_PART_BYTES,
    MAX_WORLD_SIZE,
    chunk_key,
    decode_doc,
    manifest_key,
    parse_attempt,
    part_key,
    parts_index_key,
)
from .leaf import dense_permuted, torch_dtype_from_name
from .overlap import GlobalTensor, Piece, tiling_defect

__all__ = ["SavedStep", "is_int", "is_sharded", "confine", "read_doc", "read_doc_bytes", "read_manifest",
           "parse_part", "check_part", "read_part", "probe_chunk", "check_chunk", "unzstd_chunk", "read_data",
           "leaf_dtype", "build_leaf", "part_state", "READ_THREADS"]

READ_THREADS = 8  # a SavedStep's reads in flight
INDEX_FRAMING_BYTES = 4096  # a parts index's bytes besides its part documents (plus 2 per part)


def is_int(v: Any, lo: int = 0, hi: int = 1 << 62) -> TypeGuard[int]:
    """Whether a document's value ``v`` is an int in ``[lo, hi]`` (JSON's true is no int)."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_sharded(part: dict[str, Any]) -> bool:
    """Whether a part holds pieces of global tensors (its state is then built by overlap,
    reshard.py)."""
    leaves = part.get("leaves")
    return isinstance(leaves, list) and any(isinstance(s, dict) and "global" in s for s in leaves)


def confine(store: Store, key: str, where: str) -> None:
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


def read_doc_bytes(store: Store, key: str, kind: str, max_bytes: int) -> bytes:
    """A document's bytes, its size probed before it is read."""
    url = store.url(key)
    confine(store, key, url)
    size = store.size(key)
    if size > max_bytes:
        raise CorruptCheckpointError(f"{url}: {size} bytes, more than a {kind} may hold ({max_bytes})")
    data = store.get(key)
    if len(data) > max_bytes:
        raise CorruptCheckpointError(f"{url}: grew past {max_bytes} bytes while read")
    return data


def read_doc(store: Store, key: str, kind: str, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """A document's bytes and its verified JSON, its size probed before it is read."""
    data = read_doc_bytes(store, key, kind, max_bytes)
    return data, decode_doc(data, kind, store.url(key))


def parse_part(pdata: bytes, entry: dict[str, Any], step: int, attempt: str, r: int, ws: int, url: str,
             where: str) -> dict[str, Any]:
    """The part document ``pdata`` that the manifest's ``entry`` names (read from its file,
    or sliced out of the parts index): checked against the entry's checksum before it is
    parsed, then its shape and chunk layout checked."""
    if checksum(pdata) != entry["checksum"]:
        raise CorruptCheckpointError(f"{where}: part {url} does not match its manifest checksum")
    part = decode_doc(pdata, "part", url)
    check_part(part, entry, step, attempt, r, ws, where)
    return part


def read_manifest(store: Store, step: int) -> dict[str, Any]:
    """The manifest of ``step``, its shape checked field by field: every key it names is
    the one the format defines for that step, attempt and rank."""
    key = manifest_key(step)
    url = store.url(key)
    _data, doc = read_doc(store, key, "manifest", MAX_MANIFEST_BYTES)

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{url}: {msg}; the checkpoint is skipped")

    if doc.get("step") != step or not is_int(doc.get("step")):
        raise bad(f"manifest names step {doc.get('step')!r:.40}")
    attempt, ws, parts = doc.get("attempt"), doc.get("world_size"), doc.get("parts")
    if not isinstance(attempt, str) or parse_attempt(attempt) is None:
        raise bad(f"attempt {attempt!r:.80} is not <run_id>-<n>")
    if not is_int(ws, 1, MAX_WORLD_SIZE):
        raise bad(f"world_size {ws!r:.40} is not an int in [1, {MAX_WORLD_SIZE}]")
    if not isinstance(parts, list) or len(parts) != ws:
        raise bad(f"parts is not a list of {ws} entries")
    for r, p in enumerate(parts):
        if not isinstance(p, dict):
            raise bad(f"part {r} is not an object")
        if p.get("rank") != r or not is_int(p.get("rank")):
            raise bad(f"part {r} names rank {p.get('rank')!r:.40}")
        if p.get("key") != part_key(step, attempt, r):
            raise bad(f"part {r} key {p.get('key')!r:.120} is not {part_key(step, attempt, r)}")
        if not isinstance(p.get("checksum"), str):
            raise bad(f"part {r} has no checksum")
        if not (is_int(p.get("data_bytes")) and is_int(p.get("stored_bytes"))):
            raise bad(f"part {r} sizes {p.get('data_bytes')!r:.40}/{p.get('stored_bytes')!r:.40} are not ints >= 0")
    for field in ("data_bytes", "stored_bytes"):
        if doc.get(field) != sum(p[field] for p in parts) or not is_int(doc.get(field)):
            raise bad(f"{field} {doc.get(field)!r:.40} is not the sum over its parts")
    return doc


#: listings one read of a checkpoint URL makes while a writer's retention deletes what the
#: listing before showed (each further one means the writer committed again meanwhile)


def check_part(part: dict[str, Any], entry: dict[str, Any], step: int, attempt: str, r: int,
                ws: int, where: str) -> None:
    """The part's shape, and a chunk layout that covers ``[0, data_bytes)`` exactly with
    the keys the format defines for this step, attempt and rank."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: part {entry['key']}: {msg}")

    ident = (part.get("step"), part.get("attempt"), part.get("rank"), part.get("world_size"))
    if ident != (step, attempt, r, ws) or not all(is_int(v) for v in ident[::2] + ident[3:]):
        raise bad(f"is for step {part.get('step')!r:.40} attempt {part.get('attempt')!r:.80} "
                  f"rank {part.get('rank')!r:.40}/{part.get('world_size')!r:.40}")
    compression, cb = part.get("compression"), part.get("chunk_bytes")
    if compression not in (None, "zstd"):
        raise bad(f"unknown compression {compression!r:.40}")
    if not is_int(cb, 1, MAX_CHUNK_BYTES):
        raise bad(f"chunk_bytes {cb!r:.40} is not an int in [1, {MAX_CHUNK_BYTES}]")
    total, stored = part.get("data_bytes"), part.get("stored_bytes")
    if not (is_int(total) and is_int(stored)) or total != entry["data_bytes"] or stored != entry["stored_bytes"]:
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
        if not is_int(off) or off != pos or not is_int(n, 1, cb) or not is_int(sb, 0, MAX_CHUNK_BYTES + (1 << 20)):
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


def probe_chunk(store: Store, c: dict[str, Any], compressed: bool, where: str) -> None:
    """Sizes from the store, before a byte of the rank's buffer is allocated: the file
    holds exactly the recorded stored bytes, and a zstd frame declares the raw size."""
    key = c["key"]
    confine(store, key, where)
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
        check_chunk(c, dst, store.get_range(key, 0, c["stored_bytes"]), store.url(key), where)
        return
    got = store.readinto(key, dst)
    if got != c["bytes"]:
        raise CorruptCheckpointError(f"chunk {store.url(key)} of {where} is not {c['bytes']} bytes long")
    check_chunk(c, dst, None, store.url(key), where)


def check_chunk(c: dict[str, Any], dst: memoryview, stored: Any, url: str, where: str) -> None:
    """Check chunk ``c`` against its checksums: its raw bytes already in ``dst``
    (``stored`` None), or its ``stored`` zstd bytes, decompressed into ``dst`` here."""
    if stored is not None:
        dst[:] = unzstd_chunk(c, stored, url, where)
    elif checksum(dst) != c["checksum"]:
        raise CorruptCheckpointError(f"checksum mismatch in chunk {url} of {where}")


def unzstd_chunk(c: dict[str, Any], stored: Any, url: str, where: str) -> bytes:
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


def read_data(store: Store, part: dict[str, Any], where: str, threads: int = 4) -> Any:
    """The rank's staged bytes as one torch uint8 tensor, every chunk verified; chunks are
    read ``threads`` at a time (object stores answer concurrent requests faster). The
    buffer is allocated only after every chunk's size was probed in the store, so a
    document that claims more bytes than its files hold never allocates them."""
    import torch

    chunks = part["chunks"]
    compressed = part.get("compression") == "zstd"
    with cf.ThreadPoolExecutor(max(1, min(threads, len(chunks))), thread_name_prefix="datapipe-ckpt-load") as pool:
        for f in [pool.submit(probe_chunk, store, c, compressed, where) for c in chunks]:
            f.result()  # the first failure, in chunk order; the pool waits for the rest
        buf = torch.empty(part["data_bytes"], dtype=torch.uint8)
        view = buf.numpy().data
        futs = [pool.submit(_read_chunk, store, c, view[c["offset"] : c["offset"] + c["bytes"]],
                            compressed, where) for c in chunks]
        for f in futs:
            f.result()
    return buf


def leaf_dtype(kind: Any, dtype: Any, path: Any, where: str) -> tuple[str, int]:
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


def build_leaf(buf: Any, spec: Any, where: str, map_location: Any) -> Any:
    """The value a leaf record ``spec`` describes, built on ``buf`` (a torch uint8 tensor of
    verified bytes), its kind, dtype, shape, place and strides checked first."""
    import torch

    if not isinstance(spec, dict):
        raise CorruptCheckpointError(f"{where}: malformed leaf record {spec!r:.100}")
    kind, dtype, shape, path = spec.get("kind"), spec.get("dtype"), spec.get("shape"), spec.get("path")
    off, nbytes, strides = spec.get("offset"), spec.get("nbytes"), spec.get("strides")
    if not isinstance(path, str):
        raise CorruptCheckpointError(f"{where}: malformed leaf record {spec!r:.100}")
    dtype, itemsize = leaf_dtype(kind, dtype, path, where)
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(d) for d in shape)):
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} has a malformed shape {shape!r:.100}")
    numel = 1
    for d in shape:
        numel *= d
    if not (is_int(off) and is_int(nbytes) and off + nbytes <= buf.numel()):
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100} lies outside the data")
    if numel * itemsize != nbytes:
        raise CorruptCheckpointError(f"{where}: leaf {path!r:.100}: shape {shape} of {dtype} is not {nbytes} bytes")
    if strides is not None and not (isinstance(strides, list) and len(strides) == len(shape)
                                    and all(is_int(x, 1) for x in strides)
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


def read_part(store: Store, doc: dict[str, Any], r: int, where: str) -> dict[str, Any]:
    """The part of rank ``r`` named by the verified manifest ``doc``: its checksum, shape
    and chunk layout checked; a one-part checkpoint must hold every leaf's bytes."""
    entry = doc["parts"][r]
    pdata = read_doc_bytes(store, entry["key"], "part", MAX_PART_BYTES)
    part = parse_part(pdata, entry, doc["step"], doc["attempt"], r, doc["world_size"], store.url(entry["key"]), where)
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


def part_state(part: dict[str, Any], buf: Any, where: str, map_location: Any) -> Any:
    """The state a checked part describes, its leaves built on ``buf`` (its verified bytes)."""
    leaves = [build_leaf(buf, spec, where, map_location) for spec in part["leaves"]]
    return unflatten(part["tree"], leaves, where)


class SavedStep:
    """Every part of one committed step, checked, with an index of its global tensors
    (``tensors``: path -> :class:`GlobalTensor`; ``per_rank``: the leaves that are a rank's
    own) and verified byte ranges of each rank's data (:meth:`read_into`, :meth:`read_range`).

    Everything the parts say about pieces is checked before a byte is read: one record per
    path and rank, the same dtype and global shape in every part, boxes inside the global
    shape, a stored piece holding exactly its box's bytes inside its rank's data, and the
    stored pieces of a tensor tiling it exactly (no overlap, nothing missing). A defect is
    a :class:`CorruptCheckpointError` naming the part file."""

    def __init__(self, store: Store, step: int, manifest: dict[str, Any], where: str,
                 threads: int = READ_THREADS, *, joined: list[tuple[Store, dict[str, Any]]] | None = None,
                 prefer: int | None = None) -> None:
        self.store, self.step, self.where, self.threads = store, step, where, threads
        self.failed_ranks: set[int] = set()  # ranks whose bytes failed a check (restore skips those copies)
        self.prefer = prefer
        self._twins: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}  # a joined step's boxes -> piece
        if joined is not None:
            # One part per saved rank, each read from a store of its own: a node-local
            # folder or a received copy (a one-part checkpoint whose manifest names its
            # origin), or rank r's part of a shared tier's step. Node-local parts each
            # hold their rank's copy of the values it held with other ranks: of the exact
            # duplicates of a piece one is kept, rank ``prefer``'s where it has one.
            ws = len(joined)
            self.world_size, self.stores, self.copies_allowed = ws, [s for s, _m in joined], True
            self.parts = [self._read_part(m, r if m["world_size"] > 1 else 0, s) for r, (s, m) in enumerate(joined)]
            self.part_urls = [s.url(m["parts"][r if m["world_size"] > 1 else 0]["key"])
                              for r, (s, m) in enumerate(joined)]
        else:
            ws = manifest["world_size"]
            self.world_size, self.stores, self.copies_allowed = ws, [store] * ws, False
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
            why = tiling_defect(gt, self.part_urls)
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
        if not (isinstance(record, dict) and record.get("key") == key and is_int(record.get("bytes"))
                and isinstance(record.get("checksum"), str)):
            raise CorruptCheckpointError(f"the manifest's record of it is malformed ({record!r:.200})")
        size = record["bytes"]
        end = 0
        for r, e in enumerate(entries):
            off, n = e.get("index_offset"), e.get("doc_bytes")
            if not (is_int(off) and is_int(n, 1, MAX_PART_BYTES) and off >= end and off + n <= size):
                raise CorruptCheckpointError(
                    f"part {r} lies at {off!r:.40} + {n!r:.40} bytes, not after byte {end} inside its {size} bytes")
            end = off + n
        framing = size - sum(e["doc_bytes"] for e in entries)
        if framing > INDEX_FRAMING_BYTES + 2 * len(entries):
            # the header, separators and end hold a few bytes: reading the index never reads
            # much more than the part files it stands for
            raise CorruptCheckpointError(f"its {size} bytes hold {framing} bytes besides the part documents")
        confine(self.store, key, url)
        got = self.store.size(key)
        if got != size:
            raise CorruptCheckpointError(f"it holds {got} bytes, the manifest records {size}")
        data = memoryview(self.store.get_range(key, 0, size))  # the probed size, even if it grew since
        if checksum(data) != record["checksum"]:
            raise CorruptCheckpointError("it does not match its manifest checksum")
        parts = []
        for r, e in enumerate(entries):
            doc = bytes(data[e["index_offset"] : e["index_offset"] + e["doc_bytes"]])
            parts.append(parse_part(doc, e, self.step, manifest["attempt"], r, self.world_size,
                                  f"{self.store.url(e['key'])} (part {r}'s bytes in the parts index)", self.where))
        return parts

    def _read_part(self, manifest: dict[str, Any], r: int, store: Store | None = None) -> dict[str, Any]:
        store = self.store if store is None else store
        entry = manifest["parts"][r]
        data = read_doc_bytes(store, entry["key"], "part", MAX_PART_BYTES)
        return parse_part(data, entry, self.step, manifest["attempt"], r, manifest["world_size"],
                        store.url(entry["key"]), self.where)

    def _index_part(self, r: int) -> None:
        part, url = self.parts[r], self.part_urls[r]
        data_bytes = part["data_bytes"]
        seen: set[str] = set()
        for i, spec in enumerate(part["leaves"]):
            if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
                raise CorruptCheckpointError(f"{url}: malformed leaf record {spec!r:.100}")
            path, kind = spec["path"], spec.get("kind")
            dtype, itemsize = leaf_dtype(kind, spec.get("dtype"), path, url)
            shape, off, nbytes = spec.get("shape"), spec.get("offset"), spec.get("nbytes")
            if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(d) for d in shape)):
                raise CorruptCheckpointError(f"{url}: leaf {path!r:.100} has a malformed shape {shape!r:.100}")
            if not (is_int(off) and is_int(nbytes) and off + nbytes <= data_bytes):
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
            if replica:
                continue
            twin = self._twins.get((path, start, region)) if self.copies_allowed else None
            if twin is None:
                self._twins[(path, start, region)] = len(gt.pieces)
                gt.pieces.append(Piece(r, off, start, region))
            elif r == self.prefer:  # the reading rank's own part: no other part need be read for it
                gt.pieces[twin] = Piece(r, off, start, region)

    @staticmethod
    def _check_global(g: Any, shape: list[int], nbytes: int, path: str,
                      url: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]:
        def bad(msg: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{url}: global record of {path!r:.100}: {msg}")

        if not isinstance(g, dict):
            raise bad(f"not an object: {g!r:.100}")
        gshape, start, region, replica = g.get("shape"), g.get("offset"), g.get("region"), g.get("replica")
        for name, v in (("shape", gshape), ("offset", start), ("region", region)):
            if not (isinstance(v, list) and len(v) <= MAX_NDIM and all(is_int(x) for x in v)):
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
    def chunk_size(self, r: int, i: int) -> int:
        """The chunk file's size, probed once; it must be what the part records (so nothing
        is allocated or read on the word of a document alone)."""
        key = (r, i)
        with self._lock:
            size = self._sizes.get(key)
        if size is None:
            c, store = self.parts[r]["chunks"][i], self.stores[r]
            confine(store, c["key"], self.where)
            size = store.size(c["key"])
            if size != c["stored_bytes"]:
                self.failed_ranks.add(r)
                raise CorruptCheckpointError(
                    f"chunk {store.url(c['key'])} of {self.where} holds {size} bytes, its part "
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
        if not (is_int(n, 1, MAX_CHUNK_BYTES) and isinstance(sums, list)
                and len(sums) == -(-c["bytes"] // n) and all(isinstance(s, str) for s in sums)):
            raise CorruptCheckpointError(f"{self.part_urls[r]}: chunk {c['key']} has malformed block checksums")
        return n, sums

    def _fill(self, r: int, i: int, lo: int, hi: int, dst: np.ndarray[Any, Any]) -> None:
        """Bytes ``[lo, hi)`` of chunk ``i`` of rank ``r`` into ``dst``, checked: ``lo``/``hi``
        fall on block boundaries (or the chunk's ends when it has no blocks)."""
        try:
            self._fill_checked(r, i, lo, hi, dst)
        except BaseException:
            self.failed_ranks.add(r)
            raise

    def _fill_checked(self, r: int, i: int, lo: int, hi: int, dst: np.ndarray[Any, Any]) -> None:
        part, store = self.parts[r], self.stores[r]
        c = part["chunks"][i]
        key, url = c["key"], store.url(c["key"])
        self.chunk_size(r, i)
        if part.get("compression") == "zstd":
            raw = unzstd_chunk(c, store.get_range(key, 0, c["stored_bytes"]), url, self.where)
            dst[:] = np.frombuffer(raw, np.uint8, hi - lo, lo)
            return
        got = store.readinto(key, dst.data, lo)
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

    def read_through(self, r: int, start: int, end: int, dst: np.ndarray[Any, Any],
                     scratch: np.ndarray[Any, Any]) -> None:
        """Bytes ``[start, end)`` of rank ``r``'s data into ``dst``, each block read into
        ``scratch`` and checked there before its bytes are copied into ``dst``: ``dst`` never
        holds a byte that failed its check, and the bytes pass through a buffer already
        touched (a new buffer the size of the range costs a page fault per 4 KiB). Runs of
        whole blocks that fit ``scratch`` are read and checked at once; a chunk without
        blocks (or compressed, or with blocks larger than ``scratch``) goes through
        :meth:`read_into` and a buffer of its own."""
        part = self.parts[r]
        chunks = part["chunks"]
        i = bisect.bisect_right(self.chunk_starts[r], start) - 1
        whole = part.get("compression") is not None
        room = len(scratch)
        while i < len(chunks) and chunks[i]["offset"] < end:
            c0, cb = chunks[i]["offset"], chunks[i]["bytes"]
            lo, hi = max(start - c0, 0), min(end - c0, cb)
            blocks = None if whole else self._blocks(r, i)
            if blocks is None or blocks[0] > room:
                tmp = np.empty(hi - lo, np.uint8)
                self.read_into(r, c0 + lo, c0 + hi, tmp)
                dst[c0 + lo - start : c0 + hi - start] = tmp
            else:
                n = blocks[0]
                step = room // n * n
                b0 = lo // n * n
                while b0 < hi:
                    b1 = min(b0 + step, -(-hi // n) * n, cb)
                    self._fill(r, i, b0, b1, scratch[: b1 - b0])
                    a, z = max(lo, b0), min(hi, b1)
                    dst[c0 + a - start : c0 + z - start] = scratch[a - b0 : z - b0]
                    b0 = b1
            i += 1

    def read_range(self, r: int, start: int, end: int,
                   alloc: Callable[[int], np.ndarray[Any, Any]] | None = None) -> tuple[np.ndarray[Any, Any], int]:
        """``(buf, base)``: checked bytes of rank ``r``'s data covering ``[start, end)``;
        ``buf[k]`` is byte ``base + k`` (whole blocks or chunks around the range). ``alloc(n)``
        gives the buffer of ``n`` bytes to read into (default: a new one)."""
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
        n = chunks[units[-1][0]]["offset"] + units[-1][2] - base
        buf = np.empty(n, np.uint8) if alloc is None else alloc(n)
        for i, lo, hi in units:
            at = chunks[i]["offset"] + lo - base
            self._fill(r, i, lo, hi, buf[at : at + hi - lo])
        return buf, base


# -- copy plans: runs of bytes from pieces into a target box ----------------------------------
