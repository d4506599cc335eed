"""Field names of a Parquet table's rows: a struct of bytes becomes one field per child
(``image`` -> ``image.bytes``, ``image.path``), so two columns could give one field name.
Such a table is refused, naming the file and both columns, by the loader reading it in
place and by ``datapipe.pack``; nothing is dropped."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import FormatError, InputFileError
from datapipe.loader import StreamingDataset

_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
_BOTH = r"struct column 'image' \(one field per child\) and column 'image.bytes' both give the field 'image.bytes'"


def _image(n: int) -> pa.Array:
    return pa.array([{"bytes": b"struct-%d" % i, "path": f"{i}.jpg"} for i in range(n)], _IMAGE)


def _colliding(path: os.PathLike[str] | str) -> str:
    pq.write_table(pa.table({"image": _image(2), "image.bytes": [b"top-0", b"top-1"]}), path)
    return str(path)


def test_the_loader_refuses_a_struct_beside_a_column_of_its_child_name(tmp_path):
    path = _colliding(tmp_path / "t.parquet")
    with pytest.raises(FormatError, match=rf"t\.parquet: {_BOTH}.*rename one of the columns"):
        StreamingDataset(path, shuffle=False)


def test_pack_refuses_a_struct_beside_a_column_of_its_child_name(tmp_path):
    path = _colliding(tmp_path / "t.parquet")
    with pytest.raises(InputFileError, match=rf"t\.parquet: {_BOTH}"):
        datapipe.pack(path, str(tmp_path / "out"), workers=1)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_folder_names_the_file_that_holds_both_columns(tmp_path):
    table = tmp_path / "table"
    table.mkdir()
    pq.write_table(pa.table({"image": _image(2), "caption": ["a", "b"]}), table / "a.parquet")
    _colliding(table / "b.parquet")
    with pytest.raises(FormatError, match=rf"b\.parquet: {_BOTH}"):
        StreamingDataset(str(table), shuffle=False)
    with pytest.raises(InputFileError, match=rf"b\.parquet: {_BOTH}"):
        datapipe.pack(str(table), str(tmp_path / "out"), workers=1)


def test_columns_of_two_files_that_give_one_field_are_refused(tmp_path):
    """Each file alone is fine; the table's rows would hold both columns (the schema of a
    folder is the union of its files')."""
    table = tmp_path / "table"
    table.mkdir()
    pq.write_table(pa.table({"image": _image(2)}), table / "a.parquet")
    pq.write_table(pa.table({"image.bytes": [b"x", b"y"]}), table / "b.parquet")
    with pytest.raises(FormatError, match=rf"table: {_BOTH}"):
        StreamingDataset(str(table), shuffle=False)
    with pytest.raises(InputFileError, match=rf"table: {_BOTH}"):
        datapipe.pack(str(table), str(tmp_path / "out"), workers=1)


def test_a_struct_without_bytes_and_distinct_names_still_read(tmp_path):
    """A struct of bytes beside other columns, and a struct without bytes (stored as one
    JSON field under its own name) beside a column named like one of its children."""
    path = tmp_path / "ok.parquet"
    meta = pa.array([{"w": 1}, {"w": 2}], pa.struct([("w", pa.int64())]))
    pq.write_table(pa.table({"image": _image(2), "image.caption": ["c0", "c1"], "meta": meta,
                             "meta.w": [7, 8]}), path)
    rows = sorted(StreamingDataset(str(path), shuffle=False), key=lambda s: s["__key__"])
    assert [(s["image.bytes"], s["image.path"], s["image.caption"], s["meta"], s["meta.w"]) for s in rows] == [
        (b"struct-0", "0.jpg", "c0", {"w": 1}, 7), (b"struct-1", "1.jpg", "c1", {"w": 2}, 8)]
    datapipe.pack(str(path), str(tmp_path / "out"), workers=1)
    ds = datapipe.open_dataset(str(tmp_path / "out"))
    assert ds[1]["image.bytes"] == b"struct-1" and ds[1]["image.caption"] == b"c1"
