"""The directory tier interface (cache/tier.py) that the warm directory, a further node-local
directory and the shared directory all implement: lookup, fill, discard, with the same
counters, on real directories and real flocks."""

import fcntl
import os

import pytest

from datapipe.cache import CacheTier, TieredCache
from datapipe.cache.eviction import choose_victims
from datapipe.checksum import checksum

TIERS = ["warm", "local2", "shared"]


@pytest.fixture
def cache(tmp_path):
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                    local_tiers=[CacheTier(tmp_path / "local2", 1 << 20)],
                    shared_dir=tmp_path / "shared", shared_bytes=1 << 20)
    yield c
    c.close()


def _tier(cache, name):
    tiers = cache._state().tiers
    return {"warm": tiers.warm, "local2": tiers.lower[0], "shared": tiers.shared}[name]


def _object(tmp_path, name="obj.bin", size=5000):
    data = os.urandom(size)
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name), data


def _fill(cache, tier, url, data):
    def chooser():
        return lambda cands, need, *_: choose_victims(cands, need, url)

    got, _origin = tier.fill(url, checksum(data), cache._state().tiers.route(tier, chooser))
    assert got == data


def _flip(path):
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("name", TIERS)
def test_every_tier_looks_up_fills_and_discards_alike(cache, tmp_path, name):
    url, data = _object(tmp_path)
    tier = _tier(cache, name)
    assert tier.name == name
    missing = tier.lookup(url, checksum(data))
    assert (missing.data, missing.fd, missing.kept) == (None, None, False)
    _fill(cache, tier, url, data)
    assert os.path.exists(tier.path(url))
    found = tier.lookup(url, checksum(data))
    assert found.data == data and found.fd is None
    kept = tier.lookup(url, checksum(data), want_bytes=False, keep=True)  # a verified copy, held
    assert kept.data == b"" and kept.fd is not None
    assert tier.discard(url, kept.fd)  # nobody else holds it: gone
    assert not os.path.exists(tier.path(url))
    s = cache.stats()
    assert s[f"{name}_fills"] == 1 and s.get(f"{name}_corrupt", 0) == 0


@pytest.mark.parametrize("name", TIERS)
def test_a_copy_that_fails_is_counted_corrupt_and_removed(cache, tmp_path, name):
    url, data = _object(tmp_path)
    tier = _tier(cache, name)
    _fill(cache, tier, url, data)
    _flip(tier.path(url))
    found = tier.lookup(url, checksum(data))
    assert (found.data, found.kept) == (None, False)
    assert not os.path.exists(tier.path(url))
    assert cache.stats()[f"{name}_corrupt"] == 1


@pytest.mark.parametrize("name", ["warm", "local2"])
def test_a_node_local_copy_that_fails_but_is_pinned_elsewhere_stays(cache, tmp_path, name):
    url, data = _object(tmp_path)
    tier = _tier(cache, name)
    _fill(cache, tier, url, data)
    _flip(tier.path(url))
    with open(tier.path(url), "rb") as other:  # another reader's pin: a shared flock of its own
        fcntl.flock(other.fileno(), fcntl.LOCK_SH)
        found = tier.lookup(url, checksum(data))
        assert (found.data, found.kept) == (None, True)
        assert os.path.exists(tier.path(url))  # never removed under a holder
    assert cache.stats()[f"{name}_corrupt"] == 1


def test_a_shared_copy_is_not_pinned_across_hosts(cache, tmp_path):
    # no flock means anything across hosts: a damaged shared copy goes even while open
    url, data = _object(tmp_path)
    tier = _tier(cache, "shared")
    _fill(cache, tier, url, data)
    _flip(tier.path(url))
    with open(tier.path(url), "rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_SH)
        assert tier.lookup(url, checksum(data)).kept is False
    assert not os.path.exists(tier.path(url))


def test_the_walk_reads_each_tier_in_order_and_counts_where_bytes_came_from(cache, tmp_path):
    url, data = _object(tmp_path)
    assert cache.read(url, checksum=checksum(data)) == data
    s = cache.stats()
    # one miss per tier, then one fill per tier from the one below it
    assert [s[f"{t}_misses"] for t in TIERS] == [1, 1, 1]
    assert [s[f"{t}_fills"] for t in TIERS] == [1, 1, 1]
    assert (s["warm_from_local2"], s["local2_from_cold"], s["cold_reads"]) == (1, 1, 1)
    os.unlink(_tier(cache, "warm").path(url))
    assert cache.read(url, checksum=checksum(data)) == data  # warm misses, local2 hits
    s = cache.stats()
    assert (s["warm_misses"], s["local2_hits"], s["warm_from_local2"], s["cold_reads"]) == (2, 1, 2, 1)
