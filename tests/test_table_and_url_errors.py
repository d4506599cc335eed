"""Bad Parquet values, reserved column names, binary keys, shards too large to hold and brace
patterns beyond any list of shards: each a named DatapipeError naming file, row (group) and
column (or the shard, or the pattern) with the fix, never a raw Python exception or a silent
drop. Real Parquet files (pyarrow), real tars, the real CLI."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import FormatError, InputFileError, InvalidMemberNameError, PackOptionError
from datapipe.format import encode_sample
from datapipe.loader import StreamingDataset
from datapipe.tarindex.urls import expand_urls


def _damaged_strings(path, column: str = "s") -> str:
    """Ten rows whose string column ``column`` holds a byte that is not UTF-8 in row 3 (a
    damaged data page: Parquet pages carry no checksum by default)."""
    pq.write_table(pa.table({column: [f"value-{i:03d}" for i in range(10)], "x": [b"v%d" % i for i in range(10)]}),
                   path, compression="none", use_dictionary=False)
    data = bytearray(path.read_bytes())
    data[data.find(b"value-003")] = 0xFF
    path.write_bytes(bytes(data))
    return str(path)


_OUT_OF_RANGE = {
    "timestamp": pa.array([2**62, 1], pa.timestamp("us")),  # past datetime's year 9999
    "date32": pa.array([2**31 - 1, 0], pa.date32()),
}


# --- B5: the loader over a table ------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(_OUT_OF_RANGE))
def test_stream_a_value_python_cannot_hold_is_its_rows_named_error_and_skips_alone(tmp_path, kind):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"t": _OUT_OF_RANGE[kind], "x": [b"a", b"b"]}), path)
    with pytest.raises(FormatError, match=r"t\.parquet#rowgroup=0: row 0, column 't': .*datetime.*cast the column"):
        list(StreamingDataset(str(path), shuffle=False))
    with pytest.warns(RuntimeWarning, match="skipped 1 "):
        rows = list(StreamingDataset(str(path), shuffle=False, on_error="skip"))
    assert [r["x"] for r in rows] == [b"b"]


def test_stream_a_damaged_string_page_skips_only_the_bad_row(tmp_path):
    path = _damaged_strings(tmp_path / "s.parquet")
    with pytest.raises(FormatError, match=r"s\.parquet#rowgroup=0: row 3, column 's': a string that is not UTF-8"):
        list(StreamingDataset(path, shuffle=False))
    with pytest.warns(RuntimeWarning, match="skipped 1 "):
        rows = list(StreamingDataset(path, shuffle=False, on_error="skip"))
    assert [r["s"] for r in rows] == [f"value-{i:03d}" for i in range(10) if i != 3]


@pytest.mark.parametrize("damage", ["utf8", "timestamp"])
def test_stream_a_key_python_cannot_hold_is_the_row_groups_named_error(tmp_path, damage):
    path = tmp_path / "k.parquet"
    if damage == "utf8":
        _damaged_strings(path, "__key__")
        row = 3
    else:
        pq.write_table(pa.table({"__key__": _OUT_OF_RANGE["timestamp"], "x": [b"a", b"b"]}), path)
        row = 0
    with pytest.raises(FormatError, match=rf"k\.parquet row group 0: row {row}, column '__key__'"):
        list(StreamingDataset(str(path), shuffle=False))
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert list(StreamingDataset(str(path), shuffle=False, on_error="skip")) == []


# --- B9: binary keys -------------------------------------------------------------------


def test_a_binary_key_column_is_decoded_not_its_repr(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"__key__": [b"k1", "kö".encode()], "x": [b"a", b"b"]}), path)
    assert [s["__key__"] for s in StreamingDataset(str(path), shuffle=False)] == ["k1", "kö"]
    datapipe.pack(str(path), str(tmp_path / "out"), workers=1)
    assert sorted(datapipe.open_dataset(str(tmp_path / "out")).index.keys()) == ["k1", "kö"]


def test_a_binary_key_that_is_not_utf8_is_a_named_error(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"__key__": [b"k1", b"\xffk2"], "x": [b"a", b"b"]}), path)
    with pytest.raises(FormatError, match=r"row 1, column '__key__': the key b'\\xffk2' is not UTF-8"):
        list(StreamingDataset(str(path), shuffle=False))
    with pytest.raises(InputFileError, match=r"t\.parquet: row 1, column '__key__'.* is not UTF-8"):
        datapipe.pack(str(path), str(tmp_path / "out"), workers=1)


# --- B6: pack from a table -------------------------------------------------------------


_NESTED_BYTES = {
    "list_binary": pa.table({"frames": pa.array([[b"a", b"b"], [b"c"]], pa.list_(pa.binary()))}),
    "struct_of_struct": pa.table({"s": pa.array([{"a": {"b": b"x"}}, {"a": {"b": b"y"}}],
                                                pa.struct([("a", pa.struct([("b", pa.binary())]))]))}),
    "map_binary": pa.table({"m": pa.array([[("k", b"v")], [("j", b"w")]], pa.map_(pa.string(), pa.binary()))}),
}


@pytest.mark.parametrize("name", sorted(_NESTED_BYTES))
def test_pack_refuses_a_nested_column_of_bytes_naming_it(tmp_path, name):
    path = tmp_path / f"{name}.parquet"
    pq.write_table(_NESTED_BYTES[name], path)
    column = _NESTED_BYTES[name].column_names[0]
    with pytest.raises(InputFileError, match=rf"{name}\.parquet: column '{column}' .*stored as JSON.*base64"):
        datapipe.pack(str(path), str(tmp_path / "out"), workers=1)


def test_pack_cli_names_a_nested_column_of_bytes_without_a_traceback(tmp_path):
    path = tmp_path / "frames.parquet"
    pq.write_table(_NESTED_BYTES["list_binary"], path)
    r = subprocess.run([sys.executable, "-m", "datapipe.cli", "pack", str(path), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "frames.parquet: column 'frames'" in r.stderr


def test_a_list_holding_bytes_is_a_named_error_when_encoded():
    with pytest.raises(InvalidMemberNameError, match="sample 'k' field 'frames': a list is stored as JSON"):
        encode_sample({"__key__": "k", "frames": [b"a", b"b"]})


@pytest.mark.parametrize("kind", ["timestamp", "utf8"])
def test_pack_names_file_row_and_column_of_a_value_python_cannot_hold(tmp_path, kind):
    path = tmp_path / "t.parquet"
    if kind == "utf8":
        _damaged_strings(path)
        where = r"row 3, column 's': a string that is not UTF-8"
    else:
        pq.write_table(pa.table({"t": _OUT_OF_RANGE["timestamp"], "x": [b"a", b"b"]}), path)
        where = r"row 0, column 't': a date"
    with pytest.raises(InputFileError, match=rf"t\.parquet row group 0: {where}"):
        datapipe.pack(str(path), str(tmp_path / "out"), workers=1)


def test_pack_part_converts_only_its_own_rows(tmp_path):
    """Rows 0-4 are part 0, rows 5-9 part 1: the damaged row 3 fails part 0 alone."""
    path = _damaged_strings(tmp_path / "s.parquet")
    datapipe.pack(path, str(tmp_path / "out"), workers=1, part=(1, 2))
    with pytest.raises(InputFileError, match="row 3, column 's'"):
        datapipe.pack(path, str(tmp_path / "out"), workers=1, part=(0, 2))


def test_pack_refuses_a_reserved_column_name_instead_of_dropping_it(tmp_path):
    path = tmp_path / "dunder.parquet"
    pq.write_table(pa.table({"__meta": [b"m1", b"m2"], "x": [b"a", b"b"]}), path)
    with pytest.raises(InputFileError, match=r"dunder\.parquet: column '__meta': .*rename the column"):
        datapipe.pack(str(path), str(tmp_path / "out"), workers=1)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"x": "a"}\n{"x": "b", "__meta": "m"}\n')
    with pytest.raises(InputFileError, match=r"rows\.jsonl:2: row 1 has field '__meta'.*rename it"):
        datapipe.pack(str(jsonl), str(tmp_path / "out2"), workers=1)


# --- B7: a shard larger than a worker may hold ------------------------------------------


def test_index_refuses_a_shard_larger_than_memory_naming_it(tmp_path):
    small = tmp_path / "a.tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("s0.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    small.write_bytes(buf.getvalue())
    huge = tmp_path / "huge.tar"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # sparse: no disk used, more memory than any test machine has
    for call in (lambda: datapipe.index_shards([str(small), str(huge)], str(tmp_path / "idx"), workers=1),
                 lambda: datapipe.index_shards([str(huge)], str(tmp_path / "idx2"), workers=2),
                 lambda: datapipe.open_dataset(str(huge))):
        t = time.monotonic()
        with pytest.raises(PackOptionError, match=r"shard .*huge\.tar holds 1,099,511,627,776 bytes.*fewer workers"):
            call()
        assert time.monotonic() - t < 30


# --- B8: brace patterns ---------------------------------------------------------------


@pytest.mark.parametrize("pattern", [
    "/tmp/x/shard-{0.." + "9" * 5000 + "}.tar",  # past int()'s 4300 digits
    "/tmp/x/shard-" + "{x}" * 1200 + ".tar",  # past the recursion limit, one group after another
    "/tmp/x/" + "{" * 1200 + "a" + "}" * 1200 + ".tar",  # and nested
    "/tmp/x/" + "{a,b}" * 10 + "y" * 70_000 + ".tar",  # no list of shards is this long
], ids=["range-5000-digits", "1200-groups", "1200-nested", "70000-characters"])
def test_a_pattern_beyond_any_list_of_shards_is_a_named_error(pattern):
    t = time.monotonic()
    with pytest.raises(PackOptionError, match=r"digits|brace groups|characters"):
        expand_urls(pattern)
    assert time.monotonic() - t < 5
