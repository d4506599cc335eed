"""Eviction: the clairvoyant policy reaches the offline Belady optimum and beats LRU."""

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.cache import Schedule, TieredCache, belady_hits, lru_hits
from datapipe.cache.eviction import NEVER, choose_victims


def _epochs(keys, epochs, seed):
    rng = random.Random(seed)
    order = []
    for _ in range(epochs):
        ks = list(keys)
        rng.shuffle(ks)
        order += ks
    return order


def _equal_objects(tmp_path, n, size):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(n):
        p = cold / f"s{i:02d}"
        p.write_bytes(os.urandom(size))
        urls.append(str(p))
    return urls


@pytest.mark.parametrize("tier", ["warm", "hot"])
def test_clairvoyant_equals_belady_and_beats_lru(tmp_path, tier):
    size, n, slots = 2000, 12, 4
    urls = _equal_objects(tmp_path, n, size)
    schedule = _epochs(urls, 5, seed=7)
    sizes = {u: size for u in urls}
    optimum = belady_hits(schedule, sizes, slots * size)
    lru = lru_hits(schedule, sizes, slots * size)

    def run(with_schedule, name):
        if tier == "warm":
            c = TieredCache(warm_dir=tmp_path / name, warm_bytes=slots * size)
        else:
            c = TieredCache(hot_bytes=slots * size)
        if with_schedule:
            c.set_schedule(schedule, lookahead=0)
        for u in schedule:
            c.read(u)
        s = c.stats()
        c.close()
        hits = s[f"{tier}_hits"]
        assert hits + s["cold_reads"] == len(schedule)
        return hits

    clair = run(True, "clair")
    plain = run(False, "lru")
    assert clair == optimum
    assert plain == lru
    assert clair > plain


def test_schedule_prefetch_fetches_ahead_in_order(tmp_path):
    import time

    size = 3000
    urls = _equal_objects(tmp_path, 8, size)
    schedule = _epochs(urls, 2, seed=1)
    first = list(dict.fromkeys(schedule[:3]))
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=4 * size)
    c.set_schedule(schedule, lookahead=3)
    deadline = time.monotonic() + 10
    # both counters: a prefetch counts its cold read and itself one after the other
    while (min(c.stats()["prefetched"], c.stats()["cold_reads"]) < len(first)
           and time.monotonic() < deadline):
        time.sleep(0.01)
    s = c.stats()
    assert (s["prefetched"], s["cold_reads"]) == (len(first), len(first))  # only the lookahead
    for u in schedule[:3]:
        assert c.read(u) == open(u, "rb").read()
    s = c.stats()
    assert s["warm_hits"] == 3 and s["warm_misses"] == 0
    for u in schedule[3:]:
        assert c.read(u) == open(u, "rb").read()
    s = c.stats()
    c.close()
    assert s["schedule_position"] == len(schedule)
    assert s["prefetch_errors"] == 0 and s["warm_used_bytes"] <= 4 * size


def test_schedule_position_and_advance(tmp_path):
    urls = _equal_objects(tmp_path, 3, 100)
    c = TieredCache(hot_bytes=1000)
    c.set_schedule([urls[0], urls[1], urls[2], urls[0]], lookahead=0, window=1)
    c.read(urls[0])
    assert c.schedule_position == 1
    c.read(urls[2])  # within window=1 of position 1: jumps past index 2
    assert c.schedule_position == 3
    c.read(urls[1])  # late, and further behind than window=1: unscheduled, position stays
    assert c.schedule_position == 3
    assert c.advance() == 4
    with pytest.raises(ValueError):
        c.advance(-1)
    c.clear_schedule()
    assert c.schedule_position is None


def test_choose_victims_rules():
    s = Schedule(["a", "b", "c", "a", "b"], position=0)
    cands = [("a", 1, 0.0), ("b", 1, 1.0), ("c", 1, 2.0)]
    # LRU: oldest first
    assert choose_victims(cands, 1, "x") == ["a"]
    # Belady at horizon 3: a next at 3, b at 4, c never -> c first, then b
    assert choose_victims(cands, 2, "x", schedule=s, incoming_next=NEVER - 0, horizon=3) is None
    assert choose_victims(cands, 2, "x", schedule=s, incoming_next=3.5, horizon=3) == ["c", "b"]
    # incoming needed after everything evictable: not admitted
    assert choose_victims(cands, 3, "x", schedule=s, incoming_next=4, horizon=3) is None
    assert choose_victims(cands, 0, "x") == []
    assert choose_victims(cands, 5, "x") is None


@settings(max_examples=60, deadline=None)
@given(
    accesses=st.lists(st.integers(0, 7), min_size=1, max_size=60),
    slots=st.integers(1, 5),
)
def test_online_policy_matches_offline_optimum(accesses, slots):
    """Simulate the online rule (choose_victims with the schedule) on equal sizes."""
    s = Schedule(accesses, window=0)
    cache: dict = {}
    hits = 0
    for t, k in enumerate(accesses):
        s.position = t + 1
        if k in cache:
            hits += 1
            cache[k] = t
            continue
        need = len(cache) + 1 - slots
        victims = choose_victims([(c, 1, float(r)) for c, r in cache.items()], need, k,
                                 schedule=s, incoming_next=s.next_use(k, t + 1), horizon=t + 1)
        if victims is None:
            continue
        for v in victims:
            del cache[v]
        cache[k] = t
    assert hits == belady_hits(accesses, {k: 1 for k in accesses}, slots)
    assert hits >= lru_hits(accesses, {k: 1 for k in accesses}, slots)


def test_turns_serve_tickets_in_issue_order():
    import threading

    from datapipe.cache.hot import Turns

    turns = Turns()
    tickets = [turns.issue() for _ in range(5)]
    served = []

    def worker(t):
        if turns.wait(t):
            served.append(t)
            turns.done(t)

    threads = [threading.Thread(target=worker, args=(t,)) for t in reversed(tickets[1:])]
    for th in threads:
        th.start()
    turns.done(tickets[0])  # the first task ended early (say, cancelled)
    for th in threads:
        th.join(5)
    assert served == tickets[1:]
    t = turns.issue()
    turns.close()
    assert turns.wait(t + 1) is False  # shut down: nobody waits forever


def test_bad_schedule_and_prefetch_arguments(tmp_path):
    from datapipe.errors import StorageError

    c = TieredCache(hot_bytes=1000)
    with pytest.raises(StorageError, match="no schedule"):
        c.advance()
    with pytest.raises(ValueError, match="lookahead"):
        c.set_schedule(["a"], lookahead=-1)
    with pytest.raises(ValueError, match="position"):
        c.set_schedule(["a"], position=5)
    with pytest.raises(ValueError, match="2 urls but 1 checksums"):
        c.prefetch(["a", "b"], checksums=["x"])
    with pytest.raises(ValueError, match="prefetch_threads"):
        TieredCache(prefetch_threads=0)
