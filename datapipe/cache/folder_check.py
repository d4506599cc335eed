"""The one check of a folder tier: a probe file written, fsync'd, dropped from the page cache
where the kernel allows, read back, compared and timed; free space (plus the tier's own
files) against its budget. ``datapipe doctor`` (``health.check_tiers``) runs it with a large
probe; a :class:`~datapipe.cache.TieredCache` runs it once per directory tier when a process
opens its tiers (not again in a DataLoader worker whose cache came from a process that
checked the folder and found it sound: ``Settings.checked_roots``), and a
``CheckpointWriter`` once per local tier when it starts, both with a small one
(:data:`START_PROBE_BYTES`) under a deadline.

The probe is ``.datapipe-doctor-<token>`` in the folder, created with ``O_EXCL`` (never an
existing file) and removed only while it is still the file this check created (delete only
what we wrote). A missing folder, a read-only one, a full disk, a read that differs from what
was written fail the check with the reason and what to do; free space plus the tier's own
files short of its budget is a warning; ``min_mb_s``: a write or read slower fails.

Imports nothing of the cache but deadline.py: the checkpoint writer and ``health`` use it
without the rest.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .deadline import Deadline

__all__ = ["FolderCheck", "check_folder", "check_folder_within", "used_bytes", "PROBE_PREFIX", "START_PROBE_BYTES",
           "START_CHECK_DEADLINE_S", "format_size"]

#: the name of every probe file and object a check writes: ``.datapipe-doctor-<token>``
PROBE_PREFIX = ".datapipe-doctor-"
#: the probe of the checks run when a cache opens its tiers or a checkpoint writer starts:
#: 16 KiB written, fsync'd and read back once per folder (one fsync: a few milliseconds on a
#: disk); a disk too full for a fill is the fill's to meet (read through, with a warning)
START_PROBE_BYTES = 16 << 10
#: the most such a check may take before its folder is reported hung (its thread is left to
#: finish and remove the probe when the filesystem answers)
START_CHECK_DEADLINE_S = 10.0

_MAX_WALK = 100_000  # files counted for a tier's own use; past this its use is "unknown"


@dataclass(frozen=True)
class FolderCheck:
    """What :func:`check_folder` found. ``status``: ``ok``, ``warn`` or ``failed``;
    ``problem``: why (empty when ok). Rates in MB/s (10^6 bytes), times in ms."""

    path: str
    status: str
    problem: str = ""
    write_mb_s: float | None = None
    read_mb_s: float | None = None
    fsync_ms: float | None = None
    free_bytes: int | None = None
    budget_bytes: int | None = None
    used_bytes: int | None = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def format_size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _write_problem(e: OSError, path: str) -> str:
    if e.errno == errno.EROFS:
        return f"read-only: the filesystem at {path} is mounted read-only ({e.strerror})"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"read-only: no permission to create a file in {path} ({e.strerror}); fix its owner or mode"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"full: no space left on {path} ({e.strerror}); free space or point the tier elsewhere"
    return f"cannot write in {path}: {e.strerror or e} (errno {e.errno})"


def check_folder(path: str, *, probe_bytes: int, budget_bytes: int | None = None, min_mb_s: float | None = None,
                 used: Callable[[], int | None] | None = None) -> FolderCheck:
    """Check the folder at ``path`` (see the module docstring). ``used``: the bytes the
    tier's own files take, asked only when the free space alone is short of the budget
    (default: the files under ``path``, counted whenever a budget is given). Never raises
    for a failing folder: it is reported failed."""
    path = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)

    def fail(problem: str, **kw: Any) -> FolderCheck:
        return FolderCheck(path, "failed", problem, budget_bytes=budget_bytes, **kw)

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return fail(f"missing: no folder at {path}; create it or fix the path")
    except OSError as e:
        return fail(f"cannot reach {path}: {e.strerror or e} (errno {e.errno})")
    if not stat.S_ISDIR(st.st_mode):
        return fail(f"not a folder: {path} is a file or device")
    try:
        vfs = os.statvfs(path)
    except OSError as e:
        return fail(f"cannot read the free space of {path}: {e.strerror or e}")
    free = vfs.f_bavail * vfs.f_frsize
    if free < probe_bytes:
        return fail(f"full: {format_size(free)} free on {path}, less than the {format_size(probe_bytes)} probe; "
                    "free space or point the tier elsewhere", free_bytes=free)
    data = os.urandom(probe_bytes)
    probe = os.path.join(path, f"{PROBE_PREFIX}{uuid.uuid4().hex[:16]}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return fail(_write_problem(e, path), free_bytes=free)
    ino, phase = None, "write"
    try:
        try:
            ino = os.fstat(fd).st_ino
            t0 = time.perf_counter()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            t1 = time.perf_counter()
            os.fsync(fd)
            t2 = time.perf_counter()
            if hasattr(os, "posix_fadvise"):  # so the read below comes from the device, not the page cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        phase = "read"
        t3 = time.perf_counter()
        with open(probe, "rb", buffering=0) as f:
            back = f.read()
        t4 = time.perf_counter()
    except OSError as e:
        if phase == "read":
            return fail(f"unreadable: the probe written to {path} cannot be read back: {e.strerror or e} "
                        f"(errno {e.errno}); the disk or filesystem is failing", free_bytes=free)
        return fail(_write_problem(e, path), free_bytes=free)
    finally:
        _remove_own(probe, ino)
    if back != data:
        return fail(f"corrupt: the probe read back from {path} differs from what was written ({len(back)} of "
                    f"{len(data)} bytes read); the disk or filesystem is failing", free_bytes=free)
    write_mb_s = probe_bytes / max(t2 - t0, 1e-9) / 1e6
    read_mb_s = probe_bytes / max(t4 - t3, 1e-9) / 1e6
    fsync_ms = (t2 - t1) * 1e3
    status, problems = "ok", []
    if min_mb_s is not None and min(write_mb_s, read_mb_s) < min_mb_s:
        status = "failed"
        problems.append(f"slow: writes {write_mb_s:.3g} MB/s and reads {read_mb_s:.3g} MB/s, below the "
                        f"{min_mb_s:g} MB/s asked")
    own = None
    if budget_bytes is not None:
        own = used_bytes(path) if used is None else (used() if free < budget_bytes else None)
        room = free + (own or 0)
        if room < budget_bytes:
            status = "warn" if status == "ok" else status
            theirs = (f" + its own {format_size(own)}" if own is not None
                      else " (its own files not counted: too many)")
            problems.append(f"short of its budget: {format_size(free)} free{theirs} < budget "
                            f"{format_size(budget_bytes)}; lower the budget to {format_size(room)} or free space")
    return FolderCheck(path, status, "; ".join(problems), write_mb_s=write_mb_s, read_mb_s=read_mb_s,
                       fsync_ms=fsync_ms, free_bytes=free, budget_bytes=budget_bytes, used_bytes=own)


def check_folder_within(path: str, timeout_s: float = START_CHECK_DEADLINE_S, *, probe_bytes: int = START_PROBE_BYTES,
                        budget_bytes: int | None = None, used: Callable[[], int | None] | None = None) -> FolderCheck:
    """:func:`check_folder` under a deadline: a folder that gives no answer within
    ``timeout_s`` (a hung mount) is reported failed, naming the wait."""
    deadline = Deadline(timeout_s, name="datapipe-folder-check")
    try:
        return deadline.call(partial(check_folder, path, probe_bytes=probe_bytes, budget_bytes=budget_bytes,
                                     used=used), what=f"checking {path}")
    except OSError as e:  # the deadline's: the check itself never raises
        return FolderCheck(os.path.abspath(path), "failed", f"hung: {e}; check the mount (a dead NFS server, a stuck "
                           "disk)", budget_bytes=budget_bytes)
    finally:
        deadline.close()


def _remove_own(probe: str, ino: int | None) -> None:
    """Remove the probe if it is still the file this check created."""
    try:
        if ino is not None and os.lstat(probe).st_ino == ino:
            os.unlink(probe)
    except OSError:
        pass


def used_bytes(path: str) -> int | None:
    """The bytes of the files under ``path`` (links not followed), or None past
    :data:`_MAX_WALK` entries."""
    total, seen, stack = 0, 0, [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > _MAX_WALK:
                return None
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
    return total
