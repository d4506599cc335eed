"""Publishing a checkpoint: rank parts, the commit manifest, ``latest`` and retention.

The commit rule: a checkpoint exists once ``step-N/manifest.json`` exists and verifies.
Rank 0 writes it only after finding every rank's part document in storage; a rank writes
its part only after all of its chunks are durable. Coordination goes through storage
alone, never through the training process group. ``latest`` moves after the manifest;
retention runs after that and deletes a manifest before the data it names.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from ..errors import CheckpointError, ObjectNotFoundError
from ..storage import LocalStore, Store
from .format import (
    LATEST_KEY,
    decode_doc,
    encode_doc,
    manifest_key,
    parse_step_dir,
    part_key,
    step_dir,
)

__all__ = ["sync_dirs", "await_parts", "write_manifest", "write_latest", "apply_retention", "scan_steps"]


def sync_dirs(store: Store, key: str) -> None:
    """fsync every directory above ``key``'s parent up to the store root, so the entries
    of freshly created directories survive a power loss (the parent itself is fsync'd by
    LocalStore when it publishes ``key``; object stores need nothing)."""
    if not isinstance(store, LocalStore) or not store.durable:
        return
    parts = key.split("/")[:-1]
    for i in range(len(parts) - 1, -1, -1):
        d = os.path.join(store.root, *parts[:i])
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def await_parts(store: Store, step: int, attempt: str, world_size: int, timeout: float,
                closing: Any = None) -> list[dict[str, Any]]:
    """Poll storage until every rank's part document of this attempt exists; return
    ``[{rank, key, checksum-free doc bytes info}]`` in rank order."""
    from ..checksum import checksum

    deadline = time.monotonic() + timeout
    found: dict[int, dict[str, Any]] = {}
    delay = 0.005
    while True:
        for r in range(world_size):
            if r in found:
                continue
            key = part_key(step, attempt, r)
            try:
                data = store.get(key)
            except ObjectNotFoundError:
                continue
            doc = decode_doc(data, "part", store.url(key))
            if (doc.get("step"), doc.get("attempt"), doc.get("rank"), doc.get("world_size")) != (
                step, attempt, r, world_size
            ):
                raise CheckpointError(
                    f"{store.url(key)}: part is for step {doc.get('step')} attempt {doc.get('attempt')!r} "
                    f"rank {doc.get('rank')}/{doc.get('world_size')}, expected step {step} attempt "
                    f"{attempt!r} rank {r}/{world_size}"
                )
            found[r] = {"rank": r, "key": key, "checksum": checksum(data),
                        "data_bytes": doc["data_bytes"], "stored_bytes": doc["stored_bytes"]}
        if len(found) == world_size:
            return [found[r] for r in range(world_size)]
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(found))
            raise CheckpointError(
                f"step {step}: ranks {missing} did not publish their part within {timeout:.0f} s "
                f"(looked for {store.url(part_key(step, attempt, missing[0]))}); the checkpoint "
                "is not committed"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def write_manifest(store: Store, step: int, attempt: str, world_size: int,
                   parts: list[dict[str, Any]]) -> None:
    doc = {
        "step": step,
        "attempt": attempt,
        "world_size": world_size,
        "created_unix": time.time(),
        "parts": parts,
        "data_bytes": sum(p["data_bytes"] for p in parts),
        "stored_bytes": sum(p["stored_bytes"] for p in parts),
    }
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


def _delete_step(store: Store, step: int, keys: list[str]) -> None:
    # The manifest goes first: from then on the step is merely incomplete, never torn.
    mkey = manifest_key(step)
    if mkey in keys:
        store.delete(mkey)
    for key in keys:
        if key != mkey:
            store.delete(key)
    if isinstance(store, LocalStore):
        # Also the temporary files of killed writers, which listings hide, and the empty dirs.
        shutil.rmtree(os.path.join(store.root, step_dir(step)), ignore_errors=True)


def apply_retention(store: Store, committed: int, attempt: str, keep_last: int,
                    keep_every: int | None) -> list[int]:
    """Delete old checkpoints after ``committed`` is durable; returns the deleted steps.

    Kept: the ``keep_last`` highest complete steps, every complete step divisible by
    ``keep_every``, and ``committed`` itself. Incomplete steps below ``committed`` are
    leftovers of crashed or skipped saves (every rank has finished them) and go too.
    Older attempts inside the committed step are removed."""
    by_step = scan_steps(store)
    complete = sorted(s for s, keys in by_step.items() if manifest_key(s) in keys)
    keep = set(complete[-keep_last:]) | {committed}
    if keep_every:
        keep |= {s for s in complete if s % keep_every == 0}
    deleted = []
    for s, keys in sorted(by_step.items()):
        if s in keep or s > committed:
            continue
        _delete_step(store, s, keys)
        deleted.append(s)
    prefix = f"{step_dir(committed)}/{attempt}/"
    for key in by_step.get(committed, []):
        if key != manifest_key(committed) and not key.startswith(prefix):
            store.delete(key)
    return deleted
