"""The one walk down a process's directory tiers: ``warm_dir``, then each of ``local_tiers``,
then ``shared_dir``, then the cold store.

At each tier the same step (:meth:`Tiers.step`): the tier's verified copy is a hit; a copy
that fails verification and stays (another process holds it pinned) is read around, from
the tiers below; a miss fills the tier from the tiers below (each tier's fill is its own:
nodelocal.py, shared.py). A tier whose directory fails is repaired or passed over, and the
walk goes on below it. What each step found is counted once, through the tier's counters
(tier.py), and what a tier took from the one below as ``<into>_from_<tier>``.

A tier that fails and whose probe fails too (read-only, deleted and not re-creatable, full,
an I/O error) is taken out of the path (:meth:`Tiers.take_out`): the walk passes it by, no
read waits on it, and every ``retry_s`` seconds the next walk probes it (``DirTier.probe``:
an unnamed file written, fsync'd and read back in each of its folders); the first probe
that passes takes it back (:meth:`Tiers.in_path`), with one message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StorageError
from ..telemetry import Telemetry
from .cold import ColdReader, SizeChanged
from .eviction import VictimChooser
from .nodelocal import LocalTier
from .shared import SharedTier
from .tier import Count, DirTier, Warn

__all__ = ["Tiers", "TOP", "WARM_RANK", "DEFAULT_TIER_RETRY_S"]

#: ``below=TOP``: the walk from the first tier; ranks of the tiers (``DirTier.rank``)
TOP, WARM_RANK = -1, 0
#: how long a tier out of the path stays out before it is probed again (``tier_retry_s``)
DEFAULT_TIER_RETRY_S = 30.0


class Tiers:
    """This process's directory tiers, in order, above its cold reader. A tier given up
    (its folder is someone else's now) is dropped from here and never used again; ranks
    stay, so a walk under way goes on below the place it had."""

    def __init__(self, cold: ColdReader, count: Count, *, warn: Warn | None = None,
                 retry_s: float = DEFAULT_TIER_RETRY_S, give_up: Callable[[DirTier], None] | None = None) -> None:
        self.cold = cold
        self.count = count
        self.warn = warn
        self.retry_s = retry_s
        #: what to do with a tier whose re-created folder would be someone else's (the
        #: process state's ``give_up``)
        self.give_up = give_up
        self.warm: LocalTier | None = None
        self.lower: list[LocalTier] = []  # local_tiers that opened, in order
        self.shared: SharedTier | None = None
        #: where each step's hit (bytes, seconds) or miss is recorded too (the process
        #: state's :meth:`~.state.ProcessState.set_telemetry`)
        self.telemetry: Telemetry | None = None

    def order(self) -> list[DirTier]:
        """The tiers in the path now, in order (a tier out of the path and not yet due for
        its probe is left out)."""
        tiers: list[DirTier] = []
        if self.warm is not None:
            tiers.append(self.warm)
        tiers.extend(self.lower)
        if self.shared is not None:
            tiers.append(self.shared)
        return [t for t in tiers if self.in_path(t)]

    def warm_in_path(self) -> LocalTier | None:
        """The warm tier when it is in the path, else None (none, given up, or out)."""
        warm = self.warm
        return warm if warm is not None and self.in_path(warm) else None

    def take_out(self, tier: DirTier, e: OSError) -> None:
        """Take ``tier`` out of the path after ``e`` (its probe failed too): counted as
        ``<tier>_outs``, probed again in ``retry_s`` seconds."""
        if tier.retry_at is None:
            tier.count_event("outs")
        tier.out_error = f"{type(e).__name__}: {e}"
        tier.retry_at = time.monotonic() + self.retry_s

    def in_path(self, tier: DirTier) -> bool:
        """Whether ``tier`` is in the path: True unless it is out; an out tier due for its
        probe is probed here, and taken back (one message, ``<tier>_backs``) when the probe
        passes, else left out for another ``retry_s``."""
        at = tier.retry_at
        if at is None:
            return True
        if time.monotonic() < at:
            return False
        try:
            tier.probe()
        except OSError as e:
            tier.retry_at = time.monotonic() + self.retry_s
            tier.count_event("probes_failed")
            tier.out_error = f"{type(e).__name__}: {e}"
            return False
        except StorageError:  # its path is someone else's folder now: never touched again
            tier.retry_at = float("inf")
            if self.give_up is not None:
                self.give_up(tier)
            return False
        tier.retry_at = None
        tier.count_event("backs")
        if self.warn is not None:
            self.warn(f"{tier.name}_back", f"{tier.name} cache {tier.dir.root} answers again (a probe was "
                      f"written, fsync'd and read back; it was out after {tier.out_error}): back in the path")
        return True

    def _next(self, below: int) -> DirTier | None:
        """The first tier ranked after ``below``, as the tiers are now."""
        return next((t for t in self.order() if t.rank > below), None)

    def route(self, tier: DirTier, chooser: Callable[[], VictimChooser], *, background: bool = False) -> Below:
        """The way below ``tier`` for one read (what its fill reads from)."""
        return Below(self, tier, chooser, background)

    def step(self, tier: DirTier, url: str, checksum: str | None, chooser: Callable[[], VictimChooser], *,
             fixed_size: int | None = None, background: bool = False,
             before_fill: Callable[[], None] | None = None) -> tuple[bytes, str]:
        """One tier's step (see the module docstring): the bytes, and the name the tier
        above counts them as coming from. ``before_fill``: a check to run before a miss
        downloads anything (the hot tier's budget)."""
        tel = self.telemetry
        t0 = time.perf_counter() if tel is not None else 0.0
        found = tier.lookup(url, checksum)
        if found.data is not None:
            tier.count_hit(len(found.data))
            if tel is not None:
                tel.hit(tier.telemetry_name)
                tel.read(tier.telemetry_name, len(found.data), time.perf_counter() - t0)
            return found.data, tier.name
        route = self.route(tier, chooser, background=background)
        if found.kept:
            tier.count_read_around()
            return route.fetch(url, checksum, fixed_size=fixed_size), tier.fetched_as
        tier.count_miss()
        if tel is not None:
            tel.miss(tier.telemetry_name)
        if before_fill is not None:
            before_fill()
        return tier.fill(url, checksum, route, fixed_size=fixed_size)

    def read(self, url: str, checksum: str | None, chooser: Callable[[], VictimChooser], *, into: str,
             below: int = TOP, fixed_size: int | None = None, background: bool = False) -> bytes:
        """The whole object from the tiers ranked after ``below`` (then cold), counted as
        ``<into>_from_<tier>``. ``fixed_size``: the size the caller reserved room for;
        another raises SizeChanged. ``background``: a prefetch's read."""
        tier = self._next(below)
        while tier is not None:
            try:
                data, origin = self.step(tier, url, checksum, chooser, fixed_size=fixed_size, background=background)
            except OSError as e:
                if not tier.broken(e):
                    raise
            else:
                if fixed_size is not None and len(data) != fixed_size:
                    raise SizeChanged()
                self.count({f"{into}_from_{origin}": 1})
                return data
            tier = self._next(tier.rank)
        data = self.cold.fetch(url, checksum, fixed_size=fixed_size, background=background)
        self.count({f"{into}_from_cold": 1})
        return data

    def size(self, url: str, *, below: int = TOP) -> int:
        """The object's size as the tiers ranked after ``below`` know it (the shared tier's
        record of a published copy), else a request to cold."""
        tier = self._next(below)
        while tier is not None:
            try:
                size = tier.known_size(url)
            except OSError as e:
                if not tier.broken(e):
                    raise
                size = None
            if size is not None:
                return size
            tier = self._next(tier.rank)
        return self.cold.size(url)


@dataclass(frozen=True)
class Below:
    """:class:`tier.Route` over the tiers below ``tier``: what its fill reserves room by
    and reads from, counted as ``<tier>_from_<source>``."""

    tiers: Tiers
    tier: DirTier
    choose: Callable[[], VictimChooser]
    background: bool = False

    def chooser(self) -> VictimChooser:
        return self.choose()

    def size(self, url: str) -> int:
        return self.tiers.size(url, below=self.tier.rank)

    def fetch(self, url: str, checksum: str | None, *, fixed_size: int | None = None) -> bytes:
        return self.tiers.read(url, checksum, self.choose, into=self.tier.name, below=self.tier.rank,
                               fixed_size=fixed_size, background=self.background)
