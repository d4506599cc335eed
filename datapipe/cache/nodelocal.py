"""A node-local directory as a tier (``warm_dir``, and each of ``local_tiers``): the tier
interface (tier.py) over a :class:`~.warm.WarmDir`, whose fill is the node's single flight.

One download of an object per node at a time (the single-flight flock of its warm key),
room reserved before the download and the download's size held to it, the copy published
with its fill record, and every copy verified before it is used (against the checksum
asked for and the size and digest it was filled with). The warm tier's fill has two more
modes for the cache's callers: :meth:`LocalTier.pin` (a pinned copy for ``local_path`` and
``pin_or_read``) and :meth:`LocalTier.prefetch` (a background fill whose bytes nobody waits
for)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import cast

from ..checksum import checksum as compute_checksum
from ..errors import CacheBudgetError, DatapipeError, ObjectChangedError, StorageError
from .cold import CHANGE_RESTARTS, ColdReader, SizeChanged
from .deadline import timed_out
from .hot import Room
from .tier import Count, DirTier, Route, Warn
from .warm import BROKEN_DIR_ERRNOS, DISK_FULL_ERRNOS, WarmDir, url_key

__all__ = ["LocalTier"]

#: how often a pin waiting for room looks again when the room can only come from another
#: process (its releases cannot signal across processes)
_PIN_RECHECK_S = 0.05


class LocalTier(DirTier):
    """A node-local directory tier. ``budget_arg``: the argument that sets its budget,
    named when an object is larger than the budget (``warm_bytes``); None: such an object
    is read through (a directory of ``local_tiers``). ``room``: where a pin waits for room
    (up to ``pin_wait_s``); ``pins_held()``: how many pins this process holds, for the
    error that says why there is none."""

    def __init__(self, name: str, rank: int, d: WarmDir, *, cold: ColdReader, count: Count, warn: Warn,
                 room: Room, pins_held: Callable[[], int], pin_wait_s: float, budget_arg: str | None = None,
                 repair: Callable[[OSError], bool] | None = None) -> None:
        super().__init__(name, rank, d, cold=cold, count=count, warn=warn, repair=repair)
        self.room = room
        self.pins_held = pins_held
        self.pin_wait_s = pin_wait_s
        self.budget_arg = budget_arg

    def fill(self, url: str, checksum: str | None, route: Route, *,
             fixed_size: int | None = None) -> tuple[bytes, str]:
        return cast(bytes, self._fill(url, checksum, route)), self.name

    def pin(self, url: str, checksum: str | None, route: Route, *, read_through: bool) -> int | bytes:
        """An fd pinning the published copy (not verified here when another filled it:
        the caller verifies what it pins). Without ``read_through`` the copy is always
        admitted, waiting up to ``pin_wait_s`` for room (the route's chooser of a pin that
        must have its copy admits it at any cost). With ``read_through``, a pin the chooser
        does not admit (Belady's non-admission, or room held by pins and downloads) waits
        for nothing: it returns the object's verified bytes read through the tiers below,
        counted as ``<tier>_not_admitted``, and leaves the residents in place; so does a
        tier that cannot be written."""
        return cast("int | bytes", self._fill(url, checksum, route, pin=True, read_through=read_through))

    def prefetch(self, url: str, checksum: str | None, route: Route, *,
                 room_decided: Callable[[], None] | None = None) -> None:
        """Fill without waiting for the bytes; downloads nothing when the policy would not
        admit the object or a copy is there. ``room_decided``: called once its room is
        decided (the next scheduled prefetch may reserve)."""
        self._fill(url, checksum, route, prefetch=True, room_decided=room_decided)

    def _fill(self, url: str, checksum: str | None, route: Route, *, pin: bool = False, read_through: bool = False,
              prefetch: bool = False, room_decided: Callable[[], None] | None = None) -> bytes | int | None:
        """Fetch ``url`` into the directory under the node-wide single-flight lock, room
        for it reserved first (victims named by ``route.chooser()``, asked afresh each
        round), its bytes from ``route`` (the tiers below). Returns the bytes, or as
        :meth:`pin` and :meth:`prefetch` say."""
        warm = self.dir
        key = url_key(url)
        t_start = time.monotonic()
        deadline = t_start + self.pin_wait_s
        resized = 0
        while True:
            with warm.fill_lock(key) as waited:
                if not route.background:  # the reader's waits, not the background's
                    self.count(wait_seconds=waited)
                if pin or prefetch:
                    fd = warm.open_pinned(key)
                    if fd is not None:  # filled by another thread or process while we waited
                        if pin:
                            return fd
                        os.close(fd)
                        return None
                else:
                    found = self.lookup(url, checksum)
                    if found.data is not None:  # filled by another thread or process while we waited
                        self.count_hit(len(found.data))
                        return found.data
                    if found.kept:  # pinned elsewhere: it stays, so read around it
                        self.count_read_around()
                        return route.fetch(url, checksum)
                size = route.size(url)
                if size > warm.budget and self.budget_arg is None:  # a lower tier too small for it: read through
                    self.count_event("not_admitted")
                    return route.fetch(url, checksum)
                if size > warm.budget:
                    raise CacheBudgetError(
                        f"{url} is {size} bytes, more than {self.budget_arg}={warm.budget}; raise "
                        f"{self.budget_arg} to at least {size}")
                choose = route.chooser()
                before = warm.evictions
                try:
                    res = warm.reserve(key, size, choose)
                except OSError as e:
                    if e.errno not in DISK_FULL_ERRNOS:
                        raise
                    self.warn("warm_full", f"warm cache {warm.root} cannot take {url} ({e}); reading through")
                    res = None
                self.count_event("evictions", warm.evictions - before)
                if room_decided is not None:
                    room_decided()  # space decided: the next prefetch may reserve
                if res is None and prefetch:
                    self.count(prefetch_not_admitted=1)
                    return None
                if res is None and pin and not read_through:
                    if time.monotonic() > deadline:
                        raise self._no_room_for_pin(url, size, time.monotonic() - t_start)
                    # until this process releases a pin or lands a download, or another
                    # process may have (checked again every _PIN_RECHECK_S)
                    self.room.wait(min(_PIN_RECHECK_S, max(0.0, deadline - time.monotonic())))
                    continue
                if res is None:
                    self.count_event("not_admitted")
                    return route.fetch(url, checksum)
                data = None
                try:
                    data = route.fetch(url, checksum, fixed_size=size)
                    pinned = self.publish(res, data, checksum or compute_checksum(data), url, pin=pin)
                except SizeChanged:
                    res.abort()
                    resized += 1
                    if resized > CHANGE_RESTARTS:
                        raise ObjectChangedError(
                            f"{url} changed size {resized} times while being cached; stop "
                            "rewriting it while it is read, or retry later") from None
                    continue  # reserve room for the size it has now
                except OSError as e:
                    if timed_out(e) and data is not None:  # abandoned: it ends (or aborts) on its own
                        if pin and not read_through:
                            raise StorageError(f"cannot keep a local copy of {url}: {e}") from e
                        self.count_event("not_admitted")
                        return data
                    res.abort()
                    if isinstance(e, DatapipeError) or data is None:
                        raise
                    if e.errno in DISK_FULL_ERRNOS:
                        self.warn("warm_full", f"warm cache {warm.root} is full ({e}); reading through")
                        if pin and not read_through:
                            raise CacheBudgetError(f"cannot keep a local copy of {url}: {e}") from e
                        self.count_event("not_admitted")  # read through, as a refusal is
                        return data
                    if e.errno in BROKEN_DIR_ERRNOS and (not pin or read_through):
                        if self.repair is not None:
                            self.repair(e)
                        self.count_event("not_admitted")
                        return data
                    raise StorageError(f"warm cache {warm.root}: could not keep the copy of "
                                       f"{url} ({e})") from e
                except BaseException:
                    res.abort()
                    raise
                self.count_event("fills")
                self.room.notify()
                if pinned is not None:  # pinned before it was published: nobody evicted it since
                    return pinned
                if prefetch:
                    return None
                return data

    def _no_room_for_pin(self, url: str, size: int, waited: float) -> CacheBudgetError:
        warm = self.dir
        try:
            pinned, mine = warm.pinned_bytes(), self.pins_held()
        except OSError:
            pinned, mine = 0, 0
        return CacheBudgetError(
            f"no room in warm cache {warm.root} ({warm.budget} bytes) for {url} ({size} bytes) "
            f"after waiting {waited:.1f} s (pin_wait_s={self.pin_wait_s}): {pinned} bytes are "
            f"pinned ({mine} pin(s) held by this process), the rest downloading. Every "
            f"process's pins must fit at once: raise warm_bytes to at least {pinned + size}, "
            "or release pins before taking new ones")

