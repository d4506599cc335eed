"""A finished pass keeps its prefetcher running into the pass it guesses comes next (the
next epoch after set_epoch moved on, else the same one), from the object's second pass in
a process on (a first pass fetches only its own shards): whatever the trainer then does
(another epoch, the same one, a resume, a break), every pass yields exactly what a fresh
dataset yields for that epoch and resume point; a guessed pass runs on the prefetcher that
read its first shards ahead."""

from __future__ import annotations

from itertools import chain, islice

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe import ShardWriter
from datapipe.loader import StreamingDataLoader, StreamingDataset
from datapipe.plan import EpochPlan, chunk_fetches, chunk_shards, fetch_order

N = 240


def _write(path):
    with ShardWriter(str(path), max_samples=17) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "bin": bytes([i % 256]) * (i % 50 + 1)})
    return str(path)


_DS: dict[str, str] = {}


def _url(tmp_path_factory):
    if "url" not in _DS:
        _DS["url"] = _write(tmp_path_factory.mktemp("ahead") / "ds")
    return _DS["url"]


def _keys(items):
    return [s["__key__"] for s in items]


def _fresh(url, epoch, state=None, **kw):
    ds = StreamingDataset(url, **kw)
    if state is None:
        ds.set_epoch(epoch)
    else:
        ds.load_state_dict(state)
    return _keys(ds)


def test_the_guessed_next_epoch_is_read_ahead_and_used(tmp_path_factory):
    url = _url(tmp_path_factory)
    kw = dict(window=3, seed=1, chunk_samples=32)
    ds = StreamingDataset(url, **kw)
    ds.set_epoch(0)
    assert _keys(ds) == _fresh(url, 0, **kw)
    assert ds._ahead is None  # the first pass here: nothing read ahead
    ds.set_epoch(1)
    assert _keys(ds) == _fresh(url, 1, **kw)
    ahead = ds._ahead
    assert ahead is not None and ahead.key.epoch == 2  # set_epoch(1) then a pass: epoch 2 next
    for g in ahead.pending.shards:  # the next pass's first shards are being read (wait for them)
        assert ahead.pre.shard(g).shard == g
    ds.set_epoch(2)
    assert _keys(ds) == _fresh(url, 2, **kw)
    assert ds._ahead is not None and ds._ahead.pre is ahead.pre  # the pass ran on that prefetcher
    assert ds._ahead.key.epoch == 3
    ds.set_epoch(5)  # not the guess: a new prefetcher, the same samples as a fresh dataset
    assert _keys(ds) == _fresh(url, 5, **kw)
    assert ds._ahead.pre is not ahead.pre and ds._ahead.key.epoch == 6


@pytest.mark.parametrize("chunk_samples", [7, 32, 10_000])
def test_a_first_pass_fetches_its_own_shards_only(tmp_path_factory, chunk_samples):
    """Until one pass has run here, a pass fetches exactly what its plan says (the pure
    fetch order, repeats included) and nothing of the next one; the second pass fetches
    its own and the next pass's first shards, which the third then uses: the fetches of
    its chunks and the next passes' as one run of chunks (a shard the last chunk of a pass
    and the first of the next both read is fetched once, handed on)."""
    url = _url(tmp_path_factory)
    kw = dict(window=3, seed=3, chunk_samples=chunk_samples)
    ds = StreamingDataset(url, **kw)
    fetched: list[int] = []
    fetch = ds.source.fetch

    def recording(g, cache=None):
        fetched.append(g)
        return fetch(g, cache)

    ds.source.fetch = recording  # the real fetch, each call recorded
    plan = {e: fetch_order(EpochPlan(ds._layout(e)[0], seed=3, epoch=e, window=3), ds._layout(e)[1], 0, 0, 1,
                           1, chunk_samples).tolist() for e in range(6)}
    assert _keys(ds) == _fresh(url, 0, **kw)
    assert fetched == plan[0] and ds._ahead is None
    fetched.clear()
    ds.set_epoch(1)
    assert _keys(ds) == _fresh(url, 1, **kw)
    ahead = ds._ahead
    assert ahead is not None
    ahead.pre.fetched(ahead.pending)  # the next pass's first chunk has landed
    got = list(fetched)  # (it may be fetching more of epoch 2 meanwhile)
    assert got[: len(plan[1])] == plan[1] and len(got) > len(plan[1])
    # (a short pass's read ahead runs on into the next)
    chained = list(chunk_fetches(chain(*(chunk_shards(EpochPlan(ds._layout(e)[0], seed=3, epoch=e, window=3),
                                                      ds._layout(e)[1], 0, 0, 1, 1, chunk_samples)
                                         for e in range(1, 6)))))
    assert chained[: len(plan[1])] == plan[1]
    assert got == chained[: len(got)]  # the start of epoch 2's
    fetched.clear()
    ds.set_epoch(2)
    assert _keys(ds) == _fresh(url, 2, **kw)
    assert ds._ahead is not None and ds._ahead.pre is ahead.pre


@pytest.mark.parametrize("window", [16, 4])
def test_a_read_ahead_waits_for_what_the_pass_lets_go_and_is_used(tmp_path_factory, window):
    """A read ahead reads into the bytes the pass being read let go (the mechanism:
    test_dataset's prefetcher tests). With the whole dataset in one window (16 > 15
    shards) the next pass's shards are fetched only as the pass ends: each pass still
    ends, yields what a fresh dataset yields, and the next one runs on its read ahead."""
    url = _url(tmp_path_factory)
    kw = dict(window=window, seed=5, chunk_samples=24, prefetch_bytes=1 << 30)
    ds = StreamingDataset(url, **kw)
    pres = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        assert _keys(ds) == _fresh(url, epoch, **kw)
        pres.append(None if ds._ahead is None else ds._ahead.pre)
    assert pres[0] is None and pres[1] is pres[2] is pres[3] is not None


def test_a_copy_in_another_process_counts_its_own_passes(tmp_path_factory):
    """A DataLoader worker's copy (forked: the parent's count in its memory; or unpickled)
    makes its first pass there: it reads nothing ahead."""
    import multiprocessing as mp
    import pickle

    url = _url(tmp_path_factory)
    ds = StreamingDataset(url, window=3, seed=1)
    _keys(ds)
    _keys(ds)
    assert ds._passes.count == 2 and ds._ahead is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._passes.count == 0
    ds._ahead.closer.cancel()  # no prefetch thread when forking (a fork has none of its threads)
    ds._ahead.pre.close()
    ds._ahead = None
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_first_pass_in_a_fork, args=(ds, out))
    child.start()
    got = out.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == (0, True, 1, _fresh(url, 0, window=3, seed=1))  # the parent's two passes are not the child's
    assert ds._passes.count == 2


def _first_pass_in_a_fork(ds, out):
    seen = ds._passes.count
    ds.set_epoch(0)
    keys = _keys(ds)
    out.put((seen, ds._ahead is None, ds._passes.count, keys))


def test_without_set_epoch_the_same_epoch_is_guessed(tmp_path_factory):
    url = _url(tmp_path_factory)
    ds = StreamingDataset(url, window=3, seed=2)
    once = _keys(ds)
    assert _keys(ds) == once  # epoch 0 again (guessed 1 first: dropped, a new prefetcher)
    assert ds._ahead is not None and ds._ahead.key.epoch == 0
    assert _keys(ds) == once


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["all", "break", "resume"]),
                          st.integers(1, N - 1)), min_size=1, max_size=6))
def test_any_sequence_of_passes_yields_what_a_fresh_dataset_yields(tmp_path_factory, passes):
    url = _url(tmp_path_factory)
    kw = dict(window=4, seed=7, chunk_samples=20)
    ds = StreamingDataset(url, **kw)
    for epoch, how, at in passes:
        if how == "resume":  # a state taken `at` samples into `epoch`, from another dataset
            other = StreamingDataset(url, **kw)
            other.set_epoch(epoch)
            it = iter(other)
            list(islice(it, at))
            state = other.state_dict()
            it.close()
            ds.load_state_dict(state)
            assert _keys(ds) == _fresh(url, epoch, state, **kw)
            continue
        ds.set_epoch(epoch)
        expected = _fresh(url, epoch, **kw)
        if how == "break":  # the trainer stops early: nothing is kept for a next pass
            it = iter(ds)
            assert _keys(islice(it, at)) == expected[:at]
            it.close()
            assert ds._ahead is None
        else:
            assert _keys(ds) == expected


def test_persistent_dataloader_workers_read_ahead_and_stay_exact(tmp_path_factory):
    url = _url(tmp_path_factory)
    ds = StreamingDataset(url, window=3, seed=4, decode=None)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    assert loader.persistent_workers
    for epoch in (0, 1, 1, 3):
        ds.set_epoch(epoch)
        got = [k for b in loader for k in b["__key__"]]
        single = StreamingDataset(url, window=3, seed=4, decode=None, batch_size=8)
        single.set_epoch(epoch)
        assert sorted(got) == sorted(_keys(single)) and len(got) == N
    # a resume between passes: the workers' read-ahead is not used, the resume is exact
    ds.set_epoch(2)
    it = iter(loader)
    seen = [k for b in islice(it, 5) for k in b["__key__"]]
    state = loader.state_dict()
    del it
    loader2 = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    loader2.load_state_dict(state)
    rest = [k for b in loader2 for k in b["__key__"]]
    assert sorted(seen + rest) == sorted(f"s{i:04d}" for i in range(N))


def test_with_a_cache_a_pass_reads_nothing_beyond_itself(tmp_path_factory, tmp_path):
    # the cache is told each pass's fetches to the end of the next epoch (its schedule):
    # reads it served ahead of a pass would not be in that pass's schedule
    from datapipe import TieredCache

    url = _url(tmp_path_factory)
    cache = TieredCache(warm_dir=str(tmp_path / "warm"), warm_bytes=1 << 24)
    ds = StreamingDataset(url, window=3, seed=1, cache=cache)
    ds.set_epoch(0)
    assert _keys(ds) == _fresh(url, 0, window=3, seed=1)
    assert ds._ahead is None
    cache.close()


class _Shard:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_a_read_ahead_whose_dataset_is_collected_stops_without_waiting():
    """Collection runs finalizers on whatever thread allocates: the closer of a read ahead
    only asks it to stop there (no join, no lock). Its threads end by themselves once
    their fetches return and close what they hold; at exit it would still be closed."""
    import gc
    import threading
    import warnings

    import numpy as np

    from datapipe.loader.chunks import Chunk
    from datapipe.loader.prefetch import Prefetcher
    from datapipe.loader.prefetch import ReadAheadCloser as _Closer

    started, gate, made = threading.Event(), threading.Event(), {}

    def fetch(g):
        made[g] = _Shard()
        if g == 1:
            started.set()
            gate.wait(60)  # a store that does not answer (yet)
        return made[g]

    def chunks():
        for k in range(4):
            yield Chunk.make(k, np.arange(1), np.array([k]), np.zeros(1, np.int64))

    class Owner:
        pass

    owner = Owner()
    pre = Prefetcher(chunks(), fetch, lambda g: 1)
    closer = _Closer(owner, pre)
    assert started.wait(10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del owner
        gc.collect()  # a close that waited here would time out (30 s) and warn
    assert not [w for w in caught if "did not stop" in str(w.message)]
    assert not closer._at_exit.still_active()  # nothing left to do at exit
    gate.set()
    pre._thread.join(10)
    assert not pre._thread.is_alive()
    assert made and all(s.closed for s in made.values())
