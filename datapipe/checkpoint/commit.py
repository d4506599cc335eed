"""Publishing a checkpoint: rank parts, the commit manifest, ``latest`` and retention.

The commit rule: a checkpoint exists once ``step-N/manifest.json`` exists and verifies.
Rank 0 writes it only after finding every rank's part document in storage; a rank writes
its part only after all of its chunks are durable. In between, rank 0 checks that the
pieces the parts record of each global tensor tile it exactly once (:func:`await_parts`),
and writes the parts index of a multi-rank step (the part documents it just read, in one object), so that a
reader of every part makes one request instead of one per rank. Coordination goes through
storage alone, never through the training process group. ``latest`` moves after the manifest;
retention runs after that and deletes a manifest before the data it names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ..checksum import checksum
from ..errors import CheckpointError, ObjectNotFoundError, StorageError
from ..storage import Store
from .format import (
    LATEST_KEY,
    MANIFEST_NAME,
    MAX_LATEST_BYTES,
    decode_doc,
    encode_doc,
    encode_parts_index,
    is_data_key,
    manifest_key,
    parse_step_dir,
    part_key,
    parts_index_key,
    step_dir,
)
from .overlap import GlobalTensor, Piece, tiling_defect

__all__ = ["sync_dirs", "await_parts", "write_parts_index", "write_manifest", "write_latest", "apply_retention",
           "scan_steps", "read_latest_step"]


def sync_dirs(store: Store, key: str) -> None:
    """fsync every directory above ``key``'s parent up to the store root, so the entries
    of freshly created directories survive a power loss (the store's own capability:
    object stores need nothing)."""
    store.sync_parents(key)


def await_parts(store: Store, step: int, attempt: str, world_size: int,
                timeout: float, keep_docs: int = 0) -> tuple[list[dict[str, Any]], list[bytes] | None]:
    """Poll storage until every rank's part document of this attempt exists; return the
    manifest's entries ``{rank, key, checksum, doc_bytes, data_bytes, stored_bytes}`` and
    the documents' bytes, both in rank order; the bytes only while they add up to at most
    ``keep_docs`` (else None: none are kept past that).

    Each look reads the parts in rank order from the first one not found yet and stops at
    the next one missing: a wait costs one request per look whatever the world size, so
    looks can come often. They come every 2 ms, then every 1/16 of the time waited so far
    (at most every 0.5 s): the last part is seen at most that late (the looks doubling, and
    later growing by a quarter, let the commit lag the last part by up to a quarter of the
    wait, 30 ms of a 0.2 s save)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    found: list[dict[str, Any]] = []
    docs: list[bytes] | None = []
    kept = 0
    tensors: dict[str, GlobalTensor] = {}
    while True:
        while len(found) < world_size:
            r = len(found)
            key = part_key(step, attempt, r)
            try:
                data = store.get(key)
            except ObjectNotFoundError:
                break
            doc = decode_doc(data, "part", store.url(key))
            if (doc.get("step"), doc.get("attempt"), doc.get("rank"), doc.get("world_size")) != (
                step, attempt, r, world_size
            ):
                raise CheckpointError(
                    f"{store.url(key)}: part is for step {doc.get('step')} attempt {doc.get('attempt')!r} "
                    f"rank {doc.get('rank')}/{doc.get('world_size')}, expected step {step} attempt "
                    f"{attempt!r} rank {r}/{world_size}"
                )
            if world_size > 1:
                _add_pieces(tensors, doc, r, store.url(key))
            found.append({"rank": r, "key": key, "checksum": checksum(data), "doc_bytes": len(data),
                          "data_bytes": doc["data_bytes"], "stored_bytes": doc["stored_bytes"]})
            kept += len(data)
            if docs is not None:
                docs.append(data)
                if kept > keep_docs:
                    docs = None
        if len(found) == world_size:
            urls = [store.url(p["key"]) for p in found]
            for gt in tensors.values():
                why = tiling_defect(gt, urls)
                if why is not None:
                    raise CheckpointError(
                        f"step {step}: global tensor {gt.path!r:.100}: {why}; the checkpoint is not "
                        "committed (do the ranks that hold a DTensor together all save it, with the "
                        "same mesh and placements?)")
            return found, docs
        now = time.monotonic()
        if now > deadline:
            missing = [r for r in range(len(found), world_size) if not store.exists(part_key(step, attempt, r))]
            if missing:
                raise CheckpointError(
                    f"step {step}: ranks {missing} did not publish their part within {timeout:.0f} s "
                    f"(looked for {store.url(part_key(step, attempt, missing[0]))}); the checkpoint "
                    "is not committed"
                )
            continue  # every one is there now: read them
        time.sleep(min(max(0.002, (now - t0) / 16), 0.5, max(0.0, deadline - now) + 0.001))


def _add_pieces(tensors: dict[str, GlobalTensor], doc: dict[str, Any], r: int, url: str) -> None:
    """The global tensors rank ``r``'s part names and the pieces of them it stores, added to
    ``tensors`` (a box a rank records as a replica stores nothing: its holder's part stores
    it). Only the geometry: the reader checks every other field of a record before it
    trusts it."""
    leaves = doc.get("leaves")
    for spec in leaves if isinstance(leaves, list) else ():
        g = spec.get("global") if isinstance(spec, dict) else None
        if not isinstance(g, dict):
            continue
        path = spec.get("path")
        shape: Any = g.get("shape")
        start: Any = g.get("offset")
        region: Any = g.get("region")
        if not (isinstance(path, str) and all(isinstance(v, list) for v in (shape, start, region))
                and len(shape) == len(start) == len(region)
                and all(type(x) is int and x >= 0 for v in (shape, start, region) for x in v)
                and all(o + k <= n for n, o, k in zip(shape, start, region))):
            raise CheckpointError(f"{url}: malformed global record of leaf {path!r:.100}")
        gt = tensors.get(path)
        if gt is None:
            gt = tensors[path] = GlobalTensor(path, str(spec.get("kind")), str(spec.get("dtype")), 0,
                                              tuple(shape), where=url)
        elif gt.shape != tuple(shape):
            raise CheckpointError(f"{url}: global tensor {path!r:.100} is {list(shape)} here, "
                                  f"{list(gt.shape)} in {gt.where}; the checkpoint is not committed")
        if g.get("replica") is False:
            gt.pieces.append(Piece(r, 0, tuple(start), tuple(region)))


def write_parts_index(store: Store, step: int, attempt: str, parts: list[dict[str, Any]],
                      docs: list[bytes]) -> dict[str, Any]:
    """Write the parts index of this attempt (every part document, byte for byte, in rank
    order) and return the manifest's record of it, ``{key, bytes, checksum}``; each entry
    of ``parts`` gets the ``index_offset`` of its document. Written before the manifest
    and durable when ``put`` returns: an attempt killed here has no manifest, so nothing
    about it looks complete, and retention deletes the index with the attempt."""
    data, offsets = encode_parts_index(step, attempt, docs)
    key = parts_index_key(step, attempt)
    store.put(key, data)
    for entry, off in zip(parts, offsets):
        entry["index_offset"] = off
    return {"key": key, "bytes": len(data), "checksum": checksum(data)}


def write_manifest(store: Store, step: int, attempt: str, world_size: int,
                   parts: list[dict[str, Any]], origin: dict[str, int] | None = None,
                   parts_index: dict[str, Any] | None = None) -> None:
    """``origin``: in a node-local tier, the job rank and world size whose one part this
    one-part checkpoint holds (docs/CHECKPOINT_FORMAT.md, "Tiers"). ``parts_index``: the
    record :func:`write_parts_index` returned, if the step has one."""
    doc: dict[str, Any] = {
        "step": step,
        "attempt": attempt,
        "world_size": world_size,
        "created_unix": time.time(),
        "parts": parts,
        "data_bytes": sum(p["data_bytes"] for p in parts),
        "stored_bytes": sum(p["stored_bytes"] for p in parts),
    }
    if origin is not None:
        doc["origin"] = origin
    if parts_index is not None:
        doc["parts_index"] = parts_index
    # The step directory and its entry in the root are durable already (the chunks'
    # sync_dirs); publishing fsyncs the step directory with the manifest's entry.
    store.put(manifest_key(step), encode_doc(doc, "manifest"))


def write_latest(store: Store, step: int, attempt: str) -> None:
    store.put(LATEST_KEY, encode_doc({"step": step, "attempt": attempt}, "latest"))


def scan_steps(store: Store) -> dict[int, list[str]]:
    """Every key of the store grouped by the step directory it lies in."""
    out: dict[int, list[str]] = {}
    for key in store.list():
        head = key.split("/", 1)[0]
        step = parse_step_dir(head)
        if step is not None and "/" in key:
            out.setdefault(step, []).append(key)
    return out


def read_latest_step(store: Store) -> int | None:
    """The step ``latest`` points to, or None if it is absent or unreadable."""
    try:
        if store.size(LATEST_KEY) > MAX_LATEST_BYTES:
            return None
        doc = decode_doc(store.get(LATEST_KEY), "latest", store.url(LATEST_KEY))
    except (CheckpointError, StorageError):
        return None
    step = doc.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _delete_step(store: Store, step: int, keys: list[str], keep_attempt: Callable[[str], bool],
                 delete_manifest: bool = True) -> None:
    """Delete a step's manifest and the parts and chunks of every attempt that
    ``keep_attempt`` does not claim. Keys that are not this format's names are left alone:
    a writer deletes only what writers of this format write."""
    mkey = manifest_key(step)
    if delete_manifest and mkey in keys:
        # The manifest goes first: from then on the step is merely incomplete, never torn.
        store.delete(mkey)
    attempts = set()
    for key in keys:
        if is_data_key(key):
            attempt = key.split("/")[1]
            if not keep_attempt(attempt):
                attempts.add(attempt)
                store.delete(key)
    root = store.local_path("")
    if root is not None:
        sdir = os.path.join(root, step_dir(step))
        # The temporary files of killed writers, which listings hide, inside the attempts
        # we deleted (and of a manifest in the step folder), then the folders left empty.
        for attempt in attempts:
            for dirpath, _dirs, _files in os.walk(os.path.join(sdir, attempt), topdown=False):
                rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
                store.remove_temporaries(rel)
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        if delete_manifest:
            store.remove_temporaries(step_dir(step), suffix=MANIFEST_NAME)
            try:
                os.rmdir(sdir)
            except OSError:
                pass  # not empty: an attempt in flight or a file that is not ours


def apply_retention(store: Store, committed: int, attempt: str, keep_last: int,
                    keep_every: int | None,
                    in_flight: Callable[[int, str], bool] = lambda step, attempt: False) -> list[int]:
    """Delete old checkpoints after ``committed`` is durable; returns the deleted steps.

    Kept: the ``keep_last`` highest complete steps, every complete step divisible by
    ``keep_every``, ``committed`` itself and the step ``latest`` points to (if writing
    ``latest`` failed, it still names the previous commit, which a reader may be using).
    Incomplete steps below ``committed`` are leftovers of crashed or skipped saves and go
    too, except attempts ``in_flight(step, attempt)`` claims (a rank of this writer's job
    may still write a step it saved after ``committed``). Older attempts inside the
    committed step are removed."""
    by_step = scan_steps(store)
    complete = sorted(s for s, keys in by_step.items() if manifest_key(s) in keys)
    # The highest complete steps this listing shows, made after the commit: a step goes only
    # while newer ones show to a listing (a commit that does not show yet keeps the step
    # before it), which is what readers listing meanwhile rely on (load._listings).
    keep = set(complete[-keep_last:]) | {committed}
    pointed = read_latest_step(store)
    if pointed is not None:
        keep.add(pointed)
    if keep_every:
        keep |= {s for s in complete if s % keep_every == 0}
    deleted = []
    for s, keys in sorted(by_step.items()):
        if s in keep or s > committed:
            continue
        _delete_step(store, s, keys, partial(in_flight, s))
        deleted.append(s)
    _delete_step(store, committed, by_step.get(committed, []),
                 lambda a: a == attempt or in_flight(committed, a), delete_manifest=False)
    # a `latest` whose write failed (disk full) or was killed; we hold the lease, so no
    # other writer is writing one now
    store.remove_temporaries("", suffix="-" + LATEST_KEY)
    return deleted
