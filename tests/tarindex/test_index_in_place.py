"""Indexing existing tars in place: nothing deleted that we did not write (a user's files
named like an index, a packed dataset as destination), our own interrupted commit
finished, a shard name that is not a regular file named; each on real tar files."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from benchmarks.fuzz_reader import deadline
from datapipe.errors import DestinationExistsError
from tests.tar_shards import text_shard


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


_shard = text_shard


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
