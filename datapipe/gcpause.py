"""No cyclic garbage collection while a job builds many long-lived objects.

A checkpoint load of hundreds of tensors makes tens of thousands of small dicts and lists
(parsed part documents, leaf records, copy plans) that live until it returns; a pack
lists, plans and journals a tuple per input file that lives until it commits. Python's
collector promotes what survives two young collections to the oldest generation, and once
enough has been promoted it runs a full collection, whose cost grows with the whole heap
(a trainer with torch loaded: 0.2-0.3 s here), in the middle of whichever job happened
to tip it. Paused, the young collections do not run, nothing of ours is
promoted, and what we free by reference counts leaves the collector's counts as they
were: the full collection is not moved to later, it does not happen on our account. (A
load without ``into=`` leaves a few objects of cyclic garbage, a recursive closure, for
the next collection.) A leaf: the checkpoint loader and the packer use it.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collections_paused"]

_lock = threading.Lock()
_depth = 0  # loads inside the pause, in any thread
_reenable = False  # whether the collector was enabled when the first of them began


def _after_fork_in_child() -> None:
    """A child forked while another thread was inside a pause (a DataLoader worker started
    during a load) runs none of those loads: its collector is as it was before them, and
    the lock, which that thread may have held at the fork, is a new one."""
    global _lock, _depth
    _lock = threading.Lock()
    if _depth:
        _depth = 0
        if _reenable:
            gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def collections_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block; it is enabled again when the last such
    block (in any thread) ends, and only if it was enabled when the first began."""
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _reenable:
                gc.enable()
