"""One writer per checkpoint URL: the storage's writer lease on ``<url>/writer.lease``.

The mechanism (flock on a local disk, conditional writes on S3, write-and-read-back
elsewhere; a heartbeat every ``ttl/3``) is :class:`datapipe.storage.lease.WriterLease`;
this module gives it the checkpoint format's document (``kind: lease``, with a
self-checksum and the run id, docs/CHECKPOINT_FORMAT.md) and turns its errors into
:class:`CheckpointError`. The writer checks that it still holds the lease before it
commits a manifest and before retention deletes anything; a writer that lost it fails
its save instead.
"""

from __future__ import annotations

from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointOptionError,
    CorruptCheckpointError,
    LeaseBusyError,
    LeaseLostError,
    StorageError,
)
from ..storage import LEASE_FILE_DELETED, Store, WriterLease, describe_holder
from .format import decode_doc, encode_doc

__all__ = ["LEASE_KEY", "Lease"]

LEASE_KEY = "writer.lease"


class Lease:
    """The lease of one checkpoint writer on one store; :meth:`acquire` or raise."""

    def __init__(self, store: Store, run_id: str, ttl: float = 60.0, wait: float = 0.0) -> None:
        if not isinstance(ttl, (int, float)) or not ttl > 0:
            raise CheckpointOptionError(f"lease_ttl must be a positive number of seconds, got {ttl!r}")
        if not isinstance(wait, (int, float)) or wait < 0:
            raise CheckpointOptionError(f"lease_wait must be a number of seconds >= 0, got {wait!r}")
        self.url = store.url(LEASE_KEY)
        self.run_id = run_id
        self._lease = WriterLease(store, LEASE_KEY, ttl=ttl, wait=wait, fields={"run_id": run_id},
                                  encode=lambda doc: encode_doc(doc, "lease"), decode=self._decode)

    def _decode(self, data: bytes) -> dict[str, Any] | None:
        try:
            return decode_doc(data, "lease", self.url)
        except CorruptCheckpointError:
            return None

    def acquire(self) -> Lease:
        try:
            self._lease.acquire()
        except LeaseBusyError as e:
            raise CheckpointError(
                f"{self.url}: another checkpoint writer holds this URL: {describe_holder(e.holder, local=e.local)}. "
                f"One writer per URL: close the other writer, or write to another URL. If that writer "
                f"is dead, {e.frees}; pass lease_wait=<seconds> to wait for it"
            ) from None
        except StorageError as e:
            raise CheckpointError(f"{self.url}: cannot take the writer lease ({type(e).__name__}: {e}); "
                                  "is the checkpoint URL writable?") from e
        return self

    def check(self, doing: str) -> None:
        """Raise :class:`CheckpointError` unless this writer still holds the lease."""
        try:
            self._lease.check()
        except LeaseLostError as e:
            raise CheckpointError(
                f"{self.url}: this writer lost its lease ({e.why}); not {doing}. "
                "Another writer may own this URL now: one writer per URL"
            ) from None

    def deleted(self) -> bool:
        """Whether this writer lost the lease only because its file was deleted (the
        folder removed under it): nobody took it over, so it may be taken again."""
        try:
            self._lease.check()
        except LeaseLostError as e:
            return e.why == LEASE_FILE_DELETED
        return False

    def release(self) -> None:
        self._lease.release()
