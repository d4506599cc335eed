"""One pack writes a destination at a time, and a rerun cleans up exactly what a killed
pack left behind.

Local destinations: an exclusive ``flock`` on ``_pack/writer.lock``. The kernel drops it
when the holder dies (kill -9 included), so a stale lock cannot outlive its writer and
the rerun of a killed pack simply takes it. The lock file also journals the run tokens
of the writers that held it: every temporary file a pack creates is named
``.tmp-<token>-<name>`` and the token is written here before the first such file
exists, so the next holder deletes exactly those files and nothing another writer
(or the user) put beside them.

Object stores: an upload is invisible until it completes, so there are no temporaries
to clean; one writer is enforced by a lease object, ``_pack/lease.json`` (the writer's
token and a heartbeat refreshed in the background). A lease whose heartbeat is older
than ``LEASE_STALE_S`` belongs to a dead writer and is taken over; a writer re-reads its
lease before it commits and stops if another writer took it over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..errors import DestinationBusyError, StorageError
from ..storage import Store
from .commit import LEASE, LOCK, WORK

__all__ = ["WriterLock"]

LEASE_STALE_S = 120.0  # a heartbeat this old means the writer is gone
LEASE_BEAT_S = 15.0
_KEEP_TOKENS = 8


def _describe(info: dict[str, Any]) -> str:
    who = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    if isinstance(info.get("started"), (int, float)):
        who += ", started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
    return who


class WriterLock:
    """``with WriterLock(store) as lock: ...`` makes ``lock.store`` the store to write
    through (temporaries named by this writer's token). Raises `DestinationBusyError`
    while another pack holds the destination."""

    def __init__(self, store: Store) -> None:
        self.token = uuid.uuid4().hex
        self.info = {"token": self.token, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        self.base = store
        self.store: Store = store
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost: str | None = None  # why the lease was lost, if it was
        self._created: str | None = None
        self._lock_path: str | None = None  # the flock'd file, on a local destination

    def __enter__(self) -> WriterLock:
        path = self.base.local_path(LOCK)
        if path is not None:
            self._lock_local(self.base, path)
        else:
            self._lease(self.base)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- local: flock ---------------------------------------------------------------------
    def _lock_local(self, store: Store, path: str) -> None:
        self._lock_path = path
        # the topmost folder this writer creates: removed again if it ends up empty
        missing = store.local_path("") or os.path.dirname(os.path.dirname(path))
        while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
            missing = os.path.dirname(missing)
        self._created = None if os.path.exists(missing) else missing
        fd = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            while True:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held = _read_json(fd)
                    raise DestinationBusyError(
                        f"another pack is writing {store.root} ({_describe(held)}; it holds {path}): "
                        "wait for it to finish, or stop it and run your command again"
                    ) from None
                try:
                    same = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)  # the previous holder removed the file as we opened it: again
                fd = None
            self._fd, fd = fd, None
            old = _read_json(self._fd)
            tokens = [t for t in old.get("tokens", []) if isinstance(t, str) and t.isalnum()]
            for folder in ("", WORK):  # the folders a pack writes temporaries in
                store.remove_temporaries(folder, tokens=tokens)
            # Journal our token before the first temporary named by it can exist. Earlier
            # tokens stay listed a while: a worker of a killed pack can outlive its lock by
            # the moment the kernel takes to deliver its death signal.
            data = json.dumps({**self.info, "tokens": [*tokens[-(_KEEP_TOKENS - 1):], self.token]}).encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
            os.fsync(self._fd)
        except OSError as e:
            self.release()
            raise StorageError(f"cannot take the writer lock {path}: {e.strerror or e} (a pack needs a "
                               "filesystem with flock for its destination)") from None
        except BaseException:
            self.release()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        self.store = store.for_writer(self.token)

    def inherited_fd(self) -> tuple[int, int, int] | None:
        """(fd, device, inode) of the lock, for forked workers to close their copy: the
        lock must die with this process, not live on in an orphaned worker."""
        if self._fd is None:
            return None
        st = os.fstat(self._fd)
        return self._fd, st.st_dev, st.st_ino

    # -- object stores: a lease with a heartbeat ---------------------------------------
    def _lease(self, store: Store) -> None:
        held = self._read_lease()
        if held is not None and held.get("token") != self.token:
            age = time.time() - _number(held.get("heartbeat"))
            if age < LEASE_STALE_S and not _dead_here(held):
                raise DestinationBusyError(
                    f"another pack is writing {store.root} ({_describe(held)}; its lease {store.url(LEASE)} "
                    f"was renewed {age:.0f} s ago): wait for it to finish; a writer that died on another host "
                    f"releases the destination {LEASE_STALE_S:.0f} s after its last heartbeat"
                )
        self._put_lease()
        # Two writers that both found no live lease both wrote one: the last write wins,
        # and the loser sees another token here (a writer that reads its own token
        # after this pause was last, or alone).
        time.sleep(0.5)
        self.check()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="datapipe-pack-lease")
        self._beat.start()

    def _read_lease(self) -> dict[str, Any] | None:
        """The lease as stored, None if there is none (or it is not a lease); a store that
        cannot be read raises `StorageError`."""
        if not self.base.exists(LEASE):
            return None
        try:
            value = json.loads(self.base.get(LEASE))
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _put_lease(self) -> None:
        self.base.put(LEASE, json.dumps({**self.info, "heartbeat": time.time()}).encode())

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_BEAT_S):
            try:
                held = self._read_lease()
                if held is None or held.get("token") != self.token:
                    self.lost = "another pack took over " + self.base.url(LEASE) + (f" ({_describe(held)})" if held else "")
                    return
                self._put_lease()
            except StorageError:
                continue  # a missed beat; the next one retries well before the lease goes stale

    def check(self) -> None:
        """Raise `DestinationBusyError` if another writer holds the destination now (an
        object-store lease taken over): called before committing."""
        if self._lock_path is not None:
            return  # a flock cannot be taken over
        held = self._read_lease()
        if self.lost is None and (held is None or held.get("token") != self.token):
            self.lost = "another pack took over " + self.base.url(LEASE) + (f" ({_describe(held)})" if held else "")
        if self.lost:
            raise DestinationBusyError(f"{self.lost}: two packs wrote {self.base.root} at once; "
                                       "run one pack again, alone")

    # -- release --------------------------------------------------------------------------
    def release(self) -> None:
        """Give the destination up. The lock file goes with the journal: it stays while
        ``_pack/`` holds an unfinished pack (its token names the temporaries to clean)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
            try:
                held = self._read_lease()
                if held is not None and held.get("token") == self.token:
                    self.base.delete(LEASE)
            except StorageError:
                pass  # it goes stale on its own
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            lock_path = self._lock_path
            work = os.path.dirname(lock_path)
            if set(os.listdir(work)) <= {os.path.basename(lock_path)}:
                os.unlink(lock_path)  # while held: a waiter re-checks the inode
                os.rmdir(work)
                d = self.base.root
                while self._created and d.startswith(self._created) and not os.listdir(d):
                    os.rmdir(d)  # folders this writer created and left empty (a failed pack)
                    d = os.path.dirname(d)
        except OSError:
            pass  # the lock file stays; the next pack takes it as usual
        finally:
            os.close(fd)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _dead_here(info: dict[str, Any]) -> bool:
    """Whether the lease's writer ran on this host and its process is gone: then a rerun
    need not wait for the lease to go stale."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read_json(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 1 << 16, 0)
        value = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}  # a torn write of a killed holder: nothing of it was used yet
    return value if isinstance(value, dict) else {}
