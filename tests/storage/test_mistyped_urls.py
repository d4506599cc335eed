"""A URL with its slashes missing (``s3:/bucket/x``, ``gs:bucket/x``) is a local path to
Python and fsspec: instead of "no dataset at s3:/bucket/x: manifest.json is missing (not
packed, ...)", a UrlError names the URL that was meant, before anything is read or written.
A path that exists is left alone (a folder may be named ``s3:``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import datapipe
from datapipe import ShardWriter, StreamingDataset, open_dataset
from datapipe.errors import ObjectNotFoundError, OptionError, StorageError, UrlError
from datapipe.storage import open_store


@pytest.mark.parametrize("url, meant", [
    ("s3:/bucket/x", "s3://bucket/x"),
    ("s3:bucket/x", "s3://bucket/x"),
    ("gs:/bucket/ds", "gs://bucket/ds"),
    ("memory:/ds", "memory://ds"),
    ("S3:/bucket/x", "s3://bucket/x"),
    ("file:/nonexistent-dir/ds", "/nonexistent-dir/ds"),
])
def test_a_url_missing_its_slashes_names_the_url_meant(url, meant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing at the local path these name
    for call in (lambda: StreamingDataset(url), lambda: open_dataset(url), lambda: open_store(url),
                 lambda: StreamingDataset(url + "/shard-{000..003}.tar"), lambda: open_dataset([url + "/a.tar"])):
        with pytest.raises(UrlError, match=f"Did you mean {meant}") as e:
            call()
        assert isinstance(e.value, OptionError) and isinstance(e.value, StorageError)
        assert not isinstance(e.value, ObjectNotFoundError)
    assert os.listdir(tmp_path) == []


def test_pack_to_a_mistyped_url_writes_nothing(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UrlError, match="Did you mean s3://bucket/ds"):
        datapipe.pack(str(src), "s3:/bucket/ds")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_the_command_line_names_it_too(tmp_path):
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "inspect", "s3:/bucket/x"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 2 and "Did you mean s3://bucket/x?" in out.stderr, out.stderr
    assert "manifest.json is missing" not in out.stderr


def test_a_path_that_exists_or_no_protocol_names_is_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with ShardWriter("./s3:/ds", max_samples=4) as w:  # "./" makes it a path
        for i in range(6):
            w.write({"__key__": f"k{i}", "cls": str(i)})
    assert len(list(StreamingDataset("s3:/ds"))) == 6  # it exists: a local folder named s3:
    with pytest.raises(ObjectNotFoundError):
        StreamingDataset("notaprotocol:/ds")  # no fsspec protocol of that name: an ordinary path
    with pytest.raises(UrlError, match="chained"):
        open_store("simplecache::s3://bucket/x")
