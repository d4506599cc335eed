"""What a TieredCache is configured with: :class:`CacheTier` (a further node-local directory
and its budget, for ``local_tiers``), the checks of the directory arguments, and
:class:`Settings`, the configuration a process's state is built from (state.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CacheBudgetError, CacheOptionError, OptionError
from ..options import check_path, show
from ..storage import RetryPolicy, Store

__all__ = ["CacheTier", "Tier", "Settings", "check_local_tiers", "refuse_shared_folders"]


@dataclass(frozen=True)
class CacheTier:
    """A node-local directory and its byte budget, for ``TieredCache(local_tiers=...)``."""

    path: str | os.PathLike[str]
    bytes: int


#: the name ``CacheTier`` had (before ``datapipe.checkpoint.Tier`` took it); deprecated
Tier = CacheTier


class Settings(Protocol):
    """A TieredCache's configuration, as each process's state reads it (checked when the
    cache was made)."""

    hot_bytes: int
    warm_dir: str | None
    warm_bytes: int
    storage_options: dict[str, Any]
    max_inflight_bytes: int
    retry: RetryPolicy
    prefetch_threads: int
    pin_wait_s: float
    cold_wrapper: Callable[[Store], Store] | None
    stats_interval_s: float
    shared_dir: str | None
    shared_bytes: int
    lease_timeout_s: float
    shared_wait_s: float
    cold_concurrency: int
    local_tiers: tuple[CacheTier, ...]
    tier_retry_s: float
    tier_deadline_s: float | None
    tier_min_mb_s: float | None
    tier_window_bytes: int
    #: folders a parent process checked at open and found sound (a DataLoader worker's cache
    #: came from it, pickled or forked): not checked again in this process
    checked_roots: frozenset[str]


def check_local_tiers(local_tiers: Any, warm_dir: object) -> tuple[CacheTier, ...]:
    """``local_tiers`` as CacheTier records with plain paths, each budget > 0, below a
    ``warm_dir``."""
    if isinstance(local_tiers, (str, bytes)) or not isinstance(local_tiers, Sequence):
        raise OptionError(f"local_tiers={show(local_tiers)}: expected a list of CacheTier(path, bytes)")
    for i, tier in enumerate(local_tiers):
        if not isinstance(tier, CacheTier):
            raise OptionError(f"local_tiers[{i}]={show(tier)}: local_tiers takes CacheTier(path, bytes) records")
        check_path(f"local_tiers[{i}].path", tier.path)
        if not isinstance(tier.bytes, int) or isinstance(tier.bytes, bool) or tier.bytes <= 0:
            raise CacheOptionError(f"local tier {tier.path!s} needs bytes > 0, got {show(tier.bytes)}")
    if local_tiers and warm_dir is None:
        raise CacheOptionError("local_tiers lie below warm_dir; give warm_dir (the fastest) as well")
    return tuple(CacheTier(os.fspath(t.path), t.bytes) for t in local_tiers)


def refuse_shared_folders(tiers: list[tuple[str, str | os.PathLike[str] | None]]) -> None:
    """Each directory tier needs a folder of its own: two tiers in one folder (or one inside
    the other) would wait on their own locks and evict each other's copies."""
    seen: list[tuple[str, str]] = []
    for name, path in tiers:
        if path is None:
            continue
        real = os.path.realpath(os.fspath(path))
        for other, other_real in seen:
            if os.path.commonpath([real, other_real]) in (real, other_real):
                how = "the same folder" if real == other_real else "folders one inside the other"
                raise CacheBudgetError(
                    f"{other}={other_real} and {name}={real} are {how}; each cache tier needs a "
                    "folder of its own: give them separate paths")
        seen.append((name, real))
