"""Several spawned processes share one warm directory over moto's S3 on loopback."""

import fcntl
import functools
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest

from datapipe.cache import TieredCache
from datapipe.cache.warm import WarmDir, url_key
from datapipe.checksum import checksum
from datapipe.errors import StorageError
from datapipe.storage import open_store
from datapipe.storage.faults import FaultInjectingStore

CTX = mp.get_context("spawn")


def _put(s3, n, size):
    root, opts = s3
    store = open_store(root, opts)
    sums = {}
    for i in range(n):
        data = os.urandom(size + i)
        store.put(f"ds/shard-{i:03d}.tar", data)
        sums[f"{root}/ds/shard-{i:03d}.tar"] = checksum(data)
    return sums


def _reader(cache, sums, seed, rounds, barrier, q):
    try:
        urls = sorted(sums)
        barrier.wait(60)
        bad = []
        for _ in range(rounds):
            random.Random(seed).shuffle(urls)
            for u in urls:
                if checksum(cache.read(u)) != sums[u]:
                    bad.append(u)
        q.put((bad, cache.stats()))
    except BaseException as e:  # report instead of dying silently
        q.put(([repr(e)], {}))


def _run_readers(cache, sums, n, rounds):
    barrier = CTX.Barrier(n)
    q = CTX.Queue()
    procs = [CTX.Process(target=_reader, args=(cache, sums, seed, rounds, barrier, q)) for seed in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def test_each_object_fetched_once_per_node(tmp_path, s3):
    sums = _put(s3, 6, 200_000)
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=16 << 20, storage_options=s3[1])
    results = _run_readers(cache, sums, n=4, rounds=2)
    assert [bad for bad, _ in results] == [[]] * 4
    assert sum(s["cold_reads"] for _, s in results) == 6
    assert sum(s["cold_bytes"] for _, s in results) == sum(200_000 + i for i in range(6))
    assert sum(s["warm_hits"] for _, s in results) == 4 * 2 * 6 - 6


def test_budget_holds_under_concurrent_eviction_and_pins_survive(tmp_path, s3):
    sums = _put(s3, 8, 100_000)
    budget = 3 * 100_010
    warm_dir = tmp_path / "warm"
    cache = TieredCache(warm_dir=warm_dir, warm_bytes=budget, storage_options=s3[1])
    pinned_url = sorted(sums)[0]
    pinned_path = cache.local_path(pinned_url)  # pinned by this (parent) process
    watch = WarmDir(str(warm_dir), budget)
    peak = [0]
    lost = []
    stop = threading.Event()

    def monitor():
        # usage() counts under the budget lock: the state every reservation sees.
        while not stop.is_set():
            peak[0] = max(peak[0], watch.usage())
            if not os.path.exists(pinned_path):
                lost.append(time.monotonic())
            time.sleep(0.002)

    t = threading.Thread(target=monitor)
    t.start()
    try:
        results = _run_readers(cache, sums, n=3, rounds=2)
    finally:
        stop.set()
        t.join()
    assert [bad for bad, _ in results] == [[]] * 3
    assert 0 < peak[0] <= budget
    assert lost == []
    assert checksum(open(pinned_path, "rb").read()) == sums[pinned_url]
    assert sum(s["warm_evictions"] for _, s in results) > 0
    cache.release(pinned_url)


def _slow_reader(cache, url):
    cache.read(url)


def test_sigkill_mid_download_leaves_nothing_torn(tmp_path, s3):
    sums = _put(s3, 1, 300_000)
    url = next(iter(sums))
    warm_dir = tmp_path / "warm"
    slow = TieredCache(warm_dir=warm_dir, warm_bytes=1 << 20, storage_options=s3[1],
                       cold_wrapper=functools.partial(FaultInjectingStore, delays=1, delay_s=60))
    p = CTX.Process(target=_slow_reader, args=(slow, url))
    p.start()
    tmp = warm_dir / "tmp"
    deadline = time.monotonic() + 60
    while not (tmp.exists() and os.listdir(tmp)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.listdir(tmp), "the download never started"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    leftover = os.listdir(tmp)
    assert len(leftover) == 1 and leftover[0].startswith(url_key(url))
    assert not os.path.exists(warm_dir / "objects" / url_key(url))  # nothing torn published
    fresh = TieredCache(warm_dir=warm_dir, warm_bytes=1 << 20, storage_options=s3[1])
    t0 = time.monotonic()
    assert checksum(fresh.read(url)) == sums[url]
    assert time.monotonic() - t0 < 10  # the dead process's lock did not stick
    s = fresh.stats()
    assert s["warm_tmp_cleaned"] == 1 and s["cold_reads"] == 1
    assert os.listdir(tmp) == []


def _forked_read(cache, url, q):
    q.put(checksum(cache.read(url)))


def test_usable_after_fork_once_the_parent_has_used_it(tmp_path, s3):
    """The parent's fsspec filesystem, threads and pins stay behind; the child makes its own."""
    sums = _put(s3, 2, 50_000)
    a, b = sorted(sums)
    cache = TieredCache(hot_bytes=1 << 20, warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                        storage_options=s3[1])
    assert checksum(cache.read(a)) == sums[a]
    cache.prefetch([a])[0].result()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_read, args=(cache, b, q))
    p.start()
    assert q.get(timeout=60) == sums[b]
    p.join(30)
    assert p.exitcode == 0
    assert cache.stats()["cold_reads"] == 1  # the parent's counters are its own
    assert checksum(cache.read(b)) == sums[b]
    assert cache.stats()["warm_hits"] == 1  # the child's fill is shared through the warm dir


def _start_on(root, q):
    q.put(WarmDir(root, 1 << 20).cleaned)  # what a process starting up on the node does


def _waits_for_flock(path):
    """Whether some process is blocked waiting for a flock on ``path`` (Linux /proc/locks)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any("->" in ln.split() and ln.split()[-3].endswith(f":{ino}") for ln in f)


def test_a_process_starting_up_leaves_a_new_download_alone(tmp_path, monkeypatch):
    """reserve() creates its temporary file and only then locks it. A process starting up in
    that gap must not take the file for a dead download: it waits for the budget lock."""
    root = str(tmp_path / "warm")
    warm = WarmDir(root, 1 << 20)
    real_flock, started = fcntl.flock, []

    def flock(fd, op):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not started and op == fcntl.LOCK_EX and path.startswith(warm.tmpdir + os.sep):
            # the gap: the sized temporary file exists, not yet locked; start a real process
            # and let it run until it has finished or waits on a lock
            q = CTX.Queue()
            p = CTX.Process(target=_start_on, args=(root, q))
            p.start()
            started.append((p, q))
            deadline = time.monotonic() + 60
            while (p.is_alive() and not _waits_for_flock(os.path.join(root, "budget.lock"))
                   and time.monotonic() < deadline):
                time.sleep(0.005)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    res = warm.reserve(url_key("s3://b/x"), 100, lambda cands, need: [])
    monkeypatch.setattr(fcntl, "flock", real_flock)
    p, q = started[0]
    assert q.get(timeout=60) == 0  # the newcomer cleaned nothing
    p.join(30)
    assert p.exitcode == 0
    assert warm.usage() == 100  # the download in progress is counted
    res.write_and_publish(b"x" * 100)
    assert open(warm.path(url_key("s3://b/x")), "rb").read() == b"x" * 100


class _DownloadRemover(FaultInjectingStore):
    """A cold store whose reads delete the warm directory's downloads in progress (as a
    careless ``rm`` would), so the publish that follows finds no file to rename."""

    def __init__(self, inner, tmpdir):
        super().__init__(inner)
        self.tmpdir = tmpdir

    def _remove(self):
        for name in os.listdir(self.tmpdir):
            os.unlink(os.path.join(self.tmpdir, name))

    def get(self, key):
        self._remove()
        return super().get(key)

    def get_range_at(self, key, start, end, version):
        self._remove()
        return super().get_range_at(key, start, end, version)


def test_a_failed_publish_reads_through_or_names_the_url(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    (cold / "shard-7.tar").write_bytes(b"y" * 1000)
    url = str(cold / "shard-7.tar")
    warm = tmp_path / "warm"
    cache = TieredCache(warm_dir=warm, warm_bytes=1 << 20,
                        cold_wrapper=functools.partial(_DownloadRemover, tmpdir=str(warm / "tmp")))
    with pytest.warns(RuntimeWarning, match="warm cache"):
        assert cache.read(url) == b"y" * 1000  # the bytes are good: served, not cached
    with pytest.raises(StorageError, match=r"shard-7\.tar") as err:
        cache.local_path(url)  # a local copy is what was asked for: a named error
    assert not isinstance(err.value, FileNotFoundError)  # not "no such object": the copy failed
    assert os.listdir(warm / "objects") == [] and os.listdir(warm / "tmp") == []
    cache.close()


def _pin_two(cache, urls, done, q):
    held, error = [], None
    try:
        for u in urls:
            cache.local_path(u)
            held.append(u)
    except StorageError as e:
        error = f"{type(e).__name__}: {e}"
    q.put((len(held), error))
    done.wait(60)  # pins are held until every process has tried
    cache.close()


def test_pins_beyond_the_budget_fail_saying_what_holds_it(tmp_path, s3):
    """4 processes each pin 2 objects in a budget of 3: the ones left out fail after
    pin_wait_s with an error that says what holds the budget and what budget would do."""
    sums = _put(s3, 8, 1000)
    urls = sorted(sums)
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=3 * 1007, storage_options=s3[1],
                        pin_wait_s=0.5)
    done, q = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_pin_two, args=(cache, urls[2 * i: 2 * i + 2], done, q)) for i in range(4)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=120) for _ in procs]
    finally:
        done.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(n for n, _ in results) <= 3, results
    errors = [e for _, e in results if e]
    assert errors and all(e.startswith("CacheBudgetError") for e in errors), results
    for e in errors:
        assert "after waiting" in e and "pinned" in e and "raise warm_bytes to at least" in e
