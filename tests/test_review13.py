"""Review of #13 (existing tars indexed, Parquet read in place): each test here failed
before the fix it names, on real tar files and pyarrow-written Parquet."""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from benchmarks.fuzz_reader import deadline
from datapipe.errors import DestinationExistsError, ObjectChangedError, PackOptionError
from datapipe.loader import StreamingDataset
from datapipe.tables import ParquetTable
from datapipe.tarindex import expand_braces


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


def _shard(path: Path, keys: list[str]) -> None:
    src = path.parent / "member.txt"
    src.write_bytes(b"hello")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for k in keys:
            t.add(src, arcname=f"{k}.txt")
    src.unlink()


# --- brace patterns: the bound is on the names a pattern expands to, not on each range --


@pytest.mark.parametrize("pattern", ["s-{0..99999}-{0..99999}.tar", "s" + "{a,b}" * 40 + ".tar"])
def test_a_pattern_of_too_many_names_is_refused_at_once(pattern):
    """Each range was bounded on its own, so two ranges (or 40 two-way lists) multiplied to
    10^10 (10^12) names, built in memory before any check."""
    t0 = time.monotonic()
    with deadline(10, "expand_braces"), pytest.raises(PackOptionError, match="more than"):
        expand_braces(pattern)
    assert time.monotonic() - t0 < 10


# --- nothing deleted that we did not write ---------------------------------------------


@pytest.mark.parametrize("name", ["samples.parquet", "shards.parquet"])
def test_a_users_index_named_file_beside_the_shards_is_never_overwritten(tmp_path, name):
    """Indexing in place wrote shards.parquet and samples.parquet over files of those names
    that the user had in the shard folder (only manifest.json was checked)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    _shard(folder / "shard-000000.tar", ["a", "b"])
    theirs = pq.write_table(pa.table({"caption": ["the user's table"]}), folder / name)
    del theirs
    before = (folder / name).read_bytes()
    with pytest.raises(DestinationExistsError, match=name):
        datapipe.index_shards([str(folder / "shard-000000.tar")], workers=1)
    assert (folder / name).read_bytes() == before
    assert not (folder / "manifest.json").exists()


def test_an_index_over_our_own_interrupted_commit_is_finished(tmp_path):
    """The refusal above must not refuse our own files: a commit that stopped after writing
    samples.parquet (manifest not yet written) is finished by the same command."""
    folder = tmp_path / "shards"
    folder.mkdir()
    _shard(folder / "shard-000000.tar", ["a", "b"])
    url = str(folder / "shard-000000.tar")
    datapipe.index_shards([url], workers=1)
    (folder / "manifest.json").unlink()  # as if killed between samples.parquet and manifest.json
    r = datapipe.index_shards([url], workers=1)
    assert r.committed and r.samples == 2
    assert sorted(s["__key__"] for s in datapipe.open_dataset(str(folder))) == ["a", "b"]


def test_a_packed_dataset_as_destination_is_refused_before_any_shard_is_read(tmp_path):
    """A destination holding a packed dataset was refused only at the commit, after every
    shard had been read (and records of them written into that dataset's folder)."""
    packed = tmp_path / "packed"
    datapipe.pack(str(_files(tmp_path)), str(packed), workers=1)
    listing = sorted(p.name for p in packed.rglob("*"))
    folder = tmp_path / "shards"
    folder.mkdir()
    _shard(folder / "shard-000000.tar", ["a"])
    with pytest.raises(DestinationExistsError, match="a packed dataset"):
        datapipe.index_shards([str(folder / "shard-000000.tar")], str(packed), workers=1)
    assert sorted(p.name for p in packed.rglob("*")) == listing


def _files(tmp_path: Path) -> Path:
    src = tmp_path / "files"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_bytes(b"x" * i)
    return src


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


# --- storage options: a prefix matches at a path boundary ----------------------------------


def test_storage_option_prefixes_match_whole_path_segments():
    """``s3://bucket`` matched ``s3://bucket-public/...`` (another bucket got its endpoint and
    keys), and ``s3://bucket/`` did not match the bucket's own root ``s3://bucket``."""
    from datapipe.storage import options, set_storage_options, storage_options_for

    try:
        set_storage_options("s3://data", {"key": "data"})
        set_storage_options("s3://logs/", {"key": "logs"})
        set_storage_options("s3://", {"key": "any"})
        assert storage_options_for("s3://data/x.tar") == {"key": "data"}
        assert storage_options_for("s3://data") == {"key": "data"}
        assert storage_options_for("s3://data-public/x.tar") == {"key": "any"}
        assert storage_options_for("s3://logs") == {"key": "logs"}
        assert storage_options_for("s3://logs/a/b") == {"key": "logs"}
        assert storage_options_for("s3://logsx/a") == {"key": "any"}
        assert storage_options_for("gs://data/x") == {}
    finally:
        options._set.clear()


# --- clear refusals for Parquet tables ------------------------------------------------------


def test_a_chained_url_to_a_parquet_table_is_refused_with_the_way_out():
    """StreamingDataset("simplecache::s3://b/t.parquet") raised fsspec's raw
    ``ValueError: Protocol not known: simplecache::s3``."""
    from datapipe.errors import StorageError

    with pytest.raises(StorageError, match=r"chained fsspec URLs.*s3://b/t\.parquet"):
        StreamingDataset("simplecache::s3://b/t.parquet")


def test_open_dataset_on_a_parquet_table_says_what_reads_it(tmp_path):
    """open_dataset on a Parquet folder said "manifest.json is missing ... run the same
    `datapipe pack` command again; for existing tar shards, run `datapipe index`": no
    advice for a table, which StreamingDataset reads in place."""
    from datapipe.errors import PlanError

    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "a.parquet")
    for url in (str(tmp_path), str(tmp_path / "a.parquet")):
        with pytest.raises(PlanError, match=r"Parquet table.*StreamingDataset.*datapipe pack"):
            datapipe.open_dataset(url)


# --- no partial result looks complete: an index without its manifest is not a table ---------


def test_an_index_that_lost_its_manifest_is_not_streamed_as_a_parquet_table(tmp_path):
    """An index written elsewhere (--index-to DEST) holds only shards.parquet, samples.parquet
    and _index/: once its manifest is gone (a commit killed before the manifest, or a rewrite
    under way) StreamingDataset(DEST) took it for a Parquet table and streamed the index's
    own rows (key, shard, offset, ...) as samples."""
    from datapipe.errors import ObjectNotFoundError

    folder = tmp_path / "shards"
    folder.mkdir()
    _shard(folder / "shard-000000.tar", ["a", "b"])
    dest = tmp_path / "index"
    datapipe.index_shards([str(folder / "shard-000000.tar")], str(dest), workers=1)
    assert sorted(s["__key__"] for s in StreamingDataset(str(dest), decode=None)) == ["a", "b"]
    (dest / "manifest.json").unlink()
    with pytest.raises(ObjectNotFoundError, match=r"manifest\.json is missing"):
        list(StreamingDataset(str(dest), decode=None))


# --- storage options: a malformed environment value is not echoed (it holds credentials) ----


@pytest.mark.parametrize("text", ['{"s3://b/": "secret-key-AKIA123"}', '["secret-key-AKIA123"]',
                                  '{"s3://b/": {"key": "secret-key-AKIA123"}, "b/": {}}'])
def test_a_malformed_environment_value_is_named_without_echoing_it(monkeypatch, text):
    """The error quoted the first 200 characters of DATAPIPE_STORAGE_OPTIONS: keys and
    secrets went into logs and tracebacks."""
    from datapipe.errors import StorageError
    from datapipe.storage import storage_options_for

    monkeypatch.setenv("DATAPIPE_STORAGE_OPTIONS", text)
    with pytest.raises(StorageError, match="DATAPIPE_STORAGE_OPTIONS") as e:
        storage_options_for("s3://b/x")
    assert "secret-key" not in str(e.value)


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


# --- the index cached for shard URLs is checked to list those shards --------------------------


def test_a_cached_index_of_other_shards_is_not_used(tmp_path):
    """index_location trusted whatever manifest it found at the cache key's folder: an index
    of other shards there (a shared DATAPIPE_CACHE_DIR, a folder copied over) was opened and
    its samples delivered for the shards asked for."""
    import shutil

    from datapipe.errors import CorruptIndexError
    from datapipe.tarindex.resolve import index_location

    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    _shard(mine / "shard-000000.tar", ["a", "b"])
    _shard(other / "shard-000000.tar", ["x", "y"])
    pattern = str(mine / "shard-*.tar")
    dest = index_location(pattern)
    assert sorted(s["__key__"] for s in datapipe.open_dataset(pattern)) == ["a", "b"]
    planted = tmp_path / "planted"
    datapipe.index_shards([str(other / "shard-000000.tar")], str(planted), workers=1)
    shutil.rmtree(dest)
    shutil.copytree(planted, dest)
    with pytest.raises(CorruptIndexError, match=str(dest)):
        datapipe.open_dataset(pattern)
    assert sorted(p.name for p in Path(dest).iterdir()) == sorted(p.name for p in planted.iterdir())


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab{},.019", max_size=24))
def test_brace_counts_match_the_expansion(pattern):
    """The bound is checked on a count made without expanding: it must be the number of
    names the expansion makes, for any pattern (nested, unbalanced, literal braces)."""
    from datapipe.storage.patterns import _count_names, _expand

    try:
        names = _expand(pattern)
    except PackOptionError:
        return
    assert _count_names(pattern) == len(names)


def test_a_null_key_in_a_tables_key_column_is_not_the_key_none(tmp_path):
    """A null ``__key__`` became the key "None" (the same for every such row), where pack
    gives such a row its position's key."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"__key__": ["a", None, None], "x": [1, 2, 3]}), path)
    keys = [s["__key__"] for s in StreamingDataset(str(path), shuffle=False)]
    assert keys[0] == "a" and "None" not in keys and len(set(keys)) == 3


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_shard_name_that_is_not_a_regular_file_is_named(tmp_path, kind):
    """A folder named x.tar raised a raw IsADirectoryError from the read; a FIFO named x.tar
    blocked the run forever in open()."""
    from datapipe.errors import DatapipeError

    path = tmp_path / "x.tar"
    if kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    with deadline(10, "index a non-file"), pytest.raises(DatapipeError, match=r"x\.tar.*not a regular file"):
        datapipe.index_shards(str(path), str(tmp_path / "index"), workers=1)
