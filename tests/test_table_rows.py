"""Parquet tables read in place, row by row: field names, typed values under decode=,
schemas that differ between files, null keys, a file replaced after its check; on
pyarrow-written Parquet."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import ObjectChangedError
from datapipe.loader import StreamingDataset
from datapipe.tables import ParquetTable


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


# --- Parquet: struct-of-bytes columns give the same fields in every row -----------------


def _image_table() -> pa.Table:
    img = pa.array([{"bytes": b"\x89PNG1", "path": "a.png"}, {"bytes": None, "path": "b.png"},
                    {"bytes": b"\x89PNG3", "path": None}],
                   type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    return pa.table({"id": [0, 1, 2], "image": img})


def test_a_struct_of_bytes_with_a_null_child_gives_the_same_fields(tmp_path):
    """A row whose image bytes were null became one field ``image`` holding a dict, while
    the other rows had ``image.bytes``/``image.path``: the field names depended on values."""
    path = tmp_path / "t.parquet"
    pq.write_table(_image_table(), path)
    rows = {int(s["id"]): s for s in StreamingDataset(str(path), shuffle=False, decode=None)}
    assert "image" not in rows[1] and rows[1]["image.path"] in ("b.png", b"b.png") and "image.bytes" not in rows[1]
    dest = str(tmp_path / "packed")
    datapipe.pack(str(path), dest, workers=1)
    packed = {int(s["id"]): s for s in datapipe.open_dataset(dest)}
    assert set(packed[1]) == {"__key__", "id", "image.path"}
    assert packed[0]["image.bytes"] == b"\x89PNG1" and packed[2]["image.bytes"] == b"\x89PNG3"


# --- Parquet: a file replaced between the check and the read ----------------------------


def test_a_parquet_file_replaced_after_the_check_is_not_read_silently(tmp_path, monkeypatch):
    """The file's size and version were checked before the row group was read, and never
    after: a file renamed over it in between (same schema, same layout, other values) was
    read as if it were the one the plan was made from."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"v": pa.array(range(100), pa.int64())}), path, compression="none",
                   write_statistics=False)
    table = ParquetTable(str(path))
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"v": pa.array(range(1000, 1100), pa.int64())}), other, compression="none",
                   write_statistics=False)
    assert other.stat().st_size == path.stat().st_size
    real_stat = table.store.stat
    swapped = []

    def stat_then_swap(key: str):
        out = real_stat(key)
        if not swapped:  # a writer's rename lands right after our check
            os.replace(other, path)
            swapped.append(key)
        return out

    monkeypatch.setattr(table.store, "stat", stat_then_swap)
    with pytest.raises(ObjectChangedError):
        rows, _ = table.read_row_group(0)
        assert rows.column("v").to_pylist() == list(range(100)), "the replaced file's rows were delivered"


# --- decode= over a Parquet table: typed values are not bytes -----------------------------


def test_decode_auto_leaves_a_tables_typed_values_as_they_are(tmp_path):
    """decode="auto" ran the ``id``/``cls``/``txt`` decoders on a table's int and str values:
    ``bytes(3)`` is three zero bytes (a DecodeError), and an id of 2*10^8 first allocated
    200 MB of zeros."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [3, 200_000_000], "txt": ["a", "b"], "label.cls": [1, 2],
                             "meta.json": [b'{"k": 1}', b'{"k": 2}']}), path)
    rows = list(StreamingDataset(str(path), shuffle=False, decode="auto"))
    assert [(r["id"], r["txt"], r["label.cls"], r["meta.json"]) for r in rows] == \
        [(3, "a", 1, {"k": 1}), (200_000_000, "b", 2, {"k": 2})]


# --- Parquet: every file's columns, or a named refusal ---------------------------------------


def test_files_of_a_table_with_more_columns_than_the_first_lose_none(tmp_path):
    """pyarrow takes a dataset's schema from its first file: a column that only later files
    have was dropped from every row, silently, in the loader and in pack alike."""
    root = tmp_path / "t"
    (root / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"y": ["s"]}), root / "a.parquet")
    pq.write_table(pa.table({"x": [1], "y": ["t"]}), root / "sub" / "b.parquet")
    rows = {s["y"]: s.get("x") for s in StreamingDataset(str(root), shuffle=False)}
    assert rows == {"s": None, "t": 1}
    dest = str(tmp_path / "packed")
    datapipe.pack(str(root), dest, workers=1)
    packed = {bytes(s["y"]): s.get("x") for s in datapipe.open_dataset(dest)}
    assert packed == {b"s": None, b"t": b"1"}


def test_a_column_with_two_types_in_a_table_is_a_named_format_error(tmp_path):
    """A Hive key that is also a column of the files (int32 from the folder name, int64 in
    the file) raised pyarrow's raw ArrowTypeError."""
    from datapipe.errors import FormatError

    (tmp_path / "t" / "x=5").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "t" / "x=5" / "a.parquet")
    with pytest.raises(FormatError, match=str(tmp_path / "t")):
        StreamingDataset(str(tmp_path / "t"))


def test_a_null_key_in_a_tables_key_column_is_not_the_key_none(tmp_path):
    """A null ``__key__`` became the key "None" (the same for every such row), where pack
    gives such a row its position's key."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"__key__": ["a", None, None], "x": [1, 2, 3]}), path)
    keys = [s["__key__"] for s in StreamingDataset(str(path), shuffle=False)]
    assert keys[0] == "a" and "None" not in keys and len(set(keys)) == 3
