"""Shard bytes on the wire: tar members, zstd frames, the dataset index. No I/O here."""

from .index import (
    MANIFEST,
    SAMPLE_ROW_GROUP,
    SAMPLES_FILE,
    SHARDS_FILE,
    SampleRecords,
    SampleTableWriter,
    ShardRecord,
    make_manifest,
    parse_manifest,
    read_shard_table,
    shard_table_bytes,
)
from .sample import COMPRESSIONS, decode_sample, encode_sample
from .shard import ShardBuilder, shard_name
from .tar import split_member_name

__all__ = [
    "COMPRESSIONS",
    "MANIFEST",
    "SAMPLES_FILE",
    "SHARDS_FILE",
    "SAMPLE_ROW_GROUP",
    "SampleRecords",
    "SampleTableWriter",
    "ShardBuilder",
    "ShardRecord",
    "decode_sample",
    "encode_sample",
    "make_manifest",
    "parse_manifest",
    "read_shard_table",
    "shard_name",
    "shard_table_bytes",
    "split_member_name",
]
