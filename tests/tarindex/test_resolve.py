"""The index cached for shard URLs (tarindex.resolve.index_location) is checked to list
those shards before it is used."""

from __future__ import annotations

from pathlib import Path

import pytest

import datapipe
from tests.tar_shards import text_shard


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


_shard = text_shard


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
