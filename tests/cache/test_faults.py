"""Injected cold-tier faults are recovered (or raised by name); a full disk reads through."""

import functools
import multiprocessing as mp
import os
import time

import pytest

from datapipe.cache import TieredCache
from datapipe.checksum import checksum
from datapipe.errors import ChecksumError, RemoteError
from datapipe.storage import RetryPolicy, open_store
from datapipe.storage.faults import FaultInjectingStore
from datapipe.storage.retry import is_transient

FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.01)


def _put(s3, n, size):
    root, opts = s3
    store = open_store(root, opts)
    blobs = {}
    for i in range(n):
        data = os.urandom(size)
        store.put(f"d/s{i}.tar", data)
        blobs[f"{root}/d/s{i}.tar"] = data
    return blobs, opts


def _cache(tmp_path, opts, retry=FAST, **faults):
    return TieredCache(warm_dir=tmp_path / "warm", warm_bytes=8 << 20, storage_options=opts,
                       retry=retry, cold_wrapper=functools.partial(FaultInjectingStore, **faults))


def _injected(cache):
    return sum((s.injected for s in cache._state().cold.stores.values()), start=__import__("collections").Counter())


@pytest.mark.parametrize("fault", ["errors", "resets", "truncations"])
def test_transient_faults_are_retried(tmp_path, s3, fault):
    blobs, opts = _put(s3, 2, 50_000)
    c = _cache(tmp_path, opts, **{fault: 2})
    for url, data in blobs.items():
        assert c.read(url, checksum=checksum(data)) == data
    s = c.stats()
    assert s["cold_retries"] == 4 and s["cold_reads"] == 2
    assert sum(_injected(c).values()) == 4


def test_persistent_failure_raises_remote_error_naming_url(tmp_path, s3):
    blobs, opts = _put(s3, 1, 1000)
    url = next(iter(blobs))
    c = _cache(tmp_path, opts, resets=10)  # not 503s: throttling is waited out (tests/cache/test_throttling.py)
    with pytest.raises(RemoteError, match=f"{url}.*4 attempts.*reset"):
        c.read(url)
    # nothing half-written remains in the warm tier
    assert os.listdir(tmp_path / "warm" / "objects") == []
    assert os.listdir(tmp_path / "warm" / "tmp") == []


def test_slow_answer_times_out_and_is_retried(tmp_path, s3):
    blobs, opts = _put(s3, 1, 1000)
    url, data = next(iter(blobs.items()))
    # Only the first answer is slow. The timeout leaves room for a loaded machine: a
    # retry that is itself slow to come back would be counted as a second retry.
    slow = RetryPolicy(attempts=4, base_delay_s=0.001, attempt_timeout_s=1.0)
    c = _cache(tmp_path, opts, retry=slow, delays=1, delay_s=2.5)
    t0 = time.perf_counter()
    assert c.read(url) == data
    assert 1 <= c.stats()["cold_retries"] <= 2
    assert time.perf_counter() - t0 < 2.5  # it did not wait for the slow answer
    c.close()


def test_corrupt_body_is_fetched_once_more_then_raised(tmp_path, s3):
    blobs, opts = _put(s3, 1, 4000)
    url, data = next(iter(blobs.items()))
    c = _cache(tmp_path, opts, corruptions=1)
    assert c.read(url, checksum=checksum(data)) == data
    assert c.stats()["cold_refetches"] == 1
    c2 = _cache(tmp_path / "b", opts, corruptions=2)
    with pytest.raises(ChecksumError, match=url):
        c2.read(url, checksum=checksum(data))
    assert os.listdir(tmp_path / "b" / "warm" / "objects") == []
    # a range request without a cache tier: same rule
    c3 = TieredCache(storage_options=opts, retry=FAST,
                     cold_wrapper=functools.partial(FaultInjectingStore, corruptions=1))
    assert c3.read_range(url, 10, 90, checksum=checksum(data[10:90])) == data[10:90]
    assert c3.stats()["range_refetches"] == 1


def test_large_objects_use_concurrent_ranges_each_retried(tmp_path, s3):
    blobs, opts = _put(s3, 1, 300_000)
    url, data = next(iter(blobs.items()))
    parts = RetryPolicy(attempts=4, base_delay_s=0.001, part_bytes=64 << 10, max_parts=3)
    c = _cache(tmp_path, opts, retry=parts, resets=1, truncations=1)
    assert c.read(url, checksum=checksum(data)) == data
    store = next(iter(c._state().cold.stores.values()))
    assert store.reads["s0.tar"] == 5 + 2  # five 64 KiB parts, two of them asked twice
    assert c.stats()["cold_retries"] == 2


def test_classification_of_errors():
    import errno

    from datapipe.errors import ObjectNotFoundError, StorageError, TruncatedReadError

    assert is_transient(TruncatedReadError("short"))
    busy = OSError(errno.EBUSY, "SlowDown")
    wrapped = StorageError("x")
    wrapped.__cause__ = busy
    assert is_transient(wrapped)
    assert not is_transient(ObjectNotFoundError("gone"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(ValueError("bad"))


def _read_with_small_file_limit(warm_dir, urls, q):
    import resource
    import signal
    import warnings

    # The kernel refuses to grow any file past RLIMIT_FSIZE (EFBIG): a disk that is full
    # for this process. SIGXFSZ would kill it otherwise.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
    c = TieredCache(warm_dir=warm_dir, warm_bytes=10 << 20)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        datas = [c.read(u) for u in urls]
    q.put(([checksum(d) for d in datas], c.stats(), [str(x.message) for x in w]))


def test_full_disk_reads_through_with_a_warning(tmp_path):
    urls = []
    for i in range(3):
        p = tmp_path / f"big{i}"
        p.write_bytes(os.urandom(50_000))
        urls.append(str(p))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_read_with_small_file_limit, args=(str(tmp_path / "warm"), urls, q))
    proc.start()
    sums, stats, warns = q.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert sums == [checksum(open(u, "rb").read()) for u in urls]
    assert stats["cold_reads"] == 3 and stats["warm_fills"] == 0
    assert stats["warm_not_admitted"] == 3  # each read went through, as a refused one does
    assert stats["warnings_warm_full"] == 3
    assert len([m for m in warns if "reading through" in m]) == 1  # warned once
    assert os.listdir(tmp_path / "warm" / "tmp") == []


class _Stalled(FaultInjectingStore):
    """Every ranged read stalls until ``release`` is set: a server (or a hung mount) that
    accepts a request and never answers."""

    release = None

    def get_range(self, key, start, end):
        self.release.wait(60)
        return super().get_range(key, start, end)

    def get_range_at(self, key, start, end, version):
        self.release.wait(60)
        return super().get_range_at(key, start, end, version)


def test_close_after_an_abandoned_attempt_does_not_wait_for_it(tmp_path):
    import threading

    (tmp_path / "cold").mkdir()
    (tmp_path / "cold" / "s.tar").write_bytes(os.urandom(4096))
    url = str(tmp_path / "cold" / "s.tar")
    _Stalled.release = threading.Event()
    try:
        cache = TieredCache(hot_bytes=1 << 20, cold_wrapper=_Stalled,
                            retry=RetryPolicy(attempts=2, base_delay_s=0.001, attempt_timeout_s=0.3, deadline_s=5))
        with pytest.raises(RemoteError, match="no answer"):
            cache.read(url)
        closer = threading.Thread(target=cache.close, daemon=True)
        t0 = time.monotonic()
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() waits for an abandoned, stalled attempt"
        assert time.monotonic() - t0 < 5
    finally:
        _Stalled.release.set()
