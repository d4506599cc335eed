"""The hot tier (whole objects in this process's memory), the bound on bytes in flight, the
ordering of scheduled prefetches, and the wait of a pin for room."""

from __future__ import annotations

import itertools
import threading
import time

from ..errors import CacheBudgetError
from .eviction import VictimChooser

__all__ = ["HotTier", "InflightBytes", "Turns", "Room"]


class HotTier:
    """URL -> (bytes, checksum verified at admission), within ``budget`` bytes. Only
    complete, verified objects enter, so the budget counts every byte it holds."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.evictions = 0
        self._d: dict[str, tuple[bytes, str | None]] = {}
        self._recency: dict[str, int] = {}
        self._clock = itertools.count()
        self._lock = threading.Lock()

    def get(self, url: str) -> tuple[bytes, str | None] | None:
        with self._lock:
            hit = self._d.get(url)
            if hit is not None:
                self._recency[url] = next(self._clock)
            return hit

    def __contains__(self, url: str) -> bool:
        return url in self._d

    def admit(self, url: str, data: bytes, checksum: str | None, choose: VictimChooser) -> bool:
        """Store ``data`` if the policy makes room for it; False when it is not admitted."""
        size = len(data)
        if self.budget <= 0 or size > self.budget:
            return False
        with self._lock:
            if url in self._d:
                return True
            need = self.used + size - self.budget
            if need > 0:
                cands = [(k, len(v[0]), float(self._recency[k])) for k, v in self._d.items()]
                victims = choose(cands, need, url)
                if victims is None:
                    return False
                for v in victims:
                    self._drop(v)
                    self.evictions += 1
            self._d[url] = (bytes(data), checksum)
            self._recency[url] = next(self._clock)
            self.used += size
            return True

    def discard(self, url: str) -> None:
        with self._lock:
            self._drop(url)

    def _drop(self, url: str) -> None:
        entry = self._d.pop(url, None)
        if entry is not None:
            self.used -= len(entry[0])
            self._recency.pop(url, None)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._recency.clear()
            self.used = 0


class InflightBytes:
    """A semaphore counted in bytes: downloads wait until their bytes fit under the limit.
    An object larger than the whole limit could never fit, so it is an error, not a wait."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, what: str) -> float:
        """Take ``n`` bytes; returns the seconds spent waiting."""
        if n > self.limit:
            raise CacheBudgetError(
                f"{what} is {n} bytes, more than max_inflight_bytes={self.limit}; "
                f"raise max_inflight_bytes to at least {n}"
            )
        t0 = time.monotonic()
        with self._cond:
            while self.current + n > self.limit:
                self._cond.wait()
            self.current += n
            self.peak = max(self.peak, self.current)
        return time.monotonic() - t0

    def release(self, n: int) -> None:
        with self._cond:
            self.current -= n
            self._cond.notify_all()


class Turns:
    """Tickets taken in issue order, served in that order: scheduled prefetches reserve warm
    space one after another in schedule order (so a later object never takes the room an
    earlier one needs), while their downloads still overlap. A ticket whose task ends
    early (cancelled, already cached, failed) is marked done, and the queue moves on."""

    def __init__(self) -> None:
        self._issued = 0
        self._next = 0
        self._done: set[int] = set()
        self._cond = threading.Condition()
        self.closed = False

    def issue(self) -> int:
        with self._cond:
            self._issued += 1
            return self._issued - 1

    def wait(self, ticket: int) -> bool:
        """Block until it is ``ticket``'s turn; False if shut down meanwhile."""
        with self._cond:
            while self._next != ticket and not self.closed:
                self._cond.wait()
            return not self.closed

    def done(self, ticket: int) -> None:
        with self._cond:
            if ticket < self._next or ticket in self._done:
                return
            self._done.add(ticket)
            while self._next in self._done:
                self._done.discard(self._next)
                self._next += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Room:
    """Where a pin waiting for room in a directory tier sleeps: this process's releases,
    fills and discards wake it (pins of other processes are released without a signal that
    crosses processes, so a waiter also looks again after a timeout)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)
