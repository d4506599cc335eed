"""Window summaries as the detector reads them: a published document checked and parsed
(:func:`parse_summary`), many of them as numpy columns (:class:`SummaryTable`), and the
units a report speaks in (:func:`rate`, :func:`seconds`).

A document comes from another process, another host or a file anyone could write: it is
read bounded (at most :data:`MAX_SUMMARY_BYTES`), parsed as JSON only, and every field the
detector uses is taken as a number only if it is one (a bool, a string, NaN, a negative
count make the row unreadable, named with the reason), never trusted further.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import HealthError
from ..options import show
from ..telemetry import SUMMARY_FORMAT, SUMMARY_VERSION, TIERS, WindowSummary

Floats = npt.NDArray[np.float64]

__all__ = ["MAX_SUMMARY_BYTES", "parse_summary", "SummaryTable", "rate", "seconds"]

#: the largest summary document read (one is about 2 KB)
MAX_SUMMARY_BYTES = 1 << 20

_NAN = math.nan
_REQUIRED = ("time", "duration_s", "steps", "data_wait_s")
_OPTIONAL = ("step_s", "waiting_now_s", "computes", "compute_s", "decode_s", "decoded_samples", "cold_throttled",
             "cold_retries", "cache_hit_ratio")
_KEYS = ("rank", "seq", *_REQUIRED, *_OPTIONAL[:-1])  # every number a summary always holds
_ROW = itemgetter(*_KEYS)
_EMPTY: dict[str, Any] = {}
_NUMBERS = {int, float, type(None)}
_TIER_INDEX = {name: j for j, name in enumerate(TIERS)}


def parse_summary(data: bytes, where: str) -> dict[str, Any]:
    """The window document in ``data`` (read from ``where``, named in errors):
    :class:`HealthError` unless it is a JSON object of :data:`SUMMARY_FORMAT` with an int
    ``rank``. Its numbers are checked by :class:`SummaryTable`."""
    if len(data) > MAX_SUMMARY_BYTES:
        raise HealthError(f"{where}: {len(data)} bytes, more than a window summary may be ({MAX_SUMMARY_BYTES})")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
        raise HealthError(f"{where}: not JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(doc, dict):
        raise HealthError(f"{where}: a JSON {type(doc).__name__}, not a window summary object")
    if doc.get("format") != SUMMARY_FORMAT:
        raise HealthError(f"{where}: format {show(doc.get('format'))}, not {SUMMARY_FORMAT!r}")
    version = doc.get("version")
    if type(version) is not int or not 1 <= version <= SUMMARY_VERSION:
        raise HealthError(f"{where}: version {show(version)} of the summary format; this datapipe reads "
                          f"1..{SUMMARY_VERSION} (upgrade datapipe where the detector runs)")
    rank = doc.get("rank")
    if type(rank) is not int or rank < 0:
        raise HealthError(f"{where}: rank {show(rank)} is not an int >= 0")
    return doc


_BAD = -math.inf  # a field present but not a number: fails every row check


def _num(x: Any) -> float:
    """``x`` as a float when it is an int or a float (not a bool, not NaN); NaN when it is
    absent (None); :data:`_BAD` otherwise."""
    t = type(x)
    if t is float:
        return x if x == x else _BAD
    if t is int:
        try:
            return float(x)
        except OverflowError:  # an int of hundreds of digits
            return _BAD
    return _NAN if x is None else _BAD


def _numbers(rows: list[Any]) -> Floats:
    """Equal-length lists of values as a float array, each as :func:`_num` takes it:
    through numpy whole when they are ints and floats (what a summary holds), else value
    by value."""
    kinds = set(map(type, chain.from_iterable(rows)))
    if kinds <= _NUMBERS:
        try:
            if type(None) in kinds:
                obj = np.array(rows, dtype=object)
                absent = obj == None  # noqa: E711  (elementwise)
                obj[absent] = 0.0
                out = obj.astype(float)
                out[np.isnan(out)] = _BAD  # a NaN given is no number
                out[absent] = _NAN
                return out
            out = np.array(rows, dtype=float)
            out[np.isnan(out)] = _BAD
            return out
        except OverflowError:  # an int of hundreds of digits
            pass
    return np.array([[_num(v) for v in row] for row in rows], dtype=float)


def _dicts(values: list[Any]) -> tuple[list[dict[str, Any]], npt.NDArray[np.bool_]]:
    """Each value if it is a dict, else an empty one; and where a value was there but no dict."""
    out = [v if type(v) is dict else _EMPTY for v in values]
    odd = np.fromiter((v is not None and type(v) is not dict for v in values), dtype=bool, count=len(values))
    return out, odd


def _columns(docs: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Floats], Floats, npt.NDArray[np.bool_]]:
    """``(docs as dicts, a column per field, tier read rates (len(docs), len(TIERS)),
    misshapen rows)``. Summaries as datapipe writes them (every field there) are read
    through numpy whole; anything else field by field, value by value."""
    dicts, misshapen = _dicts(docs)
    n = len(docs)
    rates = np.full((n, len(TIERS)), _NAN)
    try:
        if misshapen.any():
            raise ValueError("a document that is no object")
        fields = _numbers(list(map(_ROW, dicts))).reshape(n, len(_KEYS))
        col = {key: fields[:, i] for i, key in enumerate(_KEYS)}
        # the tiers a summary holds, as (row, tier, rate): only the tiers read are there
        found = [(i, name, e["bytes_per_s"]) for i, d in enumerate(dicts) for name, e in d["tiers"].items()]
    except (KeyError, ValueError, AttributeError, TypeError):
        pass
    else:
        if found:
            rows = np.array([t[0] for t in found])
            cols = np.array([_TIER_INDEX.get(t[1], -1) for t in found])
            known = cols >= 0  # a tier of a later datapipe is left out, as value by value
            rates[rows[known], cols[known]] = _numbers([[t[2] for t in found]])[0][known]
        col["cache_hit_ratio"] = _numbers([[d.get("cache_hit_ratio") for d in dicts]])[0]
        return dicts, col, rates, misshapen
    col = {key: np.array([_num(d.get(key)) for d in dicts], dtype=float) for key in ("rank", "seq", *_REQUIRED,
                                                                                        *_OPTIONAL)}
    tier_dicts, odd = _dicts([d.get("tiers") for d in dicts])
    misshapen |= odd
    for j, name in enumerate(TIERS):
        entries, odd = _dicts([t.get(name) for t in tier_dicts])
        misshapen |= odd
        rates[:, j] = [_num(e.get("bytes_per_s")) for e in entries]
    return dicts, col, rates, misshapen


@dataclass
class SummaryTable:
    """Summaries as columns, one row per rank (the newest summary of each); NaN where a
    field is absent. ``unreadable``: (rank or None, reason) of the documents left out."""

    ranks: npt.NDArray[np.int64]
    hosts: list[str]
    seq: Floats
    time: Floats
    duration: Floats
    steps: Floats
    step_mean: Floats
    wait_s: Floats
    waiting_now: Floats
    computes: Floats
    compute_mean: Floats
    decode_per_sample: Floats
    throttled: Floats
    retries: Floats
    hit_ratio: Floats
    tier_bps: Floats  # (ranks, len(TIERS)): each tier's read rate, NaN where not read
    unreadable: list[tuple[int | None, str]]

    def __len__(self) -> int:
        return len(self.ranks)

    @classmethod
    def from_summaries(cls, summaries: Iterable[WindowSummary | Mapping[str, Any]]) -> SummaryTable:
        """The table of ``summaries`` (:class:`WindowSummary` s or their documents)."""
        docs: list[Any] = [s.to_dict() if isinstance(s, WindowSummary) else s for s in summaries]
        dicts, col, tier_bps, misshapen = _columns(docs)
        rank = col["rank"]
        bad_rank = ~(rank >= 0) | (rank != np.floor(rank)) | (rank > 2.0 ** 53)
        required = np.stack([col[k] for k in _REQUIRED])
        bad = misshapen | bad_rank | ~np.isfinite(required).all(axis=0) | (required < 0).any(axis=0)
        for key in _OPTIONAL:
            bad |= (col[key] < 0) | np.isinf(col[key])  # NaN (absent) passes: the field is optional
        bad |= ((tier_bps < 0) | np.isinf(tier_bps)).any(axis=1)
        unreadable: list[tuple[int | None, str]] = []
        for i in np.flatnonzero(bad):
            r = None if bad_rank[i] else int(rank[i])
            unreadable.append((r, _why_unreadable(docs[i])))
        keep = np.flatnonzero(~bad)
        # the newest summary of each rank: sort by (rank, time), keep the last of each rank
        order = keep[np.lexsort((col["time"][keep], rank[keep]))]
        if len(order):
            last = np.r_[rank[order][1:] != rank[order][:-1], True]
            order = order[last]
        hosts = [str(dicts[i].get("host"))[:256] for i in order]
        steps, computes, decoded = col["steps"][order], col["computes"][order], col["decoded_samples"][order]
        with np.errstate(divide="ignore", invalid="ignore"):
            step_mean = np.where(steps > 0, col["step_s"][order] / steps, _NAN)
            compute_mean = np.where(computes > 0, col["compute_s"][order] / computes, _NAN)
            decode_per_sample = np.where(decoded > 0, col["decode_s"][order] / decoded, _NAN)
        return cls(ranks=rank[order].astype(np.int64), hosts=hosts, seq=col["seq"][order], time=col["time"][order],
                   duration=col["duration_s"][order], steps=steps, step_mean=step_mean,
                   wait_s=col["data_wait_s"][order], waiting_now=np.nan_to_num(col["waiting_now_s"][order]),
                   computes=np.nan_to_num(computes), compute_mean=compute_mean, decode_per_sample=decode_per_sample,
                   throttled=np.nan_to_num(col["cold_throttled"][order]),
                   retries=np.nan_to_num(col["cold_retries"][order]), hit_ratio=col["cache_hit_ratio"][order],
                   tier_bps=tier_bps[order], unreadable=unreadable)

    def select(self, ranks: Sequence[int]) -> tuple[SummaryTable, list[int]]:
        """The rows of ``ranks`` (a sub-group), and the ranks among them with no row."""
        wanted = np.unique(np.asarray(list(ranks), dtype=np.int64))
        rows = np.flatnonzero(np.isin(self.ranks, wanted))
        missing = np.setdiff1d(wanted, self.ranks[rows]).tolist()
        return self.take(rows), missing

    def take(self, rows: npt.NDArray[np.intp]) -> SummaryTable:
        """A table of the rows ``rows`` (indices)."""
        out = {}
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                out[name] = value[rows]
        return SummaryTable(hosts=[self.hosts[i] for i in rows], unreadable=list(self.unreadable), **out)


def _why_unreadable(doc: Any) -> str:
    if type(doc) is not dict:
        return f"a {type(doc).__name__}, not a summary document"
    rank = doc.get("rank")
    if type(rank) is not int or rank < 0:
        return f"rank {show(rank)} is not an int >= 0"
    for key in (*_REQUIRED, *_OPTIONAL):
        value = doc.get(key)
        x = _num(value)
        if x == _BAD or (key in _REQUIRED and not math.isfinite(x)):
            return f"{key} {show(value)} is not a number"
        if x < 0 or math.isinf(x):
            return f"{key} {show(value)} is negative or infinite"
    tiers = doc.get("tiers")
    if tiers is not None and (type(tiers) is not dict or any(v is not None and type(v) is not dict
                                                             for v in tiers.values())):
        return "tiers is not an object of tier objects"
    return "a tier's bytes_per_s is not a number, negative or infinite"


def rate(bytes_per_s: float) -> str:
    """``40 MB/s``, ``1.8 GB/s``: decimal units, two or three significant digits."""
    x = float(bytes_per_s)
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if x >= scale:
            return f"{_sig(x / scale)} {unit}"
    return f"{_sig(x)} B/s"


def seconds(s: float) -> str:
    """``850 us``, ``12 ms``, ``1.6 s``, ``95 s``."""
    x = float(s)
    if x >= 1:
        return f"{_sig(x)} s"
    if x >= 1e-3:
        return f"{_sig(x * 1e3)} ms"
    return f"{_sig(x * 1e6)} us"


def _sig(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"
