"""Shard bytes on the wire: tar members, zstd frames, the dataset index. No I/O here.

- ``tar``: member names and headers, and the one strict tar parser (``walk_members``).
- ``sample``: one sample's members (and zstd frame) to and from ``{"__key__": ..., field: ...}``.
- ``shard``: ``ShardBuilder``, writing a shard and recording offsets and checksums.
- ``layout``: where every field of every sample of a shard lies (the strict parse, and the
  one fast structural check tested against it).
- ``index``: the manifest, ``shards.parquet`` and ``samples.parquet``, and their checks.
- ``rows``: a table's rows as the fields of samples (struct-of-bytes columns flattened).
- ``parquet_pages``: the page headers of a Parquet column chunk, read before pyarrow
  decodes it (what each page decompresses to).

Imports only the leaves (``datapipe.errors``, ``datapipe.checksum``); nothing about where
bytes live.
"""

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
