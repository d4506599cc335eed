"""A TieredCache given a Telemetry records, per tier, the bytes and seconds of the reads it
serves, its hits and misses, a broken tier, and the cold store's retries and throttled
answers: what the health detector reads to name a data straggler's cause."""

from __future__ import annotations

import functools
import os
import shutil

import pytest

from datapipe.cache import CacheTier, TieredCache
from datapipe.errors import OptionError
from datapipe.storage import open_store
from datapipe.storage.faults import FaultInjectingStore
from datapipe.telemetry import Telemetry


@pytest.fixture
def cold(tmp_path):
    root = tmp_path / "cold"
    root.mkdir()
    objects = {}
    for i in range(4):
        data = os.urandom(10_000 + i)
        (root / f"o{i}.bin").write_bytes(data)
        objects[str(root / f"o{i}.bin")] = data
    return objects


def _tiers(summary):
    return {name: (t.reads, t.bytes, t.hits, t.misses, t.errors) for name, t in summary.tiers.items()}


def test_each_tier_records_its_reads_hits_and_misses(tmp_path, cold):
    tel = Telemetry(window_s=3600)
    cache = TieredCache(hot_bytes=1 << 20, warm_dir=tmp_path / "warm", warm_bytes=1 << 20, telemetry=tel)
    try:
        urls = sorted(cold)
        for url in urls:  # cold -> warm -> hot
            assert cache.read(url) == cold[url]
        for url in urls:  # hot hits
            assert cache.read(url) == cold[url]
        cache.close()  # a new process state: the memory tier is empty, the warm copies stay
        for url in urls:  # warm hits
            assert cache.read(url) == cold[url]
        s = tel.snapshot()
    finally:
        cache.close()
        tel.close()
    size = sum(len(v) for v in cold.values())
    tiers = _tiers(s)
    assert tiers["cold"][:2] == (4, size)
    assert tiers["memory"] == (4, size, 4, 8, 0)  # 4 hits; 8 misses (the first and the third pass)
    assert tiers["warm"] == (4, size, 4, 4, 0)  # the first pass missed, the third hit
    assert s.tiers["cold"].seconds > 0 and s.tiers["warm"].seconds > 0
    assert s.cache_hit_ratio == pytest.approx(8 / 12)


def test_node_local_and_range_reads_are_recorded(tmp_path, cold):
    tel = Telemetry(window_s=3600)
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=12_000, telemetry=tel,
                        local_tiers=[CacheTier(tmp_path / "local2", 1 << 20)])
    try:
        urls = sorted(cold)
        for url in urls:
            cache.read(url)
        cache.read_range(urls[0], 10, 20)
        s = tel.snapshot()
    finally:
        cache.close()
        tel.close()
    assert "node-local" in s.tiers and s.tiers["node-local"].misses >= 1
    assert s.tiers["cold"].reads >= 4


def test_cold_retries_and_throttled_answers_are_recorded(s3):
    root, opts = s3
    data = os.urandom(50_000)
    open_store(root, opts).put("o.bin", data)
    tel = Telemetry(window_s=3600)
    cache = TieredCache(telemetry=tel, storage_options=opts,
                        cold_wrapper=functools.partial(FaultInjectingStore, errors=2))
    try:
        assert cache.read(f"{root}/o.bin") == data
        stats = cache.stats()
        s = tel.snapshot()
    finally:
        cache.close()
        tel.close()
    assert stats["cold_throttled"] >= 1 and stats["cold_retries"] >= 1
    assert s.cold_throttled == stats["cold_throttled"]
    assert s.cold_retries == stats["cold_retries"]
    assert s.tiers["cold"].bytes == len(data)


def test_a_broken_warm_tier_is_recorded_as_an_error(tmp_path, cold):
    tel = Telemetry(window_s=3600)
    warm = tmp_path / "warm"
    cache = TieredCache(warm_dir=warm, warm_bytes=1 << 20, telemetry=tel)
    try:
        urls = sorted(cold)
        cache.read(urls[0])
        shutil.rmtree(warm)
        with pytest.warns(RuntimeWarning):
            for url in urls[1:]:
                assert cache.read(url) == cold[url]
        s = tel.snapshot()
    finally:
        cache.close()
        tel.close()
    assert s.tiers["warm"].errors >= 1


def test_telemetry_set_later_and_refused_junk(tmp_path, cold):
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20)
    tel = Telemetry(window_s=3600)
    try:
        url = sorted(cold)[0]
        cache.read(url)  # before: recorded nowhere
        cache.telemetry = tel
        cache.read(url)
        s = tel.snapshot()
        with pytest.raises(OptionError, match="telemetry="):
            cache.telemetry = "yes"
        with pytest.raises(OptionError, match="telemetry="):
            TieredCache(telemetry=object())
    finally:
        cache.close()
        tel.close()
    assert s.tiers["warm"].hits == 1 and "cold" not in s.tiers
