"""One writer per destination: a lease object under a key of a store.

The lease names its holder (a random writer id, host, pid, and the caller's fields).
Exclusion comes from the storage, never from reading and then writing:

- a store with a local path: ``flock`` on the lease file. The kernel drops the lock when
  the holder's process dies, so a crashed writer's lease is free at once; two writers in
  one process conflict too (each opens the file itself). No heartbeat and no thread: a
  held flock is the proof of life (and a writer without threads may still fork).
- a store with conditional writes (S3): a heartbeat that a background thread refreshes
  every ``ttl/3`` seconds; created with ``If-None-Match: *``, refreshed with
  ``If-Match: <its ETag>``; a lease whose heartbeat is older than its ``ttl`` is stale and
  taken over with ``If-Match`` on the stale version, so of two contenders exactly one
  wins. A holder whose refresh fails that condition has lost it.
- any other store (memory://, stores without conditional writes): the same protocol over
  plain reads and writes, checked again after writing. This refuses a second writer that
  starts while the first is alive, but two writers starting in the same instant may both
  believe they hold it: that is a limit of the store.

A holder checks that it still holds the lease (:meth:`WriterLease.check`) before it
publishes anything that only one writer may publish.

:class:`SharedFileLease` is the lease for a directory that several hosts mount (NFS,
Lustre, GPFS), where ``flock`` is not to be trusted: a lease file created with
``O_EXCL``, a heartbeat thread moving its mtime, and a takeover by ``rename`` once the
heartbeat stops, judged by the waiter's own clock (see the class). It is a separate class,
not a fourth mode of WriterLease: its callers (the cache's shared tier) hold it for one
download, poll it without blocking and must see the holder of every key they wait on,
while WriterLease blocks one writer per destination for a whole run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from ..checksum import checksum
from ..errors import LeaseBusyError, LeaseLostError, ObjectNotFoundError, OptionError, StorageError
from .store import Store

# LeaseBusyError and LeaseLostError live in datapipe.errors (every error does); named here
# too, where the leases that raise them are
__all__ = ["WriterLease", "SharedFileLease", "LeaseBusyError", "LeaseLostError", "LeaseHolder", "current_holder",
           "describe_holder", "holder_here_fields", "MAX_LEASE_BYTES", "LEASE_FILE_DELETED"]

#: ``LeaseLostError.why`` of a lease whose file is gone (its folder removed): nobody took it over
LEASE_FILE_DELETED = "the lease file was deleted"

#: a lease document is small; anything larger is not one
MAX_LEASE_BYTES = 1 << 16


def _encode_json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True).encode()


def _decode_json(data: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def describe_holder(doc: dict[str, Any] | None, *, local: bool, now: float | None = None) -> str:
    """"writer 'ab12' (host 'h', pid 7), last heartbeat 3 s ago" for error messages; a local
    (flock) lease has no heartbeat: its holder is alive while the lock is held."""
    if doc is None:
        return "an unreadable lease"
    now = time.time() if now is None else now
    extra = "".join(f", {k} {doc[k]!r}" for k in ("run_id",) if k in doc)
    who = f"writer {doc.get('writer')!r} (host {doc.get('host')!r}, pid {doc.get('pid')!r}{extra})"
    if local:
        t = doc.get("acquired_unix")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"
        return f"{who}, holding it since {since}"
    hb = doc.get("heartbeat_unix")
    age = now - hb if isinstance(hb, (int, float)) else float("nan")
    return f"{who}, last heartbeat {age:.0f} s ago"


def _read_id(path: str, link: bool = False) -> str | None:
    try:
        if link:
            return os.readlink(path)
        with open(path) as f:
            return f.read().strip()[:100]
    except OSError:
        return None


#: this host's boot and this process's pid namespace: a hostname alone does not say that a
#: pid means the same process (containers with the host's network and hostname have pid
#: namespaces of their own)
_BOOT_ID = _read_id("/proc/sys/kernel/random/boot_id")
_PID_NS = _read_id("/proc/self/ns/pid", link=True)


def holder_here_fields() -> dict[str, Any]:
    """What a lease document records so that a waiter can tell the holder's pid is its own
    kind of pid (see :func:`holder_is_dead_here`)."""
    return {"host": socket.gethostname(), "boot_id": _BOOT_ID, "pid_ns": _PID_NS}


def holder_is_dead_here(doc: dict[str, Any] | None) -> bool:
    """Whether the holder ran on this host, in this boot and pid namespace, and its process
    is gone. A holder whose document lacks the boot or namespace (or that ran in another
    one) is judged by its heartbeat only."""
    if doc is None:
        return False
    pid = doc.get("pid")
    if doc.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    if _BOOT_ID is None or _PID_NS is None or doc.get("boot_id") != _BOOT_ID or doc.get("pid_ns") != _PID_NS:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """A process that has exited but was not reaped (where pid 1 reaps nothing, as in some
    containers, a killed holder stays a zombie): dead, though ``kill(pid, 0)`` succeeds."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read(4096)
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
    tail = stat_line.rpartition(b")")[2].split()
    return bool(tail) and tail[0] in (b"Z", b"X")


class WriterLease:
    """The lease of one writer on ``store``'s ``key``: :meth:`acquire` or raise
    :class:`LeaseBusyError`.

    ``ttl``: seconds after its last heartbeat that a lease counts as abandoned (object
    stores). ``wait``: how long :meth:`acquire` keeps trying while another writer holds
    it. ``fields``: extra holder fields written into the document. ``encode``/``decode``:
    the document's bytes (JSON by default; ``decode`` returns None for what is not a
    lease). ``inherit(previous)``: called once the lock file is ours (local stores), with
    the document the previous holder left, before ours replaces it; returns fields to
    add (a holder's journal outlives it there). ``take_over_dead_here``: a lease whose
    holder ran on this host and whose process is gone counts as abandoned at once."""

    def __init__(self, store: Store, key: str, *, ttl: float = 60.0, wait: float = 0.0,
                 fields: dict[str, Any] | None = None,
                 encode: Callable[[dict[str, Any]], bytes] = _encode_json,
                 decode: Callable[[bytes], dict[str, Any] | None] = _decode_json,
                 inherit: Callable[[dict[str, Any] | None], dict[str, Any]] | None = None,
                 take_over_dead_here: bool = False) -> None:
        if not isinstance(ttl, (int, float)) or not ttl > 0:
            raise OptionError(f"lease ttl must be a positive number of seconds, got {ttl!r}")
        if not isinstance(wait, (int, float)) or wait < 0:
            raise OptionError(f"lease wait must be a number of seconds >= 0, got {wait!r}")
        self.store, self.key, self.ttl, self.wait = store, key, float(ttl), float(wait)
        self.fields = dict(fields or {})
        self._encode, self._decode, self._inherit = encode, decode, inherit
        self.take_over_dead_here = take_over_dead_here
        self.writer = uuid.uuid4().hex
        self.url = store.url(key)
        self.path = store.local_path(key)  # a local file: flock
        self.exclusive = self.path is not None or store.supports_conditional_writes
        self._fd: int | None = None
        self._pid = os.getpid()
        self._ino: int | None = None
        self._tag: str | None = None
        self._acquired = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # heartbeat vs check/release
        self._thread: threading.Thread | None = None

    @property
    def local(self) -> bool:
        """The lease is a flock on a local file (freed when its holder's process exits)."""
        return self.path is not None

    @property
    def fd(self) -> int | None:
        """The locked file's descriptor while held locally (forked children close theirs)."""
        return self._fd

    # -- the document ---------------------------------------------------------------------
    def _body(self) -> bytes:
        now = time.time()
        return self._encode({**self.fields, "writer": self.writer, **holder_here_fields(),
                             "pid": os.getpid(), "acquired_unix": self._acquired or now,
                             "heartbeat_unix": now, "ttl_s": self.ttl})

    def _parse(self, data: bytes) -> dict[str, Any] | None:
        if len(data) > MAX_LEASE_BYTES:
            return None
        return self._decode(data)

    def _stale(self, doc: dict[str, Any] | None) -> bool:
        if doc is None:
            return True  # unreadable: no live writer of ours wrote it
        hb, ttl = doc.get("heartbeat_unix"), doc.get("ttl_s")
        if not isinstance(hb, (int, float)) or not isinstance(ttl, (int, float)):
            return True
        if self.take_over_dead_here and holder_is_dead_here(doc):
            return True
        return time.time() - hb > ttl

    def _busy(self, doc: dict[str, Any] | None) -> LeaseBusyError:
        how = ("the kernel frees it when that process exits" if self.local else
               f"it goes stale {doc.get('ttl_s') if doc else self.ttl} s after its last heartbeat")
        holder = describe_holder(doc, local=self.local)
        return LeaseBusyError(f"{self.url}: held by {holder}; if that writer is dead, {how}", doc, self.local, how)

    # -- acquire ----------------------------------------------------------------------------
    def acquire(self) -> WriterLease:
        """Take the lease (waiting up to ``wait`` seconds) and start the heartbeat.
        Raises LeaseBusyError while another writer holds it, StorageError when the store
        cannot hold a lease."""
        deadline = time.monotonic() + self.wait
        while True:
            try:
                path = self.path
                doc = self._try_local(path) if path is not None else self._try_remote()
            except OSError as e:
                raise StorageError(f"{self.url}: cannot take the writer lease ({type(e).__name__}: {e})") from e
            if doc is True:
                break
            if time.monotonic() >= deadline:
                raise self._busy(doc)
            time.sleep(min(1.0, max(0.05, self.ttl / 10), max(0.0, deadline - time.monotonic())))
        if self._fd is None:
            # a flock needs no heartbeat: the kernel frees it when the holder exits. No thread
            # either, so a local writer (pack) may still fork its workers
            self._thread = threading.Thread(target=self._heartbeat, name="datapipe-writer-lease", daemon=True)
            self._thread.start()
        return self

    def _try_local(self, path: str) -> Any:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            # never through a link: the holder writes its document into the file it opens
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise StorageError(f"{path} is a symbolic link, not a lease file; a writer lease is never "
                               "taken through one (it would overwrite the file it points to): remove "
                               "it if no writer of ours made it") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._parse(os.pread(fd, MAX_LEASE_BYTES + 1, 0))
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                # a filesystem without locks (some NFS mounts): the store's own protocol
                warnings.warn(f"{self.url}: the filesystem refuses flock ({e}); the writer lease "
                              "falls back to write-and-read-back, which two writers starting "
                              "at the same instant can both pass", stacklevel=4)
                self.path = None
                self.exclusive = self.store.supports_conditional_writes
                return self._try_remote()
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (unlinked) between our open and our lock: open again
                return self._try_local(path)
            if self._inherit is not None:
                self.fields.update(self._inherit(self._parse(os.pread(fd, MAX_LEASE_BYTES + 1, 0))))
            self._acquired = time.time()
            self._write_local(fd, durable=True)
            self._fd, self._ino, fd = fd, os.fstat(fd).st_ino, -1
            return True
        finally:
            if fd >= 0:
                os.close(fd)

    def _write_local(self, fd: int, *, durable: bool = False) -> None:
        body = self._body()
        os.pwrite(fd, body, 0)
        os.ftruncate(fd, len(body))
        if durable:
            os.fsync(fd)

    def _get_tagged(self) -> tuple[bytes, str]:
        if self.store.supports_conditional_writes:
            return self.store.get_tagged(self.key)
        data = self.store.get(self.key)
        return data, checksum(data)

    def _put_if(self, body: bytes, match: str | None) -> str | None:
        if self.store.supports_conditional_writes:
            return self.store.put_if(self.key, body, match)
        # No atomic condition on this store: check, write, and read back (see module doc).
        try:
            data, tag = self._get_tagged()
        except ObjectNotFoundError:
            if match is not None:
                return None
        else:
            if match is None or tag != match:
                return None
        self.store.put(self.key, body)
        data, tag = self._get_tagged()
        return tag if data == body else None

    def _try_remote(self, released: int = 0) -> Any:
        self._acquired = time.time()
        tag = self._put_if(self._body(), None)
        if tag is None:
            try:
                data, seen = self._get_tagged()
            except ObjectNotFoundError:
                # released between our create and our read: try again now (a few times,
                # then the caller's wait decides)
                return self._try_remote(released + 1) if released < 3 else None
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
                    tag = self._put_if(self._body(), self._tag)
                    if tag is None:
                        self._lost = "its heartbeat found the lease replaced"
                        return
                    self._tag = tag
                except (OSError, StorageError):
                    pass  # a transient failure; check() asks the store itself before a commit

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless this writer still holds the lease."""
        with self._lock:
            if self._lost is None:
                try:
                    if self.path is not None:
                        if os.stat(self.path).st_ino != self._ino:
                            self._lost = "the lease file was replaced"
                    else:
                        data, tag = self._get_tagged()
                        if tag != self._tag:
                            self._lost = f"it is now held by {describe_holder(self._parse(data), local=self.local)}"
                except (FileNotFoundError, ObjectNotFoundError):
                    self._lost = LEASE_FILE_DELETED
            if self._lost is not None:
                raise LeaseLostError(f"{self.url}: this writer lost its lease ({self._lost})", self._lost)

    def release(self, *, remove: bool = True) -> None:
        """Stop the heartbeat and give the lease up. ``remove=False`` keeps a local lease
        file (unlocked) for the next holder to :meth:`inherit` from. Never deletes a
        lease another writer took over; a forked child (a DataLoader worker) exiting
        leaves its parent's lease alone."""
        if os.getpid() != self._pid:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            try:
                if self._fd is not None:
                    try:
                        if remove and self.path is not None and os.stat(self.path).st_ino == self._ino:
                            os.unlink(self.path)  # while locked: a waiter re-checks the inode
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
                        self.store.delete(self.key)
                    self._tag = None
            except (OSError, StorageError):
                pass  # an unreleased remote lease goes stale after ttl; a local one with us


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class LeaseHolder(NamedTuple):
    """A writer lease's live holder, seen from outside: its document (None while being
    written, or unreadable) and whether the lease is a flock (see :func:`describe_holder`)."""

    doc: dict[str, Any] | None
    local: bool


def current_holder(store: Store, key: str) -> LeaseHolder | None:
    """Who holds the :class:`WriterLease` at ``key`` now, seen without taking it: None when
    nobody does (no lease, or one its holder left behind).

    A local lease is held while its file is ``flock``-ed, which the kernel lists in
    ``/proc/locks`` (testing with a lock of our own, even a shared one, would make a writer
    starting that instant fail to take it); where that list cannot be read, while the
    document's writer runs on this host. An object-store lease is held while its heartbeat
    is younger than its ttl and its writer is not known dead."""
    path = store.local_path(key)
    if path is None:
        try:
            size = store.size(key)
            doc = _decode_json(store.get_range(key, 0, size)) if 0 < size <= MAX_LEASE_BYTES else None
        except (OSError, StorageError):  # gone (released), or unreadable: no holder to name
            return None
        hb, ttl = (doc or {}).get("heartbeat_unix"), (doc or {}).get("ttl_s")
        live = isinstance(hb, (int, float)) and isinstance(ttl, (int, float)) and time.time() - hb <= ttl
        return LeaseHolder(doc, False) if live and not holder_is_dead_here(doc) else None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        doc = _decode_json(os.pread(fd, MAX_LEASE_BYTES, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    locked = _flocked(st, doc)
    if locked is None:  # no lock list to read: judge by the holder's process
        pid = (doc or {}).get("pid")
        locked = (doc is not None and doc.get("host") == socket.gethostname() and isinstance(pid, int)
                  and pid > 0 and not holder_is_dead_here(doc) and _pid_exists(pid))
    return LeaseHolder(doc, True) if locked else None


def _flocked(st: os.stat_result, doc: dict[str, Any] | None) -> bool | None:
    """Whether ``/proc/locks`` lists a flock on the file ``st`` describes (None: no list).
    A line names the file by device and inode; on an overlay filesystem the device it
    names may be the layer's, so an entry with the inode and the document's pid counts too."""
    try:
        with open("/proc/locks", "rb") as f:
            lines = f.read(1 << 22).decode("ascii", "replace").splitlines()
    except OSError:
        return None
    dev_ino = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pid = str((doc or {}).get("pid"))
    for line in lines:
        parts = line.split()
        if "FLOCK" not in parts or len(parts) < 6:
            continue
        i = parts.index("FLOCK")  # "N: FLOCK ADVISORY WRITE pid maj:min:ino start end" (or "-> ..." waiters)
        if len(parts) < i + 5 or parts[0] == "->" or parts[1] == "->":
            continue
        where, who = parts[i + 4], parts[i + 3]
        if where == dev_ino or (where.rpartition(":")[2] == str(st.st_ino) and who == pid):
            return True
    return False


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedFileLease:
    """A lease file on a filesystem that several hosts share, without ``flock``.

    - taken: ``open(path, O_CREAT | O_EXCL)`` (atomic on NFSv3+, Lustre, GPFS), then the
      holder's document (writer id, host, pid, the caller's ``fields``) written and synced;
    - alive: a daemon thread sets the file's mtime every ``timeout_s / 4`` seconds (an
      explicit nanosecond stamp, so every beat changes it);
    - dead: a waiter that sees the same file (inode, mtime, size, content) unchanged for
      ``timeout_s`` by its own monotonic clock, so clocks of different hosts never have
      to agree; or at once, when the holder ran on this host and its pid is gone;
    - taken over: the waiter renames the dead file to a name of its own (of two waiters
      renaming one file, one succeeds), checks that what it moved is the file it judged
      dead (else puts it back with ``link``, which never overwrites), deletes it and
      creates the lease anew with ``O_EXCL``, which again only one contender wins.

    Holding the lease makes the holder the one expected to do the work; it is not what
    keeps data whole (publishing by rename does that), so a rare double holder costs a
    duplicate download, never a torn file. A lease path that is a link, a directory or
    anything but a regular file raises StorageError naming it. Instances are per waiter:
    :meth:`try_acquire` remembers what it saw to time the holder's silence."""

    def __init__(self, path: str, *, timeout_s: float = 30.0, fields: dict[str, Any] | None = None) -> None:
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise OptionError(f"lease timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.path = path
        self.timeout_s = float(timeout_s)
        self.fields = dict(fields or {})
        self.writer = uuid.uuid4().hex
        self.takeovers = 0
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._pid = os.getpid()
        self._seen: tuple[tuple[Any, ...], float] | None = None  # (identity, monotonic first seen)
        self._holder: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def holder(self) -> dict[str, Any] | None:
        """The document of the holder last seen by :meth:`try_acquire` (None: unreadable)."""
        return self._holder

    def silent_for(self) -> float:
        """Seconds the current holder's file has been seen unchanged by this waiter."""
        return 0.0 if self._seen is None else time.monotonic() - self._seen[1]

    def try_acquire(self) -> bool:
        """One attempt, never blocking: True when this instance now holds the lease."""
        if self._fd is not None:
            return True
        for _ in range(3):  # the file may vanish between our create and our look at it
            if self._create():
                return True
            seen = self._look()
            if seen is None:
                continue  # released meanwhile: try to create it again
            identity, doc = seen
            self._holder = doc
            now = time.monotonic()
            if self._seen is None or self._seen[0] != identity:
                self._seen = (identity, now)  # a new holder or a heartbeat: it lives
                if not holder_is_dead_here(doc):
                    return False
            elif now - self._seen[1] < self.timeout_s and not holder_is_dead_here(doc):
                return False
            if not self._take_over(identity):
                return False
            self.takeovers += 1
        return False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        try:
            body = _encode_json({**self.fields, "writer": self.writer, **holder_here_fields(),
                                 "pid": os.getpid(), "acquired_unix": time.time(), "timeout_s": self.timeout_s})
            os.write(fd, body)
            os.fsync(fd)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(self.path)
            except OSError:
                pass
            raise
        self._fd, self._ino, self._seen = fd, (st.st_dev, st.st_ino), None
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="datapipe-shared-lease", daemon=True)
        self._thread.start()
        return True

    def _look(self) -> tuple[tuple[Any, ...], dict[str, Any] | None] | None:
        """(identity, document) of the lease file now there, or None if there is none.
        Opening it (close-to-open on NFS) revalidates its attributes."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | _O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StorageError(f"lease {self.path} is a symbolic link; a lease is never read through "
                                   "one: remove it (no process of ours makes links there)") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StorageError(f"lease {self.path} is not a regular file; remove it (no process of "
                                   "ours makes anything else there)")
            data = os.pread(fd, MAX_LEASE_BYTES + 1, 0)
        finally:
            os.close(fd)
        doc = _decode_json(data) if len(data) <= MAX_LEASE_BYTES else None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, checksum(data)), doc

    def _take_over(self, identity: tuple[Any, ...]) -> bool:
        """Move the dead file ``identity`` away; True when it was that file and is gone."""
        return _remove_exact(self.path, identity[:3], f"{self.path}.dead-{self.writer}")

    def _heartbeat(self) -> None:
        period = self.timeout_s / 4
        while not self._stop.wait(period):
            fd = self._fd
            if fd is None:
                return
            try:
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            except OSError:
                pass  # a transient failure of the shared filesystem; the next beat tries again

    def still_held(self) -> bool:
        """Whether the file at the path is still the one this holder created."""
        if self._ino is None:
            return False
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._ino

    def release(self) -> None:
        """Stop the heartbeat and delete the lease file if it is still ours (a forked
        child leaves its parent's lease alone)."""
        if self._fd is None or os.getpid() != self._pid:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        fd, self._fd = self._fd, None
        try:
            st = os.fstat(fd)
            _remove_exact(self.path, (st.st_dev, st.st_ino, st.st_mtime_ns), f"{self.path}.done-{self.writer}")
        except OSError:
            pass  # the filesystem is gone; a lease left behind goes stale after timeout_s
        finally:
            os.close(fd)
            self._ino = None


def _remove_exact(path: str, identity: tuple[int, int, int], private: str) -> bool:
    """Delete the file at ``path`` only if it is ``identity`` (dev, ino, mtime_ns): rename it
    to ``private`` (atomic: of two callers one moves it), compare, and put back with
    ``link`` (never over a newer file) what turned out to be another file."""
    try:
        os.rename(path, private)
    except FileNotFoundError:
        return False
    try:
        st = os.stat(private, follow_symlinks=False)
        if (st.st_dev, st.st_ino, st.st_mtime_ns) == identity:
            return True
        try:
            os.link(private, path)  # a live holder's file, moved by a race: put it back
        except FileExistsError:
            pass  # a newer lease is there already; that holder's lease stands
        return False
    finally:
        try:
            os.unlink(private)
        except FileNotFoundError:
            pass
