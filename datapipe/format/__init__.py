"""Shard bytes on the wire: tar members, zstd frames, the dataset index. No I/O here.

- ``tar``: member names and headers, and the one strict tar parser (``walk_members``).
- ``sample``: one sample's members (and zstd frame) to and from ``{"__key__": ..., field: ...}``.
- ``shard``: ``ShardBuilder``, writing a shard and recording offsets and checksums.
- ``layout``: where every field of every sample of a shard lies (the strict parse, and the
  fast structural checks tested against it: of a layout the index records, and of a shard
  whose index records none).
- ``index``: the manifest, ``shards.parquet`` and ``samples.parquet`` (version 2: with each
  sample's member layout), and their checks; ``columns``: those checks over a whole
  column, vectorised.
- ``rows``: a table's rows as the fields of samples (struct-of-bytes columns flattened).
- ``parquet_pages``: the page headers of a Parquet column chunk, read before pyarrow
  decodes it (what each page decompresses to).
- ``tarscan``: ``scan_tar``, the index rows of an existing tar shard (the strict parser).
- ``tokens``: Megatron ``.bin``/``.idx`` token parts and their manifest (a face of its
  own, ``datapipe.format.tokens``: its names, ``MANIFEST`` among them, are not the index's).

Other packages import the names below from here, never from the modules inside.

Imports only the leaves (``datapipe.errors``, ``datapipe.checksum``); nothing about where
bytes live.
"""

from .index import (
    FORMAT_VERSION,
    MANIFEST,
    READ_VERSIONS,
    SAMPLE_BASE,
    SAMPLE_ROW_GROUP,
    SAMPLES_FILE,
    SHARDS_FILE,
    TAR_INDEX,
    FileDigest,
    SampleRecords,
    SampleRows,
    SampleTableWriter,
    ShardColumns,
    ShardRecord,
    check_relative_name,
    check_shard_rows,
    digest_bytes,
    is_checksum,
    make_manifest,
    parse_manifest,
    read_shard_columns,
    read_shard_table,
    sample_checksums,
    sample_rows,
    shard_table_bytes,
    stored_layout,
)
from .layout import MemberTable, ShardLayout, StoredLayout, check_layout, find_layout, sample_members
from .parquet_pages import chunk_pages
from .rows import flatten_bytes_structs, key_text, python_rows, python_values, row_fields
from .sample import COMPRESSIONS, decode_sample, decompress_frame, encode_sample, field_bytes
from .shard import STAGING_BYTES, ShardBuilder, members_tar_bytes, shard_name
from .tar import (
    BLOCK,
    END_OF_ARCHIVE,
    check_key,
    member_name,
    next_member_name,
    padding,
    split_member_name,
    walk_members,
)
from .tarscan import scan_tar

__all__ = [
    "BLOCK",
    "COMPRESSIONS",
    "END_OF_ARCHIVE",
    "FORMAT_VERSION",
    "MANIFEST",
    "READ_VERSIONS",
    "SAMPLES_FILE",
    "SAMPLE_BASE",
    "SHARDS_FILE",
    "SAMPLE_ROW_GROUP",
    "STAGING_BYTES",
    "TAR_INDEX",
    "FileDigest",
    "MemberTable",
    "SampleRecords",
    "SampleRows",
    "SampleTableWriter",
    "ShardBuilder",
    "ShardColumns",
    "ShardLayout",
    "ShardRecord",
    "StoredLayout",
    "check_key",
    "check_layout",
    "check_relative_name",
    "check_shard_rows",
    "chunk_pages",
    "decode_sample",
    "decompress_frame",
    "digest_bytes",
    "encode_sample",
    "field_bytes",
    "find_layout",
    "flatten_bytes_structs",
    "is_checksum",
    "key_text",
    "make_manifest",
    "member_name",
    "members_tar_bytes",
    "next_member_name",
    "padding",
    "parse_manifest",
    "python_rows",
    "python_values",
    "read_shard_columns",
    "read_shard_table",
    "row_fields",
    "sample_checksums",
    "sample_members",
    "sample_rows",
    "scan_tar",
    "shard_name",
    "shard_table_bytes",
    "split_member_name",
    "stored_layout",
    "walk_members",
]
