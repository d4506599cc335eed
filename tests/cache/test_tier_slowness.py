"""A directory tier that turns slow or hangs during training is taken out of the path: its
reads are served by the tiers below, it is said once, probed, and taken back when it reads
at the floor again; a read that never answers is abandoned at the deadline.

The slowness is real: the test holds an exclusive ``flock`` on a published copy (the lock
eviction takes), so the cache's read of it (which pins it with a shared lock) really waits,
until a timer the test started releases it, or until the test does. No timing is asserted:
only what was warned, what was served, and which tier read it."""

from __future__ import annotations

import fcntl
import functools
import os
import threading
import warnings
from contextlib import contextmanager

import pytest

from datapipe.cache import CacheTier, TieredCache
from datapipe.cache.warm import url_key
from datapipe.errors import OptionError
from datapipe.health import PROBE_PREFIX
from tests.folder_faults import fill_up
from tools.elastic_drill import ThrottledStore

SIZE = 256 << 10  # above rates.MIN_READ_BYTES: each read counts in its tier's window
FLOOR = 5.0  # MB/s: a read held 0.3 s runs below 0.9 MB/s, a free one at hundreds


def _objects(tmp_path, n=6):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(n):
        (cold / f"o{i}.bin").write_bytes(bytes([i]) * SIZE)
        urls.append(str(cold / f"o{i}.bin"))
    return urls


def _copy(warm, url):
    return os.path.join(str(warm), "objects", url_key(url))


@contextmanager
def held(path, seconds=None):
    """An exclusive flock on ``path`` from now: released after ``seconds`` by a timer (the
    read that waits on it is slowed by at least that), or when the block ends."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released = threading.Event()

    def release():
        if not released.is_set():
            released.set()
            fcntl.flock(fd, fcntl.LOCK_UN)

    timer = threading.Timer(seconds, release) if seconds is not None else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        release()
        os.close(fd)


def _messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def _cache(tmp_path, **kw):
    kw.setdefault("tier_min_mb_s", FLOOR)
    kw.setdefault("tier_window_bytes", 4 * SIZE)
    return TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20, **kw)


def test_a_slow_warm_tier_is_taken_out_and_reads_go_to_the_tier_below(tmp_path):
    urls = _objects(tmp_path)
    warm = tmp_path / "warm"
    c = _cache(tmp_path, tier_retry_s=3600)
    try:
        for i, u in enumerate(urls):  # fills: the cold store's rate is measured on these
            assert c.read(u) == bytes([i]) * SIZE
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, u in enumerate(urls[:4]):  # four reads, each held 0.3 s: one window, below the floor
                with held(_copy(warm, u), 0.3):
                    assert c.read(u) == bytes([i]) * SIZE
            before = c.stats()
            # out of the path: every copy held for good, and yet no read waits on one
            with held(_copy(warm, urls[4])), held(_copy(warm, urls[5])), held(_copy(warm, urls[0])):
                for i in (4, 5, 0):
                    assert c.read(urls[i]) == bytes([i]) * SIZE
            after = c.stats()
    finally:
        c.close()
    slow = _messages(caught, "is slow")
    assert len(slow) == 1, [str(w.message) for w in caught]
    assert str(warm) in slow[0] and "warm cache" in slow[0] and "MB/s" in slow[0]
    assert f"tier_min_mb_s={FLOOR:g}" in slow[0] and "taken out of the path" in slow[0]
    assert before["warm_slow"] == 1 and before["warm_outs"] == 1 and before["warm_hits"] == 4
    assert after["warm_hits"] == 4  # the tier read nothing more
    assert after["hot_from_cold"] == before["hot_from_cold"] + 3
    assert after.get("warm_hung", 0) == 0


def test_a_slow_tier_is_probed_and_taken_back_once_it_reads_fast_again(tmp_path):
    urls = _objects(tmp_path)
    warm = tmp_path / "warm"
    c = _cache(tmp_path, tier_retry_s=0)  # probed at every read while out
    try:
        for u in urls:
            c.read(u)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for u in urls[:4]:
                with held(_copy(warm, u), 0.3):
                    c.read(u)
            out = c.stats()
            for u in urls[:4] + urls[:4]:  # on trial: a fast window takes it back
                assert c.read(u) == bytes([urls.index(u)]) * SIZE
            back = c.stats()
    finally:
        c.close()
    assert len(_messages(caught, "is slow")) == 1
    backs = _messages(caught, "back in the path")
    assert len(backs) == 1 and "again" in backs[0] and str(warm) in backs[0]
    assert out["warm_slow"] == 1 and out["warm_outs"] == 1
    assert back["warm_trials"] == 1 and back["warm_backs"] == 1 and back.get("warm_slow") == 1
    assert back["warm_hits"] == out["warm_hits"] + 8  # the tier serves again


def test_a_slow_node_local_tier_is_passed_by_while_warm_stays(tmp_path):
    urls = _objects(tmp_path)
    local = tmp_path / "local2"
    c = _cache(tmp_path, local_tiers=[CacheTier(local, 64 << 20)], tier_retry_s=3600)
    try:
        for u in urls:
            c.read(u)  # warm and local2 both filled
        warm = tmp_path / "warm"
        for u in urls:  # out of warm (copies stay in local2), so reads go to local2
            os.unlink(_copy(warm, u))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for u in urls[:4]:
                with held(_copy(local, u), 0.3):
                    c.read(u)
            st = c.stats()
    finally:
        c.close()
    slow = _messages(caught, "is slow")
    assert len(slow) == 1 and str(local) in slow[0] and "local2 cache" in slow[0]
    assert st["local2_slow"] == 1 and st.get("warm_slow", 0) == 0


def test_the_rule_keeps_a_slow_tier_when_the_one_below_is_slower_still(tmp_path):
    # the cold store throttled by the elastic drill's throttle (TieredCache(cold_wrapper=)):
    # a 256 KiB read takes 0.5 s there while the switch file exists, slower than the held warm reads
    urls = _objects(tmp_path)
    warm = tmp_path / "warm"
    switch = tmp_path / "throttle"
    switch.write_bytes(b"")
    c = _cache(tmp_path, tier_retry_s=3600,
               cold_wrapper=functools.partial(ThrottledStore, switch=str(switch), bytes_per_s=SIZE / 0.5))
    try:
        for u in urls[:4]:
            c.read(u)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for u in urls[:4]:
                with held(_copy(warm, u), 0.3):
                    c.read(u)
            st = c.stats()
    finally:
        c.close()
    assert _messages(caught, "is slow") == []
    assert st["warm_slow_kept"] == 1 and st.get("warm_outs", 0) == 0


def test_a_read_that_never_answers_is_abandoned_at_the_deadline(tmp_path):
    urls = _objects(tmp_path, 3)
    warm = tmp_path / "warm"
    c = _cache(tmp_path, tier_retry_s=3600, tier_deadline_s=0.3)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    try:
        for u in urls:
            c.read(u)
        open_before = fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with held(_copy(warm, urls[0])):  # never released while the cache reads
                assert c.read(urls[0]) == bytes([0]) * SIZE  # abandoned, served from cold
                st = c.stats()
                assert c.read(urls[1]) == bytes([1]) * SIZE  # the tier is out: cold again, no wait
                assert c.pin_or_read(urls[2]) == bytes([2]) * SIZE  # the loader's read: through as well
            after = c.stats()
        # released: the abandoned read finishes and closes the copy it opened
        done = threading.Event()
        for _ in range(200):
            if fds() <= open_before:
                done.set()
                break
            done.wait(0.05)
        assert done.is_set(), "the abandoned read kept its descriptor"
    finally:
        c.close()
    hung = _messages(caught, "does not answer")
    assert len(hung) == 1, [str(w.message) for w in caught]
    assert str(warm) in hung[0] and "abandoned" in hung[0] and "taken out of the path" in hung[0]
    assert st["warm_hung"] == 1 and st["warm_outs"] == 1 and st["hot_from_cold"] >= 1
    assert after["warm_hung"] == 1 and after["warm_hits"] == 0


@pytest.mark.parametrize("kw", [{"tier_deadline_s": 0}, {"tier_deadline_s": "soon"}, {"tier_min_mb_s": -1},
                                {"tier_min_mb_s": float("nan")}, {"tier_window_bytes": 0},
                                {"tier_window_bytes": 1.5}])
def test_the_options_are_checked_naming_them(kw):
    with pytest.raises(OptionError, match=next(iter(kw))):
        TieredCache(**kw)


def test_a_tier_that_fails_the_check_at_open_is_out_from_the_start_and_taken_back(tmp_path, tmpfs):
    urls = _objects(tmp_path, 3)
    fs = tmpfs("8m")
    warm, local = fs.path / "warm", fs.path / "local2"
    tiers = dict(warm_dir=warm, warm_bytes=1 << 20, local_tiers=[CacheTier(local, 1 << 20)])
    made = TieredCache(**tiers)
    made.stats()  # the folders are made as a process opens its tiers
    made.close()
    fill_up(fs.path / "filler")  # a full disk: the folders open, a write fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = TieredCache(**tiers, tier_retry_s=0)  # no exception: both are passed by
        try:
            opened = c.stats()
            assert c.read(urls[0]) == bytes([0]) * SIZE
            out = c.stats()
            os.unlink(fs.path / "filler")
            for i, u in enumerate(urls):  # probed back, then filled as usual
                assert c.read(u) == bytes([i]) * SIZE
            back = c.stats()
        finally:
            c.close()
    said = _messages(caught, "fails the check at open")
    assert len(said) == 2, [str(w.message) for w in caught]
    assert any(str(warm) in m and "warm cache" in m for m in said)
    assert any(str(local) in m and "node-local cache" in m for m in said)
    assert all("full" in m and "free space or point the tier elsewhere" in m for m in said)
    assert opened["warm_outs"] == 1 and opened["local2_outs"] == 1
    assert out["hot_from_cold"] == 1 and out.get("warm_fills", 0) == 0
    assert back["warm_backs"] == 1 and back["local2_backs"] == 1 and back["warm_fills"] >= 2
    assert len(_messages(caught, "back in the path")) == 2
    assert not list(fs.path.rglob(f"{PROBE_PREFIX}*"))  # the checks leave nothing behind


def test_a_budget_the_disk_cannot_hold_is_a_warning_at_open(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=free * 4)
        try:
            st = c.stats()
        finally:
            c.close()
    short = _messages(caught, "short of its budget")
    assert len(short) == 1 and "lower the budget" in short[0]
    assert st.get("warm_outs", 0) == 0  # still in the path: only its budget is too large


def test_the_loader_reads_every_sample_through_a_warm_copy_that_hangs(tmp_path):
    # StreamingDataset through the cache (pin_or_read): the second epoch meets a copy whose
    # pin never comes (held by the test) and goes on without it, every sample once
    from datapipe import ShardWriter
    from datapipe.loader import StreamingDataset

    n = 96
    url = str(tmp_path / "ds")
    with ShardWriter(url, max_samples=12) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:05d}", "cls": str(i), "bin": bytes([i % 256]) * 700})
    warm = tmp_path / "warm"
    cache = TieredCache(warm_dir=warm, warm_bytes=64 << 20, tier_retry_s=3600, tier_deadline_s=0.3)
    ds = StreamingDataset(url, cache=cache, window=2, seed=3, chunk_samples=24, prefetch_bytes=1, concurrency=1)
    epochs = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds.set_epoch(0)
            epochs.append(sorted(int(item["cls"]) for item in ds))
            copies = sorted(os.listdir(warm / "objects"))
            assert copies
            with held(os.path.join(warm, "objects", copies[0])):  # one copy never answers
                ds.set_epoch(1)
                epochs.append(sorted(int(item["cls"]) for item in ds))
            s = cache.stats()
    finally:
        cache.close()
    assert epochs == [list(range(n))] * 2  # every sample once, no crash
    hung = _messages(caught, "does not answer")
    assert len(hung) == 1 and str(warm) in hung[0], [str(w.message) for w in caught]
    assert s["warm_hung"] == 1 and s["warm_outs"] == 1
