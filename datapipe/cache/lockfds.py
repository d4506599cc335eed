"""The file descriptors through which this process holds ``flock``s of the cache (the
warm tier's stripe locks, budget lock and reservations, the cold pacer's state lock and
request slots), so that a forked child closes its copies of them.

A ``flock`` belongs to the open file description, which a fork shares with the child: a
child started while a thread of the parent holds such a lock (a DataLoader worker forked
during a download) would keep the lock for as long as it lives, after the parent let it
go, and every reader waiting on it would hang. So each such descriptor is opened through
:func:`open_lock` (or :func:`register_opened`) and closed through :func:`close_lock`,
and in a forked child every one is closed (never ``LOCK_UN``: that would release the
parent's lock). The objects that held them belong to the parent: a child never uses them
(the cache's per-process state is created afresh in each process).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

__all__ = ["open_lock", "register_opened", "forget", "close_lock"]

# fd -> None: the descriptors to close in a forked child
_held: dict[int, None] = {}
# Held while a descriptor is opened and registered, or unregistered and closed, and by the
# forking thread across a fork (register_at_fork's before/after hooks): a fork can then
# never fall between the two, where the child would keep a copy nobody closes. It is held
# for a system call at a time, so a fork waits for one open or close at most. Reentrant: a
# finalizer that closes a lock (a counter file's last flush) may run in the forking thread
# while it holds the guard, in another library's fork hook.
_fork_guard = threading.RLock()


def open_lock(path: str, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags, mode)``, registered: closed in a forked child."""
    with _fork_guard:
        fd = os.open(path, flags, mode)
        _held[fd] = None
    return fd


def register_opened(opener: Callable[[], int | None]) -> int | None:
    """The fd ``opener()`` returns (None: nothing opened), registered as it is opened."""
    with _fork_guard:
        fd = opener()
        if fd is not None:
            _held[fd] = None
    return fd


def forget(fd: int) -> None:
    """The fd is handed on as something else (a reservation's fd that becomes a pin)."""
    _held.pop(fd, None)


def close_lock(fd: int) -> None:
    """Close a registered fd (dropping its lock). One this process no longer holds (a
    forked child closed its copy at the fork) is left alone: its number may be reused."""
    with _fork_guard:
        if fd in _held:
            del _held[fd]
            os.close(fd)


def _close_in_child() -> None:
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()
    _fork_guard.release()  # taken by the parent's forking thread before the fork


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_fork_guard.acquire, after_in_parent=_fork_guard.release,
                        after_in_child=_close_in_child)
