"""Small files (or table rows) -> shards: ``pack()`` and ``ShardWriter``; ``join_parts``.

Holds: ``packer`` (``pack()``: plan, worker processes, resume; ``plan_shards``, the cut of
listed samples into shards; ``pack_shard``, one planned shard written; ``commit_shards``,
finished shards published), ``pieces`` (a large shard written by several workers at once,
at offsets known from the listing), ``writer`` (``ShardWriter``), ``sources`` (listing a
directory by the key rules, in pieces by several threads (or Ray tasks) too, ``file_key``, reading
JSONL/Parquet rows), ``join`` (parts -> one dataset). How the result is made visible (the
writer lock, the ``_pack/`` journal, the commit with the manifest last, the shard series and
its limits, the checks of a writer's
arguments) is :mod:`datapipe.publish`'s. May import :mod:`datapipe.publish`,
:mod:`datapipe.format`, :mod:`datapipe.storage`, :mod:`datapipe.dataset` (``join`` reads
the parts' indexes), :mod:`datapipe.progress`, :mod:`datapipe.errors`; never the loader, the
cache or the checkpoint. (``datapipe.pack`` is the function ``pack``; this package was
``datapipe.pack``.)
"""

from ..publish import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_SAMPLES
from .join import join_parts
from .packer import (
    PackOptions,
    PackResult,
    commit_shards,
    describe_tree,
    pack,
    pack_options,
    pack_shard,
    plan_shards,
    refuse_tar_shards,
)
from .sources import (
    KEY_RULES,
    DirectoryListing,
    FileSample,
    check_table_columns,
    file_key,
    is_parquet_tree,
    list_directory,
    parquet_dataset,
    read_fragment,
    row_group_bytes,
    source_kind,
)
from .writer import ShardWriter

__all__ = [
    # packing small files or table rows, and joining parts
    "pack", "PackResult", "PackOptions", "pack_options", "ShardWriter", "join_parts",
    "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES",
    # the pieces the Ray engine runs as tasks
    "plan_shards", "pack_shard", "commit_shards", "describe_tree", "refuse_tar_shards",
    # sources: directories by the key rules, tables
    "KEY_RULES", "FileSample", "DirectoryListing", "file_key", "list_directory", "source_kind",
    "check_table_columns", "read_fragment", "is_parquet_tree", "parquet_dataset", "row_group_bytes",
]
