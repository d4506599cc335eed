"""TieredCache: read paths through hot, warm and cold; budgets; pins; integrity; pickling."""

import os
import pickle
import threading

import pytest

from datapipe.cache import TieredCache, clear_warm_dir, warm_dir_stats
from datapipe.cache.warm import url_key
from datapipe.checksum import checksum
from datapipe.errors import CacheBudgetError, ChecksumError, ObjectNotFoundError, StorageError


def _objects(tmp_path, n, size):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls, blobs = [], {}
    for i in range(n):
        data = os.urandom(size + i)  # distinct sizes catch mixed-up objects
        p = cold / f"shard-{i:03d}.tar"
        p.write_bytes(data)
        urls.append(str(p))
        blobs[str(p)] = data
    return urls, blobs


def _warm_usage(d):
    objs = os.path.join(d, "objects")
    tmp = os.path.join(d, "tmp")
    return sum(os.path.getsize(os.path.join(objs, f)) for f in os.listdir(objs)) + sum(
        os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))


def test_read_through_tiers_and_promotion(tmp_path):
    urls, blobs = _objects(tmp_path, 3, 1000)
    c = TieredCache(hot_bytes=10_000, warm_dir=tmp_path / "warm", warm_bytes=10_000)
    u = urls[0]
    assert c.read(u, checksum=checksum(blobs[u])) == blobs[u]
    s = c.stats()
    assert (s["hot_misses"], s["warm_misses"], s["cold_reads"], s["cold_bytes"]) == (1, 1, 1, 1000)
    assert c.read(u) == blobs[u]
    assert c.stats()["hot_hits"] == 1
    # a second cache instance (another process's view) finds the warm copy, not cold
    c2 = TieredCache(hot_bytes=10_000, warm_dir=tmp_path / "warm", warm_bytes=10_000)
    assert c2.read(u) == blobs[u]
    s2 = c2.stats()
    assert (s2["warm_hits"], s2["cold_reads"]) == (1, 0)
    c.close()
    c2.close()


def test_warm_budget_holds_and_lru_evicts_oldest(tmp_path):
    urls, blobs = _objects(tmp_path, 6, 1000)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=3100)
    for u in urls:
        assert c.read(u) == blobs[u]
        assert _warm_usage(warm) <= 3100
    present = set(os.listdir(warm / "objects"))
    assert present == {url_key(u) for u in urls[3:]}
    assert c.stats()["warm_evictions"] == 3
    c.close()


def test_read_range_paths(tmp_path):
    urls, blobs = _objects(tmp_path, 2, 5000)
    u = urls[0]
    want = blobs[u][100:300]
    # no cache tier: one range request
    direct = TieredCache()
    assert direct.read_range(u, 100, 300, checksum=checksum(want)) == want
    assert direct.stats()["cold_bytes"] == 200
    with pytest.raises(StorageError, match="past the end"):
        direct.read_range(u, 4000, 6000)
    with pytest.raises(StorageError, match="invalid byte range"):
        direct.read_range(u, 10, 5)
    # warm tier: a miss fills the whole object, then ranges are hits
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=100_000)
    assert c.read_range(u, 100, 300, checksum=checksum(want)) == want
    assert c.read_range(u, 0, 10) == blobs[u][:10]
    s = c.stats()
    assert (s["cold_reads"], s["warm_hits"], s["warm_bytes"]) == (1, 1, 10)
    with pytest.raises(StorageError, match="past the end"):
        c.read_range(u, 0, 6000)
    with pytest.raises(ChecksumError, match="shard-000"):
        c.read_range(u, 0, 10, checksum=checksum(b"other"))
    # hot only
    h = TieredCache(hot_bytes=100_000)
    assert h.read_range(u, 100, 300) == want
    assert h.read_range(u, 0, 5) == blobs[u][:5]
    assert h.stats()["hot_hits"] == 1


def test_missing_object_names_the_url(tmp_path, s3):
    root, opts = s3
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts)
    with pytest.raises(ObjectNotFoundError, match=f"{root}/nope.tar"):
        c.read(f"{root}/nope.tar")
    with pytest.raises(ObjectNotFoundError, match="nothing-here"):
        TieredCache().read(str(tmp_path / "nothing-here"))


def test_s3_cold_tier_reads_byte_exact(tmp_path, s3):
    root, opts = s3
    c = TieredCache(hot_bytes=1 << 20, warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                    storage_options=opts)
    from datapipe.storage import open_store
    store = open_store(root, opts)
    data = os.urandom(200_000)
    store.put("a/x.tar", data)
    assert c.read(f"{root}/a/x.tar", checksum=checksum(data)) == data
    assert c.read_range(f"{root}/a/x.tar", 5, 50) == data[5:50]
    assert c.stats()["cold_reads"] == 1


def test_budget_smaller_than_object_is_a_clear_error(tmp_path):
    urls, _ = _objects(tmp_path, 1, 5000)
    with pytest.raises(CacheBudgetError, match="warm_bytes"):
        TieredCache(warm_dir=tmp_path / "w1", warm_bytes=1000).read(urls[0])
    with pytest.raises(CacheBudgetError, match="hot_bytes"):
        TieredCache(hot_bytes=1000).read(urls[0])
    with pytest.raises(CacheBudgetError, match="max_inflight_bytes"):
        TieredCache(max_inflight_bytes=1000).read(urls[0])
    with pytest.raises(CacheBudgetError, match="warm_bytes"):
        TieredCache(warm_dir=tmp_path / "w2")
    with pytest.raises(CacheBudgetError):
        TieredCache(hot_bytes=-1)
    with pytest.raises(CacheBudgetError, match="without warm_dir"):
        TieredCache(warm_bytes=10)


def test_pins_are_never_evicted_and_full_pins_do_not_hang(tmp_path):
    urls, blobs = _objects(tmp_path, 5, 1000)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=2100, pin_wait_s=0.3)
    p0 = c.local_path(urls[0])
    assert open(p0, "rb").read() == blobs[urls[0]]
    for u in urls[1:]:
        assert c.read(u) == blobs[u]
        assert os.path.exists(p0)  # pinned: survives every fill
    with c.pinned(urls[1]) as p1:
        # both slots pinned: a read passes through, a pin waits its bound and fails clearly
        assert c.read(urls[2]) == blobs[urls[2]]
        assert c.stats()["warm_not_admitted"] >= 1
        with pytest.raises(CacheBudgetError, match="pinned"):
            c.local_path(urls[3])
        assert warm_dir_stats(warm)["pinned"] == 2
        assert open(p1, "rb").read() == blobs[urls[1]]
    c.release(urls[0])
    with pytest.raises(StorageError, match="not pinned"):
        c.release(urls[0])
    assert c.read(urls[3]) == blobs[urls[3]]
    assert warm_dir_stats(warm)["pinned"] == 0
    c.close()


def test_single_flight_within_a_process(tmp_path):
    urls, blobs = _objects(tmp_path, 1, 300_000)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20)
    out = []
    threads = [threading.Thread(target=lambda: out.append(c.read(urls[0]))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [blobs[urls[0]]] * 8
    s = c.stats()
    assert s["cold_reads"] == 1 and s["warm_hits"] == 7


def test_corrupted_warm_file_is_detected_and_refetched(tmp_path):
    urls, blobs = _objects(tmp_path, 1, 4000)
    u = urls[0]
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    c.read(u)
    path = warm / "objects" / url_key(u)
    raw = bytearray(path.read_bytes())
    raw[1234] ^= 0x01
    path.write_bytes(bytes(raw))
    c2 = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    assert c2.read(u, checksum=checksum(blobs[u])) == blobs[u]
    s = c2.stats()
    assert (s["warm_corrupt"], s["cold_reads"]) == (1, 1)
    assert path.read_bytes() == blobs[u]  # the refetched copy replaced it


def test_prefetch_fills_warm_within_inflight_bound(tmp_path):
    urls, blobs = _objects(tmp_path, 6, 10_000)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, max_inflight_bytes=25_000)
    futs = c.prefetch(urls, checksums={u: checksum(b) for u, b in blobs.items()})
    for f in futs:
        f.result()
    s = c.stats()
    assert s["prefetched"] == 6 and s["prefetch_errors"] == 0
    assert s["inflight_peak_bytes"] <= 25_000
    for u in urls:
        assert c.read(u) == blobs[u]
    assert c.stats()["cold_reads"] == 6  # all reads were warm hits
    bad = c.prefetch([str(tmp_path / "missing")])
    bad[0].result()
    assert c.stats()["prefetch_errors"] == 1
    c.close()


def test_pickle_carries_configuration_not_state(tmp_path):
    urls, blobs = _objects(tmp_path, 2, 1000)
    c = TieredCache(hot_bytes=5000, warm_dir=tmp_path / "warm", warm_bytes=5000)
    c.read(urls[0])
    assert c.stats()["hot_used_bytes"] == 1000
    c2 = pickle.loads(pickle.dumps(c))
    fresh = c2.stats()  # per-process state is not carried: no hot copy, no counts
    assert (fresh["hot_used_bytes"], fresh["hot_misses"], fresh["cold_reads"]) == (0, 0, 0)
    assert c2.read(urls[0]) == blobs[urls[0]]
    assert c2.stats()["warm_hits"] == 1
    assert c2.read_range(urls[1], 2, 9) == blobs[urls[1]][2:9]
    with c2.pinned(urls[1]) as p:
        assert open(p, "rb").read() == blobs[urls[1]]
    c.close()
    c2.close()


def test_cli_helpers(tmp_path):
    urls, _ = _objects(tmp_path, 3, 1000)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=10_000)
    for u in urls:
        c.read(u)
    st = warm_dir_stats(warm)
    assert (st["objects"], st["bytes"], st["budget_bytes"]) == (3, 3003, 10_000)
    with c.pinned(urls[0]):
        assert clear_warm_dir(warm) == 2  # the pinned copy stays
    assert clear_warm_dir(warm) == 1
    assert warm_dir_stats(warm)["objects"] == 0
    with pytest.raises(ObjectNotFoundError):
        warm_dir_stats(tmp_path / "nope")
    with pytest.raises(StorageError, match="not a datapipe warm cache"):
        clear_warm_dir(tmp_path / "cold")


def test_local_path_verifies_and_names_the_url(tmp_path):
    urls, blobs = _objects(tmp_path, 1, 3000)
    u = urls[0]
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    with pytest.raises(ChecksumError, match="shard-000"):
        c.local_path(u, checksum=checksum(b"not this"))
    assert os.listdir(warm / "objects") == [] and os.listdir(warm / "tmp") == []
    assert c.stats()["cold_refetches"] == 1  # fetched once more before giving up
    good = checksum(blobs[u])
    for _ in range(2):  # the second pin reuses this process's verification
        with c.pinned(u, checksum=good) as path:
            assert open(path, "rb").read() == blobs[u]
    assert c.stats()["cold_reads"] == 3
    with pytest.raises(StorageError, match="needs a usable warm_dir"):
        TieredCache(hot_bytes=1 << 20).local_path(u)


def test_counters_lose_no_update_under_threads():
    from concurrent.futures import ThreadPoolExecutor

    from datapipe.cache.state import Stats

    stats = Stats()

    def bump(_):
        for _ in range(20000):
            stats.update(cold_reads=1)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(bump, range(4)))
    assert stats.snapshot()["cold_reads"] == 80000
