"""End to end from moto's S3 server (loopback), through the TieredCache and without one."""

from __future__ import annotations

import functools

import pytest

from datapipe import ShardWriter
from datapipe.cache import TieredCache
from datapipe.errors import ObjectNotFoundError
from datapipe.loader import StreamingDataset
from datapipe.storage.faults import FaultInjectingStore
from datapipe.storage.retry import RetryPolicy

N = 200


@pytest.fixture
def s3_ds(s3):
    root, opts = s3
    url = f"{root}/ds"
    with ShardWriter(url, max_samples=30, storage_options=opts, compression="zstd") as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "bin": bytes(i % 256 for _ in range(300))})
    return url, opts


def _ids(ds):
    """The samples' numbers (``cls`` is raw bytes under the default decode)."""
    return [int(s["cls"]) for s in ds]


def test_s3_through_warm_cache_twice(s3_ds, tmp_path):
    url, opts = s3_ds
    cache = TieredCache(hot_bytes=0, warm_dir=str(tmp_path / "warm"), warm_bytes=64 << 20, storage_options=opts)
    ds = StreamingDataset(url, cache=cache, storage_options=opts, window=3, seed=2)
    first = _ids(ds)
    assert sorted(first) == list(range(N))
    cold = cache.stats()["cold_reads"]
    assert cold >= 7  # every shard came from S3 once
    # the loader handed the cache its upcoming shard order (clairvoyant eviction)
    assert cache.schedule is not None and set(cache.schedule.keys) <= {s.url for s in ds.source.indexes[0].shards}
    ds.set_epoch(1)
    second = _ids(ds)
    assert sorted(second) == list(range(N)) and second != first
    assert cache.stats()["cold_reads"] == cold  # the second epoch reads the warm copies only


def test_s3_through_hot_cache_only(s3_ds):
    url, opts = s3_ds
    cache = TieredCache(hot_bytes=32 << 20, storage_options=opts)
    assert sorted(_ids(StreamingDataset(url, cache=cache, storage_options=opts, window=2))) == list(range(N))


def test_s3_without_cache(s3_ds):
    url, opts = s3_ds
    assert _ids(StreamingDataset(url, storage_options=opts, shuffle=False)) == list(range(N))


def test_briefly_unavailable_store_is_retried(s3_ds, tmp_path):
    url, opts = s3_ds
    # every shard's first two reads fail with 503 / connection reset
    cache = TieredCache(warm_dir=str(tmp_path / "w"), warm_bytes=64 << 20, storage_options=opts,
                        retry=RetryPolicy(base_delay_s=0.001, max_delay_s=0.01),
                        cold_wrapper=functools.partial(FaultInjectingStore, errors=1, resets=1))
    assert sorted(_ids(StreamingDataset(url, cache=cache, storage_options=opts))) == list(range(N))
    assert cache.stats()["cold_retries"] >= 2
    # and without a cache, through the loader's own retries
    ds = StreamingDataset(url, storage_options=opts, shuffle=False)
    ds.source.retry = RetryPolicy(base_delay_s=0.001, max_delay_s=0.01)
    for ix in ds.source.indexes:
        ix.store = FaultInjectingStore(ix.store, errors=1)
    assert _ids(ds) == list(range(N))


def test_missing_s3_dataset(s3):
    root, opts = s3
    with pytest.raises(ObjectNotFoundError, match="no dataset"):
        StreamingDataset(f"{root}/absent", storage_options=opts)
