"""cache: tiers of bytes with budgets over the stores of ``storage/``.

- tiered.py: `TieredCache`, the public API (read, read_range, local_path/pinned,
  pin_or_read, prefetch, set_schedule, stats, close): hot (memory) -> warm (a node-local directory
  shared by processes) -> shared (a directory every node mounts) -> cold (any store);
- process.py: the state one process holds for a cache (tiers, pools, pins, counters);
- cold.py: reads from the cold store, one version per download, bounded in flight;
- fill.py: filling the warm tier (single flight, room reserved first, copies verified);
- hot.py, warm.py: the memory tier and the warm directory (single flight, budgets, pins);
- shared.py: the shared tier, a directory every node mounts: the warm directory's
  protocol with lease files instead of flocks, cluster-wide single flight;
- eviction.py: the access schedule, Belady/LRU victim choice and hit-rate simulators;
- future.py: the node's merged future (each process's next reads, published in the warm dir);
- pacing.py: node-wide AIMD limits on cold requests per prefix (503 SlowDown);
- node_stats.py: counters of every process using one warm directory;
- lockfds.py: the descriptors this process holds flocks through, closed in a forked child
  (a DataLoader worker forked mid-download must not keep its parent's locks);
- report.py: what ``datapipe cache stats DIR...`` shows, per directory and per tier.

Imports: storage, errors, checksum. It knows no tar, no dataset, no loader.
"""

from .eviction import Schedule, belady_hits, lru_hits
from .report import cache_report, format_tiers
from .shared import clear_shared_dir, is_shared_dir, shared_dir_stats
from .tiered import Tier, TieredCache
from .warm import clear_warm_dir, warm_dir_stats

__all__ = [
    "TieredCache",
    "Tier",
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
]
