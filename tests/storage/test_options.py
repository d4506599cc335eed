"""Storage options in one place: set once per URL prefix (or in the environment), used by
every store datapipe opens; a dataset read through a cache uses the cache's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import datapipe
from datapipe.errors import StorageError
from datapipe.storage import open_store, set_storage_options, storage_options_for


@pytest.fixture
def registry():
    yield set_storage_options
    from datapipe.storage import options

    options._set.clear()


def _pack(tmp_path, n=40):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        (src / f"s{i:03d}.bin").write_bytes(bytes([i]) * (i + 1))
    return str(src)


def test_longest_prefix_and_explicit_options_merge(registry, monkeypatch):
    registry("s3://", {"anon": False, "client_kwargs": {"region_name": "r1"}})
    registry("s3://b/", {"client_kwargs": {"endpoint_url": "http://e"}})
    monkeypatch.setenv("DATAPIPE_STORAGE_OPTIONS", json.dumps({"s3://b/x/": {"key": "env"}, "s3://": {"key": "k"}}))
    assert storage_options_for("s3://b/x/y") == {"key": "env"}  # the longest prefix, from the environment
    assert storage_options_for("s3://b/y", {"client_kwargs": {"verify": False}}) == {
        "client_kwargs": {"endpoint_url": "http://e", "verify": False}}
    assert storage_options_for("s3://c/y") == {"anon": False, "client_kwargs": {"region_name": "r1"}}
    assert storage_options_for("gs://c/y") == {}
    registry("s3://b/", None)
    assert storage_options_for("s3://b/y")["client_kwargs"] == {"region_name": "r1"}
    with pytest.raises(ValueError, match="prefix"):
        registry("bucket/", {})
    monkeypatch.setenv("DATAPIPE_STORAGE_OPTIONS", "{not json")
    with pytest.raises(StorageError, match="DATAPIPE_STORAGE_OPTIONS"):
        storage_options_for("s3://b/y")


def test_options_set_once_reach_pack_the_loader_the_cache_and_checkpoints(s3, tmp_path, registry):
    """The README's flow against a custom endpoint (moto), with the options given once."""
    import torch

    root, opts = s3
    registry(root, opts)
    dest = root + "/ds"
    datapipe.pack(_pack(tmp_path), dest, workers=2)  # worker processes get the merged options
    assert datapipe.open_index(dest).num_samples == 40
    cache = datapipe.TieredCache(hot_bytes=1 << 20, warm_dir=str(tmp_path / "warm"), warm_bytes=64 << 20)
    ds = datapipe.StreamingDataset(dest, cache=cache, decode=None)
    assert sorted(s["__key__"] for s in ds) == [f"s{i:03d}" for i in range(40)]
    w = datapipe.CheckpointWriter(root + "/ckpt")
    w.save(1, {"w": torch.arange(5)}).wait()
    w.close()
    assert torch.equal(datapipe.load_checkpoint(root + "/ckpt")["w"], torch.arange(5))


def test_a_dataset_read_through_a_cache_uses_the_cache_options(s3, tmp_path):
    root, opts = s3
    dest = root + "/ds"
    datapipe.pack(_pack(tmp_path), dest, storage_options=opts, workers=1)
    cache = datapipe.TieredCache(hot_bytes=1 << 20, storage_options=opts)
    ds = datapipe.StreamingDataset(dest, cache=cache, decode=None)  # no options of its own
    assert len(list(ds)) == 40


def test_options_from_the_environment_reach_another_process(s3, tmp_path):
    root, opts = s3
    dest = root + "/ds"
    datapipe.pack(_pack(tmp_path), dest, storage_options=opts, workers=1)
    env = dict(os.environ, DATAPIPE_STORAGE_OPTIONS=json.dumps({root: opts}))
    code = f"import datapipe; print(datapipe.open_index({dest!r}).num_samples)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "40", out.stderr[-2000:]


def test_chained_urls_are_refused_with_the_way_out():
    with pytest.raises(StorageError, match=r"simplecache::.*TieredCache") as e:
        open_store("simplecache::s3://bucket/ds")
    assert "s3://bucket/ds" in str(e.value)


def test_pathlib_paths_open(tmp_path):
    src = _pack(tmp_path)
    datapipe.pack(src, str(tmp_path / "ds"), workers=1)
    assert open_store(tmp_path / "ds").local_path("") is not None


def test_a_memory_destination_is_packed_in_this_process(tmp_path):
    """Worker processes would write into their own memory: the shards must not be lost."""
    dest = "memory://datapipe-test/ds"
    result = datapipe.pack(_pack(tmp_path), dest, workers=4)
    assert result.shards >= 1
    assert datapipe.open_index(dest).num_samples == 40
    assert len(datapipe.open_dataset(dest)) == 40
