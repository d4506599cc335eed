"""cache: tiers of bytes with budgets over the stores of ``storage/``.

- tiered.py: `TieredCache`, the public API (read, read_range, local_path/pinned,
  pin_or_read, prefetch, set_schedule, stats, close) and the schedule: hot (memory) ->
  warm (a node-local directory shared by processes) -> further node-local directories
  (``local_tiers``) -> shared (a directory every node mounts) -> cold (any store);
- settings.py: what a cache is configured with (`CacheTier`, the checks of its folders);
- state.py: the state one process holds for a cache (tiers, pools, pins, counters);
- tier.py: the interface every directory tier implements (lookup, fill, discard) and the
  one spelling of its counters; walk.py: the one walk down the tiers (a hit, a read around
  a copy pinned elsewhere, or a fill from below);
- nodelocal.py: a node-local directory as a tier (single flight by flock, room reserved
  first, pins); shared.py: the shared directory (the warm directory's protocol with lease
  files instead of flocks, cluster-wide single flight) and its tier;
- warm.py: the directory protocol (layout, budgets, reservations, pins, fill records,
  verification: ``WarmDir.read_verified``); hot.py: the memory tier, the bytes in flight,
  the order of prefetches, the wait for room; cold.py: reads from the cold store, one
  version per download, bounded in flight;
- eviction.py: the access schedule, Belady/LRU victim choice and hit-rate simulators;
- future.py: the node's merged future (each process's next reads, published in the warm dir);
- pacing.py: node-wide AIMD limits on cold requests per prefix (503 SlowDown);
- node_stats.py: counters of every process using one warm directory;
- lockfds.py: the descriptors this process holds flocks through, closed in a forked child
  (a DataLoader worker forked mid-download must not keep its parent's locks);
- report.py: what ``datapipe cache stats DIR...`` shows, per directory and per tier;
- folder_check.py: the one check of a folder tier (write, fsync, read back, time, free
  space against budget: `check_folder`), for ``datapipe doctor``, a cache opening its tiers
  and a checkpoint writer starting; deadline.py: calls on a tier's folder that give up
  after a deadline (a hung mount costs a bounded stall);
- rates.py: each tier's read rate over a window, the rule that takes a slow tier out.

Imports: storage, errors, checksum, options. It knows no tar, no dataset, no loader.
"""

import warnings
from typing import TYPE_CHECKING, Any

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .deadline import Deadline
    from .eviction import Schedule, belady_hits, lru_hits
    from .folder_check import PROBE_PREFIX, START_PROBE_BYTES, FolderCheck, check_folder, check_folder_within
    from .report import cache_report, format_tiers
    from .settings import CacheTier
    from .settings import Tier as Tier  # deprecated: CacheTier
    from .shared import clear_shared_dir, is_shared_dir, shared_dir_stats
    from .tiered import TieredCache
    from .warm import clear_warm_dir, warm_dir_stats

__all__ = [
    "TieredCache",
    "CacheTier",
    "Schedule",
    "belady_hits",
    "lru_hits",
    "warm_dir_stats",
    "clear_warm_dir",
    "shared_dir_stats",
    "clear_shared_dir",
    "cache_report",
    "format_tiers",
    "is_shared_dir",
    "check_folder",
    "check_folder_within",
    "Deadline",
    "FolderCheck",
    "PROBE_PREFIX",
    "START_PROBE_BYTES",
]

#: public name -> the submodule that defines it, imported on first use: ``datapipe cache
#: stats`` needs the report, not the read path
_WHERE = {"TieredCache": "tiered", "CacheTier": "settings", "Schedule": "eviction", "belady_hits": "eviction",
          "lru_hits": "eviction", "warm_dir_stats": "warm", "clear_warm_dir": "warm",
          "shared_dir_stats": "shared", "clear_shared_dir": "shared", "is_shared_dir": "shared",
          "cache_report": "report", "format_tiers": "report", "check_folder": "folder_check",
          "check_folder_within": "folder_check", "Deadline": "deadline",
          "FolderCheck": "folder_check", "PROBE_PREFIX": "folder_check", "START_PROBE_BYTES": "folder_check"}

#: the submodules the eager imports bound (`datapipe.cache.warm.url_key`)
_SUBMODULES = frozenset({"cold", "deadline", "eviction", "folder_check", "future", "hot", "lockfds", "node_stats",
                         "pacing", "report", "shared", "tiered", "warm"})

_getattr, __dir__ = lazy_exports(__name__, globals(), _WHERE, _SUBMODULES)


def __getattr__(name: str) -> Any:
    if name == "Tier":  # its old name (README: local_tiers=[datapipe.cache.Tier(...)]); kept working
        warnings.warn("datapipe.cache.Tier is now datapipe.cache.CacheTier (datapipe.checkpoint.Tier is "
                      "another thing); the old name will go", DeprecationWarning, stacklevel=2)
        return _getattr("CacheTier")
    return _getattr(name)
