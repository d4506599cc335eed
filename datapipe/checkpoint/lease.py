"""One writer per checkpoint URL: a lease object, ``<url>/writer.lease``.

The lease names its holder (a random writer id, the run id, host, pid) and carries a
heartbeat that a background thread refreshes every ``ttl/3`` seconds. Exclusion comes
from the storage, never from reading and then writing:

- a local directory: ``flock`` on the lease file. The kernel drops the lock when the
  holder's process dies, so a crashed writer's lease is free at once; two writers in one
  process conflict too (each opens the file itself). The heartbeat is informational.
- an object store with conditional writes (S3): created with ``If-None-Match: *``,
  refreshed with ``If-Match: <its ETag>``; a lease whose heartbeat is older than its
  ``ttl`` is stale and taken over with ``If-Match`` on the stale version, so of two
  contenders exactly one wins. A holder whose refresh fails that condition has lost it.
- any other store (memory://, stores without conditional writes): the same protocol over
  plain reads and writes, checked again after writing. This refuses a second writer that
  starts while the first is alive, but two writers starting in the same instant may both
  believe they hold it: that is a limit of the store, stated in docs/CHECKPOINT_FORMAT.md.

The writer checks that it still holds the lease before it commits a manifest and before
retention deletes anything; a writer that lost it fails its save instead.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import uuid
import warnings
from typing import Any

from ..checksum import checksum
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageError,
)
from ..storage import Store
from .format import MAX_LATEST_BYTES, decode_doc, encode_doc

__all__ = ["LEASE_KEY", "Lease"]

LEASE_KEY = "writer.lease"


def _describe(doc: dict[str, Any] | None, now: float) -> str:
    if doc is None:
        return "an unreadable lease"
    age = now - doc["heartbeat_unix"] if isinstance(doc.get("heartbeat_unix"), (int, float)) else float("nan")
    return (f"writer {doc.get('writer')!r} (run {doc.get('run_id')!r}, host {doc.get('host')!r}, "
            f"pid {doc.get('pid')!r}), last heartbeat {age:.0f} s ago")


class Lease:
    """The lease of one writer on one store; :meth:`acquire` or raise."""

    def __init__(self, store: Store, run_id: str, ttl: float = 60.0, wait: float = 0.0) -> None:
        if not isinstance(ttl, (int, float)) or not ttl > 0:
            raise CheckpointError(f"lease_ttl must be a positive number of seconds, got {ttl!r}")
        if not isinstance(wait, (int, float)) or wait < 0:
            raise CheckpointError(f"lease_wait must be a number of seconds >= 0, got {wait!r}")
        self.store, self.run_id, self.ttl, self.wait = store, run_id, float(ttl), float(wait)
        self.writer = uuid.uuid4().hex
        self.url = store.url(LEASE_KEY)
        self.path = store.local_path(LEASE_KEY)  # a local file: flock
        self.local = self.path is not None
        self.exclusive = self.local or store.supports_conditional_writes
        self._fd: int | None = None
        self._pid = os.getpid()
        self._ino: int | None = None
        self._tag: str | None = None
        self._acquired = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # heartbeat vs check/release
        self._thread: threading.Thread | None = None

    # -- the document ---------------------------------------------------------------------
    def _body(self) -> bytes:
        now = time.time()
        return encode_doc({"writer": self.writer, "run_id": self.run_id, "host": socket.gethostname(),
                           "pid": os.getpid(), "acquired_unix": self._acquired or now,
                           "heartbeat_unix": now, "ttl_s": self.ttl}, "lease")

    def _parse(self, data: bytes) -> dict[str, Any] | None:
        if len(data) > MAX_LATEST_BYTES:
            return None
        try:
            return decode_doc(data, "lease", self.url)
        except CorruptCheckpointError:
            return None

    def _stale(self, doc: dict[str, Any] | None) -> bool:
        if doc is None:
            return True  # unreadable: no live writer of ours wrote it
        hb, ttl = doc.get("heartbeat_unix"), doc.get("ttl_s")
        if not isinstance(hb, (int, float)) or not isinstance(ttl, (int, float)):
            return True
        return time.time() - hb > ttl

    def _refuse(self, doc: dict[str, Any] | None) -> CheckpointError:
        how = ("the kernel frees it when that process exits" if self.local else
               f"it goes stale {doc.get('ttl_s') if doc else self.ttl} s after its last heartbeat")
        return CheckpointError(
            f"{self.url}: another checkpoint writer holds this URL: {_describe(doc, time.time())}. "
            f"One writer per URL: close the other writer, or write to another URL. If that writer "
            f"is dead, {how}; pass lease_wait=<seconds> to wait for it"
        )

    # -- acquire ----------------------------------------------------------------------------
    def acquire(self) -> Lease:
        deadline = time.monotonic() + self.wait
        while True:
            try:
                doc = self._try_local() if self.local else self._try_remote()
            except (OSError, StorageError) as e:
                raise CheckpointError(f"{self.url}: cannot take the writer lease ({type(e).__name__}: {e}); "
                                      "is the checkpoint URL writable?") from e
            if doc is True:
                break
            if time.monotonic() >= deadline:
                raise self._refuse(doc)
            time.sleep(min(1.0, max(0.05, self.ttl / 10), max(0.0, deadline - time.monotonic())))
        self._thread = threading.Thread(target=self._heartbeat, name="datapipe-ckpt-lease", daemon=True)
        self._thread.start()
        return self

    def _try_local(self) -> Any:
        import fcntl

        path = self.path
        if path is None:
            return self._try_remote()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._parse(os.pread(fd, MAX_LATEST_BYTES + 1, 0))
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                # a filesystem without locks (some NFS mounts): the store's own protocol
                warnings.warn(f"{self.url}: the filesystem refuses flock ({e}); the writer lease "
                              "falls back to write-and-read-back, which two writers starting "
                              "at the same instant can both pass", stacklevel=4)
                self.local = self.exclusive = False
                return self._try_remote()
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (unlinked) between our open and our lock: open again
                return self._try_local()
            self._acquired = time.time()
            self._write_local(fd)
            self._fd, self._ino, fd = fd, os.fstat(fd).st_ino, -1
            return True
        finally:
            if fd >= 0:
                os.close(fd)

    def _write_local(self, fd: int) -> None:
        body = self._body()
        os.pwrite(fd, body, 0)
        os.ftruncate(fd, len(body))

    def _get_tagged(self) -> tuple[bytes, str]:
        if self.store.supports_conditional_writes:
            return self.store.get_tagged(LEASE_KEY)
        data = self.store.get(LEASE_KEY)
        return data, checksum(data)

    def _put_if(self, body: bytes, match: str | None) -> str | None:
        if self.store.supports_conditional_writes:
            return self.store.put_if(LEASE_KEY, body, match)
        # No atomic condition on this store: check, write, and read back (see module doc).
        try:
            data, tag = self._get_tagged()
        except ObjectNotFoundError:
            if match is not None:
                return None
        else:
            if match is None or tag != match:
                return None
        self.store.put(LEASE_KEY, body)
        data, tag = self._get_tagged()
        return tag if data == body else None

    def _try_remote(self) -> Any:
        self._acquired = time.time()
        tag = self._put_if(self._body(), None)
        if tag is None:
            try:
                data, seen = self._get_tagged()
            except ObjectNotFoundError:
                return None  # released meanwhile: try again
            doc = self._parse(data)
            if not self._stale(doc):
                return doc
            tag = self._put_if(self._body(), seen)  # of two contenders, one wins
            if tag is None:
                return doc
        self._tag = tag
        return True

    # -- while held -------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        period = self.ttl / 3
        while not self._stop.wait(period):
            with self._lock:
                if self._lost is not None or self._stop.is_set():
                    return
                try:
                    if self.local:
                        self._write_local(self._fd)  # type: ignore[arg-type]
                    else:
                        tag = self._put_if(self._body(), self._tag)
                        if tag is None:
                            self._lost = "its heartbeat found the lease replaced"
                            return
                        self._tag = tag
                except (OSError, StorageError):
                    pass  # a transient failure; check() asks the store itself before a commit

    def check(self, doing: str) -> None:
        """Raise :class:`CheckpointError` unless this writer still holds the lease."""
        with self._lock:
            if self._lost is None:
                try:
                    if self.local:
                        if self.path is None or os.stat(self.path).st_ino != self._ino:
                            self._lost = "the lease file was replaced"
                    else:
                        data, tag = self._get_tagged()
                        if tag != self._tag:
                            self._lost = f"it is now held by {_describe(self._parse(data), time.time())}"
                except (FileNotFoundError, ObjectNotFoundError):
                    self._lost = "the lease file was deleted"
            if self._lost is not None:
                raise CheckpointError(
                    f"{self.url}: this writer lost its lease ({self._lost}); not {doing}. "
                    "Another writer may own this URL now: one writer per URL"
                )

    def release(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child (a DataLoader worker) exiting: the lease is its parent's
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            try:
                if self.local:
                    path = self.path
                    if self._fd is not None and path is not None:
                        try:
                            if os.stat(path).st_ino == self._ino:
                                os.unlink(path)  # while locked: a waiter re-checks the inode
                        except FileNotFoundError:
                            pass
                        os.close(self._fd)
                        self._fd = None
                elif self._lost is None and self._tag is not None:
                    try:
                        _data, tag = self._get_tagged()
                    except ObjectNotFoundError:
                        return
                    if tag == self._tag:  # never delete a lease another writer took over
                        self.store.delete(LEASE_KEY)
                    self._tag = None
            except (OSError, StorageError):
                pass  # an unreleased remote lease goes stale after ttl; a local one with us
