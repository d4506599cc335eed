"""The shared tier: one directory that every node of a cluster mounts (NFS, Lustre, GPFS),
between the node-local tier and the cold store, with cluster-wide single flight.

Layout under the root (the warm tier's, see warm.py, plus what replaces its flocks)::

    objects/<key>            published copies, each complete (renamed into place)
    records/<key>            {"size", "digest"} of the copy, written before the copy is renamed
    tmp/<key>.<writer>       downloads in progress, sized up front, named by their lease's writer
    leases/<key>             fill leases (storage.lease.SharedFileLease): O_EXCL + heartbeat
    budget.lease             the budget's lease, held while usage is counted and room is made
    gets/<key>.<rand>        one empty file per whole-object GET from cold through this tier
    meta.json                marker and budget

Why not the warm tier's flocks: ``flock`` over NFS is emulated or absent, and a lock held by
a host that vanished may never be released. Every cross-host exclusion here is a lease file
whose holder's death is judged from its silence (see SharedFileLease); every copy is
published by rename after an fsync and carries a record (size and digest) that each reader
checks before it uses a byte, so neither a dead writer's temporary file nor a torn copy is
ever served. A copy is not pinned: eviction may delete one being read, which the reader's
open descriptor survives (POSIX; NFS's silly rename); a read that fails is a miss.

Single flight: a node that misses takes the key's fill lease and downloads; the others wait
(polling for the published copy, at most ``wait_s``), take the lease over when its holder
falls silent for ``lease_timeout_s``, or read around it from cold once ``wait_s`` is spent.
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ..checksum import checksum as compute_checksum
from ..errors import DatapipeError, ObjectChangedError, StorageError
from ..storage import MAX_LEASE_BYTES, SharedFileLease
from .cold import CHANGE_RESTARTS, ColdReader, SizeChanged
from .deadline import timed_out
from .lockfds import open_lock
from .tier import Count, DirTier, Route, Warn
from .warm import (
    DISK_FULL_ERRNOS,
    SHARED_FORMAT,
    WarmDir,
    check_cache_dir,
    claim_dir,
    dir_meta,
    open_regular,
    url_key,
    valid_record,
)

__all__ = ["SharedDir", "SharedTier", "shared_dir_stats", "clear_shared_dir", "is_shared_dir", "SHARED_MARKER",
           "DEFAULT_LEASE_TIMEOUT_S", "DEFAULT_SHARED_WAIT_S"]

SHARED_MARKER = {"format": SHARED_FORMAT, "version": 1}
DEFAULT_LEASE_TIMEOUT_S = 30.0
DEFAULT_SHARED_WAIT_S = 300.0
_MAX_RECORD_BYTES = 4096
# a temporary file is dead once its lease's heartbeat is this many timeouts old by our
# clock (hosts' clocks may disagree by less than that)
_TMP_DEAD_TIMEOUTS = 4
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.5  # a waiter polls at most every 0.5 s: a few metadata ops
_USAGE_TTL_S = 5.0  # how long a count of the shared directory's bytes is reused


class SharedDir(WarmDir):
    """The warm directory's protocol with leases instead of flocks (see the module doc)."""

    marker = SHARED_MARKER
    sync_before_publish = True

    def __init__(self, root: str, budget_bytes: int, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> None:
        self.lease_timeout_s = float(lease_timeout_s)
        self.marker = {**SHARED_MARKER, "lease_timeout_s": self.lease_timeout_s}  # meta.json says it too
        root = claim_dir(root, self.marker, int(budget_bytes))  # before the folders below are made in it
        self.leases = os.path.join(root, "leases")
        self.records_dir = os.path.join(root, "records")
        self.gets = os.path.join(root, "gets")
        for d in (self.leases, self.records_dir, self.gets):
            os.makedirs(d, exist_ok=True)
        super().__init__(root, budget_bytes)

    def repair(self) -> None:
        """Re-create the layout after the directory was deleted under us, the lease, record
        and GET folders too (without them no fill could take its lease again); claimed
        first, as the warm tier's (a folder of someone else's is refused untouched)."""
        super().repair()
        for d in (self.leases, self.records_dir, self.gets):
            os.makedirs(d, exist_ok=True)

    def lease(self, key: str, **fields: Any) -> SharedFileLease:
        return SharedFileLease(os.path.join(self.leases, key), timeout_s=self.lease_timeout_s, fields=fields)

    # -- fill records: a file beside the copy (NFS may keep no xattrs) ----------------------
    def _records_work(self) -> bool:
        return True  # every copy here is published after its record

    def write_record(self, fd: int, key: str, size: int, digest: str) -> None:
        tmp = os.path.join(self.records_dir, f".{key}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            json.dump({"size": size, "digest": digest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.records_dir, key))

    def record_of(self, key: str, fd: int | None = None) -> tuple[int, str] | None:
        rfd = open_regular(os.path.join(self.records_dir, key))
        if rfd is None:
            return None
        try:
            doc = json.loads(os.pread(rfd, _MAX_RECORD_BYTES, 0))
        except (OSError, ValueError):
            return None
        finally:
            os.close(rfd)
        if not isinstance(doc, dict):
            return None
        return valid_record(doc.get("size"), doc.get("digest"))

    def usage(self) -> int:
        """Bytes held, counted without the budget lease (that lease is for reservations,
        not for every ``stats()`` of every node): a copy published between the two scans
        may count twice. Counted again at most every few seconds: a count lists the whole
        shared directory, and ``stats()`` may be called at every step."""
        now = time.monotonic()
        seen = getattr(self, "_usage_seen", None)
        if seen is not None and now - seen[0] < _USAGE_TTL_S:
            return int(seen[1])
        used = sum(s for _k, s, _m in self.entries()) + self._tmp_bytes()
        self._usage_seen = (now, used)
        return used

    def clean_dead_tmp(self, wait: bool = False) -> int:
        """Delete temporary files whose writer's lease is gone, under the budget lease.
        Without ``wait`` (each process as it opens the tier) only when no other node holds
        that lease: thousands of processes starting at once must not queue for it one by
        one; a fill that finds the tier full cleans them anyway."""
        if wait:
            with self._budget_lock():
                return self._clean_dead_tmp_locked()
        lease = SharedFileLease(os.path.join(self.root, "budget.lease"), timeout_s=self.lease_timeout_s)
        if not lease.try_acquire():
            return 0
        try:
            return self._clean_dead_tmp_locked()
        finally:
            lease.release()

    # -- no pins, no flocks ---------------------------------------------------------------
    def _pin(self, fd: int) -> None:
        pass  # nothing holds a copy against eviction across hosts (see the module doc)

    def _held_by_others(self, fd: int) -> bool:
        return False  # no pins across hosts: a reader keeps its open file (see the module doc)

    def _remove_copy(self, key: str) -> bool | None:
        try:
            os.unlink(self.path(key))
            return True
        except FileNotFoundError:
            return None

    @contextmanager
    def _budget_lock(self) -> Iterator[None]:
        lease = SharedFileLease(os.path.join(self.root, "budget.lease"), timeout_s=self.lease_timeout_s)
        pause = _POLL_MIN_S
        while not lease.try_acquire():
            time.sleep(pause)
            pause = min(_POLL_MAX_S, pause * 2)
        try:
            yield
        finally:
            lease.release()

    def _new_tmp(self, key: str, owner: str | None) -> tuple[str, int]:
        """``tmp/<key>.<owner>``: alive while the lease of ``key`` is ``owner``'s and beats."""
        owner = owner or uuid.uuid4().hex
        tmp = os.path.join(self.tmpdir, f"{key}.{owner}")
        return tmp, open_lock(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # closed as a reservation's

    def _clean_dead_tmp_locked(self) -> int:
        try:
            names = os.listdir(self.tmpdir)
        except FileNotFoundError:
            return 0
        return self._unlink_tmp(name for name in names if not self._tmp_alive(name))

    def _tmp_alive(self, name: str) -> bool:
        """Whether ``tmp/<key>.<owner>``'s writer still holds the key's lease."""
        key, _dot, owner = name.rpartition(".")
        return bool(key) and self._writer_alive(key, owner)

    def drop_tmp_of_others(self, key: str, owner: str) -> int:
        """Delete ``key``'s temporary files of writers other than ``owner``, who holds the
        key's lease: they are dead (their lease was taken over). Under the budget lock,
        as every deletion in tmp/."""
        prefix = f"{key}."
        if not any(n.startswith(prefix) for n in os.listdir(self.tmpdir)):
            return 0
        with self._budget_lock():
            return self._unlink_tmp(name for name in os.listdir(self.tmpdir)
                                    if name.startswith(prefix) and name != f"{key}.{owner}")

    def _unlink_tmp(self, names: Iterable[str]) -> int:
        """Delete these files of tmp/ (under the budget lock); how many were there."""
        removed = 0
        for name in names:
            try:
                os.unlink(os.path.join(self.tmpdir, name))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def _writer_alive(self, key: str, owner: str) -> bool:
        """Whether ``key``'s lease is held by ``owner`` and has beaten lately."""
        fd = open_regular(os.path.join(self.leases, key))
        if fd is None:
            return False
        try:
            st = os.fstat(fd)
            data = os.pread(fd, MAX_LEASE_BYTES + 1, 0)
        finally:
            os.close(fd)
        try:
            doc = json.loads(data)
        except ValueError:
            return False
        if not isinstance(doc, dict) or doc.get("writer") != owner:
            return False
        return time.time_ns() - st.st_mtime_ns < _TMP_DEAD_TIMEOUTS * self.lease_timeout_s * 1e9

    def note_cold_get(self, key: str) -> None:
        """One whole-object GET of ``key`` from cold through this tier (``cache stats``)."""
        try:
            os.close(os.open(os.path.join(self.gets, f"{key}.{uuid.uuid4().hex[:12]}"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except OSError:
            pass  # only a statistic


class SharedTier(DirTier):
    """One process's use of a shared directory as a tier (tier.py; see the module
    docstring): a copy of another node's is a hit; a miss is filled from cold under the
    key's lease, by one node of the cluster while the others wait. Bytes it had to fetch
    count as cold's for the tier above (``warm_from_cold``): its own are ``shared_fills``."""

    dir: SharedDir

    def __init__(self, root: str, budget_bytes: int, *, rank: int, cold: ColdReader, count: Count, warn: Warn,
                 lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S, wait_s: float = DEFAULT_SHARED_WAIT_S,
                 repair: Callable[[OSError], bool] | None = None) -> None:
        super().__init__("shared", rank, SharedDir(root, budget_bytes, lease_timeout_s), cold=cold, count=count,
                         warn=warn, repair=repair)
        self.wait_s = float(wait_s)
        self.cleaned = self.dir.cleaned
        self.fetched_as = "cold"

    @property
    def root(self) -> str:
        return self.dir.root

    def known_size(self, url: str) -> int | None:
        """From the record of a published copy (no request to cold)."""
        key = url_key(url)
        if os.path.exists(self.dir.path(key)):
            rec = self.dir.record_of(key)
            if rec is not None:
                return rec[0]
        return None

    def vanished(self, e: OSError) -> bool:
        """Evicted under us by another host."""
        return not isinstance(e, DatapipeError) and e.errno in (errno.ESTALE, errno.ENOENT, errno.EIO)

    def fill(self, url: str, checksum: str | None, route: Route, *,
             fixed_size: int | None = None) -> tuple[bytes, str]:
        """Take the key's lease and download, or wait for the node that holds it (polling
        for its published copy, at most ``wait_s``; a lease whose holder falls silent is
        taken over), or read around it from cold."""
        key = url_key(url)
        lease = self.dir.lease(key, url=url)
        t0 = time.monotonic()
        pause = _POLL_MIN_S
        waited = False
        try:
            while True:
                try:
                    got = lease.try_acquire()
                except StorageError as e:  # a lease path that is no lease file of ours
                    self.warn("shared_lease", f"shared cache {self.root}: {e}; reading {url} around it")
                    return self._read_around(url, key, checksum, fixed_size, route.background), "cold"
                if lease.takeovers:
                    self.count_event("takeovers", lease.takeovers)
                    lease.takeovers = 0
                if got:
                    try:
                        found = self.lookup(url, checksum)  # published while we waited
                        if found.data is not None:
                            self.count_hit(len(found.data))
                            return found.data, "shared"
                        return self._fill(url, key, checksum, route, lease, fixed_size)
                    finally:
                        lease.release()
                if time.monotonic() - t0 >= self.wait_s:
                    self.count_read_around()
                    return self._read_around(url, key, checksum, fixed_size, route.background), "cold"
                if not waited:
                    self.count_event("waits")
                    waited = True
                time.sleep(pause)
                pause = min(_POLL_MAX_S, self.dir.lease_timeout_s / 8, pause * 2)
                found = self.lookup(url, checksum)
                if found.data is not None:
                    self.count_hit(len(found.data))
                    return found.data, "shared"
        finally:
            if waited and not route.background:
                self.count(wait_seconds=time.monotonic() - t0)

    def _read_around(self, url: str, key: str, checksum: str | None, fixed_size: int | None,
                     background: bool) -> bytes:
        data = self.cold.fetch(url, checksum, fixed_size=fixed_size, background=background)
        self.dir.note_cold_get(key)
        return data

    def _fill(self, url: str, key: str, checksum: str | None, route: Route, lease: SharedFileLease,
              fixed_size: int | None) -> tuple[bytes, str]:
        """Under the key's lease: room reserved, the object fetched from cold once, the copy
        published. Without room (or with a full disk) the bytes are still returned."""
        self.count_event("tmp_cleaned", self.dir.drop_tmp_of_others(key, lease.writer))
        resized = 0
        while True:
            size = self.cold.size(url)
            if fixed_size is not None and size != fixed_size:
                raise SizeChanged()
            res = None
            if size <= self.dir.budget:
                before = self.dir.evictions
                try:
                    res = self.dir.reserve(key, size, route.chooser(), owner=lease.writer)
                except OSError as e:
                    if e.errno not in DISK_FULL_ERRNOS:
                        raise
                    self.warn("shared_full", f"shared cache {self.root} cannot take {url} ({e}); reading through")
                self.count_event("evictions", self.dir.evictions - before)
            if res is None:
                self.count_event("not_admitted")
                return self._read_around(url, key, checksum, fixed_size, route.background), "cold"
            try:
                data = self.cold.fetch(url, checksum, fixed_size=size, background=route.background)
            except SizeChanged:
                res.abort()
                resized += 1
                if resized > CHANGE_RESTARTS:  # SizeChanged is internal: the caller's error is this
                    raise ObjectChangedError(
                        f"{url} changed size {resized} times while being cached in the shared "
                        f"tier {self.root}; stop rewriting it while it is read, or retry later") from None
                continue
            except BaseException:
                res.abort()
                raise
            self.dir.note_cold_get(key)
            try:
                self.publish(res, data, checksum or compute_checksum(data), url)
            except OSError as e:
                if timed_out(e):  # abandoned (it ends, or aborts, on its own): the bytes served
                    return data, "cold"
                res.abort()
                if isinstance(e, DatapipeError):
                    raise
                self.warn("shared_full", f"shared cache {self.root} could not keep {url} ({e}); reading through")
                return data, "cold"
            except BaseException:
                res.abort()
                raise
            self.count_event("fills")
            return data, "cold"


def is_shared_dir(root: str) -> bool:
    """Whether ``root`` is marked as a shared cache directory (else: a warm one, or none)."""
    meta = dir_meta(os.path.abspath(root))
    return meta is not None and meta.get("format") == SHARED_MARKER["format"]


def _check_shared_dir(root: str) -> str:
    return check_cache_dir(root, SHARED_MARKER, "shared", "shared_dir")


def shared_dir_stats(root: str) -> dict[str, Any]:
    """What a shared directory holds (objects, bytes, the budget last configured),
    downloads in progress and dead temporary files, leases (live or silent longer than
    ``lease_timeout_s`` by their mtime), and ``cold_gets``: whole-object GETs from cold made
    through this tier (total, distinct objects, per object mean and max). Reads no copy."""
    root = _check_shared_dir(root)
    meta = dir_meta(root) or {}
    budget = meta.get("budget_bytes")
    timeout = meta.get("lease_timeout_s", DEFAULT_LEASE_TIMEOUT_S)
    shared = SharedDir.__new__(SharedDir)  # a view: no cleanup, no meta write, no lease
    shared.root, shared.lease_timeout_s = root, float(timeout)
    shared.leases = os.path.join(root, "leases")
    n = total = 0
    with os.scandir(os.path.join(root, "objects")) as it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if e.is_file(follow_symlinks=False):
                n, total = n + 1, total + st.st_size
    live = dead = tmp_bytes = 0
    tmpdir = os.path.join(root, "tmp")
    for name in os.listdir(tmpdir) if os.path.isdir(tmpdir) else []:
        key, _dot, owner = name.rpartition(".")
        try:
            tmp_bytes += os.stat(os.path.join(tmpdir, name)).st_size
        except FileNotFoundError:
            continue
        if key and shared._writer_alive(key, owner):
            live += 1
        else:
            dead += 1
    leases = silent = 0
    now = time.time_ns()
    for name in os.listdir(shared.leases) if os.path.isdir(shared.leases) else []:
        try:
            st = os.stat(os.path.join(shared.leases, name), follow_symlinks=False)
        except FileNotFoundError:
            continue
        leases += 1
        silent += now - st.st_mtime_ns > shared.lease_timeout_s * 1e9
    per_object: dict[str, int] = {}
    gets_dir = os.path.join(root, "gets")
    for name in os.listdir(gets_dir) if os.path.isdir(gets_dir) else []:
        key = name.rpartition(".")[0]
        per_object[key] = per_object.get(key, 0) + 1
    gets = sum(per_object.values())
    return {
        "dir": root,
        "tier": "shared",
        "objects": n,
        "bytes": total,
        "budget_bytes": budget,
        "downloading": live,
        "dead_tmp_files": dead,
        "tmp_bytes": tmp_bytes,
        "leases": leases,
        "silent_leases": silent,
        "cold_gets": {"gets": gets, "objects": len(per_object),
                      "per_object_mean": round(gets / len(per_object), 4) if per_object else None,
                      "per_object_max": max(per_object.values(), default=None)},
    }


def clear_shared_dir(root: str) -> int:
    """Delete every published copy (and its record), the cold-GET ledger, and temporary
    files whose writer's lease is gone; returns how many copies and temporary files were
    removed. Copies are not pinned across hosts: a node reading one keeps its open file,
    and later reads miss."""
    root = _check_shared_dir(root)
    meta = dir_meta(root) or {}
    shared = SharedDir(root, int(meta.get("budget_bytes") or 1),
                       float(meta.get("lease_timeout_s", DEFAULT_LEASE_TIMEOUT_S)))
    removed = 0
    for name in os.listdir(shared.objects):
        removed += shared._remove_copy(name) is True
    for folder in (shared.records_dir, shared.gets):
        for name in os.listdir(folder):
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass
    return removed + shared.clean_dead_tmp(wait=True)
