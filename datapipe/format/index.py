"""The dataset index: ``manifest.json`` (written last), ``shards.parquet``, ``samples.parquet``.

Planning reads ``shards.parquet`` alone (one row per shard). ``samples.parquet`` holds one
row per sample in dataset order, in row groups of exactly ``sample_row_group`` rows, so
the rows of one shard, or of one global sample index, are found by arithmetic and read
with a few range reads: no rank ever loads every sample's offset.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .._version import __version__
from ..errors import FormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "SHARDS_FILE",
    "SAMPLES_FILE",
    "SAMPLE_ROW_GROUP",
    "ShardRecord",
    "SampleRecords",
    "SHARD_SCHEMA",
    "SAMPLE_SCHEMA",
    "make_manifest",
    "parse_manifest",
    "shard_table_bytes",
    "read_shard_table",
    "SampleTableWriter",
]

FORMAT_NAME = "datapipe-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARDS_FILE = "shards.parquet"
SAMPLES_FILE = "samples.parquet"
SAMPLE_ROW_GROUP = 65536

SHARD_SCHEMA = pa.schema(
    [
        ("name", pa.string()),  # path relative to the dataset root
        ("bytes", pa.int64()),  # stored bytes of the shard file
        ("samples", pa.int64()),
        ("checksum", pa.string()),  # of the stored bytes
        ("tar_bytes", pa.int64()),  # bytes of the (decompressed) tar
    ]
)
SAMPLE_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.int32()),
        ("offset", pa.int64()),  # of the sample's stored bytes inside the shard file
        ("length", pa.int64()),
        ("checksum", pa.string()),  # of those stored bytes
    ]
)


@dataclass(frozen=True)
class ShardRecord:
    name: str
    bytes: int
    samples: int
    checksum: str
    tar_bytes: int


@dataclass
class SampleRecords:
    """Per-sample columns of one shard, in stored order."""

    keys: list[str]
    offsets: list[int]
    lengths: list[int]
    checksums: list[str]

    def __len__(self) -> int:
        return len(self.keys)


def make_manifest(
    shards: list[ShardRecord], compression: str, fields: list[str], extra: dict[str, Any] | None = None
) -> bytes:
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "compression": compression,
        "num_shards": len(shards),
        "num_samples": int(sum(s.samples for s in shards)),
        "stored_bytes": int(sum(s.bytes for s in shards)),
        "fields": sorted(fields),
        "shards_file": SHARDS_FILE,
        "samples_file": SAMPLES_FILE,
        "sample_row_group": SAMPLE_ROW_GROUP,
        "created_by": f"datapipe {__version__}",
        **(extra or {}),
    }
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{where}: manifest is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a datapipe dataset manifest (format != {FORMAT_NAME!r})")
    if doc.get("version") != FORMAT_VERSION:
        raise FormatError(
            f"{where}: dataset format version {doc.get('version')!r}; this datapipe reads "
            f"version {FORMAT_VERSION} (upgrade datapipe)"
        )
    for k in ("compression", "num_shards", "num_samples", "sample_row_group"):
        if k not in doc:
            raise FormatError(f"{where}: manifest lacks {k!r}")
    return doc


def shard_table_bytes(shards: list[ShardRecord]) -> bytes:
    cols = {f: [getattr(s, f) for s in shards] for f in SHARD_SCHEMA.names}
    table = pa.Table.from_pydict(cols, schema=SHARD_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def read_shard_table(data: bytes, where: str) -> list[ShardRecord]:
    try:
        table = pq.ParquetFile(io.BytesIO(data)).read()  # not read_table: it imports pyarrow.dataset (~0.1 s)
    except (pa.ArrowInvalid, OSError) as e:
        raise FormatError(f"{where}: unreadable shard table: {e}") from None
    if not set(SHARD_SCHEMA.names) <= set(table.column_names):
        raise FormatError(f"{where}: shard table lacks columns {SHARD_SCHEMA.names}")
    cols = table.to_pydict()
    return [ShardRecord(**{f: cols[f][i] for f in SHARD_SCHEMA.names}) for i in range(table.num_rows)]


class SampleTableWriter:
    """Streams per-shard sample records, in shard order, into ``samples.parquet`` row groups
    of exactly ``SAMPLE_ROW_GROUP`` rows (the last one shorter)."""

    def __init__(self, sink: BinaryIO) -> None:
        self._writer = pq.ParquetWriter(sink, SAMPLE_SCHEMA, compression="zstd")
        self._pending: dict[str, list[Any]] = {f: [] for f in SAMPLE_SCHEMA.names}
        self.rows = 0

    def add(self, shard: int, records: SampleRecords) -> None:
        p = self._pending
        p["key"].extend(records.keys)
        p["shard"].extend([shard] * len(records))
        p["offset"].extend(records.offsets)
        p["length"].extend(records.lengths)
        p["checksum"].extend(records.checksums)
        while len(p["key"]) >= SAMPLE_ROW_GROUP:
            self._flush(SAMPLE_ROW_GROUP)

    def _flush(self, n: int) -> None:
        p = self._pending
        cols = {f: p[f][:n] for f in SAMPLE_SCHEMA.names}
        for f in SAMPLE_SCHEMA.names:
            del p[f][:n]
        table = pa.Table.from_pydict(cols, schema=SAMPLE_SCHEMA)
        self._writer.write_table(table, row_group_size=SAMPLE_ROW_GROUP)
        self.rows += n

    def close(self) -> None:
        n = len(self._pending["key"])
        if n:
            self._flush(n)
        self._writer.close()


def sample_rows(table: pa.Table) -> dict[str, np.ndarray | list[str]]:
    """Columns of a slice of ``samples.parquet`` as numpy arrays (keys and checksums as lists)."""
    return {
        "key": table.column("key").to_pylist(),
        "shard": table.column("shard").to_numpy(),
        "offset": table.column("offset").to_numpy(),
        "length": table.column("length").to_numpy(),
        "checksum": table.column("checksum").to_pylist(),
    }


def as_dict(record: ShardRecord) -> dict[str, Any]:
    return asdict(record)
