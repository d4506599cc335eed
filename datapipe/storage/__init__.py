"""storage: the `Store` contract and its backends. The only package that imports fsspec.

- store.py: the contract (bytes by key under a root URL, reads pinned to a version,
  conditional writes, capabilities: a local path, durable folders, per-writer
  temporaries) and URL helpers;
- memory.py, local.py, remote.py: backends (a dict, a local directory, any fsspec
  protocol); opening.py: ``open_store(url)`` picks one; options.py: storage options
  set once per URL prefix (or in ``DATAPIPE_STORAGE_OPTIONS``), merged by ``open_store``;
  ``temporary_name``: how a writer's temporaries are named (``.tmp-<writer token>-<name>``),
  ``fsync_dir``: a folder made durable (after a rename into it, for writers of plain files);
- patterns.py: patterns in URLs, brace patterns (``expand_braces``) and globs
  (``has_glob``, ``glob_urls``: matched against one listing of the folder above them);
- retry.py: one retry and timeout layer for cold requests;
- lease.py: one writer per destination (a flock locally; a lease with a heartbeat and
  conditional writes on object stores); SharedFileLease, a lease file (O_EXCL, heartbeat,
  rename takeover) for directories several hosts mount (their errors, ``LeaseBusyError``
  and ``LeaseLostError``, are in :mod:`datapipe.errors`);
- faults.py: a fault-injecting wrapper for tests and benchmarks (not exported here).

Other packages import the names below from here, never from the modules inside.
Imports: errors and checksum only. It knows no tar, no cache, no pack or checkpoint.
"""

from .lease import (
    LEASE_FILE_DELETED,
    MAX_LEASE_BYTES,
    LeaseHolder,
    SharedFileLease,
    WriterLease,
    current_holder,
    describe_holder,
    holder_here_fields,
)
from .local import LocalStore, fsync_dir, open_regular, temporary_name
from .memory import MemoryStore
from .opening import in_this_process, open_store, refuse_chained_url, refuse_mistyped_url
from .options import set_storage_options, storage_options_for
from .patterns import expand_braces, glob_urls, has_glob
from .remote import FsspecStore
from .retry import (
    RetryPolicy,
    call_with_retry,
    fetch_object,
    fetch_range,
    is_throttle,
    is_transient,
    queued,
    run_requests,
    single_layer_options,
)
from .store import DelegatingStore, SeekableFile, Store, is_local_url, join_url, split_url

__all__ = [
    "Store",
    "DelegatingStore",
    "SeekableFile",
    "MemoryStore",
    "LocalStore",
    "FsspecStore",
    "open_store",
    "in_this_process",
    "split_url",
    "join_url",
    "is_local_url",
    "expand_braces",
    "has_glob",
    "glob_urls",
    "refuse_mistyped_url",
    "refuse_chained_url",
    "open_regular",
    "temporary_name",
    "fsync_dir",
    "RetryPolicy",
    "call_with_retry",
    "run_requests",
    "fetch_object",
    "fetch_range",
    "is_throttle",
    "is_transient",
    "queued",
    "single_layer_options",
    "set_storage_options",
    "storage_options_for",
    "WriterLease",
    "SharedFileLease",
    "LeaseHolder",
    "current_holder",
    "describe_holder",
    "holder_here_fields",
    "MAX_LEASE_BYTES",
    "LEASE_FILE_DELETED",
]
