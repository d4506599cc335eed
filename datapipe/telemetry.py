"""Telemetry of the data path, per process: how long the trainer waits for data against the
time between its batches, bytes and latency per cache tier, hits and misses, cold retries
and throttling, prefetch depth, decode/map time; summed over windows (``window_s`` seconds
or ``window_steps`` steps) into a :class:`WindowSummary`.

    tel = Telemetry(window_s=10, metrics_path="/run/metrics.jsonl", rank=rank)
    t0 = tel.wait_begin(); batch = next(it); tel.wait_end(t0)   # data wait
    tel.step()                                                  # a batch handed out: step time
    tel.read("warm", nbytes, seconds); tel.hit("warm")          # the cache, per tier
    tel.snapshot()                                              # the window so far

Cost. A record is a few list additions on counters that belong to the recording thread
(found through a ``threading.local``): no lock, no allocation, about a microsecond. Counters
only ever grow; a window is the difference of two sums over every thread's counters, taken
by the window thread (or :meth:`close_window`), which is the only place that reads them.
A thread's counters are folded into a retired sum once the thread has ended.

Processes. A DataLoader worker records into its own copy (a forked child's copy starts
from zero; a pickled one, sent to a spawned worker, arrives as a fresh worker copy without
window thread, metrics file or callbacks). :meth:`export` gives the worker's counts since
its previous export as a small ``bytes`` (at most every ``export_interval_s``), meant to
travel beside a batch to the main process, whose loader hands it to :meth:`merge`: deltas
add up, so a worker that exits or restarts needs no bookkeeping, and nothing lives in named
shared memory that could outlive a crash.

Windows. The window thread closes a window every ``window_s`` seconds, or soon after each
``window_steps``-th :meth:`step` (the step only wakes it: the trainer's thread never sums,
formats or writes). Each closed window goes to ``metrics_path`` as one JSON line (a single
``write`` with ``O_APPEND``, so lines of several processes never interleave on a local
filesystem) and to the callbacks of :meth:`on_window` (a health board publisher), on the
window thread.

Where each figure is recorded (one recorder per loader, handed to its dataset and cache):

- ``wait_begin``/``wait_end``: around the main process's ``next()`` on the batches in
  ``StreamingDataLoader.__iter__`` (or on the dataset's iterator without a DataLoader);
  ``step``: as each batch is handed to the trainer (just before its ``yield``).
- ``export``/``merge``: the worker's ``_Collate`` puts ``export()`` beside each batch it
  returns (``None`` mostly: at most one per ``export_interval_s``; ``force=True`` with a
  batch shorter than the batch size, a pass's last); the main loop merges it before it
  opens the batch. What a worker records after its last export arrives with its next one
  (a persistent worker's next pass): ``export_interval_s=0`` exports with every batch.
- ``decode``: every 64 samples and at each chunk's end where ``decode=``/``map=`` run,
  with their samples; ``prefetch_depth``: where the prefetcher's bytes of shards held or
  being fetched change.
- ``read``/``hit``/``miss``/``error``: where the cache counts a hit or miss of a tier today
  (memory: the hot tier; warm: ``warm_dir``; node-local: ``local_tiers``; shared: the shared
  directory; cold: a read of the cold store, also the loader's reads without a cache), with
  the bytes served and the seconds the read took; ``error`` where a tier is found broken.
- ``cold_retry``/``throttled``: where the cold reads count a retried failure and a
  throttled answer (503 SlowDown, 429).
- ``compute``: by the trainer, if it wants compute stragglers named in synchronous
  training (see :meth:`Telemetry.compute`).

A leaf: imports :mod:`datapipe.errors` and :mod:`datapipe.options` (itself a leaf), so the
loader and the cache record here without importing :mod:`datapipe.health`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import threading
import time
import warnings
import weakref
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import HealthError, OptionError
from .options import check_float, check_int, check_path, show

Floats = npt.NDArray[np.float64]

__all__ = ["Telemetry", "WindowSummary", "TierSummary", "Totals", "TIERS", "BUCKET_BOUNDS", "SUMMARY_FORMAT",
           "quantile"]

#: the cache tiers a read is counted against: the memory tier, the node-local ``warm_dir``,
#: the further node-local ``local_tiers``, the shared directory, the cold store
TIERS = ("memory", "warm", "node-local", "shared", "cold")

#: upper bounds (seconds, inclusive) of the latency histograms: ten per decade from 1 us to
#: 1000 s (10**(k/10) to two digits: 1, 1.3, 1.6, 2, 2.5, 3.2, 4, 5, 6.3, 7.9), so a quantile
#: read from them is within about 26% of the true one, and 1, 2.5, 5 of each decade are
#: bounds (the buckets a Prometheus histogram shows)
BUCKET_BOUNDS: tuple[float, ...] = tuple(float(f"{10 ** (k / 10):.2g}") for k in range(-60, 31))

#: the ``format`` of a window's JSON document (metrics lines, health boards)
SUMMARY_FORMAT = "datapipe-telemetry-window"
SUMMARY_VERSION = 1

_NB = len(BUCKET_BOUNDS) + 1  # the last bucket holds what lies above 1000 s
_TIMER_WIDTH = 2 + _NB  # count, seconds, histogram
_STEP = 0
_WAIT = _STEP + _TIMER_WIDTH
_COMPUTE = _WAIT + _TIMER_WIDTH
_DECODE = _COMPUTE + _TIMER_WIDTH  # calls, seconds, samples
_RETRIES = _DECODE + 3
_THROTTLED = _RETRIES + 1
_DEPTH = _THROTTLED + 1  # sum of prefetch depths set, how many were set
_TIER0 = _DEPTH + 2
_TIER_WIDTH = 6 + _NB  # reads, bytes, seconds, hits, misses, errors, histogram
_T_READS, _T_BYTES, _T_SECONDS, _T_HITS, _T_MISSES, _T_ERRORS, _T_HIST = range(7)
_SIZE = _TIER0 + len(TIERS) * _TIER_WIDTH
_TIER_BASE = {name: _TIER0 + i * _TIER_WIDTH for i, name in enumerate(TIERS)}
_TIMERS = {"step": _STEP, "data_wait": _WAIT, "compute": _COMPUTE}

_MAX_SECONDS = 1e9  # a record beyond this (31 years) is a caller's bug, not a measurement
_MAX_COUNT = float(1 << 53)  # counts and bytes stay exact in a float below this
_DELTA_MAGIC = b"DPT1"
_DELTA_HEADER = struct.Struct("<4sIqd")  # magic, counters, pid, prefetch depth
_WORKER_GAUGE_S = 60.0  # a worker's prefetch depth counts this long after its last export
_MAX_WORKER_GAUGES = 4096

_INSTANCES: weakref.WeakSet[Telemetry] = weakref.WeakSet()


def quantile(hist: Floats, q: float) -> float | None:
    """The ``q`` quantile of a histogram over :data:`BUCKET_BOUNDS` (``len + 1`` counts),
    interpolated geometrically inside its bucket; None when it is empty."""
    n = float(hist.sum())
    if n <= 0:
        return None
    cum = np.cumsum(hist)
    target = q * n
    i = min(int(np.searchsorted(cum, target)), _NB - 1)
    if i >= len(BUCKET_BOUNDS):
        return BUCKET_BOUNDS[-1]
    hi = BUCKET_BOUNDS[i]
    lo = BUCKET_BOUNDS[i - 1] if i > 0 else hi / 10 ** 0.1
    below = float(cum[i - 1]) if i > 0 else 0.0
    inside = float(hist[i])
    frac = min(max((target - below) / inside, 0.0), 1.0) if inside > 0 else 1.0
    return float(lo * (hi / lo) ** frac)


@dataclass(frozen=True)
class TierSummary:
    """One tier over a window: reads served from it, their bytes and seconds, its lookups
    (hits, misses), errors; rates and latencies derived (None where nothing was read)."""

    reads: int
    bytes: int
    seconds: float
    hits: int
    misses: int
    errors: int
    bytes_per_s: float | None
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    hit_ratio: float | None


@dataclass(frozen=True)
class WindowSummary:
    """One window of one process (with its merged workers). Times in seconds.

    ``steps``: step times in the window (the spacing of :meth:`Telemetry.step` marks), in
    all ``step_s``, and their ``step_mean_s``, ``step_p50_s``, ``step_p95_s``. ``data_wait_s``: the trainer's time
    waiting for data in total, ``data_wait_fraction`` that over the window's duration,
    ``waiting_now_s`` how long a wait still open at the window's end has lasted (a rank
    stuck on data shows here before its wait is counted). ``compute_*``: what the trainer
    recorded with :meth:`Telemetry.compute` (its own work, without collectives), if it did.
    ``tiers``: the tiers read in the window. ``cache_hit_ratio``: the reads served by a
    cache tier over all reads served. ``final``: the last window, closed by ``close()``
    before its time."""

    seq: int
    rank: int | None
    host: str
    pid: int
    time: float
    duration_s: float
    final: bool
    steps: int
    step_s: float
    step_mean_s: float | None
    step_p50_s: float | None
    step_p95_s: float | None
    waits: int
    data_wait_s: float
    data_wait_mean_s: float | None
    data_wait_p50_s: float | None
    data_wait_p95_s: float | None
    data_wait_fraction: float | None
    waiting_now_s: float
    computes: int
    compute_s: float
    compute_mean_s: float | None
    decode_s: float
    decoded_samples: int
    decode_per_sample_s: float | None
    cold_retries: int
    cold_throttled: int
    prefetch_depth: float
    prefetch_depth_mean: float | None
    cache_hit_ratio: float | None
    tiers: dict[str, TierSummary] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of this window (what metrics lines and boards hold)."""
        return {"format": SUMMARY_FORMAT, "version": SUMMARY_VERSION, **asdict(self)}


class Totals:
    """Every counter of a :class:`Telemetry` since it started (the process and its merged
    workers): what a Prometheus scrape reports."""

    def __init__(self, values: Floats) -> None:
        self._v = values

    def timer(self, name: str) -> tuple[int, float, Floats]:
        """``(count, seconds, histogram)`` of ``"step"``, ``"data_wait"`` or ``"compute"``;
        the histogram has a count per :data:`BUCKET_BOUNDS` bucket plus the overflow."""
        b = _TIMERS[name]
        return int(self._v[b]), float(self._v[b + 1]), self._v[b + 2:b + 2 + _NB]

    def tier(self, name: str) -> tuple[dict[str, float], Floats]:
        """The counters of one tier of :data:`TIERS` (reads, bytes, seconds, hits, misses,
        errors) and its read latency histogram."""
        b = _TIER_BASE[name]
        v = self._v
        counts = {"reads": v[b + _T_READS], "bytes": v[b + _T_BYTES], "seconds": v[b + _T_SECONDS],
                  "hits": v[b + _T_HITS], "misses": v[b + _T_MISSES], "errors": v[b + _T_ERRORS]}
        return {k: float(x) for k, x in counts.items()}, v[b + _T_HIST:b + _T_HIST + _NB]

    @property
    def decode(self) -> tuple[int, float, int]:
        """``(calls, seconds, samples)`` of decode/map time."""
        v = self._v
        return int(v[_DECODE]), float(v[_DECODE + 1]), int(v[_DECODE + 2])

    @property
    def cold_retries(self) -> int:
        return int(self._v[_RETRIES])

    @property
    def cold_throttled(self) -> int:
        return int(self._v[_THROTTLED])


def _refuse(name: str, value: Any, allowed: str) -> OptionError:
    return OptionError(f"Telemetry.{name}: {show(value)} is not {allowed}")


def _below(value: Any, top: float) -> bool:
    """Whether ``0 <= value < top``; False for what does not compare with numbers."""
    try:
        return bool(0 <= value < top)
    except TypeError:
        return False


class Telemetry:
    """The recorder of one process (see the module docstring).

    ``window_s``: a window closes every that many seconds (None: not by time);
    ``window_steps``: or after that many steps (None: not by steps); with both None,
    windows close only through :meth:`close_window`. ``metrics_path``: a file each closed
    window is appended to as one JSON line. ``rank``: put in every summary (the loader
    passes its topology's; a health publisher fills it in when None).
    ``export_interval_s``: the least time between two :meth:`export` s of a worker."""

    def __init__(self, *, window_s: float | None = 10.0, window_steps: int | None = None,
                 metrics_path: str | os.PathLike[str] | None = None, rank: int | None = None,
                 export_interval_s: float = 0.1) -> None:
        self.window_s = None if window_s is None else check_float(
            "window_s", window_s, min=0, min_open=True, max=_MAX_SECONDS, hint="seconds per window, or None")
        self.window_steps = None if window_steps is None else check_int(
            "window_steps", window_steps, min=1, max=1 << 40, hint="steps per window, or None")
        self.metrics_path = None if metrics_path is None else check_path("metrics_path", metrics_path)
        self.rank = None if rank is None else check_int("rank", rank, min=0, max=1 << 40)
        self.export_interval_s = check_float("export_interval_s", export_interval_s, min=0, max=_MAX_SECONDS)
        self._start(worker=False)
        _INSTANCES.add(self)
        if self.window_s is not None or self.window_steps is not None:
            thread = threading.Thread(target=_window_loop, args=(weakref.ref(self), self._wake),
                                      name="datapipe-telemetry", daemon=True)
            self._thread: threading.Thread | None = thread
            thread.start()

    def _start(self, *, worker: bool) -> None:
        """Fresh state: at construction, in a forked child, in a worker's copy."""
        #: a worker's recorder: it exports its counts and closes no windows of its own
        self.worker = worker
        self._local = threading.local()
        self._lock = threading.Lock()  # slot registration, merges, window bookkeeping
        self._slots: list[tuple[weakref.ref[threading.Thread], list[float]]] = []
        self._retired = np.zeros(_SIZE)
        self._merged = np.zeros(_SIZE)
        self._exported = np.zeros(_SIZE)
        self._exported_at = -math.inf
        self._worker_depths: dict[int, tuple[float, float]] = {}  # pid -> (depth, monotonic time)
        self._depth = 0.0
        self._waiting_since = 0.0
        self._last_step = 0.0
        self._steps = 0  # step() marks ever (the trainer's thread writes it)
        self._window_step0 = 0
        self._asked = False
        self._prev = np.zeros(_SIZE)
        self._window_start = time.monotonic()
        self._seq = 0
        self._closed = False
        self._callbacks: list[Callable[[WindowSummary], None]] = []
        self._warned: set[str] = set()
        self._wake = threading.Event()
        self._thread = None
        #: the last closed window, or None before the first
        self.last: WindowSummary | None = None

    # -- recording: the hot path --------------------------------------------------------
    def _new_slot(self) -> list[float]:
        v = [0.0] * _SIZE
        with self._lock:
            self._slots.append((weakref.ref(threading.current_thread()), v))
        self._local.v = v
        return v

    def _slot(self) -> list[float]:
        """This thread's counters."""
        try:
            return self._local.v  # type: ignore[no-any-return]
        except AttributeError:
            return self._new_slot()

    def _time(self, index: int, seconds: float) -> None:
        """Count one timing of ``seconds``: its number, sum and histogram bucket."""
        v = self._slot()
        v[index] += 1
        v[index + 1] += seconds
        v[index + 2 + bisect_left(BUCKET_BOUNDS, seconds)] += 1

    def wait_begin(self) -> float:
        """Mark the start of a wait for data (before ``next()``); returns the time to give
        :meth:`wait_end`. A wait still open shows in a window as ``waiting_now_s``."""
        t = self._waiting_since = time.perf_counter()
        return t

    def wait_end(self, started: float) -> float:
        """End the wait begun at ``started``, count it as data wait; returns its seconds."""
        seconds = time.perf_counter() - started
        self._waiting_since = 0.0
        self.data_wait(seconds)
        return seconds

    def data_wait(self, seconds: float) -> None:
        """Count ``seconds`` the trainer waited for a batch."""
        if not _below(seconds, _MAX_SECONDS):
            raise _refuse("data_wait", seconds, "a number of seconds >= 0")
        self._time(_WAIT, seconds)

    def step(self) -> None:
        """Mark a step (a batch handed to the trainer): the time since the previous mark is
        one step time. Call it from one thread (the training loop's)."""
        now = time.perf_counter()
        last = self._last_step
        self._last_step = now
        self._steps += 1
        if last:
            self._time(_STEP, now - last)
        if self.window_steps is not None and not self._asked \
                and self._steps - self._window_step0 >= self.window_steps:
            self._asked = True
            self._wake.set()

    def compute(self, seconds: float) -> None:
        """Count ``seconds`` of the trainer's own work in a step (forward and backward,
        without the collectives that wait on other ranks): in synchronous training every
        rank's step time is the slowest rank's, and only this tells the slow one."""
        if not _below(seconds, _MAX_SECONDS):
            raise _refuse("compute", seconds, "a number of seconds >= 0")
        self._time(_COMPUTE, seconds)

    def read(self, tier: str, nbytes: int, seconds: float) -> None:
        """Count a read of ``nbytes`` served by ``tier`` (one of :data:`TIERS`) in
        ``seconds``."""
        try:
            base = _TIER_BASE[tier]
            ok = 0 <= nbytes < _MAX_COUNT and 0.0 <= seconds < _MAX_SECONDS
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise self._bad_tier("read", tier, f"nbytes={show(nbytes)}, seconds={show(seconds)}")
        v = self._slot()
        v[base] += 1
        v[base + _T_BYTES] += nbytes
        v[base + _T_SECONDS] += seconds
        v[base + _T_HIST + bisect_left(BUCKET_BOUNDS, seconds)] += 1

    def hit(self, tier: str) -> None:
        """Count a lookup that found its object in ``tier``."""
        self._tier_count("hit", tier, _T_HITS)

    def miss(self, tier: str) -> None:
        """Count a lookup that did not find its object in ``tier``."""
        self._tier_count("miss", tier, _T_MISSES)

    def error(self, tier: str) -> None:
        """Count a read or write of ``tier`` that failed."""
        self._tier_count("error", tier, _T_ERRORS)

    def _tier_count(self, name: str, tier: str, offset: int) -> None:
        try:
            base = _TIER_BASE[tier]
        except (KeyError, TypeError):
            raise self._bad_tier(name, tier, "") from None
        self._slot()[base + offset] += 1

    def cold_retry(self, n: int = 1) -> None:
        """Count ``n`` retried cold requests (failures asked again)."""
        self._count("cold_retry", n, _RETRIES)

    def throttled(self, n: int = 1) -> None:
        """Count ``n`` cold answers that asked us to slow down (503 SlowDown, 429)."""
        self._count("throttled", n, _THROTTLED)

    def _count(self, name: str, n: int, index: int) -> None:
        if not _below(n, _MAX_COUNT):
            raise _refuse(name, n, "a count >= 0")
        self._slot()[index] += n

    def prefetch_depth(self, depth: float) -> None:
        """Set the prefetch depth now (batches or bytes read ahead, as the loader counts
        them): a gauge, the last value set in this process, summed with its workers'."""
        if not _below(depth, _MAX_COUNT):
            raise _refuse("prefetch_depth", depth, "a depth >= 0")
        self._depth = depth
        v = self._slot()
        v[_DEPTH] += depth
        v[_DEPTH + 1] += 1

    def decode(self, seconds: float, samples: int = 1) -> None:
        """Count ``seconds`` of decode/map work over ``samples`` samples (one call per
        batch, not per sample: a sample of 16 KiB takes microseconds)."""
        if not (_below(seconds, _MAX_SECONDS) and _below(samples, _MAX_COUNT)):
            raise _refuse("decode", (seconds, samples), "(seconds >= 0, samples >= 0)")
        v = self._slot()
        v[_DECODE] += 1
        v[_DECODE + 1] += seconds
        v[_DECODE + 2] += samples

    def _bad_tier(self, name: str, tier: Any, rest: str) -> OptionError:
        if isinstance(tier, str) and tier in _TIER_BASE:
            return _refuse(name, rest, "a read: nbytes an int >= 0 and seconds a number >= 0")
        return _refuse(name, tier, "a tier: one of " + ", ".join(TIERS))

    # -- workers --------------------------------------------------------------------------
    def export(self, *, force: bool = False) -> bytes | None:
        """This process's counts since its previous export, as bytes for :meth:`merge` in
        the main process; None when the previous export was less than
        ``export_interval_s`` ago (``force``: export anyway, e.g. with a pass's last batch)."""
        now = time.monotonic()
        if not force and now - self._exported_at < self.export_interval_s:
            return None
        with self._lock:
            totals = self._local_totals()
            delta = totals - self._exported
            self._exported = totals
            self._exported_at = now
        return _DELTA_HEADER.pack(_DELTA_MAGIC, _SIZE, os.getpid(), float(self._depth)) + delta.tobytes()

    def merge(self, delta: bytes) -> None:
        """Add a worker's :meth:`export` to this process's counts. :class:`HealthError` for
        bytes that are not one (another version of datapipe in the worker, damage)."""
        if not isinstance(delta, (bytes, bytearray, memoryview)) or len(delta) != _DELTA_HEADER.size + 8 * _SIZE:
            size = len(delta) if isinstance(delta, (bytes, bytearray, memoryview)) else None
            raise HealthError(f"Telemetry.merge: {type(delta).__name__} of {size} bytes is not a worker's "
                              f"export ({_DELTA_HEADER.size + 8 * _SIZE} bytes); is the worker running another "
                              "version of datapipe?")
        magic, size, pid, depth = _DELTA_HEADER.unpack_from(delta)
        values = np.frombuffer(delta, dtype="<f8", offset=_DELTA_HEADER.size)
        if magic != _DELTA_MAGIC or size != _SIZE or not (math.isfinite(depth) and depth >= 0) \
                or not np.isfinite(values).all() or (values < 0).any():
            raise HealthError(f"Telemetry.merge: a worker's export (pid {pid}) does not parse: bad header or "
                              "counts that are negative or not finite")
        now = time.monotonic()
        with self._lock:
            self._merged += values
            self._worker_depths[pid] = (depth, now)
            if len(self._worker_depths) > _MAX_WORKER_GAUGES:
                oldest = min(self._worker_depths, key=lambda p: self._worker_depths[p][1])
                del self._worker_depths[oldest]

    # -- reading ----------------------------------------------------------------------------
    def _local_totals(self) -> Floats:
        """This process's own counters (no merged workers); the caller holds the lock."""
        acc = self._retired.copy()
        alive = []
        for ref, v in self._slots:
            thread = ref()
            counts = np.array(v)
            if thread is None or not thread.is_alive():
                self._retired += counts  # a thread that ended writes no more
            else:
                alive.append((ref, v))
            acc += counts
        self._slots = alive
        return acc

    def _totals(self) -> Floats:
        with self._lock:
            return self._local_totals() + self._merged

    def totals(self) -> Totals:
        """Every counter since the start, of this process and the workers merged into it."""
        return Totals(self._totals())

    def depth_now(self) -> float:
        """The prefetch depth now: this process's gauge plus its workers' (each as of its
        last export, for at most a minute)."""
        now = time.monotonic()
        with self._lock:
            workers = sum(d for d, t in self._worker_depths.values() if now - t <= _WORKER_GAUGE_S)
        return float(self._depth) + workers

    def snapshot(self) -> WindowSummary:
        """The current window so far (since the last closed one), without closing it."""
        totals = self._totals()
        with self._lock:
            prev, start, seq = self._prev, self._window_start, self._seq
        return self._summary(totals - prev, time.monotonic() - start, seq + 1, final=False)

    @property
    def windows(self) -> int:
        """How many windows have been closed."""
        return self._seq

    def on_window(self, callback: Callable[[WindowSummary], None]) -> None:
        """Call ``callback(summary)`` with each closed window, on the window thread; it
        must not block for long (a publisher hands the summary to a thread of its own)."""
        with self._lock:
            self._callbacks.append(callback)

    def remove_callback(self, callback: Callable[[WindowSummary], None]) -> None:
        """Stop calling ``callback`` (a no-op when it is not registered)."""
        with self._lock:
            self._callbacks = [c for c in self._callbacks if c is not callback]

    def close_window(self, *, final: bool = False) -> WindowSummary:
        """Close the current window now: its summary goes to ``metrics_path`` and the
        callbacks (on this thread) and becomes :attr:`last`."""
        with self._lock:
            totals = self._local_totals() + self._merged
            now = time.monotonic()
            delta, duration = totals - self._prev, now - self._window_start
            self._prev, self._window_start = totals, now
            self._window_step0, self._asked = self._steps, False
            self._seq += 1
            seq = self._seq
            callbacks = list(self._callbacks)
        summary = self._summary(delta, duration, seq, final=final)
        self.last = summary
        if self.metrics_path is not None and not self.worker:
            self._append_line(self.metrics_path, summary)
        for callback in callbacks:
            try:
                callback(summary)
            except Exception as e:  # a sink's failure must not stop the windows
                self._warn_once(f"callback {callback!r}", f"datapipe telemetry: a window callback failed "
                                f"({type(e).__name__}: {e}); the next windows are still handed to it")
        return summary

    def close(self) -> None:
        """Stop the window thread; the open window is closed as the ``final`` one when
        anything was recorded in it. A later record still counts (for :meth:`snapshot`)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if not self.worker:
            totals = self._totals()
            if (totals != self._prev).any():
                self.close_window(final=True)

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the window's summary --------------------------------------------------------------
    def _summary(self, d: Floats, duration: float, seq: int, *, final: bool) -> WindowSummary:
        def timer(base: int) -> tuple[int, float, float | None, float | None, float | None]:
            n, s, hist = int(d[base]), float(d[base + 1]), d[base + 2:base + 2 + _NB]
            return n, s, (s / n if n else None), quantile(hist, 0.5), quantile(hist, 0.95)

        steps, step_s, step_mean, step_p50, step_p95 = timer(_STEP)
        waits, wait_s, wait_mean, wait_p50, wait_p95 = timer(_WAIT)
        computes, compute_s, compute_mean, _c50, _c95 = timer(_COMPUTE)
        tiers: dict[str, TierSummary] = {}
        for name, b in _TIER_BASE.items():
            reads, nbytes, seconds = int(d[b + _T_READS]), int(d[b + _T_BYTES]), float(d[b + _T_SECONDS])
            hits, misses, errors = int(d[b + _T_HITS]), int(d[b + _T_MISSES]), int(d[b + _T_ERRORS])
            if not (reads or hits or misses or errors):
                continue
            hist = d[b + _T_HIST:b + _T_HIST + _NB]
            tiers[name] = TierSummary(
                reads=reads, bytes=nbytes, seconds=seconds, hits=hits, misses=misses, errors=errors,
                bytes_per_s=nbytes / seconds if seconds > 0 else None,
                latency_mean_s=seconds / reads if reads else None,
                latency_p50_s=quantile(hist, 0.5), latency_p95_s=quantile(hist, 0.95),
                hit_ratio=hits / (hits + misses) if hits + misses else None)
        served = sum(t.reads for t in tiers.values())
        cached = served - (tiers["cold"].reads if "cold" in tiers else 0)
        decode_calls, decode_s, decoded = int(d[_DECODE]), float(d[_DECODE + 1]), int(d[_DECODE + 2])
        depth_n = float(d[_DEPTH + 1])
        waiting = self._waiting_since
        return WindowSummary(
            seq=seq, rank=self.rank, host=socket.gethostname(), pid=os.getpid(), time=time.time(),
            duration_s=duration, final=final,
            steps=steps, step_s=step_s, step_mean_s=step_mean, step_p50_s=step_p50, step_p95_s=step_p95,
            waits=waits, data_wait_s=wait_s, data_wait_mean_s=wait_mean, data_wait_p50_s=wait_p50,
            data_wait_p95_s=wait_p95, data_wait_fraction=min(wait_s / duration, 1.0) if duration > 0 else None,
            waiting_now_s=max(time.perf_counter() - waiting, 0.0) if waiting else 0.0,
            computes=computes, compute_s=compute_s, compute_mean_s=compute_mean,
            decode_s=decode_s, decoded_samples=decoded,
            decode_per_sample_s=decode_s / decoded if decoded else (decode_s / decode_calls if decode_calls else None),
            cold_retries=int(d[_RETRIES]), cold_throttled=int(d[_THROTTLED]),
            prefetch_depth=self.depth_now(), prefetch_depth_mean=float(d[_DEPTH]) / depth_n if depth_n else None,
            cache_hit_ratio=cached / served if served else None, tiers=tiers)

    def _append_line(self, path: str, summary: WindowSummary) -> None:
        line = (json.dumps(summary.to_dict(), separators=(",", ":")) + "\n").encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line)  # one write: lines of several writers never interleave
            finally:
                os.close(fd)
        except OSError as e:
            self._warn_once("metrics_path", f"datapipe telemetry: cannot append to metrics_path={self.metrics_path}: "
                            f"{e.strerror or e}; windows go on without it (fix the path or the disk)")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    # -- processes ---------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "window_steps": self.window_steps, "rank": self.rank,
                "export_interval_s": self.export_interval_s}

    def __reduce__(self) -> tuple[Callable[[Mapping[str, Any]], Telemetry], tuple[dict[str, Any]]]:
        return _worker_copy, (self._config(),)


def _worker_copy(config: Mapping[str, Any]) -> Telemetry:
    """A pickled Telemetry, unpickled in a worker: the same settings, counting from zero,
    without window thread, metrics file or callbacks (its counts reach the main process
    through :meth:`Telemetry.export`)."""
    tel = Telemetry.__new__(Telemetry)
    tel.window_s, tel.window_steps = config["window_s"], config["window_steps"]
    tel.metrics_path, tel.rank, tel.export_interval_s = None, config["rank"], config["export_interval_s"]
    tel._start(worker=True)
    _INSTANCES.add(tel)
    return tel


def _window_loop(ref: weakref.ref[Telemetry], wake: threading.Event) -> None:
    """The window thread: closes windows on time or when a step asks. Holds the recorder
    only while it works, so an abandoned recorder is collected and the thread ends."""
    while True:
        tel = ref()
        if tel is None or tel._closed or tel._wake is not wake:
            return
        timeout = None
        if tel.window_s is not None:
            timeout = max(tel._window_start + tel.window_s - time.monotonic(), 0.0)
        del tel
        wake.wait(timeout if timeout is not None else 1.0)
        wake.clear()
        tel = ref()
        if tel is None or tel._closed or tel._wake is not wake:
            return
        due_by_time = tel.window_s is not None and time.monotonic() - tel._window_start >= tel.window_s
        if due_by_time or tel._asked:  # _asked: a step found the window full
            tel.close_window()
        del tel


def _reset_in_child() -> None:
    """After a fork: every recorder starts from zero as a worker copy (its parent goes on
    counting its own; the child's counts reach it through export/merge)."""
    for tel in list(_INSTANCES):
        tel.metrics_path = None
        tel._start(worker=True)


os.register_at_fork(after_in_child=_reset_in_child)
