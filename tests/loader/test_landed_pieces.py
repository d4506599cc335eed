"""A chunk is read as its shards land: the items of a chunk that need only shards already
fetched are handed out while the chunk's other shards are still being fetched (a window's
first samples wait for their own shard, not for the whole window), in pieces of whole
batches when the pass batches; the items, their order and their steps are the chunk's."""

from __future__ import annotations

import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe import ShardWriter
from datapipe.checksum import checksum as _checksum
from datapipe.errors import ChecksumError
from datapipe.loader import Chunk, PassFetch, PassKey, Prefetcher, StreamingDataset

KEY = PassKey(0, 0, 1, 0, 1, 1, 8192)
GUARD_S = 60  # only a failing test waits this long (a piece that never comes)


class _Unit:
    def __init__(self, g: int) -> None:
        self.g = g

    def close(self) -> None:
        pass


class _HeldFetch:
    """Fetches that return at once, except those of ``held`` shards: each waits until released."""

    def __init__(self, held: set[int]) -> None:
        self.events = {g: threading.Event() for g in held}

    def __call__(self, g: int) -> _Unit:
        ev = self.events.get(g)
        if ev is not None and not ev.wait(GUARD_S):
            raise AssertionError(f"shard {g} was never released")
        return _Unit(g)

    def release_all(self) -> None:
        for ev in self.events.values():
            ev.set()


@settings(max_examples=40)
@given(shards=st.lists(st.integers(0, 5), min_size=1, max_size=60), align=st.sampled_from([1, 2, 4, 7]),
       held=st.sets(st.integers(0, 5)))
def test_pieces_need_only_landed_shards_and_keep_the_chunk(shards, align, held):
    n = len(shards)
    chunk = Chunk.make(0, np.arange(n, dtype=np.int64), np.array(shards, dtype=np.int64),
                       np.arange(n, dtype=np.int64) * 10)
    order = list(chunk.shards)  # first use order
    first = {g: shards.index(g) for g in order}
    fetch = _HeldFetch(held & set(order))
    pre = Prefetcher(iter([chunk]), fetch, lambda g: 1, concurrency=8)
    try:
        pieces = PassFetch(pre, KEY).chunks(align=align)
        start, got = 0, []
        while start < n:
            waiting = [g for g in order if g in fetch.events and not fetch.events[g].is_set()]
            limit = n if not waiting else first[waiting[0]] // align * align
            if start >= limit:  # the next piece needs a held shard: let it land
                fetch.events[waiting[0]].set()
                continue
            piece = next(pieces)
            end = start + len(piece.steps)
            assert end <= limit, "a piece needs a shard that has not landed"
            assert len(piece.steps) % align == 0 or end == n
            assert [u.g for u in piece.fetched] == list(piece.shards)
            assert set(piece.shards) == set(piece.shard.tolist())
            got += list(zip(piece.steps.tolist(), piece.shard.tolist(), piece.sample.tolist()))
            start = end
        assert next(pieces, None) is None
        assert got == list(zip(chunk.steps.tolist(), chunk.shard.tolist(), chunk.sample.tolist()))
    finally:
        fetch.release_all()
        pre.close()


class _HoldingCache:
    """A cache that reads each shard's file and checks it against the index's checksum, as a
    cache does, and holds one shard's read back until released."""

    def __init__(self, held_url: str) -> None:
        self.held_url = held_url
        self.release = threading.Event()
        self.asked = threading.Event()

    def read(self, url: str, checksum: str | None = None) -> bytes:  # a cache's signature
        if url == self.held_url:
            self.asked.set()
            if not self.release.wait(GUARD_S):
                raise AssertionError("the held shard was never released")
        with open(url, "rb") as f:
            data = f.read()
        if checksum is not None and _checksum(data) != checksum:
            raise ChecksumError(f"{url} does not match {checksum}")
        return data


def _write(path, shards=6, per_shard=40):
    with ShardWriter(str(path), max_samples=per_shard) as w:
        for i in range(shards * per_shard):
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "bin": bytes([i % 256]) * (i % 50 + 1)})
    return str(path)


def _stream(url, **kw):
    return [(s["__key__"], s["__shard__"]) for s in StreamingDataset(url, window=None, return_position=True, **kw)]


def _held_run(url, held, stop_at, **kw):
    """(what a pass yields before the held shard is released, all it yields): the pass runs
    in a thread; the held shard is released once ``stop_at`` items came out (or, failing
    that, at the guard)."""
    ds = StreamingDataset(url, window=None, cache=_HoldingCache(held), **kw)
    out: list = []
    enough = threading.Event()

    def consume():
        for item in ds:
            out.append(item)
            if len(out) >= stop_at:
                enough.set()
        enough.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    enough.wait(GUARD_S)
    before = list(out)
    ds.cache.release.set()
    t.join(GUARD_S)
    return before, out


def test_a_pass_yields_the_samples_before_a_shard_still_fetched(tmp_path):
    """Old code: the pass waited for every shard of a chunk, so it stopped at the start of
    the chunk that first reads the held shard."""
    url = _write(tmp_path / "ds")
    whole = _stream(url, seed=3)
    firsts = {}
    for i, (_, g) in enumerate(whole):
        firsts.setdefault(g, i)
    held_shard, at = max(firsts.items(), key=lambda kv: kv[1])  # the last shard first read
    chunk_starts = {0, 1, 5, 21, 85}  # chunks of 1, 4, 16, 64 ... batches of one sample
    assert at not in chunk_starts and at < 85
    held = StreamingDataset(url).source.url(held_shard)
    before, out = _held_run(url, held, at, seed=3, return_position=True)
    assert [(s["__key__"], s["__shard__"]) for s in before] == whole[:at]
    assert [(s["__key__"], s["__shard__"]) for s in out] == whole


def test_batched_pieces_are_whole_batches(tmp_path):
    url = _write(tmp_path / "ds")
    reference = [b["__key__"] for b in StreamingDataset(url, window=None, seed=5, batch_size=8, batched=True)]
    whole = _stream(url, seed=5)
    firsts = {}
    for i, (_, g) in enumerate(whole):
        firsts.setdefault(g, i)
    held_shard, at = max(firsts.items(), key=lambda kv: kv[1])
    held = StreamingDataset(url).source.url(held_shard)
    before, out = _held_run(url, held, at // 8, seed=5, batch_size=8, batched=True)
    assert [b["__key__"] for b in out] == reference
    assert all(len(b["__key__"]) == 8 for b in out[:-1])
    assert len(before) >= at // 8


def test_the_first_chunks_fetches_run_alone():
    """With first_alone (a StreamingDataset of local shards without a cache), the consumer's
    first item waits for its own shard only: no other fetch starts until the first chunk's
    have landed (they would share the cores with it). Old code: the next chunk's fetches
    started beside the first one's."""
    log: list[tuple[str, int]] = []
    other_started = threading.Event()

    def fetch(g: int) -> _Unit:
        log.append(("start", g))
        if g == 0:  # held until another fetch starts (old code), or for a while (this code)
            other_started.wait(2.0)
        else:
            other_started.set()
        log.append(("end", g))
        return _Unit(g)

    chunks = [Chunk.make(0, np.arange(1), np.array([0]), np.array([0])),
              Chunk.make(1, np.arange(1, 5), np.array([1, 2, 3, 1]), np.arange(4))]
    pre = Prefetcher(iter(chunks), fetch, lambda g: 1, concurrency=4, first_alone=True)
    try:
        got = [(c.number, [u.g for u in c.fetched]) for c in PassFetch(pre, KEY).chunks()]
    finally:
        pre.close()
    assert got == [(0, [0]), (1, [1, 2, 3])]
    assert log.index(("end", 0)) < min(log.index(("start", g)) for g in (1, 2, 3)), log



def test_a_local_dataset_fetches_its_first_chunk_alone(tmp_path):
    """Old code: the next chunk's shards were fetched beside the first one's."""
    url = _write(tmp_path / "ds")
    ds = StreamingDataset(url, window=None)
    real = ds.source.fetch
    log: list[tuple[str, int]] = []
    first: list[int] = []
    other_started = threading.Event()
    lock = threading.Lock()

    def fetch(g, cache=None):
        with lock:
            log.append(("start", g))
            is_first = not first
            if is_first:
                first.append(g)
        if is_first:  # held until another fetch starts (old code), or for a while (this code)
            other_started.wait(2.0)
        else:
            other_started.set()
        data = real(g, cache=cache)
        log.append(("end", g))
        return data

    ds.source.fetch = fetch
    assert sorted(s["__key__"] for s in ds) == [f"s{i:04d}" for i in range(240)]
    later = [i for i, (what, g) in enumerate(log) if what == "start" and i > 0]
    assert log.index(("end", first[0])) < min(later), log
