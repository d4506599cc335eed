"""How fast each tier reads, over a window, and the rule that takes a slow directory tier
out of the path.

A tier's window is the bytes and seconds of its reads (the same measurement the cache
records into its telemetry: a hit's lookup, open to verified bytes; a cold fetch) since the
window opened; it closes once it holds ``window_bytes`` in at least :data:`WINDOW_MIN_READS`
reads, and its rate is bytes over seconds spent reading (not wall time: a tier read rarely
is judged on its reads alone); reads under :data:`MIN_READ_BYTES` are left out (their time
is latency, not rate: a hung one is the deadline's). A directory tier whose closed window runs below the floor
(``tier_min_mb_s``, MB/s of 10^6 bytes) is slow, unless the tier that would serve in its
place (the next one in the path, or cold) measured slower still in its last window: reading
through must not trade a slow tier for a slower one.
"""

from __future__ import annotations

import threading

__all__ = ["ReadRate", "DEFAULT_TIER_MIN_MB_S", "DEFAULT_TIER_WINDOW_BYTES", "WINDOW_MIN_READS", "MIN_READ_BYTES"]

#: the floor of a directory tier's read rate (``tier_min_mb_s``): a node-local NVMe reads
#: GB/s, a SATA disk or a shared filesystem hundreds of MB/s; below 50 MB/s a tier is failing
#: (a dying disk, a throttled volume) and the tiers below it are likely faster
DEFAULT_TIER_MIN_MB_S = 50.0
#: the bytes a window must hold before it is judged (``tier_window_bytes``)
DEFAULT_TIER_WINDOW_BYTES = 256 << 20
#: the reads a window must hold before it is judged: one slow read is not a slow tier
WINDOW_MIN_READS = 4
#: the smallest read a window counts
MIN_READ_BYTES = 64 << 10


class ReadRate:
    """The read window of one tier (see the module docstring). Several threads record."""

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self._lock = threading.Lock()
        self._bytes = 0
        self._seconds = 0.0
        self._reads = 0
        #: bytes per second of the last closed window (None: none closed yet)
        self.last: float | None = None
        #: reads in the last closed window
        self.last_reads = 0

    def add(self, nbytes: int, seconds: float) -> float | None:
        """Record one read; the window's rate (bytes per second) when this read closes it."""
        if nbytes < MIN_READ_BYTES:
            return None
        with self._lock:
            self._bytes += nbytes
            self._seconds += max(seconds, 0.0)
            self._reads += 1
            if self._bytes < self.window_bytes or self._reads < WINDOW_MIN_READS:
                return None
            rate = self._bytes / max(self._seconds, 1e-9)
            self.last, self.last_reads = rate, self._reads
            self._bytes, self._seconds, self._reads = 0, 0.0, 0
            return rate

    def reset(self) -> None:
        """Open a new window (a tier back on trial is judged on its reads from now)."""
        with self._lock:
            self._bytes, self._seconds, self._reads = 0, 0.0, 0
