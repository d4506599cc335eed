"""Filling the warm tier: one download of an object per node at a time (the single-flight
lock of its warm key), room reserved before the download and the download's size held to
it, the copy published with its fill record, and every copy verified before it is used
(against the checksum asked for and the size and digest it was filled with)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..checksum import checksum as compute_checksum
from ..errors import CacheBudgetError, DatapipeError, ObjectChangedError, StorageError
from .cold import CHANGE_RESTARTS, SizeChanged
from .eviction import VictimChooser
from .process import ProcessState
from .warm import BROKEN_DIR_ERRNOS, DISK_FULL_ERRNOS, WarmDir, url_key

__all__ = ["fill", "read_verified", "fetch_below", "size_below"]

#: how often a pin waiting for room looks again when the room can only come from another
#: process (its releases cannot signal across processes)
_PIN_RECHECK_S = 0.05


def fill(state: ProcessState, warm: WarmDir, url: str, checksum: str | None, chooser: Callable[[], VictimChooser], *,
         pin: bool = False, read_through: bool = False, prefetch: bool = False, ticket: int | None = None,
         pin_wait_s: float = 60.0, tier: str = "warm", level: int = 0) -> Any:
    """Fetch ``url`` into a node-local directory tier (the warm tier, or with ``level`` > 0
    the ``level``-th of ``local_tiers``, counted as ``tier``) under the node-wide
    single-flight lock, room for it reserved first (victims named by ``chooser()``, asked
    afresh each round), its bytes from the tiers below (:func:`fetch_below`). Returns the
    bytes, or with ``pin`` an fd pinning the published copy (waiting up to ``pin_wait_s``
    for room; the chooser of a pin that must have its copy admits it at any cost). With
    ``pin`` and ``read_through``, a pin the chooser does not admit (Belady's non-admission,
    or room held by pins and downloads) waits for nothing: it returns the object's verified
    bytes read through the tiers below, counted as ``<tier>_not_admitted``, and leaves the
    residents in place; so does a tier that cannot be written. A prefetch returns None,
    and downloads nothing when the policy would not admit the object; ``ticket``: its turn
    among scheduled prefetches, handed on once its room is decided."""
    key = url_key(url)
    t_start = time.monotonic()
    deadline = t_start + pin_wait_s
    resized = 0
    while True:
        with warm.fill_lock(key) as waited:
            if not prefetch:  # the reader's waits, not the background's
                state.stats.update(wait_seconds=waited)
            fd = warm.open_pinned(key)
            if fd is not None:  # filled by another thread or process while we waited
                if pin:
                    return fd
                if prefetch:
                    os.close(fd)
                    return None
                data = read_verified(state, warm, url, fd, checksum, tier=tier)
                if data is not None:
                    os.close(fd)
                    state.stats.update({f"{tier}_hits": 1, f"{tier}_bytes": len(data)})
                    return data
                if not warm.discard(key, fd):  # pinned elsewhere: it stays, so read around it
                    state.stats.update({f"{tier}_read_around": 1})
                    return fetch_below(state, url, checksum, chooser, into=tier, background=prefetch, level=level + 1)
            size = size_below(state, url)
            if size > warm.budget and level:  # a lower tier too small for it: read through
                state.stats.update({f"{tier}_not_admitted": 1})
                return fetch_below(state, url, checksum, chooser, into=tier, background=prefetch, level=level + 1)
            if size > warm.budget:
                raise CacheBudgetError(
                    f"{url} is {size} bytes, more than warm_bytes={warm.budget}; raise "
                    f"warm_bytes to at least {size}")
            choose = chooser()
            before = warm.evictions
            try:
                res = warm.reserve(key, size, choose)
            except OSError as e:
                if e.errno not in DISK_FULL_ERRNOS:
                    raise
                state.warn("warm_full", f"warm cache {warm.root} cannot take {url} ({e}); reading through")
                res = None
            state.stats.update({f"{tier}_evictions": warm.evictions - before})
            if ticket is not None:
                state.turns.done(ticket)  # space decided: the next prefetch may reserve
            if res is None and prefetch:
                state.stats.update(prefetch_not_admitted=1)
                return None
            if res is None and pin and not read_through:
                if time.monotonic() > deadline:
                    raise _no_room_for_pin(state, warm, url, size, time.monotonic() - t_start, pin_wait_s)
                # until this process releases a pin or lands a download, or another
                # process may have (checked again every _PIN_RECHECK_S)
                state.wait_for_room(min(_PIN_RECHECK_S, max(0.0, deadline - time.monotonic())))
                continue
            if res is None:
                state.stats.update({f"{tier}_not_admitted": 1})
                return fetch_below(state, url, checksum, chooser, into=tier, background=prefetch, level=level + 1)
            data = None
            try:
                data = fetch_below(state, url, checksum, chooser, into=tier, fixed_size=size,
                                   background=prefetch, level=level + 1)
                pinned = res.write_and_publish(data, checksum or compute_checksum(data), pin=pin)
            except SizeChanged:
                res.abort()
                resized += 1
                if resized > CHANGE_RESTARTS:
                    raise ObjectChangedError(
                        f"{url} changed size {resized} times while being cached; stop "
                        "rewriting it while it is read, or retry later") from None
                continue  # reserve room for the size it has now
            except OSError as e:
                res.abort()
                if isinstance(e, DatapipeError) or data is None:
                    raise
                if e.errno in DISK_FULL_ERRNOS:
                    state.warn("warm_full", f"warm cache {warm.root} is full ({e}); reading through")
                    if pin and not read_through:
                        raise CacheBudgetError(f"cannot keep a local copy of {url}: {e}") from e
                    state.stats.update({f"{tier}_not_admitted": 1})  # read through, as a refusal is
                    return data
                if e.errno in BROKEN_DIR_ERRNOS and (not pin or read_through):
                    if level == 0:
                        state.warm_broken(e)
                    state.stats.update({f"{tier}_not_admitted": 1})
                    return data
                raise StorageError(f"warm cache {warm.root}: could not keep the copy of "
                                   f"{url} ({e})") from e
            except BaseException:
                res.abort()
                raise
            state.stats.update({f"{tier}_fills": 1})
            state.notify_room()
            if pinned is not None:  # pinned before it was published: nobody evicted it since
                return pinned
            if prefetch:
                return None
            return data


def size_below(state: ProcessState, url: str) -> int:
    """The object's size as the tiers below the node's know it: the shared tier's record
    of a published copy, else a request to cold."""
    shared = state.shared
    if shared is not None:
        try:
            return shared.size(state, url)
        except OSError as e:
            if not state.shared_broken(e):
                raise
    return state.cold.size(url)


def fetch_below(state: ProcessState, url: str, checksum: str | None, chooser: Callable[[], VictimChooser], *,
                into: str, fixed_size: int | None = None, background: bool = False, level: int = 1) -> bytes:
    """The whole object from the tiers below node-local tier ``level - 1``: the further
    node-local tiers (``local_tiers``: a hit, or a fill of that tier), then the shared
    tier (which fills itself from cold under its cluster-wide single flight), else cold.
    Counts ``<into>_from_<tier>`` (``into``: the tier being filled)."""
    if level <= len(state.lower):
        tier = f"local{level + 1}"
        try:
            data = _from_lower(state, state.lower[level - 1], tier, level, url, checksum, chooser)
        except OSError as e:
            if isinstance(e, DatapipeError) or e.errno not in BROKEN_DIR_ERRNOS:
                raise
            state.warn(f"{tier}_broken", f"node-local cache {state.lower[level - 1].root} failed ({e}); "
                       "reading through to the tiers below it")
            return fetch_below(state, url, checksum, chooser, into=into, fixed_size=fixed_size,
                               background=background, level=level + 1)
        if fixed_size is not None and len(data) != fixed_size:
            raise SizeChanged()
        state.stats.update({f"{into}_from_{tier}": 1})
        return data
    shared = state.shared
    if shared is not None:
        try:
            data, origin = shared.fetch(state, url, checksum, chooser, fixed_size=fixed_size, background=background)
            state.stats.update({f"{into}_from_{origin}": 1})
            return data
        except OSError as e:
            if not state.shared_broken(e):
                raise
    data = state.cold.fetch(url, checksum, fixed_size=fixed_size, background=background)
    state.stats.update({f"{into}_from_cold": 1})
    return data


def _from_lower(state: ProcessState, d: WarmDir, tier: str, level: int, url: str, checksum: str | None,
                chooser: Callable[[], VictimChooser]) -> bytes:
    """A further node-local tier: its verified copy, or a fill of it from below."""
    key = url_key(url)
    fd = d.open_pinned(key)
    if fd is not None:
        try:
            data = read_verified(state, d, url, fd, checksum, tier=tier)
        except BaseException:
            os.close(fd)
            raise
        if data is not None:
            os.close(fd)
            state.stats.update({f"{tier}_hits": 1, f"{tier}_bytes": len(data)})
            return data
        if not d.discard(key, fd):  # pinned elsewhere: it stays, so read around it
            state.stats.update({f"{tier}_read_around": 1})
            return fetch_below(state, url, checksum, chooser, into=tier, level=level + 1)
    state.stats.update({f"{tier}_misses": 1})
    out: bytes = fill(state, d, url, checksum, chooser, tier=tier, level=level)
    return out


def read_verified(state: ProcessState, warm: WarmDir, url: str, fd: int, checksum: str | None, *,
                  want_bytes: bool = True, tier: str = "warm") -> bytes | None:
    """The whole pinned copy (b"" when not ``want_bytes``), or None if it fails
    verification: against ``checksum``, and against the size and digest the copy was
    filled with (or, without that record, the cold object's size). This process skips
    hashing a copy it verified before only while its size, mtime and ctime are
    unchanged, so a copy damaged or truncated in place is verified again. A failure counts
    as ``<tier>_corrupt``."""
    st = os.fstat(fd)
    record = warm.record_of(url_key(url), fd)
    if record is not None:
        if record[0] != st.st_size:
            state.stats.update({f"{tier}_corrupt": 1})
            return None
    elif warm.records:  # this filesystem keeps records: the copy is not a fill's
        state.stats.update({f"{tier}_corrupt": 1})
        return None
    else:
        expected = state.cold.sizes.get(url)
        if expected is None and checksum is None:
            expected = state.cold.size(url)
        if expected is not None and expected != st.st_size:
            state.stats.update({f"{tier}_corrupt": 1})
            return None
    wants = {d for d in (checksum, record[1] if record else None) if d}
    known = all(warm.is_verified(st, d) for d in wants)
    if known and not want_bytes:
        return b""
    data = os.pread(fd, st.st_size, 0)
    if len(data) == st.st_size:
        if known:
            return data
        digest = compute_checksum(data) if wants else None
        if all(d == digest for d in wants):
            for d in wants:
                warm.mark_verified(st, d)
            return data
    state.stats.update({f"{tier}_corrupt": 1})
    return None


def _no_room_for_pin(state: ProcessState, warm: WarmDir, url: str, size: int, waited: float,
                     pin_wait_s: float) -> CacheBudgetError:
    try:
        pinned, mine = warm.pinned_bytes(), state.pin_count()
    except OSError:
        pinned, mine = 0, 0
    return CacheBudgetError(
        f"no room in warm cache {warm.root} ({warm.budget} bytes) for {url} ({size} bytes) "
        f"after waiting {waited:.1f} s (pin_wait_s={pin_wait_s}): {pinned} bytes are "
        f"pinned ({mine} pin(s) held by this process), the rest downloading. Every "
        f"process's pins must fit at once: raise warm_bytes to at least {pinned + size}, "
        "or release pins before taking new ones")
