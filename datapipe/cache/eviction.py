"""Which cached objects to evict: LRU when the future is unknown, Belady when it is known.

A seeded shuffle knows the order in which shards will be read, so the cache can do what an
oracle does (Belady's MIN): evict the object whose next use lies furthest in the future,
and refuse to admit an object that would itself be the first to go. Under repeated random
epochs LRU thrashes once the data does not fit; the clairvoyant policy keeps a stable part
of the working set and reaches the hit rate of the offline optimum.

Both tiers use :func:`choose_victims`. The hot tier passes its own in-process recency
counter, the warm tier the files' modification times (touched on every hit, so recency is
shared by every process of a node). Non-admission applies to every read that can do
without a copy in the tier: ``read``, prefetches, and the loader's ``pin_or_read`` (which
then reads the object through); only ``local_path``, whose caller needs a file, forces
admission.

:func:`belady_hits` and :func:`lru_hits` are offline simulators written independently of
the online code, for tests and benchmarks.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Hashable, Iterable, KeysView, Sequence
from typing import Generic, Protocol, TypeVar

from ..errors import OptionError
from ..options import check_int

__all__ = ["NEVER", "Schedule", "NextUses", "VictimChooser", "choose_victims", "belady_hits", "lru_hits"]

NEVER = float("inf")

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


class VictimChooser(Protocol):
    """What a tier asks before admitting an object: ``choose(candidates, need)`` with
    candidates as ``(key, size, recency)`` returns the keys to evict, or None: do not
    admit. Tiers may pass more (the incoming key), which a chooser ignores."""

    def __call__(self, candidates: list[tuple[str, int, float]], need: int, /,
                 *more: object) -> list[str] | None: ...


class NextUses(Protocol[K_contra]):
    """What eviction asks of a future: the reader's position and the next use of a key at
    or after an index. A :class:`Schedule` is one; ``future.MergedFuture`` (every process
    of a node) is another."""

    @property
    def position(self) -> int: ...

    def next_use(self, key: K_contra, start: int) -> float: ...


#: how many ``window``s the frontier of a :class:`Schedule` may lag its position
LAG_WINDOWS = 4


class Schedule(Generic[K]):
    """The future access order of one reader: a list of keys, repeats allowed, the position
    of the next expected access, and the frontier: the first access not yet served.

    ``locate(key)`` maps a demand read to its index: the first occurrence at or after the
    frontier that no read has claimed, if it lies before the position (a read that arrives
    late: several prefetch threads run reads slightly out of order) or within ``window``
    accesses after it; further away, the read counts as unscheduled. ``claim(i)`` takes
    the index (the position moves past it) and ``finish(i)`` marks the read served (it
    holds its object: a pin, or the bytes). Until then the read is still to come:
    :meth:`next_use` sees it, so eviction keeps the objects of reads in flight, while it
    skips reads already served. The frontier never lags the position by more than
    ``LAG_WINDOWS * window`` (a read that never finishes stops counting then): a slow read
    may be overtaken by more than ``window`` others (each fetch thread claims on while it
    is away) and still find its own index when it comes."""

    def __init__(self, keys: Sequence[K], position: int = 0, window: int = 64) -> None:
        self.keys = list(keys)
        self.position = check_int("position", position, min=0, max=len(self.keys),
                                  hint=f"a schedule position within its {len(self.keys)} reads")
        self.window = check_int("window", window, min=0, hint="how many reads ahead of the position a read may be")
        self.frontier = position
        self._claimed: set[int] = set()  # indexes in [frontier, position) a read took
        self._in_flight: set[int] = set()  # of those, the reads not yet served
        self._at: dict[K, list[int]] = {}
        for i, k in enumerate(self.keys):
            self._at.setdefault(k, []).append(i)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def distinct_keys(self) -> KeysView[K]:
        """Every key the schedule reads, once."""
        return self._at.keys()

    def _served(self, i: int) -> bool:
        return i in self._claimed and i not in self._in_flight

    def next_use(self, key: K, start: int) -> float:
        """The first index >= ``start`` at which ``key`` is read and not yet served (every
        read before the frontier is); NEVER if none."""
        at = self._at.get(key)
        if not at:
            return NEVER
        i = bisect.bisect_left(at, max(start, self.frontier))
        while i < len(at) and self._served(at[i]):
            i += 1
        return at[i] if i < len(at) else NEVER

    def locate(self, key: K) -> int | None:
        at = self._at.get(key)
        if not at:
            return None
        i = bisect.bisect_left(at, min(self.frontier, self.position))
        while i < len(at) and at[i] in self._claimed:
            i += 1
        if i == len(at) or at[i] - self.position > self.window:
            return None
        return at[i]

    def claim(self, i: int) -> None:
        """A read takes index ``i`` (from :meth:`locate`): the position moves past it."""
        self._claimed.add(i)
        self._in_flight.add(i)
        self.position = max(self.position, min(len(self.keys), i + 1))
        self._move_frontier()

    def finish(self, i: int) -> None:
        """The read at index ``i`` was served."""
        self._in_flight.discard(i)
        self._move_frontier()

    def _move_frontier(self) -> None:
        old = self.frontier
        f = max(old, self.position - self._lag())
        while f < self.position and self._served(f):
            f += 1
        self.frontier = f
        if f - old > len(self._claimed):  # a long jump: rebuild (a set never shrinks in place)
            self._claimed = {i for i in self._claimed if i >= f}
            self._in_flight = {i for i in self._in_flight if i >= f}
            return
        for i in range(old, f):
            self._claimed.discard(i)
            self._in_flight.discard(i)

    def _lag(self) -> int:
        return LAG_WINDOWS * max(self.window, 0)

    def advance(self, n: int = 1) -> int:
        """Skip ``n`` reads: they count as served."""
        if n < 0:
            raise OptionError(f"a schedule only moves forward; advance({n})")
        end = min(len(self.keys), self.position + n)
        # the frontier lags the position by at most _lag(): only those indexes need a mark
        self._claimed.update(range(max(self.position, end - self._lag()), end))
        self.position = end
        self._move_frontier()
        return self.position

    def upcoming(self, limit: int) -> list[tuple[int, K]]:
        end = min(len(self.keys), self.position + limit)
        return [(i, self.keys[i]) for i in range(self.position, end)]


def choose_victims(
    candidates: Iterable[tuple[K, int, float]],
    need: int,
    incoming: K,
    *,
    schedule: NextUses[K] | None = None,
    incoming_next: float | None = None,
    horizon: int | None = None,
    admit: bool = False,
) -> list[K] | None:
    """Victims that free at least ``need`` bytes for ``incoming``, or None: do not admit it.

    ``candidates`` are the evictable entries as ``(key, size, recency)`` (older recency =
    less recently used). Without a schedule: LRU. With one: entries never used again go
    first (least recently used among them), then the one used furthest in the future;
    ``incoming_next`` is the index of incoming's next use, ``horizon`` the first index
    still to come (so entries are ranked by their next use at or after it). An entry needed
    no later than ``incoming`` is never evicted for it; if that leaves too little room,
    the incoming object is not admitted (Belady's non-admission). With ``admit`` (a reader
    that must have a file in the tier: ``local_path``), it is always admitted, and the
    victims are still those used furthest in the future."""
    if need <= 0:
        return []
    cands = list(candidates)
    if schedule is None:
        cands.sort(key=lambda c: c[2])
        incoming_rank = None
    else:
        start = schedule.position if horizon is None else horizon
        ranked = [(schedule.next_use(k, start), -rec, k, size) for k, size, rec in cands]
        ranked.sort(key=lambda r: (r[0], r[1]), reverse=True)  # furthest next use, then oldest
        cands = [(k, size, nxt) for nxt, _r, k, size in ranked]
        incoming_rank = None if admit else (NEVER if incoming_next is None else incoming_next)
    victims: list[K] = []
    freed = 0
    for key, size, third in cands:
        if freed >= need:
            break
        if key == incoming:
            continue
        if incoming_rank is not None and third <= incoming_rank:
            return None
        victims.append(key)
        freed += size
    return victims if freed >= need else None


def belady_hits(accesses: Sequence[K], sizes: dict[K, int], capacity: int) -> int:
    """Hits of the offline optimum (for equal sizes; the natural greedy for unequal ones):
    on a miss evict whatever is next used furthest away, or do not admit the missing object
    if it is that one. A plain O(n^2) scan, deliberately unlike the online code."""
    cache: set[K] = set()
    used = 0
    hits = 0
    n = len(accesses)

    def next_use(key: K, t: int) -> int:
        for j in range(t + 1, n):
            if accesses[j] == key:
                return j
        return n + 1  # never again

    for t, key in enumerate(accesses):
        if key in cache:
            hits += 1
            continue
        size = sizes[key]
        if size > capacity:
            continue
        while used + size > capacity:
            far_key, far_t = key, next_use(key, t)
            for k in cache:
                nk = next_use(k, t)
                if nk > far_t:
                    far_key, far_t = k, nk
            if far_key == key:
                break
            cache.remove(far_key)
            used -= sizes[far_key]
        if used + size <= capacity:
            cache.add(key)
            used += size
    return hits


def lru_hits(accesses: Sequence[K], sizes: dict[K, int], capacity: int) -> int:
    """Hits of a plain LRU cache of ``capacity`` bytes that admits every object that fits."""
    cache: OrderedDict[K, int] = OrderedDict()
    used = 0
    hits = 0
    for key in accesses:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        size = sizes[key]
        if size > capacity:
            continue
        while used + size > capacity:
            _k, s = cache.popitem(last=False)
            used -= s
        cache[key] = size
        used += size
    return hits
