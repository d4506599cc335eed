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

Two more reasons take a tier out the same way. A read that does not answer within the
deadline (``tier_deadline_s``: a hung mount, a lock never released) is abandoned
(deadline.py), served from the tiers below, and the tier goes out (one warning); its probe
runs under the same deadline, so a mount still hung costs each later probe at most that.
A tier whose reads over a window run below the floor (``tier_min_mb_s``, rates.py) goes
out with one warning naming the tier, its rate and the floor; when its probe passes it is
back on trial, judged on its next window: slow still, out again (no new warning); at or
above the floor, back in the path, with one message.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..errors import StorageError
from ..telemetry import Telemetry
from .cold import ColdReader, SizeChanged
from .deadline import Deadline, timed_out
from .eviction import VictimChooser
from .nodelocal import LocalTier
from .rates import DEFAULT_TIER_WINDOW_BYTES, ReadRate
from .shared import SharedTier
from .tier import Count, DirTier, Lookup, Warn

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
                 retry_s: float = DEFAULT_TIER_RETRY_S, give_up: Callable[[DirTier], None] | None = None,
                 deadline: Deadline | None = None, min_mb_s: float | None = None,
                 window_bytes: int = DEFAULT_TIER_WINDOW_BYTES,
                 rearm: Callable[..., None] | None = None) -> None:
        self.cold = cold
        self.count = count
        self.warn = warn
        #: ``rearm(*kinds)``: warnings of these kinds are said again when next met (the
        #: process state's :meth:`~.state.ProcessState.rearm`)
        self.rearm = rearm
        self.retry_s = retry_s
        #: every call on a tier's folder that may hang (lookups, writes, probes) goes through it
        self.deadline = deadline if deadline is not None else Deadline(None)
        #: the floor of a directory tier's read rate, MB/s (None: never judged slow)
        self.min_mb_s = min_mb_s
        self.window_bytes = window_bytes
        self.cold_rate = ReadRate(window_bytes)
        #: what to do with a tier whose re-created folder would be someone else's (the
        #: process state's ``give_up``)
        self.give_up = give_up
        self.warm: LocalTier | None = None
        self.lower: list[LocalTier] = []  # local_tiers that opened, in order
        self.shared: SharedTier | None = None
        #: where each step's hit (bytes, seconds) or miss is recorded too (the process
        #: state's :meth:`~.state.ProcessState.set_telemetry`)
        self.telemetry: Telemetry | None = None
        # Taking a tier out and probing it back are decided by one thread at a time: the
        # reads of several threads (the loader's fetches, prefetches) meet a failure or a
        # due probe together, and each out and each back is counted and said once.
        self._out_lock = threading.Lock()

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

    def take_out(self, tier: DirTier, e: OSError | str) -> None:
        """Take ``tier`` out of the path after ``e`` (its probe failed too, a read hung, or,
        given as text, why it is slow): counted as ``<tier>_outs``, probed again in
        ``retry_s`` seconds."""
        with self._out_lock:
            if tier.retry_at is None and not tier.on_trial:
                tier.count_event("outs")
            tier.out_error = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
            tier.out_slow = isinstance(e, str)
            tier.on_trial = False
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
        # The probe is claimed under the lock and run outside it: a probe of a hung mount
        # waits up to the deadline, and the reads of other threads (and other tiers) must
        # not wait with it; they see the tier out until the probe's answer is applied.
        with self._out_lock:
            at = tier.retry_at
            if at is None:
                return True
            if tier.probing or time.monotonic() < at:
                return False
            tier.probing = True
            tier.retry_at = time.monotonic() + self.retry_s
        answered = True
        try:
            error = self.deadline.call(partial(_probe, tier), what=f"{tier.name} cache {tier.dir.root}: a probe",
                                       abandon=partial(_probe_answered, tier))
        except OSError as e:  # abandoned: ``probing`` stays set until the probe answers
            error, answered = e, False
        if isinstance(error, StorageError):  # its path is someone else's folder now: never touched again
            with self._out_lock:
                tier.retry_at = float("inf")
                tier.probing = False
            if self.give_up is not None:
                self.give_up(tier)
            return False
        if isinstance(error, OSError):
            with self._out_lock:
                tier.retry_at = time.monotonic() + self.retry_s
                tier.out_error = f"{type(error).__name__}: {error}"
                tier.out_slow = False
                tier.probing = tier.probing and not answered
            tier.count_event("probes_failed")
            return False
        if error is not None:
            with self._out_lock:
                tier.probing = False
            raise error
        with self._out_lock:
            tier.retry_at = None
            tier.probing = False
            trial = tier.out_slow
            if trial:  # it answers: judged on its next window of reads
                tier.on_trial, tier.out_slow = True, False
                self.rate(tier).reset()
        if trial:
            tier.count_event("trials")
            return True
        tier.count_event("backs")
        self._say_back(tier, f"{tier.name} cache {tier.dir.root} answers again (a probe was written, fsync'd "
                       f"and read back; it was out after {tier.out_error}): back in the path")
        return True

    def _say_back(self, tier: DirTier, message: str) -> None:
        """Say that ``tier`` is back in the path; its next outage (and its recovery) is then
        said again: each warning kind is said once per process (``ProcessState.warn``), so
        the kinds of an outage are forgotten once it is over (``rearm``)."""
        if self.warn is not None:
            self.warn(f"{tier.name}_back", message)
        if self.rearm is not None:
            self.rearm(f"{tier.name}_hung", f"{tier.name}_slow", f"{tier.name}_back")

    def rate(self, tier: DirTier) -> ReadRate:
        """``tier``'s read window (see rates.py)."""
        if tier.rate is None:
            tier.rate = ReadRate(self.window_bytes)
        return tier.rate

    def lookup(self, tier: DirTier, url: str, checksum: str | None, *, want_bytes: bool = True,
               keep: bool = False) -> Lookup:
        """``tier.lookup`` under the deadline, its bytes and seconds measured for the rule
        against slow tiers. A lookup that does not answer in time takes the tier out (one
        warning) and raises the ``OSError`` (``ETIMEDOUT``) that ``DirTier.broken`` passes
        over; the abandoned lookup closes the pin it opens when it answers at last."""
        t0 = time.perf_counter()
        try:
            found = self.deadline.call(partial(tier.lookup, url, checksum, want_bytes=want_bytes, keep=keep),
                                       what=f"{tier.name} cache {tier.dir.root}: a read of {url}",
                                       abandon=_close_pin)
        except OSError as e:
            if timed_out(e):
                self.hung(tier, e)
            raise
        if found.data:
            self.measured(tier, len(found.data), time.perf_counter() - t0)
        return found

    def hung(self, tier: DirTier, e: OSError) -> None:
        """A call on ``tier``'s folder gave no answer within the deadline: out of the path."""
        tier.count_event("hung")
        if self.telemetry is not None:
            self.telemetry.error(tier.telemetry_name)
        self.take_out(tier, e)
        if self.warn is not None:
            self.warn(f"{tier.name}_hung", f"{tier.name} cache {tier.dir.root} does not answer ({e}): the call is "
                      "abandoned and the read served from the tiers below it; taken out of the path, probed again "
                      f"every {self.retry_s:g} s (each probe waits at most {self.deadline.seconds:g} s) and "
                      "taken back when it answers. Check the mount (a dead NFS server, a stuck disk)")

    def measured(self, tier: DirTier, nbytes: int, seconds: float) -> None:
        """One read of ``tier`` (``nbytes`` in ``seconds``), for its window; a window that
        closes below the floor takes the tier out, one on trial back in (see rates.py)."""
        rate = self.rate(tier).add(nbytes, seconds)
        if rate is None or self.min_mb_s is None:
            return
        floor = self.min_mb_s * 1e6
        if rate >= floor:
            if tier.on_trial:
                with self._out_lock:
                    back, tier.on_trial = tier.on_trial, False
                if back:
                    tier.count_event("backs")
                    self._say_back(tier, f"{tier.name} cache {tier.dir.root} reads at {rate / 1e6:.3g} MB/s "
                                   f"again (tier_min_mb_s={self.min_mb_s:g}; it was out after {tier.out_error}): "
                                   "back in the path")
            return
        instead = self._instead(tier)
        if instead is not None and instead < rate:
            tier.count_event("slow_kept")  # what would serve in its place is slower still
            return
        trial = tier.on_trial
        why = (f"slow: {rate / 1e6:.3g} MB/s over its last {tier.rate.last_reads if tier.rate else 0} reads, "
               f"below tier_min_mb_s={self.min_mb_s:g} MB/s")
        tier.count_event("slow")
        self.take_out(tier, why)
        if self.warn is not None and not trial:
            below = "" if instead is None else f" (the tier below reads at {instead / 1e6:.3g} MB/s)"
            self.warn(f"{tier.name}_slow", f"{tier.name} cache {tier.dir.root} is {why}{below}: taken out of the "
                      f"path, reads go through to the tiers below it; probed again every {self.retry_s:g} s and "
                      f"taken back when its reads run at {self.min_mb_s:g} MB/s or more (a failing disk or a "
                      "throttled volume? `datapipe doctor` times it; tier_min_mb_s=None turns the rule off)")

    def _instead(self, tier: DirTier) -> float | None:
        """The last measured rate of what would serve reads in ``tier``'s place."""
        nxt = self._next(tier.rank)
        return self.cold_rate.last if nxt is None else self.rate(nxt).last

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
        t0 = time.perf_counter()
        found = self.lookup(tier, url, checksum)
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
        t0 = time.perf_counter()
        data = self.cold.fetch(url, checksum, fixed_size=fixed_size, background=background)
        self.cold_rate.add(len(data), time.perf_counter() - t0)
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


def _probe(tier: DirTier) -> Exception | None:
    """``tier.probe()``'s failure, returned (so that an abandoned probe's answer reaches
    ``_probe_answered`` whatever it is), else None."""
    try:
        tier.probe()
    except Exception as e:
        return e
    return None


def _probe_answered(tier: DirTier, _error: Exception | None) -> None:
    """An abandoned probe answered at last (the mount is no longer hung in it): the tier
    may be probed again. Until then no other probe starts, so a mount still hung holds one
    thread in the kernel, not one more per ``retry_s``."""
    tier.probing = False


def _close_pin(found: Lookup) -> None:
    if found.fd is not None:
        os.close(found.fd)


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
