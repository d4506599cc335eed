"""Small files (or table rows) -> shards: ``pack()`` and ``ShardWriter``.

Holds: ``packer`` (``pack()``: plan, worker processes, resume), ``writer`` (``ShardWriter``,
the shard limits and option checks every path shares), ``sources`` (listing a directory,
reading JSONL/Parquet rows), ``journal`` (finished shards recorded for resume), ``lock`` (one
writer per destination), ``commit`` (index and manifest, manifest last), ``join`` (parts ->
one dataset). May import :mod:`datapipe.format`, :mod:`datapipe.storage`,
:mod:`datapipe.dataset` (``join`` reads the parts' indexes), :mod:`datapipe.errors` and
:mod:`datapipe.checksum`; never the loader, the cache or the checkpoint.
"""

from .join import join_parts
from .packer import PackResult, pack, parse_part, part_dir
from .sources import file_key
from .writer import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_SAMPLES, ShardWriter

__all__ = ["pack", "PackResult", "ShardWriter", "file_key", "join_parts", "parse_part", "part_dir",
           "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES"]
