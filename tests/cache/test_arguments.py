"""Bad arguments of the cache's schedule and prefetch calls are OptionErrors naming the
argument (they were bare ValueErrors, or a TypeError from a comparison)."""

import pytest

from datapipe.cache import CacheTier, Schedule, TieredCache
from datapipe.cache.pacing import ColdPacer
from datapipe.errors import OptionError


@pytest.fixture
def cache():
    c = TieredCache(hot_bytes=1000)
    yield c
    c.close()


@pytest.mark.parametrize("kw, named", [
    ({"lookahead": -1}, "lookahead"), ({"lookahead": 1.5}, "lookahead"), ({"lookahead": "8"}, "lookahead"),
    ({"position": 5}, "position"), ({"position": -1}, "position"), ({"position": "0"}, "position"),
    ({"window": -1}, "window"), ({"window": 2.0}, "window"),
])
def test_set_schedule_refuses_bad_arguments_naming_them(cache, kw, named):
    with pytest.raises(OptionError, match=named):
        cache.set_schedule(["a", "b"], **kw)
    assert cache.schedule is None  # nothing half set


def test_a_schedule_only_moves_forward(cache):
    cache.set_schedule(["a", "b"], lookahead=0)
    with pytest.raises(OptionError, match="only moves forward"):
        cache.advance(-1)
    with pytest.raises(OptionError, match="position"):
        Schedule(["a"], position=2)


def test_prefetch_checksums_must_match_the_urls(cache):
    with pytest.raises(OptionError, match="2 urls but 1 checksums"):
        cache.prefetch(["a", "b"], checksums=["x"])


def test_the_pacer_refuses_no_concurrency(tmp_path):
    with pytest.raises(OptionError, match="cold_concurrency"):
        ColdPacer(None, ceiling=0)


def test_local_tiers_name_the_record_they_take(tmp_path):
    with pytest.raises(OptionError, match=r"CacheTier\(path, bytes\)"):
        TieredCache(warm_dir=tmp_path / "a", warm_bytes=1, local_tiers=[(tmp_path / "b", 10)])
    c = TieredCache(warm_dir=tmp_path / "a", warm_bytes=1 << 20, local_tiers=[CacheTier(tmp_path / "b", 1 << 20)])
    assert c.local_tiers == (CacheTier(str(tmp_path / "b"), 1 << 20),)
    c.close()
