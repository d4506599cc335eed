"""Loading from a checkpoint URL: :func:`load_checkpoint` finds the newest complete
checkpoint (or a given step) and returns its state, every byte read verified (the step
reader, step.py; how a step's state is built, read.py); :func:`list_checkpoints` says
which steps are there and complete. JSON and raw bytes only: nothing read from storage is
ever executed.

``latest`` is a hint written after a commit, never the truth: the manifests are, so the
loader scans them, newest step first, and skips (with a warning naming it) any
checkpoint that is incomplete or fails verification. A writer's retention may delete steps
while they are read: see :func:`_listings`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointOptionError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectNotFoundError,
    StorageError,
)
from ..storage import Store, open_store
from .commit import scan_steps
from .format import manifest_key
from .read import read_step
from .restore import restore_checkpoint
from .step import read_manifest

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
                listing.read[s] = read_manifest(store, s)
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
                    doc = read_manifest(store, step)
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
            raise CheckpointOptionError("load_checkpoint(tiers=...) takes no url, step, storage_options or into "
                                  "(each Tier has its own store; resharding from tiers is not supported)")
        return restore_checkpoint(tiers, rank=rank, ranks_per_node=ranks_per_node,
                                  map_location=map_location).state
    if url is None:
        raise CheckpointOptionError("load_checkpoint needs a url or tiers=[Tier(...), ...]")
    store = open_store(url, storage_options)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointOptionError(f"step must be a non-negative int, got {step!r}")
        try:
            return read_step(store, step, rank, map_location, into)
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
                    doc = read_manifest(store, s)  # below the newest listed manifest: read now
                if doc is None:
                    warnings.warn(f"skipping incomplete checkpoint step {s} at {url} (no manifest)", stacklevel=2)
                    continue
                if isinstance(doc, Exception):
                    raise doc
                try:
                    return read_step(store, s, rank, map_location, into, doc)
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
        now = read_manifest(store, step)
    except ObjectNotFoundError:
        return True
    except (CheckpointError, StorageError):
        return True  # rewritten since, and not readable now: not the one this load read
    return (now["attempt"], now.get("created_unix")) != (doc["attempt"], doc.get("created_unix"))
