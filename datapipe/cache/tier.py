"""The directory tier interface: what every cache directory a process reads through offers
the walk down the tiers (walk.py), whether node-local (``warm_dir``, ``local_tiers``:
nodelocal.py) or shared by the cluster (``shared_dir``: shared.py).

- ``lookup``: open the published copy pinned, verify it, and hand over its bytes (a hit);
  a copy that fails is discarded, unless another process holds it pinned, when it stays
  and the reader reads around it (``Lookup.kept``);
- ``fill``: bring the object in from the tiers below under the directory's single flight
  (an flock stripe on one node, a lease file across hosts), room reserved first;
- ``discard``: remove a copy the caller examined and refused, never one another process
  holds pinned.

A tier's counters are spelt here once, ``<tier>_<what>`` (``warm_hits``, ``local2_misses``,
``shared_read_around``): the walk, the fills and the cache's ranged and pinned reads count
through these methods, so a counter means the same thing on every tier.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from ..errors import DatapipeError
from .cold import ColdReader
from .deadline import Deadline, timed_out
from .eviction import VictimChooser
from .rates import ReadRate
from .warm import BROKEN_DIR_ERRNOS, Reservation, WarmDir, url_key

__all__ = ["DirTier", "Lookup", "MISSING", "KEPT", "Route", "Count", "Warn", "telemetry_tier"]

#: ``stats.update``: a mapping of counters, or counters as keywords
Count = Callable[..., None]
#: ``warn(kind, message)``: counted every time, shown the first time this process sees it
Warn = Callable[[str, str], None]


@dataclass(frozen=True)
class Lookup:
    """What a tier's ``lookup`` found: ``data``, the verified copy's bytes (b"" when they
    were not asked for), or None: no copy to use. ``fd``: the copy's pin, when the caller
    asked to keep it (the caller closes it). ``kept``: a copy failed verification but
    another process holds it pinned, so it stays as it is and the reader reads around it."""

    data: bytes | None = None
    fd: int | None = None
    kept: bool = False


MISSING = Lookup()
KEPT = Lookup(kept=True)


class Route(Protocol):
    """The way below a tier for one read, as the tier's fill sees it: how to choose
    victims to make room (asked afresh each round), the size of the object and its bytes
    from the tiers below, and whether the read is a background one (a prefetch, whose waits
    are not the reader's)."""

    @property
    def background(self) -> bool: ...

    def chooser(self) -> VictimChooser: ...

    def size(self, url: str) -> int: ...

    def fetch(self, url: str, checksum: str | None, *, fixed_size: int | None = None) -> bytes: ...


def telemetry_tier(name: str) -> str:
    """The telemetry tier of a directory tier named ``name``: ``warm_dir`` is ``warm``, each
    of ``local_tiers`` (``local2``, ...) ``node-local``, ``shared_dir`` ``shared``."""
    return "node-local" if name.startswith("local") else name


class DirTier:
    """One cache directory as a tier of this process (see the module docstring). ``name``
    prefixes its counters; ``rank`` is its place in the order (``warm_dir`` 0, then
    ``local_tiers``, then ``shared_dir``), fixed for the life of the process; ``repair``
    (``warm_dir`` and ``shared_dir``): what to do when the directory fails (deleted,
    remounted read-only): re-create it or give it up, then read through. A directory of
    ``local_tiers`` is passed over with a warning instead."""

    #: the name an upper tier's ``<into>_from_<name>`` counter gives bytes this tier
    #: fetched from below (a node-local tier: itself, the bytes went through it)
    fetched_as: str

    def __init__(self, name: str, rank: int, d: WarmDir, *, cold: ColdReader, count: Count, warn: Warn,
                 repair: Callable[[OSError], bool] | None = None) -> None:
        self.name, self.rank, self.dir = name, rank, d
        self.cold, self.count, self.warn, self.repair = cold, count, warn, repair
        self.fetched_as = name
        #: the tier's name in :mod:`datapipe.telemetry` (``warm``, ``node-local``, ``shared``)
        self.telemetry_name = telemetry_tier(name)
        #: while the tier is out of the path (it failed and a probe of it failed too): when
        #: it is probed next (``time.monotonic()``), else None (walk.py ``Tiers.in_path``)
        self.retry_at: float | None = None
        #: the error that took the tier out, for the messages
        self.out_error = ""
        #: out because its reads ran below the floor (not failed); back on trial after a
        #: probe passes, until its next window of reads is judged (walk.py)
        self.out_slow = False
        self.on_trial = False
        #: a probe of it is under way (walk.py ``Tiers.in_path``), or was abandoned at the
        #: deadline and has not answered yet: no other probe starts meanwhile
        self.probing = False
        #: its read window (walk.py ``Tiers.rate``)
        self.rate: ReadRate | None = None
        #: where calls on its folder that may hang run, under the cache's deadline, and
        #: what takes the tier out when one is abandoned (the walk's ``Tiers.hung``)
        self.io = Deadline(None)
        self.hung: Callable[[DirTier, OSError], None] | None = None

    def path(self, url: str) -> str:
        return self.dir.path(url_key(url))

    # -- the interface --------------------------------------------------------------------
    def lookup(self, url: str, checksum: str | None, *, want_bytes: bool = True, keep: bool = False) -> Lookup:
        """The published copy of ``url``, opened pinned and verified (see :class:`Lookup`)."""
        key = url_key(url)
        fd = self.dir.open_pinned(key)
        if fd is None:
            return MISSING
        try:
            data = self.verify(url, fd, checksum, want_bytes=want_bytes)
        except OSError as e:
            os.close(fd)
            if self.vanished(e):
                return MISSING
            raise
        except BaseException:
            os.close(fd)
            raise
        if data is None:
            return MISSING if self.dir.discard(key, fd) else KEPT
        if keep:
            return Lookup(data, fd)
        os.close(fd)
        return Lookup(data)

    def fill(self, url: str, checksum: str | None, route: Route, *,
             fixed_size: int | None = None) -> tuple[bytes, str]:
        """Bring ``url`` in from ``route`` (the tiers below) under the directory's single
        flight; returns its bytes, verified, and the name an upper tier counts them as
        coming from. A tier that cannot keep the object still returns its bytes."""
        raise NotImplementedError

    def discard(self, url: str, fd: int) -> bool:
        """Remove the copy examined through ``fd`` (its pin, which this closes): True when
        it is gone from the path, False when it stays (another process holds it pinned)."""
        return self.dir.discard(url_key(url), fd)

    def publish(self, res: Reservation, data: bytes, digest: str, url: str, *, pin: bool = False) -> int | None:
        """Write and publish a fill's reservation under the deadline (``io``): a write to a
        hung mount is abandoned (an ``OSError``, ``ETIMEDOUT``: the caller serves the bytes
        and the tier is out, through ``hung``), and ends, or aborts, on its own when the
        filesystem answers; a pin it took then is closed."""
        try:
            return self.io.call(partial(_publish, res, data, digest, pin), what=f"{self.name} cache "
                                f"{self.dir.root}: writing {url}", abandon=_close_fd)
        except OSError as e:
            if timed_out(e) and self.hung is not None:
                self.hung(self, e)
            raise

    # -- what the interface rests on ------------------------------------------------------
    def verify(self, url: str, fd: int, checksum: str | None, *, want_bytes: bool = True) -> bytes | None:
        """The copy open at ``fd``, verified (``WarmDir.read_verified``; without a fill record,
        against the cold object's size: remembered, or asked for when there is no
        ``checksum`` to check instead); None, counted as ``<tier>_corrupt``, if it fails."""
        data = self.dir.read_verified(url_key(url), fd, checksum,
                                      lambda: self.cold.known_size(url, probe=checksum is None),
                                      want_bytes=want_bytes)
        if data is None:
            self.count_corrupt()
        return data

    def known_size(self, url: str) -> int | None:
        """The object's size as this tier knows it without asking cold; None if it does not."""
        return None

    def vanished(self, e: OSError) -> bool:
        """Whether ``e``, met while reading an open copy, means the copy went away under the
        reader (a miss, not an error)."""
        return False

    def broken(self, e: OSError) -> bool:
        """Whether ``e`` says the directory itself failed (gone, unwritable): then it is
        repaired or given up (``repair``), or passed over with a warning, and the caller
        reads through to the tiers below."""
        if timed_out(e):  # abandoned past the deadline: the walk took the tier out already
            return True  # (even when another thread's probe has taken it back since)
        if self.repair is not None:
            return self.repair(e)
        if isinstance(e, DatapipeError) or e.errno not in BROKEN_DIR_ERRNOS:
            return False
        self.warn(f"{self.name}_broken", f"node-local cache {self.dir.root} failed ({e}); "
                  "reading through to the tiers below it")
        return True

    def probe(self) -> None:
        """Whether the directory answers again (``WarmDir.probe``); raises OSError if not.
        A tier that re-creates its folder (``warm_dir``, ``shared_dir``) does so first."""
        if self.recreates:
            self.dir.repair()
        self.dir.probe()

    #: whether a deleted folder of this tier is re-created (``warm_dir``, ``shared_dir``;
    #: a folder of ``local_tiers`` is not: it is probed as it is)
    recreates = False

    # -- counters: the one spelling of every per-tier counter -----------------------------
    def count_hit(self, nbytes: int | None = None) -> None:
        counts: dict[str, Any] = {f"{self.name}_hits": 1}
        if nbytes is not None:
            counts[f"{self.name}_bytes"] = nbytes
        self.count(counts)

    def count_miss(self) -> None:
        self.count({f"{self.name}_misses": 1})

    def count_read_around(self) -> None:
        self.count({f"{self.name}_read_around": 1})

    def count_corrupt(self) -> None:
        self.count({f"{self.name}_corrupt": 1})

    def count_event(self, what: str, n: int = 1) -> None:
        """``<tier>_<what>``: fills, evictions, not_admitted, waits, takeovers, ..."""
        self.count({f"{self.name}_{what}": n})


def _publish(res: Reservation, data: bytes, digest: str, pin: bool) -> int | None:
    """Publish a reservation; one that fails is aborted here (its caller may have gone)."""
    try:
        return res.write_and_publish(data, digest, pin=pin)
    except BaseException:
        res.abort()
        raise


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
