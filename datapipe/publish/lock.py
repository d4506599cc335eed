"""One writer per destination, and a rerun cleans up exactly what a killed writer left
behind.

Exclusion is the storage's writer lease (:class:`datapipe.storage.WriterLease`):
on a local destination an exclusive ``flock`` on ``_pack/writer.lock``, which the kernel
drops when the holder dies (kill -9 included), so the rerun of a killed pack simply takes
it; on an object store a lease object, ``_pack/lease.json``, created and refreshed with
conditional writes where the store has them (S3), taken over once its heartbeat is older
than ``LEASE_STALE_S`` or its writer ran on this host and is gone. A writer checks its
lease before it commits and stops if another writer took it over.

The lock file also journals the run tokens of the writers that held it: every temporary
file a pack creates carries its token (``Store.for_writer``), and the token is written
here before the first such file exists, so the next holder deletes exactly those files
(``Store.remove_temporaries``) and nothing another writer (or the user) put beside them.
Object stores publish an upload only when it completes: they have no temporaries.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from ..errors import DestinationBusyError, LeaseBusyError, LeaseLostError, StorageError
from ..storage import Store, WriterLease, describe_holder
from .layout import LEASE, LOCK, WORK

__all__ = ["WriterLock", "LEASE_STALE_S", "TEMPORARY_FOLDERS", "die_with_parent"]

LEASE_STALE_S = 120.0  # a heartbeat this old means the writer is gone
_KEEP_TOKENS = 8
#: the folders a writer creates temporaries in: the destination's top and the journal folder
TEMPORARY_FOLDERS = ("", WORK)


class WriterLock:
    """``with WriterLock(store) as lock: ...`` makes ``lock.store`` the store to write
    through (temporaries named by this writer's token). Raises `DestinationBusyError`
    while another pack holds the destination."""

    def __init__(self, store: Store) -> None:
        self.token = uuid.uuid4().hex
        self.base = store
        self.store: Store = store.for_writer(self.token)
        local = store.local_path(LOCK) is not None
        self._lease = WriterLease(store, LOCK if local else LEASE, ttl=LEASE_STALE_S,
                                  fields={"token": self.token}, inherit=self._inherit,
                                  take_over_dead_here=True)
        self._created: str | None = None  # the topmost folder this writer created

    def _inherit(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        """With the lock held: delete the temporaries of the tokens the previous holders
        journaled, and journal ours before the first temporary named by it can exist.
        Earlier tokens stay listed a while: a worker of a killed pack can outlive its
        lock by the moment the kernel takes to deliver its death signal."""
        old = (previous or {}).get("tokens", [])
        tokens = [t for t in old if isinstance(t, str) and t.isascii() and t.isalnum()] if isinstance(old, list) else []
        self._remove_temporaries(tokens)
        return {"tokens": [*tokens[-(_KEEP_TOKENS - 1):], self.token]}

    def _remove_temporaries(self, tokens: list[str]) -> None:
        for folder in TEMPORARY_FOLDERS:
            self.base.remove_temporaries(folder, tokens=tokens)

    def remove_temporaries(self) -> None:
        """Delete the temporaries this writer's own unfinished writes left (a failed write
        cleaning up after itself; those of earlier holders go when the lock is taken)."""
        self._remove_temporaries([self.token])

    def __enter__(self) -> WriterLock:
        root = self.base.local_path("")
        if root is not None:
            missing = root.rstrip(os.sep) or os.sep
            while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
                missing = os.path.dirname(missing)
            self._created = None if os.path.exists(missing) else missing
        try:
            self._lease.acquire()
        except LeaseBusyError as e:
            self.release()
            if e.local:
                raise DestinationBusyError(
                    f"another pack is writing {self.base.root} ({describe_holder(e.holder, local=True)}; it holds "
                    f"{self._lease.url}): wait for it to finish, or stop it and run your command again"
                ) from None
            raise DestinationBusyError(
                f"another pack is writing {self.base.root} ({describe_holder(e.holder, local=False)}; its lease "
                f"is {self._lease.url}): wait for it to finish; a writer that died on another host "
                f"releases the destination {LEASE_STALE_S:.0f} s after its last heartbeat"
            ) from None
        except StorageError as e:
            self.release()
            raise StorageError(f"cannot take the writer lock {self._lease.url}: {e} (a pack needs a "
                               "destination that can hold a writer lease)") from None
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def inherited_fd(self) -> tuple[int, int, int] | None:
        """(fd, device, inode) of the lock, for forked workers to close their copy: the
        lock must die with this process, not live on in an orphaned worker."""
        fd = self._lease.fd
        if fd is None:
            return None
        st = os.fstat(fd)
        return fd, st.st_dev, st.st_ino

    def check(self) -> None:
        """Raise `DestinationBusyError` if another writer holds the destination now (an
        object-store lease taken over): called before committing."""
        try:
            self._lease.check()
        except LeaseLostError as e:
            raise DestinationBusyError(f"another pack took over {self._lease.url} ({e.why}): two packs wrote "
                                       f"{self.base.root} at once; run one pack again, alone") from None

    def release(self) -> None:
        """Give the destination up. The lock file goes with the journal: it stays while
        ``_pack/`` holds an unfinished pack (its token names the temporaries to clean)."""
        path = self._lease.path
        work = os.path.dirname(path) if path is not None else None
        try:
            finished = work is None or set(os.listdir(work)) <= {os.path.basename(path or "")}
        except OSError:
            finished = False
        held = self._lease.fd is not None
        self._lease.release(remove=finished)
        if work is None or not held or not finished:
            return
        try:
            os.rmdir(work)
            d = self.base.root
            while self._created and d.startswith(self._created) and not os.listdir(d):
                os.rmdir(d)  # folders this writer created and left empty (a failed pack)
                d = os.path.dirname(d)
        except OSError:
            pass  # another pack took the destination meanwhile; its folders stay


def die_with_parent(parent: int, lock_fd: tuple[int, int, int] | None = None) -> None:
    """Make a writer's worker process end when the writer that started it (pid ``parent``)
    ends, however it ends: a worker left behind by a kill -9 would block forever on its
    result pipe, holding its memory (and, forked, a copy of the destination's lock:
    ``lock_fd``, from :meth:`WriterLock.inherited_fd`, is closed here)."""
    if lock_fd is not None:  # a forked copy of the writer lock: the lock must die with the parent
        fd, dev, ino = lock_fd
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.close(fd)
        except OSError:
            pass  # the descriptor is not open here (spawned, not forked): no copy of the lock to drop
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # the kernel kills us the moment our parent exits (PR_SET_PDEATHSIG = 1)
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the watchdog thread below notices the parent's end instead
    ppid = os.getppid()

    def watch() -> None:  # the portable half, and the case of a parent that died before prctl
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass  # the pid exists (another user's process reuses it): os.getppid() decides
            if os.getppid() != ppid:
                os._exit(1)
            time.sleep(0.5)

    if os.getppid() != ppid:
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="datapipe-pack-watchdog").start()
