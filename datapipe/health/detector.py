"""Naming stragglers with their cause, from window summaries alone.

    report = detect(board.read(), k=1.5)
    for f in report.stragglers:
        print(f)   # rank 3 (node1): data: node-local tier reads 40 MB/s against a median of 1.8 GB/s ...

Each rank's newest summary is compared with the median of the ranks compared (all of them,
or a sub-group's ``ranks``); nothing here talks to any rank, so the detector runs on any
rank, on a sub-group, or outside the job (``datapipe status RUN_DIR``), at any time.

- data: the rank waits for data ``k`` times the median wait per step, and the excess is a
  visible part of a step (``min_share`` of the median step). The cause named is the first
  figure that stands out against the median: a tier's read rate (``k`` times slower), the
  cache hit ratio (20 points lower), cold throttling or retries, decode/map time per
  sample; else the wait itself.
- compute: the rank's step time is ``k`` times the median and its data wait does not
  explain it. In synchronous training every rank's step lasts as long as the slowest's, so
  step times cannot tell which rank is slow: when every rank compared records its own work
  (``Telemetry.compute``), that time is compared instead.
- stale: the summary is older than ``stale_s`` (default: three windows, at least 30 s): the
  rank stopped publishing, so it is reported as stale and left out of the comparison, not
  named a straggler. idle: a window without a step or a wait. missing: a rank of ``ranks``
  with no summary. unreadable: a document that is not a summary (named with the reason).

Everything is computed over numpy columns (:class:`~.summary.SummaryTable`); only the
ranks named are formatted one by one. A rank is named only against at least two others
(with two ranks, neither is ``k`` times the median of both).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..options import check_float
from ..telemetry import TIERS, WindowSummary
from .summary import Floats, SummaryTable, rate, seconds

__all__ = ["detect", "Finding", "Report", "STRAGGLER_KINDS"]

#: the kinds of finding that name a straggler; the others (stale, idle, missing,
#: unreadable) say a rank could not be compared
STRAGGLER_KINDS = ("data", "compute")

_HIT_RATIO_DROP = 0.2
_MIN_STALE_S = 30.0


@dataclass(frozen=True)
class Finding:
    """One rank named: ``kind`` (``data``, ``compute``, ``stale``, ``idle``, ``missing``,
    ``unreadable``), ``message`` (starting with the kind), its host, and for stragglers
    ``ratio``, its step (or compute) time over the median."""

    rank: int | None
    kind: str
    message: str
    host: str | None = None
    ratio: float | None = None

    def __str__(self) -> str:
        who = "a document" if self.rank is None else f"rank {self.rank}"
        return f"{who}{f' ({self.host})' if self.host else ''}: {self.message}"


@dataclass(frozen=True)
class Report:
    """What :func:`detect` found: ``compared`` ranks, their medians, the stragglers named
    (slowest first) and the ranks that could not be compared (``others``)."""

    compared: int
    k: float
    median_step_s: float | None
    median_data_wait_s: float | None
    stragglers: tuple[Finding, ...]
    others: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """True when no rank is named, stale, missing or unreadable."""
        return not self.stragglers and not self.others

    def named(self, kind: str | None = None) -> list[int]:
        """The ranks of the findings of ``kind`` (every kind when None)."""
        return [f.rank for f in (*self.stragglers, *self.others)
                if f.rank is not None and (kind is None or f.kind == kind)]

    def to_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "k": self.k, "median_step_s": self.median_step_s,
                "median_data_wait_s": self.median_data_wait_s,
                "stragglers": [asdict(f) for f in self.stragglers], "others": [asdict(f) for f in self.others]}

    def format(self) -> str:
        """The report as lines of text."""
        if self.compared:
            head = (f"{self.compared} rank(s) compared: median step {seconds(self.median_step_s or 0.0)}, "
                    f"median data wait {seconds(self.median_data_wait_s or 0.0)} per step (k={self.k:g})")
        else:
            head = "no rank to compare"
        lines = [head]
        lines += [f"  straggler {f}" for f in self.stragglers] or ["  no straggler"]
        lines += [f"  {f}" for f in self.others]
        return "\n".join(lines)


def _median(x: Floats) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else math.nan


def detect(summaries: SummaryTable | Iterable[WindowSummary | Mapping[str, Any]], *, k: float = 1.5,
           ranks: Sequence[int] | None = None, now: float | None = None, stale_s: float | None = None,
           min_share: float = 0.05, unreadable: Iterable[tuple[int | None, str]] = ()) -> Report:
    """Compare the ranks' newest summaries and name the stragglers with their cause (see
    the module docstring). ``ranks``: compare only these (a sub-group); ``now``: the time
    (``time.time()``) ages are measured at; ``stale_s``: the age past which a summary is
    stale; ``min_share``: the least data-wait excess, as a share of the median step, that
    names a data straggler; ``unreadable``: (rank or None, reason) of documents a board could
    not read (``BoardRead.unreadable``), reported with the table's own."""
    k = check_float("k", k, min=1, min_open=True, max=1e6, hint="how many times the median names a straggler")
    min_share = check_float("min_share", min_share, min=0, max=1e6)
    now = time.time() if now is None else check_float("now", now)
    if stale_s is not None:
        stale_s = check_float("stale_s", stale_s, min=0, min_open=True)
    table = summaries if isinstance(summaries, SummaryTable) else SummaryTable.from_summaries(summaries)
    others = [Finding(r, "unreadable", f"unreadable: {why}") for r, why in [*unreadable, *table.unreadable]]
    if ranks is not None:
        table, missing = table.select(ranks)
        others += [Finding(r, "missing", "missing: no summary of it on the board") for r in missing]
    duration = _median(table.duration)
    stale_after = stale_s if stale_s is not None else max(3 * duration if math.isfinite(duration) else 0.0,
                                                          _MIN_STALE_S)
    age = now - table.time
    stale = age > stale_after
    idle = ~stale & (table.steps == 0) & (table.waiting_now == 0)
    for i in np.flatnonzero(stale).tolist():
        others.append(Finding(int(table.ranks[i]), "stale", f"stale: its last summary (window {table.seq[i]:.0f}) is "
                              f"{seconds(age[i])} old, older than {seconds(stale_after)}: it stopped publishing "
                              "(ended, hung, or lost the board); not compared", table.hosts[i]))
    for i in np.flatnonzero(idle).tolist():
        others.append(Finding(int(table.ranks[i]), "idle", f"idle: no step and no wait for data in its last window "
                              f"(window {table.seq[i]:.0f}); not compared", table.hosts[i]))
    t = table.take(np.flatnonzero(~stale & ~idle))
    if not len(t):
        return Report(0, k, None, None, (), tuple(others))
    steps = np.maximum(t.steps, 1)
    wait = (t.wait_s + t.waiting_now) / steps
    step = np.where((t.steps > 0) & np.isfinite(t.step_mean), t.step_mean, np.maximum(t.duration, t.waiting_now))
    by_compute = bool(np.all(t.computes > 0) and np.all(np.isfinite(t.compute_mean)))
    metric = t.compute_mean if by_compute else step
    med_step, med_wait, med_metric = _median(step), _median(wait), _median(metric)
    wait_excess = wait - med_wait
    data = (wait > k * med_wait) & (wait_excess > 0) & (wait_excess >= min_share * med_step)
    slow = metric > k * med_metric
    data &= ~slow | (wait_excess >= 0.5 * (metric - med_metric))  # a slow rank is data-bound when waits explain it
    compute = slow & ~data
    found = []
    if data.any() or compute.any():
        medians = _Medians(t)
        for i in np.flatnonzero(data).tolist():
            message = (f"data: {medians.cause(i, k)} (waits {seconds(wait[i])} per step for data, median "
                       f"{seconds(med_wait)})")
            found.append(Finding(int(t.ranks[i]), "data", message, t.hosts[i], float(metric[i] / med_metric)))
        what = "compute time" if by_compute else "step time"
        for i in np.flatnonzero(compute).tolist():
            ratio = float(metric[i] / med_metric)
            message = (f"compute: data wait normal ({seconds(wait[i])} per step), {what} {ratio:.1f}x the median "
                       f"({seconds(metric[i])} against {seconds(med_metric)})")
            found.append(Finding(int(t.ranks[i]), "compute", message, t.hosts[i], ratio))
    found.sort(key=lambda f: -(f.ratio or 0.0))
    return Report(len(t), k, med_step, med_wait, tuple(found), tuple(others))


class _Medians:
    """The medians a data straggler's figures are held against (computed once a rank is
    named)."""

    def __init__(self, t: SummaryTable) -> None:
        self.t = t
        self.has = np.nan_to_num(t.tier_bps) > 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a tier nobody read: an all-NaN column
            self.bps = np.nanmedian(np.where(self.has, t.tier_bps, np.nan), axis=0)
            self.hit_ratio = float(np.nanmedian(t.hit_ratio)) if np.isfinite(t.hit_ratio).any() else math.nan
            self.decode = (float(np.nanmedian(t.decode_per_sample)) if np.isfinite(t.decode_per_sample).any()
                           else math.nan)
        self.throttled = float(np.median(t.throttled))
        self.retries = float(np.median(t.retries))

    def cause(self, i: int, k: float) -> str:
        t = self.t
        worst, tier = 0.0, -1
        for j in np.flatnonzero(self.has[i]):
            ratio = self.bps[j] / t.tier_bps[i, j] if t.tier_bps[i, j] > 0 else math.inf
            if ratio > worst:
                worst, tier = ratio, int(j)
        if tier >= 0 and worst >= k:
            return f"{TIERS[tier]} tier reads {rate(t.tier_bps[i, tier])} against a median of {rate(self.bps[tier])}"
        hr = t.hit_ratio[i]
        if math.isfinite(hr) and math.isfinite(self.hit_ratio) and self.hit_ratio - hr >= _HIT_RATIO_DROP:
            return (f"cache hit ratio {hr:.0%} against a median of {self.hit_ratio:.0%}: more of its reads go to "
                    "slower tiers")
        if t.throttled[i] > max(k * self.throttled, self.throttled + 1):
            return (f"the cold store throttled {t.throttled[i]:.0f} of its requests (503/429) against a median of "
                    f"{self.throttled:.0f}")
        if t.retries[i] > max(k * self.retries, self.retries + 1):
            return f"{t.retries[i]:.0f} cold requests retried against a median of {self.retries:.0f}"
        dps = t.decode_per_sample[i]
        if math.isfinite(dps) and math.isfinite(self.decode) and dps > k * self.decode:
            return f"decode/map takes {seconds(dps)} per sample against a median of {seconds(self.decode)}"
        return "waits for data with no tier, cache or decode figure standing out"
