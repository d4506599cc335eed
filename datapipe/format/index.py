"""The dataset index: ``manifest.json`` (written last), ``shards.parquet``, ``samples.parquet``.

Planning reads ``shards.parquet`` alone (one row per shard). ``samples.parquet`` holds one
row per sample in dataset order, in row groups of exactly ``sample_row_group`` rows, so
the rows of one shard, or of one global sample index, are found by arithmetic and read
with a few range reads: no rank ever loads every sample's offset.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from .._version import __version__
from ..checksum import Hasher
from ..errors import CorruptIndexError
from .envelope import check_manifest_checksum, open_manifest, seal_manifest
from .sample import COMPRESSIONS

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
    "INDEX_BLOCK",
    "FileDigest",
    "digest_bytes",
    "check_relative_name",
    "check_shard_rows",
    "is_checksum",
    "TAR_INDEX",
    "check_shard_location",
]

FORMAT_NAME = "datapipe-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARDS_FILE = "shards.parquet"
SAMPLES_FILE = "samples.parquet"
SAMPLE_ROW_GROUP = 65536
#: manifest ``origin`` of an index of existing tar shards (``datapipe index``): its shard
#: names may be URLs or absolute paths (shards stay where they are), and its samples may
#: leave gaps (members that name no sample) and a longer end-of-archive tail
TAR_INDEX = "tar-index"

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


#: ``samples.parquet`` is checked in blocks of this many bytes, each against its own
#: checksum in the manifest, so a reader that range-reads one row group verifies only the
#: blocks it reads (no rank hashes the whole file to read its own rows)
INDEX_BLOCK = 1 << 20

_CHECKSUM_RE = re.compile(r"xxh3_64:[0-9a-f]{16}")
# a key as check_key allows it: relative, no empty/'.'/'..' component, no NUL or backslash,
# no dot in the last component
_KEY_RE = re.compile(r"(?:(?!\.\.?/)[^/\0\\]+/)*[^/.\0\\]+")
_MAX_INT = 1 << 62


class FileDigest:
    """Hashes a file as it is written: its whole checksum, size and per-block checksums."""

    def __init__(self, block: int = INDEX_BLOCK) -> None:
        self.block, self.size = block, 0
        self._whole, self._part = Hasher(), Hasher()
        self._fill = 0
        self.blocks: list[str] = []

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self._whole.update(mv)
        self.size += len(mv)
        while len(mv):
            take = min(len(mv), self.block - self._fill)
            self._part.update(mv[:take])
            self._fill += take
            mv = mv[take:]
            if self._fill == self.block:
                self.blocks.append(self._part.hexdigest())
                self._part, self._fill = Hasher(), 0

    def finish(self) -> dict[str, Any]:
        if self._fill:
            self.blocks.append(self._part.hexdigest())
            self._part, self._fill = Hasher(), 0
        return {"bytes": self.size, "checksum": self._whole.hexdigest(), "block": self.block,
                "blocks": list(self.blocks)}


def digest_bytes(data: bytes, block: int = INDEX_BLOCK) -> dict[str, Any]:
    d = FileDigest(block)
    d.update(data)
    return d.finish()


def make_manifest(
    shards: list[ShardRecord], compression: str, fields: list[str], extra: dict[str, Any] | None = None,
    index_files: dict[str, dict[str, Any]] | None = None,
) -> bytes:
    """The manifest of a dataset. ``index_files``: :meth:`FileDigest.finish` of
    ``shards.parquet`` and ``samples.parquet``. The manifest's own checksum covers every
    other field (over their canonical JSON), so no field can change unnoticed."""
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
    if index_files is not None:
        doc["index_checksums"] = {name: d["checksum"] for name, d in index_files.items()}
        doc["index_files"] = index_files
    return seal_manifest(doc, allow_nan=True)  # as ever: NaN in an extra field is written, and read back


def check_relative_name(name: Any, what: str, where: str) -> str:
    """A path inside the dataset folder: relative, no empty, '.' or '..' component, no NUL
    or backslash. Anything else could read (or name) a file outside the dataset."""
    if not isinstance(name, str) or not name:
        raise CorruptIndexError(f"{where}: {what} {name!r} is not a file name")
    parts = name.split("/")
    if name.startswith("/") or "\0" in name or "\\" in name or ":" in parts[0] \
            or any(p in ("", ".", "..") for p in parts):
        raise CorruptIndexError(
            f"{where}: {what} {name!r} leaves the dataset folder (absolute, or an empty, '.' or "
            "'..' component); refusing to read it"
        )
    return name


_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*://[^\0\\]+")


def check_shard_location(name: Any, what: str, where: str) -> str:
    """A shard of an index of existing tars: a name relative to the index folder (as
    :func:`check_relative_name`), an absolute local path, or a URL (``s3://b/x.tar``);
    never a ``.`` or ``..`` component, a NUL or a backslash."""
    if isinstance(name, str) and (name.startswith("/") or _SCHEME_RE.fullmatch(name)):
        parts = name.split("://", 1)[-1].lstrip("/").split("/")
        if "\0" in name or "\\" in name or any(p in ("", ".", "..") for p in parts):
            raise CorruptIndexError(f"{where}: {what} {name!r} has an empty, '.' or '..' component; refusing it")
        return name
    return check_relative_name(name, what, where)


def _int(doc: dict[str, Any], k: str, where: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    v = doc.get(k)
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptIndexError(f"{where}: manifest field {k!r} is {v!r}, expected an integer in [{lo}, {hi}]")
    return v


def is_checksum(v: Any) -> bool:
    return isinstance(v, str) and _CHECKSUM_RE.fullmatch(v) is not None


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The manifest, once its own checksum matches and every field has the type, range and
    shape a reader relies on; else :class:`CorruptIndexError` (or :class:`FormatError` for
    an unknown format or version) naming ``where``."""
    doc = open_manifest(data, where, name=FORMAT_NAME, version=FORMAT_VERSION, what="dataset")
    if doc.get("manifest_checksum") is None:
        raise CorruptIndexError(
            f"{where}: the manifest has no manifest_checksum (written by an older datapipe, or "
            "edited): its fields cannot be trusted. Re-run the `datapipe pack` (with --overwrite) "
            "or `datapipe join` that made the dataset to rewrite its index"
        )
    check_manifest_checksum(doc, where, "re-run the pack or join that wrote it", allow_nan=True)
    if doc.get("compression") not in COMPRESSIONS:
        raise CorruptIndexError(f"{where}: unknown compression {doc.get('compression')!r}")
    num_shards = _int(doc, "num_shards", where, 0, 1 << 31)
    _int(doc, "num_samples", where)
    _int(doc, "stored_bytes", where, num_shards)
    _int(doc, "sample_row_group", where, 1, 1 << 31)
    if "parts" in doc:
        _int(doc, "parts", where, 1, 99999)
    if doc.get("origin", TAR_INDEX) != TAR_INDEX or ("origin" in doc and doc["compression"] != "none"):
        raise CorruptIndexError(f"{where}: unknown manifest origin {doc.get('origin')!r} "
                                f"(with compression {doc['compression']!r})")
    fields = doc.get("fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise CorruptIndexError(f"{where}: manifest field 'fields' is not a list of names")
    if not isinstance(doc.get("created_by", ""), str):
        raise CorruptIndexError(f"{where}: manifest field 'created_by' is not a string")
    names = []
    for k in ("shards_file", "samples_file"):
        names.append(check_relative_name(doc.get(k), f"manifest field {k!r}", where))
    if names[0] == names[1]:
        raise CorruptIndexError(f"{where}: shards_file and samples_file are the same file")
    files = doc.get("index_files")
    sums = doc.get("index_checksums")
    if not isinstance(files, dict) or not isinstance(sums, dict) or set(files) != set(names) \
            or set(sums) != set(names):
        raise CorruptIndexError(f"{where}: manifest lacks the sizes and checksums of {names}")
    for name in names:
        d = files[name]
        ok = isinstance(d, dict) and is_checksum(d.get("checksum")) and d.get("checksum") == sums[name]
        size = d.get("bytes") if ok else None
        block = d.get("block") if ok else None
        blocks = d.get("blocks") if ok else None
        ok = ok and type(size) is int and 0 < size < _MAX_INT and type(block) is int \
            and 4096 <= block <= 1 << 30 and isinstance(blocks, list) \
            and len(blocks) == -(-size // block) and all(is_checksum(b) for b in blocks)
        if not ok:
            raise CorruptIndexError(f"{where}: manifest entry index_files[{name!r}] is malformed")
    return doc


_NUMPY_TYPES = {pa.int32(): np.int32, pa.int64(): np.int64}


def _arrow_table(columns: dict[str, list[Any]], schema: pa.Schema) -> pa.Table:
    """The table of ``schema`` (string and int32/int64 columns) holding ``columns``, built
    from buffers: ``pa.array`` and ``Table.from_pydict`` import pandas to ask whether the
    values are pandas objects (0.3 s warm, 0.75 s cold, in every pack's commit)."""
    arrays = []
    for f in schema:
        values, n = columns[f.name], len(columns[f.name])
        if f.type == pa.string():
            data = [v.encode("utf-8") for v in values]
            offsets = np.zeros(n + 1, np.int64)
            np.cumsum([len(d) for d in data], out=offsets[1:])
            if offsets[-1] >= 2**31:  # beyond int32 offsets: pyarrow's own conversion chunks it
                return pa.Table.from_pydict(columns, schema=schema)
            buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))]
        else:
            buffers = [None, pa.py_buffer(np.asarray(values, dtype=_NUMPY_TYPES[f.type]))]
        arrays.append(pa.Array.from_buffers(f.type, n, buffers))
    return pa.Table.from_arrays(arrays, schema=schema)


def shard_table_bytes(shards: list[ShardRecord]) -> bytes:
    cols = {f: [getattr(s, f) for s in shards] for f in SHARD_SCHEMA.names}
    table = _arrow_table(cols, SHARD_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def read_shard_table(data: bytes, where: str, manifest: dict[str, Any] | None = None) -> list[ShardRecord]:
    """The rows of ``shards.parquet``, each checked (safe relative name with the suffix of
    the compression, non-negative sizes, a well-formed checksum) and, given the
    ``manifest``, consistent with it."""
    try:
        # not read_table: it imports pyarrow.dataset (~0.1 s). No pre-buffering, no threads: Arrow's
        # thread pools, once started, can abort the process at exit (apache/arrow#34314)
        table = pq.ParquetFile(io.BytesIO(data), pre_buffer=False).read(use_threads=False)
    except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
        raise CorruptIndexError(f"{where}: unreadable shard table: {e}") from None
    for f in SHARD_SCHEMA:
        if f.name not in table.column_names or table.schema.field(f.name).type != f.type \
                or table.column(f.name).null_count:
            raise CorruptIndexError(f"{where}: shard table lacks column {f.name!r} of type {f.type} (or has nulls)")
    cols = table.to_pydict()
    records = [ShardRecord(**{f: cols[f][i] for f in SHARD_SCHEMA.names}) for i in range(table.num_rows)]
    if manifest is None:
        return records
    compression = manifest["compression"]
    suffix = ".tar.zst" if compression == "zstd" else ".tar"
    seen: set[str] = set()
    check_name = check_shard_location if manifest.get("origin") == TAR_INDEX else check_relative_name
    for i, r in enumerate(records):
        check_name(r.name, f"shard #{i} name", where)
        bad = None
        if not r.name.endswith(suffix) or r.name in seen:
            bad = f"name {r.name!r} is a duplicate or lacks the suffix {suffix!r}"
        elif not 0 < r.bytes < _MAX_INT or not 0 <= r.samples < _MAX_INT or not 1024 <= r.tar_bytes < _MAX_INT:
            bad = f"sizes bytes={r.bytes} samples={r.samples} tar_bytes={r.tar_bytes} are out of range"
        elif compression == "none" and r.tar_bytes != r.bytes:
            bad = f"tar_bytes={r.tar_bytes} differs from bytes={r.bytes} in an uncompressed dataset"
        elif not is_checksum(r.checksum):
            bad = f"checksum {r.checksum!r} is not an xxh3_64 checksum"
        if bad:
            raise CorruptIndexError(f"{where}: shard #{i}: {bad}")
        seen.add(r.name)
    totals = (len(records), sum(r.samples for r in records), sum(r.bytes for r in records))
    expect = (manifest["num_shards"], manifest["num_samples"], manifest["stored_bytes"])
    if totals != expect:
        raise CorruptIndexError(
            f"{where}: the shard table holds (shards, samples, bytes) = {totals}, the manifest "
            f"says {expect}"
        )
    return records


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
        table = _arrow_table(cols, SAMPLE_SCHEMA)
        self._writer.write_table(table, row_group_size=SAMPLE_ROW_GROUP)
        self.rows += n

    def close(self) -> None:
        n = len(self._pending["key"])
        if n:
            self._flush(n)
        self._writer.close()


def sample_rows(table: pa.Table, where: str = "samples.parquet", num_shards: int | None = None
                ) -> dict[str, NDArray[Any] | list[str]]:
    """Columns of a slice of ``samples.parquet`` as numpy arrays (keys and checksums as
    lists), each row checked: a safe key, a shard number below ``num_shards``, a
    non-negative offset, a positive length and a well-formed checksum."""
    for f in SAMPLE_SCHEMA:
        if f.name not in table.column_names or table.schema.field(f.name).type != f.type \
                or table.column(f.name).null_count:
            raise CorruptIndexError(f"{where}: sample table lacks column {f.name!r} of type {f.type} (or has nulls)")
    out = {
        "key": table.column("key").to_pylist(),
        "shard": table.column("shard").to_numpy(),
        "offset": table.column("offset").to_numpy(),
        "length": table.column("length").to_numpy(),
        "checksum": table.column("checksum").to_pylist(),
    }
    bad = None
    if not all(map(_KEY_RE.fullmatch, out["key"])):
        bad = next(k for k in out["key"] if not _KEY_RE.fullmatch(k))
        bad = f"key {bad!r} is not a safe relative sample key"
    elif not all(map(_CHECKSUM_RE.fullmatch, out["checksum"])):
        bad = "a sample checksum is missing or not an xxh3_64 checksum (nothing could be verified)"
    elif len(out["shard"]) and (out["shard"].min() < 0
                                or (num_shards is not None and out["shard"].max() >= num_shards)):
        bad = f"a shard number is outside [0, {num_shards})"
    elif len(out["offset"]) and (out["offset"].min() < 0 or out["length"].min() <= 0
                                 or out["length"].max() >= _MAX_INT or out["offset"].max() >= _MAX_INT):
        bad = "an offset is negative or a length not positive"
    if bad:
        raise CorruptIndexError(f"{where}: {bad}; the index is damaged (re-run the pack that wrote it)")
    return out


def check_shard_rows(c: dict[str, Any], shard: int, record: Any, compression: str, where: str,
                     gaps: bool = False) -> None:
    """The rows of one shard tile it: the first sample starts at byte 0, each starts where
    the one before ends, the last ends where the end-of-archive blocks (or their zstd
    frame) begin, and no key repeats. So every offset lands on the first header of a
    sample, as the packer laid it out, and no byte of the shard is read twice.

    ``gaps`` (an index of existing tars, uncompressed): samples may be apart (members
    that name no sample lie between them) and the end-of-archive tail longer, so the rows
    must only be in order, block-aligned, apart and end at least two blocks before the
    end; the whole-shard checksum still covers every byte."""
    offs, lens = np.asarray(c["offset"], np.int64), np.asarray(c["length"], np.int64)
    name = getattr(record, "name", record)
    bad = None
    if len(c["key"]) != record.samples or (len(c["shard"]) and (np.asarray(c["shard"]) != shard).any()):
        bad = f"the rows of shard #{shard} ({name}) do not all belong to it"
    elif len(offs):
        ends = offs + lens
        last = int(ends[-1])
        if gaps:
            tiled = compression == "none" and not (offs % 512).any() and bool((ends[:-1] <= offs[1:]).all()) \
                and last + 1024 <= record.bytes
        else:
            tail_ok = last + 1024 == record.bytes if compression == "none" else last < record.bytes
            tiled = offs[0] == 0 and not (ends[:-1] != offs[1:]).any() and tail_ok
        if not tiled:
            bad = f"the byte ranges of shard #{shard} ({name}) do not tile it ({record.bytes} bytes)"
        elif len(set(c["key"])) != len(c["key"]):
            bad = f"a key repeats within shard #{shard} ({name})"
    if bad:
        raise CorruptIndexError(f"{where}: {bad}; the index is damaged (re-run the pack that wrote it)")

