"""Bytes by URL, in tiers. The only package that imports fsspec."""

from .cache import TieredCache
from .eviction import Schedule, belady_hits, lru_hits
from .faults import FaultInjectingStore
from .retry import RetryPolicy
from .stores import FsspecStore, LocalStore, MemoryStore, Store, join_url, open_store, split_url
from .warm import clear_warm_dir, warm_dir_stats

__all__ = [
    "Store",
    "MemoryStore",
    "LocalStore",
    "FsspecStore",
    "open_store",
    "split_url",
    "join_url",
    "TieredCache",
    "RetryPolicy",
    "Schedule",
    "belady_hits",
    "lru_hits",
    "FaultInjectingStore",
    "warm_dir_stats",
    "clear_warm_dir",
]
