"""The dataset index: ``manifest.json`` (written last), ``shards.parquet``, ``samples.parquet``.

Planning reads ``shards.parquet`` alone (one row per shard). ``samples.parquet`` holds one
row per sample in dataset order, in row groups of exactly ``sample_row_group`` rows, so
the rows of one shard, or of one global sample index, are found by arithmetic and read
with a few range reads: no rank ever loads every sample's offset.

Version 2 of the format adds to each sample row where the data of each of its tar members
lies (``member_fields``, ``member_bounds``: what the writer laid out, recorded as it wrote
the shard), so that no reader works out a shard's layout again; a version 1 index (no such
columns) still reads, its layouts found by the reader (:func:`.layout.find_layout`). Both
are checked here a whole column at a time (:mod:`.columns`), never a Python step per row.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from .._version import __version__
from ..checksum import Hasher
from ..errors import CorruptIndexError, FormatError
from .columns import array_of, bad_checksums, bad_paths, int_column, list_column, string_column
from .envelope import check_manifest_checksum, open_manifest, seal_manifest
from .layout import StoredLayout
from .sample import COMPRESSIONS

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "MANIFEST",
    "SHARDS_FILE",
    "SAMPLES_FILE",
    "SAMPLE_ROW_GROUP",
    "ShardRecord",
    "ShardColumns",
    "SampleRecords",
    "SampleRows",
    "SHARD_SCHEMA",
    "SAMPLE_SCHEMA",
    "make_manifest",
    "parse_manifest",
    "shard_table_bytes",
    "read_shard_table",
    "read_shard_columns",
    "sample_checksums",
    "sample_rows",
    "stored_layout",
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
#: the version written; a reader reads every one of READ_VERSIONS (1: no member layout)
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
SHARDS_FILE = "shards.parquet"
SAMPLES_FILE = "samples.parquet"
#: rows of a ``samples.parquet`` row group (the manifest says which a dataset has: any reads).
#: A reader of a shard decodes the row groups its rows lie in, and a fresh DataLoader worker
#: reads those of every shard in its first shuffle window before its first batch: 8,192 rows
#: cost 3.9 ms a shard of 1,000 samples against 11.7 ms for 65,536 (measured here); the
#: footer grows with the groups (1,221 of them, about 1 MiB, at 10^7 samples)
SAMPLE_ROW_GROUP = 8192
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
        # version 2: the sample's fields in stored order, joined by "/", and for each of its
        # members the start and stop of its data, relative to the sample's first byte (of the
        # sample's tar bytes: in a zstd shard, the decompressed frame); null for every sample
        # of a shard whose writer recorded no layout
        ("member_fields", pa.string()),
        ("member_bounds", pa.list_(pa.int64())),
    ]
)
#: the columns every version has
SAMPLE_BASE = ("key", "shard", "offset", "length", "checksum")


@dataclass(frozen=True)
class ShardRecord:
    name: str
    bytes: int
    samples: int
    checksum: str
    tar_bytes: int


@dataclass
class SampleRecords:
    """Per-sample columns of one shard, in stored order, as a writer records them.

    ``member_fields[j]``: sample j's fields in the order its members are stored, joined by
    ``/`` (a field holds no ``/``); ``member_bounds``: for each sample in turn, the start and
    stop of each member's data relative to the sample's first byte (two numbers a member).
    None: no layout recorded (records of an older writer), and a reader finds it."""

    keys: list[str]
    offsets: list[int]
    lengths: list[int]
    checksums: list[str]
    member_fields: list[str] | None = None
    member_bounds: list[int] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def laid_out(self) -> bool:
        return self.member_fields is not None and self.member_bounds is not None


#: ``samples.parquet`` is checked in blocks of this many bytes, each against its own
#: checksum in the manifest, so a reader that range-reads one row group verifies only the
#: blocks it reads (no rank hashes the whole file to read its own rows)
INDEX_BLOCK = 1 << 20

_CHECKSUM_RE = re.compile(r"xxh3_64:[0-9a-f]{16}")
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
    doc = open_manifest(data, where, name=FORMAT_NAME, version=READ_VERSIONS, what="dataset")
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


def _arrow_array(values: Any, type_: pa.DataType) -> Any:
    """An Arrow array of ``type_`` (string, int32 or int64) holding ``values``, built from
    buffers: ``pa.array`` and ``Table.from_pydict`` import pandas to ask whether the values
    are pandas objects (0.3 s warm, 0.75 s cold, in every pack's commit)."""
    n = len(values)
    if type_ == pa.string():
        data = [v.encode("utf-8") for v in values]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(d) for d in data], out=offsets[1:])
        if offsets[-1] >= 2**31:  # beyond int32 offsets: pyarrow's own conversion chunks it
            return pa.array(values, type_)  # a ChunkedArray
        buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))]
    else:
        buffers = [None, pa.py_buffer(np.ascontiguousarray(values, dtype=_NUMPY_TYPES[type_]))]
    return pa.Array.from_buffers(type_, n, buffers)


def _arrow_table(columns: dict[str, list[Any]], schema: pa.Schema) -> pa.Table:
    """The table of ``schema`` (string and int32/int64 columns) holding ``columns``, built
    from buffers (:func:`_arrow_array`)."""
    return pa.Table.from_arrays([_arrow_array(columns[f.name], f.type) for f in schema], schema=schema)


def shard_table_bytes(shards: list[ShardRecord]) -> bytes:
    cols = {f: [getattr(s, f) for s in shards] for f in SHARD_SCHEMA.names}
    table = _arrow_table(cols, SHARD_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


@dataclass(frozen=True)
class ShardColumns:
    """The rows of ``shards.parquet`` as columns: names and checksums as lists, sizes as
    numpy arrays (a reader of 10^4 shards makes no object per shard it does not read)."""

    names: list[str]
    bytes: NDArray[np.int64]
    samples: NDArray[np.int64]
    checksums: list[str]
    tar_bytes: NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.names)

    def record(self, i: int) -> ShardRecord:
        return ShardRecord(self.names[i], int(self.bytes[i]), int(self.samples[i]), self.checksums[i],
                           int(self.tar_bytes[i]))


def _first(bad: NDArray[np.bool_]) -> int | None:
    hit = np.flatnonzero(bad)
    return int(hit[0]) if hit.size else None


def read_shard_columns(data: bytes, where: str, manifest: dict[str, Any] | None = None) -> ShardColumns:
    """The columns of ``shards.parquet``, every row checked (a name inside the dataset with
    the suffix of the compression, unique; sizes in range; a well-formed checksum) and,
    given the ``manifest``, consistent with it; else :class:`CorruptIndexError` naming
    ``where`` and the first bad row. Checked a column at a time (:mod:`.columns`)."""
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
    names_arr, name_data, name_offs = string_column(table.column("name"))
    sums_arr, sum_data, sum_offs = string_column(table.column("checksum"))
    try:
        names_arr.validate(full=True)  # UTF-8: Parquet's reader does not check it
    except pa.ArrowException as e:
        raise CorruptIndexError(f"{where}: a shard name is not UTF-8 text ({e})") from None
    cols = ShardColumns(names_arr.to_pylist(), int_column(table.column("bytes"), np.int64),
                        int_column(table.column("samples"), np.int64), sums_arr.to_pylist(),
                        int_column(table.column("tar_bytes"), np.int64))
    if manifest is None:
        return cols
    compression = manifest["compression"]
    suffix = (".tar.zst" if compression == "zstd" else ".tar").encode()
    n = len(cols)
    if manifest.get("origin") == TAR_INDEX:  # URLs and absolute paths too: one by one (rare, and few)
        for i, name in enumerate(cols.names):
            check_shard_location(name, f"shard #{i} name", where)
    else:
        bad_name = _first(bad_paths(name_data, name_offs, dot_in_last=True, colon_in_first=False))
        if bad_name is not None:
            check_relative_name(cols.names[bad_name], f"shard #{bad_name} name", where)  # raises, naming the rule
            raise CorruptIndexError(f"{where}: shard #{bad_name} name {cols.names[bad_name]!r} is not a file name "
                                    "inside the dataset folder; refusing to read it")
    suffix_ok = name_offs[1:] - name_offs[:-1] >= len(suffix)
    rows = np.flatnonzero(suffix_ok)
    if rows.size:
        tail = name_data[name_offs[1:][rows, None] - len(suffix) + np.arange(len(suffix))]
        suffix_ok[rows] = (tail == np.frombuffer(suffix, dtype=np.uint8)).all(axis=1)
    b, k, t = cols.bytes, cols.samples, cols.tar_bytes
    checks: list[tuple[NDArray[np.bool_], Callable[[int], str]]] = [
        (~suffix_ok, lambda i: f"name {cols.names[i]!r} lacks the suffix {suffix.decode()!r}"),
        ((b <= 0) | (b >= _MAX_INT) | (k < 0) | (k >= _MAX_INT) | (t < 1024) | (t >= _MAX_INT),
         lambda i: f"sizes bytes={b[i]} samples={k[i]} tar_bytes={t[i]} are out of range"),
        ((t != b) if compression == "none" else np.zeros(n, dtype=bool),
         lambda i: f"tar_bytes={t[i]} differs from bytes={b[i]} in an uncompressed dataset"),
        (bad_checksums(sum_data, sum_offs), lambda i: f"checksum {cols.checksums[i]!r} is not an xxh3_64 checksum"),
    ]
    for bad, say in checks:
        row = _first(bad)
        if row is not None:
            raise CorruptIndexError(f"{where}: shard #{row}: {say(row)}")
    if len(set(cols.names)) != n:
        seen: set[str] = set()
        for i, name in enumerate(cols.names):
            if name in seen:
                raise CorruptIndexError(f"{where}: shard #{i}: name {name!r} is a duplicate")
            seen.add(name)
    totals = (n, int(k.sum()), int(b.sum()))
    expect = (manifest["num_shards"], manifest["num_samples"], manifest["stored_bytes"])
    if totals != expect:
        raise CorruptIndexError(
            f"{where}: the shard table holds (shards, samples, bytes) = {totals}, the manifest "
            f"says {expect}"
        )
    return cols


def read_shard_table(data: bytes, where: str, manifest: dict[str, Any] | None = None) -> list[ShardRecord]:
    """The rows of ``shards.parquet`` as records, checked as :func:`read_shard_columns` checks them."""
    cols = read_shard_columns(data, where, manifest)
    return [cols.record(i) for i in range(len(cols))]


class SampleTableWriter:
    """Streams per-shard sample records, in shard order, into ``samples.parquet`` row groups
    of exactly ``SAMPLE_ROW_GROUP`` rows (the last one shorter), in the current version's
    schema: a shard whose records carry no layout gets null ``member_*`` columns."""

    def __init__(self, sink: BinaryIO) -> None:
        self._writer = pq.ParquetWriter(sink, SAMPLE_SCHEMA, compression="zstd")
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.rows = 0

    def add(self, shard: int, records: SampleRecords) -> None:
        n = len(records)
        if not n:
            return
        cols = [_arrow_array(records.keys, pa.string()), _arrow_array(np.full(n, shard), pa.int32()),
                _arrow_array(records.offsets, pa.int64()), _arrow_array(records.lengths, pa.int64()),
                _arrow_array(records.checksums, pa.string())]
        if records.member_fields is not None and records.member_bounds is not None:
            fields = _arrow_array(records.member_fields, pa.string())
            _, data, offs = string_column(fields)
            if len(fields) != n or (offs[1:] <= offs[:-1]).any():
                raise FormatError(f"shard #{shard}: {len(fields)} member field lists for {n} samples, or an empty "
                                  "one (a datapipe bug: please report it)")
            slashes = np.concatenate(([0], np.cumsum(data[: offs[-1]] == ord("/"))))
            members = slashes[offs[1:]] - slashes[offs[:-1]] + 1
            starts = np.concatenate(([0], np.cumsum(2 * members)))
            if starts[-1] != len(records.member_bounds) or starts[-1] >= 1 << 31:
                raise FormatError(f"shard #{shard}: {len(records.member_bounds)} member bounds for "
                                  f"{int(starts[-1])} (a datapipe bug: please report it)")
            bounds = pa.ListArray.from_arrays(_arrow_array(starts, pa.int32()),
                                              _arrow_array(records.member_bounds, pa.int64()))
            cols += [fields, bounds]
        else:
            cols += [pa.nulls(n, pa.string()), pa.nulls(n, pa.list_(pa.int64()))]
        self._pending.append(pa.Table.from_arrays(cols, schema=SAMPLE_SCHEMA))
        self._pending_rows += n
        while self._pending_rows >= SAMPLE_ROW_GROUP:
            self._flush(SAMPLE_ROW_GROUP)

    def _flush(self, n: int) -> None:
        table = pa.concat_tables(self._pending)
        self._writer.write_table(table.slice(0, n), row_group_size=SAMPLE_ROW_GROUP)
        rest = table.slice(n)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows -= n
        self.rows += n

    def close(self) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)
        self._writer.close()


class SampleRows:
    """Consecutive rows of ``samples.parquet``, checked (:func:`sample_rows`): numbers as
    numpy arrays; keys and checksums as Arrow string arrays, made ``str`` on demand (with
    the bytes of the keys, which the loader's check of a stored layout compares with tar
    headers); the member layout columns (version 2) as Arrow arrays, or None."""

    __slots__ = ("_keys", "checksum_array", "key_array", "key_data", "key_offsets", "length", "member_bounds",
                 "member_fields", "offset", "shard")

    def __init__(self, key_array: Any, key_data: NDArray[np.uint8], key_offsets: NDArray[np.int64],
                 shard: NDArray[np.int32], offset: NDArray[np.int64], length: NDArray[np.int64],
                 checksum_array: Any, member_fields: Any = None, member_bounds: Any = None) -> None:
        self.key_array, self.key_data, self.key_offsets = key_array, key_data, key_offsets
        self.shard, self.offset, self.length = shard, offset, length
        self.checksum_array = checksum_array
        self.member_fields, self.member_bounds = member_fields, member_bounds
        self._keys: list[str] | None = None

    def __len__(self) -> int:
        return len(self.offset)

    @property
    def keys(self) -> list[str]:
        if self._keys is None:
            self._keys = self.key_array.to_pylist()
        return self._keys

    @property
    def checksums(self) -> list[str]:
        """The rows' checksums (when the rows were read with them)."""
        if self.checksum_array is None:
            raise FormatError("these sample rows were read without their checksums (a datapipe bug: please report it)")
        out: list[str] = self.checksum_array.to_pylist()
        return out


def sample_rows(table: pa.Table, where: str = "samples.parquet", num_shards: int | None = None) -> SampleRows:
    """Consecutive rows of ``samples.parquet`` (a slice of its table), each checked: a safe
    key (UTF-8, relative, no empty, ``.`` or ``..`` component, no NUL or backslash, no dot
    in its last component), a shard number below ``num_shards``, a non-negative offset, a
    positive length and, when the slice holds the ``checksum`` column (a reader of a shard
    verified whole needs none, and reads it only when it needs it: :func:`sample_checksums`),
    a well-formed checksum; else :class:`CorruptIndexError` naming ``where``. Column by
    column, vectorised (:mod:`.columns`)."""
    for f in SAMPLE_SCHEMA:
        if f.name not in table.column_names and (f.name not in SAMPLE_BASE or f.name == "checksum"):
            continue  # version 1: no layout columns; the checksums read apart
        if f.name not in table.column_names or table.schema.field(f.name).type != f.type \
                or (f.name in SAMPLE_BASE and table.column(f.name).null_count):
            raise CorruptIndexError(f"{where}: sample table lacks column {f.name!r} of type {f.type} (or has nulls)")
    keys, key_data, key_offs = string_column(table.column("key"))
    shard = int_column(table.column("shard"), np.int32)
    offset, length = int_column(table.column("offset"), np.int64), int_column(table.column("length"), np.int64)
    try:
        keys.validate(full=True)  # UTF-8: Parquet's reader does not check it
        utf8 = True
    except pa.ArrowException:
        utf8 = False
    key_bad = _first(bad_paths(key_data, key_offs, dot_in_last=False)) if utf8 else None
    bad = None
    if not utf8:
        bad = "a key is not UTF-8 text"
    elif key_bad is not None:
        key = bytes(key_data[key_offs[key_bad] : key_offs[key_bad + 1]]).decode()
        bad = f"key {key!r} is not a safe relative sample key"
    elif len(shard) and (shard.min() < 0 or (num_shards is not None and shard.max() >= num_shards)):
        bad = f"a shard number is outside [0, {num_shards})"
    elif len(offset) and (offset.min() < 0 or length.min() <= 0 or length.max() >= _MAX_INT
                          or offset.max() >= _MAX_INT):
        bad = "an offset is negative or a length not positive"
    if bad:
        raise CorruptIndexError(f"{where}: {bad}; the index is damaged (re-run the pack that wrote it)")
    sums = sample_checksums(table.column("checksum"), where) if "checksum" in table.column_names else None
    fields = array_of(table.column("member_fields")) if "member_fields" in table.column_names else None
    bounds = array_of(table.column("member_bounds")) if "member_bounds" in table.column_names else None
    return SampleRows(keys, key_data, key_offs, shard, offset, length, sums, fields, bounds)


def sample_checksums(column: Any, where: str) -> Any:
    """The ``checksum`` column of consecutive rows of ``samples.parquet``, each checked to
    be a well-formed checksum (else :class:`CorruptIndexError` naming ``where``); an Arrow
    string array (``.to_pylist()`` makes them ``str``)."""
    if column.null_count:
        raise CorruptIndexError(f"{where}: sample table lacks column 'checksum' of type string (or has nulls)")
    sums, data, offs = string_column(column)
    if bad_checksums(data, offs).any():
        raise CorruptIndexError(f"{where}: a sample checksum is missing or not an xxh3_64 checksum (nothing could be "
                                "verified); the index is damaged (re-run the pack that wrote it)")
    return sums


def check_shard_rows(c: SampleRows, shard: int, record: Any, compression: str, where: str,
                     gaps: bool = False) -> None:
    """The rows of one shard tile it: the first sample starts at byte 0, each starts where
    the one before ends, the last ends where the end-of-archive blocks (or their zstd
    frame) begin, and no key repeats. So every offset lands on the first header of a
    sample, as the packer laid it out, and no byte of the shard is read twice.

    ``gaps`` (an index of existing tars, uncompressed): samples may be apart (members
    that name no sample lie between them) and the end-of-archive tail longer, so the rows
    must only be in order, block-aligned, apart and end at least two blocks before the
    end; the whole-shard checksum still covers every byte."""
    offs, lens = c.offset, c.length
    name = getattr(record, "name", record)
    bad = None
    if len(c) != record.samples or (len(c.shard) and (c.shard != shard).any()):
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
        elif len(set(c.keys)) != len(c):
            bad = f"a key repeats within shard #{shard} ({name})"
    if bad:
        raise CorruptIndexError(f"{where}: {bad}; the index is damaged (re-run the pack that wrote it)")


def stored_layout(c: SampleRows, where: str, tar_bytes: int | None = None) -> StoredLayout | None:
    """The member layout the index records for the rows ``c`` (one shard's, checked to tile
    it), or None where it records none (version 1; a shard whose writer recorded none).
    Checked here against the rows alone: every sample's field list (non-empty names
    without NUL) and as many (start, stop) pairs as fields, each inside the sample's
    tar bytes (its stored length; ``tar_bytes``, the shard's, for a compressed shard,
    whose rows give no sample's decompressed size). Whether the shard's bytes bear it out
    is :func:`.layout.check_layout`'s (and ``verify``'s)."""
    n = len(c)
    if c.member_fields is None or c.member_bounds is None or n == 0:
        return None
    nulls = (c.member_fields.null_count, c.member_bounds.null_count)
    if nulls == (n, n):
        return None
    if nulls != (0, 0):
        raise CorruptIndexError(f"{where}: the member layout is recorded for some samples of a shard and not "
                                "for others; the index is damaged (re-run the pack that wrote it)")
    arr, data, offs = string_column(c.member_fields)
    try:
        arr.validate(full=True)
    except pa.ArrowException:
        raise CorruptIndexError(f"{where}: a sample's member fields are not UTF-8 text") from None
    lens = offs[1:] - offs[:-1]
    if int(lens.min()) <= 0:
        raise CorruptIndexError(f"{where}: a sample's member field list is empty; the index is damaged")
    # the distinct field lists are few: only they are taken apart in Python. Rows of one
    # length at a time (one byte matrix each), so memory stays that of the column
    shape = np.empty(n, dtype=np.int64)
    distinct: list[bytes] = []
    by_len = np.argsort(lens, kind="stable")
    widths, cuts = np.unique(lens[by_len], return_index=True)
    for width, mine in zip(widths.tolist(), np.split(by_len, cuts[1:])):
        rows = data[offs[mine][:, None] + np.arange(width)]
        if (rows == rows[0]).all():
            uniq, inverse = rows[:1], np.zeros(len(mine), dtype=np.int64)
        else:
            uniq, inverse = np.unique(rows, axis=0, return_inverse=True)
        shape[mine] = inverse.reshape(-1) + len(distinct)
        distinct += [bytes(u) for u in uniq]
    shapes: list[tuple[str, ...]] = []
    for text in distinct:
        if b"\0" in text:
            raise CorruptIndexError(f"{where}: a sample's member field list holds a NUL byte")
        fields = tuple(text.decode("utf-8").split("/"))
        if not all(fields):
            raise CorruptIndexError(f"{where}: a sample's member field list {text[:200]!r} names an empty field")
        shapes.append(fields)
    bounds, first = list_column(c.member_bounds)
    counts = np.array([len(f) for f in shapes], dtype=np.int64)[shape]
    if not np.array_equal(first[1:] - first[:-1], 2 * counts):
        raise CorruptIndexError(f"{where}: a sample's member bounds do not match its member fields (two numbers a "
                                "member); the index is damaged (re-run the pack that wrote it)")
    members = np.repeat(np.arange(n), counts)
    start, stop = bounds[0::2], bounds[1::2]
    limit = c.length[members] if tar_bytes is None else tar_bytes
    if len(start) and ((start < 0).any() or (stop < start).any() or (stop > limit).any()):
        raise CorruptIndexError(f"{where}: a member's bounds lie outside its sample's bytes; the index is damaged "
                                "(re-run the pack that wrote it)")
    return StoredLayout(shapes, shape, first, bounds)
