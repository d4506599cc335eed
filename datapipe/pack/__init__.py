"""Small files (or table rows) -> shards."""

from .join import join_parts
from .packer import PackResult, pack, parse_part, part_dir
from .writer import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_SAMPLES, ShardWriter

__all__ = ["pack", "PackResult", "ShardWriter", "join_parts", "parse_part", "part_dir",
           "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES"]
