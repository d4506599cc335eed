"""The warm tier: one local directory shared by every process of a node.

Layout under the root::

    objects/<key>      published copies, each complete (written elsewhere, then renamed)
    tmp/<key>.<pid>.<rand>   downloads in progress, sized to the object up front
    locks/<stripe>     single-flight locks, one of 1024 stripes per key; never deleted
    budget.lock        held while usage is counted, space is reserved and dead
                       temporary files are deleted
    meta.json          the budget last configured, for ``datapipe cache stats``; also the
                       marker that this is a datapipe cache (``clear`` refuses a folder
                       without it)
    stats/<host>-<pid>-<token>.json   each live process's cache counters, and
    stats/exited.summary               those of exited processes, merged (see node_stats.py);
                       outside the budget, a few hundred bytes per live process

Everything cross-process is an ``fcntl.flock``, which the kernel drops when its holder dies,
so a process killed with SIGKILL leaves no stuck lock, only a temporary file, which the
next process recognises (nobody holds its lock) and deletes. A reservation creates its
temporary file and then locks it, both under the budget lock, and dead files are looked for
only under that lock too, so a new download is never taken for a dead one. There is no
shared memory.

* Single flight: a filler holds the key's stripe lock while it downloads; a second process
  that wants the same key waits on that lock, then finds the published copy.
* Budget: usage = sizes of published copies + sizes of temporary files. A reservation
  creates its temporary file already truncated to the object's size, so bytes still
  downloading are counted, and usage never exceeds the budget.
* Pins: a reader holds a shared flock on the copy it reads. Eviction takes an exclusive
  flock without waiting and skips what it cannot lock, so a file being read (or pinned by
  ``local_path``) is never removed; so does ``discard`` (a reader that refuses a copy
  another process holds pinned leaves it, and reads around it).
* Trust: each copy carries the size and digest it was filled with (an extended attribute,
  ``user.datapipe.fill``, where the filesystem has them). A process that verified a copy
  remembers it by (device, inode, size, mtime_ns, ctime_ns), so a copy changed in place
  (any write moves mtime and ctime) is verified again. Only regular files in objects/
  are copies; a symbolic link there is refused, never followed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import xxhash

from ..checksum import checksum as compute_checksum
from ..errors import ObjectNotFoundError, StorageError
from .eviction import VictimChooser
from .lockfds import close_lock, forget, open_lock, register_opened
from .node_stats import clear_counter_files, sum_counter_files

__all__ = ["WarmDir", "Reservation", "warm_dir_stats", "clear_warm_dir", "claim_dir", "check_cache_dir", "dir_meta",
           "open_regular", "url_key", "valid_record", "DISK_FULL_ERRNOS", "BROKEN_DIR_ERRNOS"]

N_STRIPES = 1024
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
# a warm directory deleted, remounted read-only or made unwritable under an open cache
BROKEN_DIR_ERRNOS = DISK_FULL_ERRNOS | {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                                        errno.ESTALE, errno.EIO}
FILL_XATTR = "user.datapipe.fill"
#: bytes :meth:`WarmDir.probe` writes and reads back in each folder of a directory tier
PROBE_BYTES = 4096
MARKER = {"format": "datapipe-warm-cache", "version": 1}
SHARED_FORMAT = "datapipe-shared-cache"  # shared.SHARED_MARKER's (shared imports this module)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def stat_signature(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes when a file is rewritten, truncated or written into in place."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


_DIGEST = re.compile(r"xxh3_64:[0-9a-f]{16}")


def valid_record(size: object, digest: object) -> tuple[int, str] | None:
    """``(size, digest)`` when both are what a filler writes (a size >= 0, a checksum in
    datapipe's text form), else None: a record that checks nothing is no record."""
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0 \
            and isinstance(digest, str) and _DIGEST.fullmatch(digest):
        return size, digest
    return None


def fill_record(fd: int) -> tuple[int, str] | None:
    """``(size, digest)`` a copy was filled with, or None when it has no (readable) record."""
    try:
        raw = os.getxattr(fd, FILL_XATTR).decode("ascii")
        size, digest = raw.split(" ", 1)
        return valid_record(int(size), digest)
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def url_key(url: str) -> str:
    """A file name for ``url``: a 128-bit hash (unique) plus the readable tail of the URL."""
    tail = _SAFE.sub("_", url.rstrip("/").rsplit("/", 1)[-1])[-48:]
    return f"{xxhash.xxh3_128_hexdigest(url.encode())}-{tail}"


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def open_regular(path: str) -> int | None:
    """An fd of the regular file at ``path``, or None: gone, or something we never write
    there (a symbolic link, which is not followed, a FIFO, a directory), left alone."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _xattrs_work(folder: str) -> bool:
    """Whether files in ``folder`` keep user extended attributes (probed on an unnamed file,
    so nothing is left behind)."""
    try:
        fd = os.open(folder, os.O_RDWR | os.O_TMPFILE, 0o600)
    except (OSError, AttributeError):
        return False
    try:
        os.setxattr(fd, FILL_XATTR, b"0 probe")
        return os.getxattr(fd, FILL_XATTR) == b"0 probe"
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def _remove_unless_locked(path: str) -> bool | None:
    """Delete ``path`` unless a process holds a lock on it (a reader's pin, a live
    download): True when deleted, False when held, None when it was gone or had been
    replaced by a newer file (which is left alone: it was not the one found unlocked)."""
    fd = register_opened(lambda: open_regular(path))  # locked for a moment: never a forked child's
    if fd is None:
        return None
    try:
        if not _try_lock(fd, fcntl.LOCK_EX):
            return False
        st, cur = os.fstat(fd), os.stat(path)
        if (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
            return None
        os.unlink(path)
        return True
    except FileNotFoundError:
        return None
    finally:
        close_lock(fd)


@dataclass
class Reservation:
    """Space for one object: a temporary file already of the object's size, locked by us."""

    warm: WarmDir
    key: str
    size: int
    tmp: str
    fd: int

    def write_and_publish(self, data: bytes | memoryview, digest: str | None = None, *,
                          pin: bool = False) -> int | None:
        """Write and publish the copy; ``digest`` (its checksum) is recorded with it, so a
        later reader without a checksum can still tell a damaged copy. With ``pin``, the
        copy is pinned before it is published and the pinning fd is returned (the caller
        closes it): no other process can evict it between its publication and the read
        it was filled for."""
        view = memoryview(data)
        if len(view) != self.size:
            raise StorageError(f"{self.warm.path(self.key)}: {len(view)} bytes for a "
                               f"reservation of {self.size}")
        off = 0
        while off < len(view):
            off += os.pwrite(self.fd, view[off:], off)
        if digest is not None:
            self.warm.write_record(self.fd, self.key, len(view), digest)
        if self.warm.sync_before_publish:
            os.fsync(self.fd)  # other hosts may open it the moment it is renamed
        # Published by rename: readers see the whole copy or none; its size is unchanged,
        # so the accounting does not move. Closing drops our lock on the published file.
        now = time.time_ns()
        os.utime(self.fd, ns=(now, now))
        if pin:
            self.warm._pin(self.fd)  # our exclusive lock on the temporary becomes a pin
        os.rename(self.tmp, self.warm.path(self.key))
        if digest is not None:
            self.warm.mark_verified(os.fstat(self.fd), digest)  # we wrote these very bytes
        fd, self.fd = self.fd, -1
        if pin:
            forget(fd)  # a pin now, held as pins are
            return fd
        close_lock(fd)
        return None

    def abort(self) -> None:
        if self.fd >= 0:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            close_lock(self.fd)
            self.fd = -1


class WarmDir:
    """One process's handle on a shared warm directory (see the module docstring).

    The directory's protocol (layout, reservations, publishing by rename, fill records,
    verification) is shared with the cluster-wide tier, ``shared.SharedDir``, which
    overrides only the hooks that rest on ``flock`` here: the budget lock, opening a copy,
    eviction, temporary files and how their writer's death is told, and fill records."""

    marker: dict[str, Any] = MARKER
    #: flush a copy's bytes to the server before its rename publishes it (other hosts)
    sync_before_publish = False

    def __init__(self, root: str, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self.root = claim_dir(root, self.marker, self.budget)
        self.objects = os.path.join(self.root, "objects")
        self.tmpdir = os.path.join(self.root, "tmp")
        self.locks = os.path.join(self.root, "locks")
        for d in (self.objects, self.tmpdir, self.locks):
            os.makedirs(d, exist_ok=True)
        self.evictions = 0
        # Where copies can carry their fill record, one without it was not written by a
        # filler (planted, or replaced behind our back) and is refused.
        self.records = self._records_work()
        # (dev, ino) -> (signature when verified, digests it matched); per process
        self._verified: dict[tuple[int, int], tuple[tuple[int, int, int, int, int], set[str]]] = {}
        self.cleaned = self.clean_dead_tmp()

    def path(self, key: str) -> str:
        return os.path.join(self.objects, key)

    # -- fill records ----------------------------------------------------------------------
    def _records_work(self) -> bool:
        """Whether every copy here carries a fill record (so one without is refused)."""
        return _xattrs_work(self.objects)

    def write_record(self, fd: int, key: str, size: int, digest: str) -> None:
        """Attach the size and digest a copy is filled with, before it is published."""
        try:
            os.setxattr(fd, FILL_XATTR, f"{size} {digest}".encode("ascii"))
        except (OSError, AttributeError):
            pass  # no xattrs here: readers fall back to the object's size

    def record_of(self, key: str, fd: int) -> tuple[int, str] | None:
        """``(size, digest)`` the copy open at ``fd`` was filled with, or None."""
        return fill_record(fd)

    def repair(self) -> None:
        """Re-create the layout after the directory was deleted under us, by the rule a
        new cache opens a folder by (:func:`claim_dir`): a folder someone else made at the
        path meanwhile is refused with a StorageError, untouched (the caller gives the
        tier up). Raises OSError when it cannot be re-created (read-only, gone with its
        parent unwritable)."""
        claim_dir(self.root, self.marker, self.budget)
        for d in (self.objects, self.tmpdir, self.locks, os.path.join(self.root, "stats")):
            os.makedirs(d, exist_ok=True)

    def probe(self) -> None:
        """Whether the directory takes writes again, after it failed: in each folder a fill
        writes in (``tmp/``, ``objects/``, ``locks/``) an unnamed file (``O_TMPFILE``: nothing
        is left behind, nothing another process lists) is written, fsync'd and read back.
        Raises OSError (read-only, deleted, full, immutable) where it does not; with
        ``PROBE_BYTES`` bytes a probe costs a few hundred microseconds."""
        payload = uuid.uuid4().bytes * (PROBE_BYTES // 16)
        for folder in (self.tmpdir, self.objects, self.locks):
            try:
                fd = os.open(folder, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                fd = self._named_probe(folder)
            try:
                os.write(fd, payload)
                os.fsync(fd)
                if os.pread(fd, len(payload), 0) != payload:
                    raise OSError(errno.EIO, f"a probe written to {folder} reads back different bytes")
            finally:
                os.close(fd)

    @staticmethod
    def _named_probe(folder: str) -> int:
        """A filesystem without ``O_TMPFILE``: a probe file of our own name, created with
        ``O_EXCL`` and unlinked at once (its descriptor still writes and reads)."""
        path = os.path.join(folder, f".probe-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _O_NOFOLLOW, 0o600)
        try:
            os.unlink(path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- trust ---------------------------------------------------------------------------
    def read_verified(self, key: str, fd: int, checksum: str | None, expected_size: Callable[[], int | None], *,
                      want_bytes: bool = True) -> bytes | None:
        """The whole copy of ``key`` open at ``fd`` (b"" when not ``want_bytes``), or None if
        it fails verification: against ``checksum``, and against the size and digest the
        copy was filled with (or, without that record, ``expected_size()``: the object's
        size where known, None if not). This process skips hashing a copy it verified
        before only while its size, mtime and ctime are unchanged, so a copy damaged or
        truncated in place is verified again."""
        st = os.fstat(fd)
        record = self.record_of(key, fd)
        if record is not None:
            if record[0] != st.st_size:
                return None
        elif self.records:  # this filesystem keeps records: the copy is not a fill's
            return None
        else:
            expected = expected_size()
            if expected is not None and expected != st.st_size:
                return None
        wants = {d for d in (checksum, record[1] if record else None) if d}
        known = all(self.is_verified(st, d) for d in wants)
        if known and not want_bytes:
            return b""
        data = os.pread(fd, st.st_size, 0)
        if len(data) != st.st_size:
            return None
        if known:
            return data
        digest = compute_checksum(data) if wants else None
        if any(d != digest for d in wants):
            return None
        for d in wants:
            self.mark_verified(st, d)
        return data

    def is_verified(self, st: os.stat_result, digest: str) -> bool:
        seen = self._verified.get((st.st_dev, st.st_ino))
        return seen is not None and seen[0] == stat_signature(st) and digest in seen[1]

    def mark_verified(self, st: os.stat_result, digest: str) -> None:
        key = (st.st_dev, st.st_ino)
        sig = stat_signature(st)
        seen = self._verified.get(key)
        if seen is None or seen[0] != sig:
            seen = (sig, set())
            self._verified[key] = seen
        seen[1].add(digest)

    # -- reading -------------------------------------------------------------------------
    def open_pinned(self, key: str) -> int | None:
        """An fd of the published copy holding a shared flock (a pin), or None if absent.
        Also marks the copy as just used (its mtime is the node-wide LRU clock)."""
        path = self.path(key)
        fd = open_regular(path)  # a link planted in objects/ is a miss, never followed
        if fd is None:
            return None
        try:
            self._pin(fd)
            # Between open and flock an evictor may have unlinked it (and a filler may have
            # published a new copy): only the inode still at the path counts.
            st = os.fstat(fd)
            try:
                cur = os.stat(path)
            except FileNotFoundError:
                cur = None
            if cur is None or (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
                os.close(fd)
                return None
            try:
                # An explicit nanosecond stamp: the kernel's own "now" is only as fine as
                # a timer tick, and ties would make the node-wide LRU order arbitrary.
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
                self._carry_trust(st, os.fstat(fd), now)
            except OSError:
                pass  # a read-only mount still serves hits; recency just stops moving
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _pin(self, fd: int) -> None:
        """Hold the copy against eviction while the fd is open (a shared flock)."""
        fcntl.flock(fd, fcntl.LOCK_SH)

    def _carry_trust(self, before: os.stat_result, after: os.stat_result, stamp: int) -> None:
        """Our own recency stamp moves mtime and ctime; what was verified before it stays
        verified, unless a write slipped in (then mtime is not our stamp)."""
        seen = self._verified.get((before.st_dev, before.st_ino))
        if seen is not None and seen[0] == stat_signature(before):
            if after.st_mtime_ns == stamp and after.st_size == before.st_size:
                self._verified[(after.st_dev, after.st_ino)] = (stat_signature(after), seen[1])

    def discard(self, key: str, fd: int) -> bool:
        """Remove the copy the caller examined through ``fd`` (its pin, found corrupt or of
        another version), and release that pin. True when the copy is gone from the path
        (removed now, or already replaced by someone else); False when it stays: another
        process holds it pinned or is reading it (a pinned copy is never removed or
        changed until released), or the directory cannot be written. On False the caller
        reads around the copy instead of filling a new one over it."""
        path = self.path(key)
        try:
            st = os.fstat(fd)
            if self._held_by_others(fd):
                return False
            cur = os.stat(path)
            if (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
                return True  # already replaced by someone else: not the copy examined
            os.unlink(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in BROKEN_DIR_ERRNOS:
                raise
            return False  # a read-only mount: the copy stays, and is refused each time
        finally:
            os.close(fd)

    def _held_by_others(self, fd: int) -> bool:
        """Whether a process other than the caller holds a lock on the copy open at ``fd``
        (a pin, a reader): the caller's own shared pin is turned into an exclusive lock,
        which fails while anyone else holds one (the lock is the caller's to drop anyway)."""
        return not _try_lock(fd, fcntl.LOCK_EX)

    # -- filling -------------------------------------------------------------------------
    @contextmanager
    def fill_lock(self, key: str) -> Iterator[float]:
        """Single flight for ``key`` across processes; yields the seconds spent waiting."""
        stripe = int(key[:8], 16) % N_STRIPES
        fd = open_lock(os.path.join(self.locks, f"{stripe:04d}"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            t0 = time.monotonic()
            if not _try_lock(fd, fcntl.LOCK_EX):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield time.monotonic() - t0
        finally:
            close_lock(fd)

    def _budget_lock(self) -> AbstractContextManager[None]:
        return _budget_lock(self.root)

    def _new_tmp(self, key: str, owner: str | None) -> tuple[str, int]:
        """A new temporary file for ``key`` and its fd, marked live (locked) before the
        budget lock is released; ``owner`` is unused here (the lock says who lives)."""
        tmp = os.path.join(self.tmpdir, f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        fd = open_lock(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            close_lock(fd)
            os.unlink(tmp)
            raise
        return tmp, fd

    def _clean_dead_tmp_locked(self) -> int:
        """Delete temporary files whose writer is gone; only under the budget lock."""
        return _clean_dead_tmp(self.tmpdir)

    def entries(self) -> list[tuple[str, int, float]]:
        """Published copies as ``(key, size, mtime_ns)``."""
        out: list[tuple[str, int, float]] = []
        with os.scandir(self.objects) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):  # a planted link is neither counted nor evicted
                    out.append((e.name, st.st_size, st.st_mtime_ns))
        return out

    def pinned_bytes(self) -> int:
        """Bytes of published copies some process holds pinned (or is reading) now."""
        total = 0
        for name, _size, _m in self.entries():
            found = _size_and_held(self.path(name))
            if found is not None and found[1]:
                total += found[0]
        return total

    def _tmp_bytes(self) -> int:
        total = 0
        with os.scandir(self.tmpdir) as it:
            for e in it:
                try:
                    total += e.stat().st_size
                except FileNotFoundError:
                    pass
        return total

    def usage(self) -> int:
        """Bytes held, counted under the budget lock: outside it an eviction and a new
        reservation falling between the two directory scans would be counted both."""
        with self._budget_lock():
            return sum(s for _k, s, _m in self.entries()) + self._tmp_bytes()

    def _try_evict(self, key: str) -> bool:
        removed = self._remove_copy(key)
        if removed is False:
            return False  # someone is reading it or holds it pinned
        self.evictions += bool(removed)
        return True

    def _remove_copy(self, key: str) -> bool | None:
        """Delete the copy unless it is pinned or read: True, False (held), None (gone)."""
        return _remove_unless_locked(self.path(key))

    def _held_except(self, key: str) -> tuple[list[tuple[str, int, float]], int]:
        """Published copies other than ``key``'s, and the bytes held with downloads in
        flight. Under the budget lock; tmp/ is scanned first (see reserve)."""
        in_flight = self._tmp_bytes()
        entries = [e for e in self.entries() if e[0] != key]
        return entries, sum(s for _k, s, _m in entries) + in_flight

    def reserve(
        self,
        key: str,
        size: int,
        choose: VictimChooser,
        owner: str | None = None,
    ) -> Reservation | None:
        """Make room for ``size`` bytes (evicting what ``choose(candidates, need)`` names,
        never a pinned copy) and create the sized temporary file. None when there is no
        room that may be made now: the caller reads through instead."""
        with self._budget_lock():
            # Downloads publish (rename tmp/ -> objects/) outside this lock: scanning tmp/
            # first counts a copy published between the two scans twice, never zero times,
            # so the budget can only be over-estimated, never exceeded.
            entries, held = self._held_except(key)
            need = held + size - self.budget
            if need > 0 and self._clean_dead_tmp_locked():
                entries, held = self._held_except(key)
                need = held + size - self.budget
            busy: set[str] = set()
            while need > 0:
                cands = [e for e in entries if e[0] not in busy]
                victims = choose(cands, need)
                if victims is None:
                    return None
                for v in victims:
                    if self._try_evict(v):
                        need -= next(s for k, s, _m in entries if k == v)
                        entries = [e for e in entries if e[0] != v]
                    else:
                        busy.add(v)
                    if need <= 0:
                        break
            tmp, fd = self._new_tmp(key, owner)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                close_lock(fd)
                os.unlink(tmp)
                raise
            return Reservation(self, key, size, tmp, fd)

    def clean_dead_tmp(self) -> int:
        """Delete temporary files whose writer is gone (nobody holds their lock)."""
        with self._budget_lock():
            return self._clean_dead_tmp_locked()


@contextmanager
def _budget_lock(root: str) -> Iterator[None]:
    fd = open_lock(os.path.join(root, "budget.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        close_lock(fd)


def _clean_dead_tmp(tmpdir: str) -> int:
    """Only under the budget lock: a reservation's file is unlocked for a moment after
    its creation, and that moment is inside the lock."""
    try:
        names = os.listdir(tmpdir)
    except FileNotFoundError:
        return 0
    return sum(_remove_unless_locked(os.path.join(tmpdir, n)) is True for n in names)


def _size_and_held(path: str) -> tuple[int, bool] | None:
    """(size, whether a process holds a lock on it: a pin or a live download), or None
    when it is gone. Probing takes the lock for a moment; closing the fd drops it."""
    fd = register_opened(lambda: open_regular(path))  # locked for a moment: never a forked child's
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_size, not _try_lock(fd, fcntl.LOCK_EX)
    finally:
        close_lock(fd)


def _write_meta(root: str, budget: int, marker: dict[str, Any] = MARKER) -> None:
    tmp = os.path.join(root, f".meta.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump({**marker, "budget_bytes": budget}, f)
    os.replace(tmp, os.path.join(root, "meta.json"))


def dir_meta(root: str) -> dict[str, Any] | None:
    """The meta.json of a cache directory (warm or shared), or None when it has none."""
    try:
        with open(os.path.join(root, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


#: what a cache directory holds at its top (meta.json's temporaries start with ".meta."),
#: and the folders of it a cache deletes files in (evictions, dead temporaries, locks,
#: counter files, lease takeovers, records and the GET ledger of ``clear_shared_dir``): an
#: unmarked folder is claimed only while each of these is empty. "tar-index": the indexes
#: of tar shards read through the cache (tarindex.resolve), which a cache never deletes
_LAYOUT = {"objects", "tmp", "locks", "stats", "leases", "records", "gets", "tar-index", "meta.json"}
_CLEANED = ("objects", "tmp", "locks", "stats", "leases", "records", "gets")


def claim_dir(root: str, marker: dict[str, Any], budget: int) -> str:
    """``root`` as a cache directory this process may clean and evict in, created and
    marked by its meta.json first (so a process opening it meanwhile finds it marked):
    absent, empty, marked as one of its kind, or holding nothing but the layout's folders
    (every one it deletes in empty: ``_CLEANED``) and meta.json's temporaries (one whose creator is about to
    mark it, or where datapipe put tar indexes before a cache opened it). Anything
    else is a folder of someone else's files, and a cache would delete them (its dead
    temporaries, its evictions): refused with a :class:`StorageError` naming it."""
    root = os.path.abspath(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        names = []  # any other OSError: an unusable folder, as the caller says (it reads through)
    meta = dir_meta(root) if "meta.json" in names else None
    ours = [n for n in names if n in _LAYOUT and n != "meta.json" and os.path.isdir(os.path.join(root, n))]
    marked = meta is not None and all(meta.get(k) == marker.get(k) for k in ("format", "version"))
    foreign: list[str] = []
    if not marked:  # what a cache would delete or overwrite here that it did not write
        foreign = [n for n in names if n not in ours and not n.startswith(".meta.")]
        foreign += [f"{n}/{f}" for n in ours if n in _CLEANED for f in sorted(os.listdir(os.path.join(root, n)))]
    if marked or not foreign:
        try:
            os.makedirs(root, exist_ok=True)
            _write_meta(root, budget, marker)
        except OSError:
            pass  # only a mark; a full disk must not stop reads (the layout's folders say why)
        return root
    kind = "shared" if marker.get("format") == SHARED_FORMAT else "warm"
    raise StorageError(
        f"{root} holds files a datapipe {kind} cache did not write ({', '.join(sorted(foreign)[:5])}"
        f"{', ...' if len(foreign) > 5 else ''}) and no meta.json marking it as one: a cache cleans and "
        "evicts in its folder, so it refuses this one. Give it an empty folder (or a new path) of its own"
    )


def check_cache_dir(root: str, marker: dict[str, Any] = MARKER, what: str = "warm",
                    given: str = "warm_dir") -> str:
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise ObjectNotFoundError(f"no {what} cache directory at {root}")
    if not os.path.isdir(os.path.join(root, "objects")):
        raise StorageError(
            f"{root} is not a datapipe {what} cache directory (it has no objects/ folder)"
        )
    meta = dir_meta(root)
    if meta is None or not all(meta.get(k) == v for k, v in marker.items()):
        raise StorageError(
            f"{root} is not a datapipe {what} cache directory (no meta.json marking it as "
            f"one); refusing to touch it. Point at the {given} a TieredCache was given"
        )
    return root


def warm_dir_stats(root: str) -> dict[str, Any]:
    """What a warm directory holds: objects, bytes, pinned copies, downloads in progress
    (and dead ones awaiting cleanup), the budget last configured, and ``counters``: the
    cache counters of every process that used it since it was last cleared, summed
    (``processes``: how many; see ``TieredCache.stats(node=True)``)."""
    root = check_cache_dir(root)
    objects = os.path.join(root, "objects")
    n = total = pinned = 0
    for name in os.listdir(objects):
        found = _size_and_held(os.path.join(objects, name))
        if found is not None:
            n, total, pinned = n + 1, total + found[0], pinned + found[1]
    live = dead = tmp_bytes = 0
    tmpdir = os.path.join(root, "tmp")
    for name in os.listdir(tmpdir) if os.path.isdir(tmpdir) else []:
        found = _size_and_held(os.path.join(tmpdir, name))
        if found is not None:
            tmp_bytes, live, dead = tmp_bytes + found[0], live + found[1], dead + (not found[1])
    node = sum_counter_files(root)
    budget = None
    try:
        with open(os.path.join(root, "meta.json")) as f:
            budget = json.load(f).get("budget_bytes")
    except (OSError, ValueError):
        pass
    return {
        "dir": root,
        "objects": n,
        "bytes": total,
        "pinned": pinned,
        "downloading": live,
        "dead_tmp_files": dead,
        "tmp_bytes": tmp_bytes,
        "budget_bytes": budget,
        "processes": node["processes"],
        "counters": node["counters"],
    }


def clear_warm_dir(root: str) -> int:
    """Delete every copy that nobody has pinned or is reading, and dead temporary files;
    returns how many of those were removed. Also resets the node-wide counters (their
    files are deleted, not counted in the result). Safe while other processes use the
    directory."""
    root = check_cache_dir(root)
    objects = os.path.join(root, "objects")
    removed = sum(_remove_unless_locked(os.path.join(objects, n)) is True for n in os.listdir(objects))
    clear_counter_files(root)
    with _budget_lock(root):
        return removed + _clean_dead_tmp(os.path.join(root, "tmp"))
