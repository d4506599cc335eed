"""storage: the `Store` contract and its backends. The only package that imports fsspec.

- store.py: the contract (bytes by key under a root URL, reads pinned to a version,
  conditional writes, capabilities: a local path, durable folders, per-writer
  temporaries) and URL helpers;
- memory.py, local.py, remote.py: backends (a dict, a local directory, any fsspec
  protocol); opening.py: ``open_store(url)`` picks one; options.py: storage options
  set once per URL prefix (or in ``DATAPIPE_STORAGE_OPTIONS``), merged by ``open_store``;
- retry.py: one retry and timeout layer for cold requests;
- lease.py: one writer per destination (a flock locally; a lease with a heartbeat and
  conditional writes on object stores); SharedFileLease, a lease file (O_EXCL, heartbeat,
  rename takeover) for directories several hosts mount;
- faults.py: a fault-injecting wrapper for tests and benchmarks (not exported here).

Imports: errors and checksum only. It knows no tar, no cache, no pack or checkpoint.
"""

from .lease import LeaseBusyError, LeaseLostError, WriterLease, describe_holder
from .local import LocalStore
from .memory import MemoryStore
from .opening import in_this_process, open_store
from .options import set_storage_options, storage_options_for
from .remote import FsspecStore
from .retry import RetryPolicy
from .store import Store, join_url, split_url

__all__ = [
    "Store",
    "MemoryStore",
    "LocalStore",
    "FsspecStore",
    "open_store",
    "in_this_process",
    "split_url",
    "join_url",
    "RetryPolicy",
    "set_storage_options",
    "storage_options_for",
    "WriterLease",
    "LeaseBusyError",
    "LeaseLostError",
    "describe_holder",
]
