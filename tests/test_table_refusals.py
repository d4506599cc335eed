"""What is not a Parquet table is refused with the way out: a chained fsspec URL, a table
given to open_dataset, an index that lost its manifest."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.loader import StreamingDataset
from tests.tar_shards import text_shard


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


_shard = text_shard


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
