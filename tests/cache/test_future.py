"""The loader tells its cache its whole future: the shards each worker will fetch to the end
of the next epoch, computed by the pure plan, and exactly the reads the cache then sees.

Reads are recorded by a real TieredCache (warm tier on disk) whose ``set_schedule``,
``local_path``, ``pin_or_read`` and ``read`` also append to a log per worker process; the
passes run through real DataLoader worker processes, several seeds, ranks x workers, and
resume points.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe import ShardWriter, TieredCache
from datapipe.loader import StreamingDataLoader, StreamingDataset
from datapipe.loader.chunks import Chunk
from datapipe.loader.prefetch import Prefetcher
from datapipe.plan import EpochPlan, chunk_fetches, fetch_order


class RecordingCache(TieredCache):
    """A real TieredCache that logs, per process, each schedule it is given and each shard
    read it serves (with its schedule position after the read)."""

    def __init__(self, log_dir: str, **kw):
        super().__init__(**kw)
        self.log_dir = log_dir

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_log_lock", None)  # a lock does not pickle: a worker makes its own
        return state

    def _log_read(self, url):
        # the position is read and its line written under one lock: else a thread that read
        # the position first could write its line after another's (fetches run in parallel)
        lock = self.__dict__.setdefault("_log_lock", threading.Lock())
        with lock:
            self._log("read", [url, self.schedule_position])

    def _log(self, kind, payload):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        name = f"w{0 if info is None else info.id}-{os.getpid()}.jsonl"
        with open(os.path.join(self.log_dir, name), "a") as f:
            f.write(json.dumps([kind, payload]) + "\n")

    def set_schedule(self, urls, **kw):
        self._log("schedule", list(urls))
        super().set_schedule(urls, **kw)

    def local_path(self, url, **kw):
        path = super().local_path(url, **kw)
        self._log_read(url)
        return path

    def pin_or_read(self, url, **kw):
        got = super().pin_or_read(url, **kw)
        self._log_read(url)
        return got

    def read(self, url, **kw):
        data = super().read(url, **kw)
        self._log_read(url)
        return data


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("future") / "ds"
    with ShardWriter(str(path), max_samples=7) as w:
        rng = random.Random(5)
        for i in range(120):
            w.write({"__key__": f"k{i:03d}", "txt": f"t{i}", "bin": bytes(rng.randrange(256) for _ in range(40))})
    return str(path)


def _logs(log_dir):
    """{worker id: [(kind, payload), ...]} of one pass (one process per worker)."""
    out = {}
    for name in sorted(os.listdir(log_dir)):
        w = int(name.split("-")[0][1:])
        if w in out:
            raise AssertionError(f"two processes logged as worker {w} in one pass: {sorted(os.listdir(log_dir))}")
        with open(os.path.join(log_dir, name)) as f:
            out[w] = [tuple(json.loads(line)) for line in f]
    return out


def _one_schedule(events):
    kinds = [k for k, _ in events]
    assert kinds.count("schedule") == 1 and kinds[0] == "schedule", "the future is told once, before any read"
    schedule = events[0][1]
    reads = [p for k, p in events[1:]]
    return schedule, [u for u, _ in reads], [pos for _, pos in reads]


def _pass(ds, tmp_path, tag, workers, cache, take=None):
    log = tmp_path / tag
    log.mkdir()
    cache.log_dir = str(log)
    loader = StreamingDataLoader(ds, batch_size=ds.batch_size, num_workers=workers)
    it = iter(loader)
    keys = []
    for n, batch in enumerate(it, 1):
        keys += list(batch["__key__"])
        if n == take:
            break
    state = loader.state_dict()
    del it
    return _logs(log), keys, state


@pytest.mark.parametrize("seed,world,workers", [(0, 1, 0), (1, 2, 2), (7, 3, 1), (3, 1, 3)])
def test_the_schedule_is_exactly_the_reads_of_this_epoch_and_the_next(ds_url, tmp_path, seed, world, workers):
    """Each worker is told its fetches to the end of the next epoch; the reads the cache
    serves in this pass are that schedule's prefix, in order, each at the cache's own
    position; the rest is exactly what the next pass reads."""
    for rank in range(world):
        cache = RecordingCache(str(tmp_path), warm_dir=str(tmp_path / f"warm-{rank}"), warm_bytes=100_000)
        ds = StreamingDataset(ds_url, cache=cache, seed=seed, window=4, batch_size=3, chunk_samples=9,
                              concurrency=1, rank=rank, world_size=world)
        passes = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            logs, _keys, _ = _pass(ds, tmp_path, f"r{rank}-e{epoch}", workers, cache)
            assert sorted(logs) == list(range(max(workers, 1)))
            passes.append({w: _one_schedule(ev) for w, ev in logs.items()})
        for w in range(max(workers, 1)):
            schedule0, reads0, pos0 = passes[0][w]
            schedule1, reads1, pos1 = passes[1][w]
            assert reads0 and reads0 == schedule0[: len(reads0)]
            assert pos0 == list(range(1, len(reads0) + 1))  # the cache located each read itself
            assert schedule0[len(reads0):] == reads1  # the next epoch, told a pass ahead
            assert reads1 == schedule1[: len(reads1)] and pos1 == list(range(1, len(reads1) + 1))
            # the pure function the loader used, recomputed here for the same worker
            plan = EpochPlan(ds._layout(0)[0], seed=seed, epoch=0, window=4, world=world)
            mine = fetch_order(plan, ds._layout(0)[1], rank, w, max(workers, 1), 3, 9)
            assert [ds.source.url(g) for g in mine.tolist()] == reads0


@pytest.mark.parametrize("seed,workers,take", [(2, 2, 3), (4, 1, 5), (9, 0, 1)])
def test_a_resumed_pass_is_told_the_fetches_from_its_resume_point(ds_url, tmp_path, seed, workers, take):
    cache = RecordingCache(str(tmp_path), warm_dir=str(tmp_path / "warm"), warm_bytes=130_000)
    ds = StreamingDataset(ds_url, cache=cache, seed=seed, window=3, batch_size=4, chunk_samples=8, concurrency=1)
    ds.set_epoch(2)
    _logs0, seen, state = _pass(ds, tmp_path, "first", workers, cache, take=take)
    assert 0 < len(seen) < 120

    ds2 = StreamingDataset(ds_url, cache=cache, seed=seed, window=3, batch_size=4, chunk_samples=8, concurrency=1)
    ds2.load_state_dict(state)
    logs, rest, _ = _pass(ds2, tmp_path, "resumed", workers, cache)
    assert sorted(seen + rest) == [f"k{i:03d}" for i in range(120)]  # every sample once
    for events in logs.values():
        schedule, reads, pos = _one_schedule(events)
        assert reads == schedule[: len(reads)] and pos == list(range(1, len(reads) + 1))
    # the next epoch (3) as told by the resumed pass is what a fresh pass of epoch 3 reads
    ds2.set_epoch(3)
    logs3, _, _ = _pass(ds2, tmp_path, "next", workers, cache)
    for w, events in logs.items():
        schedule, reads, _ = _one_schedule(events)
        assert schedule[len(reads):] == _one_schedule(logs3[w])[1]


def test_concurrent_fetches_are_the_schedule_up_to_their_order(ds_url, tmp_path):
    """With several fetches in flight the cache sees the scheduled reads, each one once,
    reordered by fewer than ``concurrency`` places (the schedule's window): every read is
    located, and the position reaches the end of the epoch's part. (A late read takes its
    own earlier index when that is within the window behind the position, else it may
    match a later occurrence of its shard within the window and move the position on.)"""
    cache = RecordingCache(str(tmp_path), warm_dir=str(tmp_path / "warm"), warm_bytes=80_000)
    ds = StreamingDataset(ds_url, cache=cache, seed=11, window=6, batch_size=2, chunk_samples=12, concurrency=4)
    logs, keys, _ = _pass(ds, tmp_path, "p", 2, cache)
    assert len(keys) == 120
    for events in logs.values():
        schedule, reads, pos = _one_schedule(events)
        assert sorted(reads) == sorted(schedule[: len(reads)])
        assert None not in pos and pos == sorted(pos)
        assert max(pos) >= len(reads)


def test_the_cache_gets_no_schedule_it_does_not_take(ds_url):
    """A cache without set_schedule (any object with the read API) is read without one."""

    class Plain:
        def __init__(self):
            self.storage_options = {}
            self.inner = TieredCache()

        def read(self, url, checksum=None):
            return self.inner.read(url, checksum=checksum)

    ds = StreamingDataset(ds_url, cache=Plain(), seed=1, batch_size=5)
    assert len(list(ds)) == 120


class _Shard:
    def __init__(self, g):
        self.g = g
        self.closed = False

    def close(self):
        self.closed = True


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=1, max_size=12),
       st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_the_prefetcher_fetches_what_chunk_fetches_says_whatever_the_timing(chunk_shards, concurrency, seed):
    """The fetches a Prefetcher makes are the pure rule's, in order with one fetch at a time,
    as a multiset with several, under random fetch and consumer delays; every fetch closed."""
    rng = random.Random(seed)
    delays = [rng.random() * 0.002 for _ in range(64)]
    fetched, made, lock = [], [], threading.Lock()

    def fetch(g):
        time.sleep(delays[len(fetched) % 64])
        shard = _Shard(g)
        with lock:
            fetched.append(g)
            made.append(shard)
        return shard

    def chunks():
        for k, shards in enumerate(chunk_shards):
            arr = np.array(shards, dtype=np.int64)
            yield Chunk.make(k, np.arange(arr.size), arr, np.zeros(arr.size, np.int64))

    pre = Prefetcher(chunks(), fetch, lambda g: 10, max_bytes=35, concurrency=concurrency)
    for chunk in pre:
        for g in chunk.shards:
            assert pre.shard(g).g == g
        time.sleep(delays[chunk.number % 64])
        pre.done(chunk)
    pre.close()
    expected = list(chunk_fetches(Chunk.make(0, np.arange(1), np.array(s), np.zeros(len(s))).shards
                                  for s in chunk_shards))
    if concurrency == 1:
        assert fetched == expected
    else:
        assert sorted(fetched) == sorted(expected)
    assert all(s.closed for s in made)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.integers(0, 5), st.integers(1, 4),
       st.integers(1, 3), st.integers(1, 5), st.integers(1, 20), st.integers(0, 40))
def test_fetch_orders_of_all_workers_cover_every_shard_their_chunks_read(counts, seed, world, workers, batch,
                                                                       chunk_samples, consumed):
    """Pure: the chunks of a rank's workers cover its steps from the resume point exactly
    once, and each worker's fetch order is its chunks' shards under the hand-over rule."""
    from datapipe.plan import worker_chunk_steps

    if sum(counts) == 0:
        return
    plan = EpochPlan(counts, seed=seed, epoch=1, window=3, world=world)
    plan = EpochPlan.from_state(counts, plan.state_dict(min(consumed, plan.per_rank)), seed=seed, window=3,
                                world=world)
    real = np.arange(len(counts))[::-1]  # virtual shard i is read from real shard n-1-i
    for rank in range(world):
        steps = []
        for w in range(workers):
            chunks = list(worker_chunk_steps(plan.start, plan.per_rank, batch, w, workers, chunk_samples))
            steps += [int(s) for c in chunks for s in c]
            shards = [list(dict.fromkeys(real[plan.rank_samples(rank, c)[0]].tolist())) for c in chunks]
            order = fetch_order(plan, real, rank, w, workers, batch, chunk_samples)
            assert order.tolist() == list(chunk_fetches(shards))
            assert all(len(c) <= max(batch, chunk_samples - chunk_samples % batch) for c in chunks)
        assert sorted(steps) == list(range(plan.start, plan.per_rank))
