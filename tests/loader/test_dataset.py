"""StreamingDataset on local datasets: coverage, order, resume, decoding, mixing, bad input."""

from __future__ import annotations

import io
import itertools
import os
import threading
import time

import numpy as np
import pytest

from datapipe import ShardWriter
from datapipe.errors import (
    ChecksumError,
    CorruptShardError,
    DatapipeError,
    DecodeError,
    ObjectNotFoundError,
    PlanError,
    StateMismatchError,
)
from datapipe.loader import Stream, StreamingDataset
from datapipe.loader.chunks import Chunk
from datapipe.loader.prefetch import Prefetcher

N = 500


def _write(path, n, per_shard, prefix="k", compression=None):
    with ShardWriter(str(path), max_samples=per_shard, compression=compression) as w:
        for i in range(n):
            w.write({"__key__": f"{prefix}{i:05d}", "cls": str(i), "txt": f"sample {i}",
                     "json": {"i": i}, "bin": bytes([i % 256]) * (i % 50 + 1)})
    return str(path)


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("ds") / "a", N, 37)


@pytest.fixture(scope="module")
def zstd_url(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("dsz") / "z", 120, 25, prefix="z", compression="zstd")


def _ids(items):
    """The samples' numbers: the ``cls`` field, raw (the default decode) or decoded."""
    return [int(it["cls"]) for it in items]


def test_every_sample_once_decoded(ds_url):
    ds = StreamingDataset(ds_url, window=3, seed=5, decode="auto")
    items = list(ds)
    assert sorted(_ids(items)) == list(range(N))
    it = items[0]
    i = it["cls"]
    assert it["__key__"] == f"k{i:05d}" and it["txt"] == f"sample {i}" and it["json"] == {"i": i}
    assert it["bin"] == bytes([i % 256]) * (i % 50 + 1)
    assert _ids(items) != list(range(N))  # shuffled


def test_order_is_deterministic_per_seed_and_epoch(ds_url):
    a = _ids(StreamingDataset(ds_url, window=4, seed=1))
    b = _ids(StreamingDataset(ds_url, window=4, seed=1))
    c = StreamingDataset(ds_url, window=4, seed=1)
    c.set_epoch(1)
    assert a == b
    assert a != _ids(c) and sorted(_ids(c)) == list(range(N))


def test_no_shuffle_is_stored_order(ds_url, zstd_url):
    assert _ids(StreamingDataset(ds_url, shuffle=False)) == list(range(N))
    assert _ids(StreamingDataset(zstd_url, shuffle=False)) == list(range(120))


def test_decode_raw_and_map(ds_url):
    raw = next(iter(StreamingDataset(ds_url, decode="raw", shuffle=False)))
    assert raw["cls"] == b"0" and raw["json"] == b'{"i": 0}'
    default = next(iter(StreamingDataset(ds_url, shuffle=False)))  # raw bytes, as WebDataset's default
    assert default.keys() == raw.keys()
    assert all(bytes(default[k]) == raw[k] for k in raw if k != "__key__")
    mapped = next(iter(StreamingDataset(ds_url, shuffle=False, decode="auto", map=lambda s: (s["cls"], s["txt"]))))
    assert mapped == (0, "sample 0")
    custom = next(iter(StreamingDataset(ds_url, shuffle=False, decode={"bin": len})))
    assert custom["bin"] == 1 and custom["cls"] == 0


def test_npy_fields_decode_without_pickle(tmp_path):
    url = str(tmp_path / "npy")
    with ShardWriter(url) as w:
        for i in range(5):
            buf = io.BytesIO()
            np.save(buf, np.arange(i + 1, dtype=np.float32))
            w.write({"__key__": f"a{i}", "npy": buf.getvalue()})
        buf = io.BytesIO()
        np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
        w.write({"__key__": "evil", "npy": buf.getvalue()})
    ds = StreamingDataset(url, shuffle=False, decode="npy")
    with pytest.raises(DecodeError, match="evil"):
        got = [s["npy"] for s in ds]
    with pytest.warns(RuntimeWarning, match="evil"):
        got = [s["npy"] for s in StreamingDataset(url, shuffle=False, decode="auto", on_error="skip")]
    assert [a.tolist() for a in got] == [list(range(i + 1)) for i in range(5)]


def test_resume_in_process_continues_exactly(ds_url):
    full = _ids(StreamingDataset(ds_url, window=3, seed=2, batch_size=4))
    ds = StreamingDataset(ds_url, window=3, seed=2, batch_size=4)
    it = iter(ds)
    first = [int(next(it)["cls"]) for _ in range(123)]
    state = ds.state_dict()
    it.close()
    again = StreamingDataset(ds_url, window=3, seed=2, batch_size=4)
    again.load_state_dict(state)
    rest = _ids(again)
    assert first + rest == full
    # the pass after the resumed one starts the epoch afresh
    assert _ids(again) == full


def test_elastic_resume_across_ranks(ds_url):
    def rank_ds(r, w, **kw):
        return StreamingDataset(ds_url, window=5, seed=3, rank=r, world_size=w, **kw)

    seen = []
    states = []
    for r in range(3):
        ds = rank_ds(r, 3)
        it = iter(ds)
        seen += [int(next(it)["cls"]) for _ in range(40)]
        states.append(ds.state_dict())
        it.close()
    assert all(s == states[0] for s in states)  # lockstep ranks agree on the state
    counts = set()
    for r in range(2):
        ds = rank_ds(r, 2)
        ds.load_state_dict(states[0])
        got = _ids(ds)
        counts.add(len(got))
        seen += got
    assert len(counts) == 1
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("drop", [False, True])
def test_equal_counts_per_rank(ds_url, drop):
    lens = []
    seen = []
    for r in range(3):
        ds = StreamingDataset(ds_url, window=2, rank=r, world_size=3, drop_last=drop)
        got = _ids(ds)
        assert len(ds) == len(got)
        lens.append(len(got))
        seen += got
    assert len(set(lens)) == 1
    if drop:
        assert lens[0] == N // 3 and len(set(seen)) == len(seen)
    else:
        assert lens[0] == -(-N // 3) and set(seen) == set(range(N))


def test_mixing_weights_and_repeats(ds_url, zstd_url):
    mix = [Stream(ds_url, weight=3), Stream(zstd_url, weight=1)]
    ds = StreamingDataset(mix, epoch_size=400, seed=1, window=4)
    keys = [s["__key__"] for s in ds]
    assert len(keys) == 400
    from_a = sum(k.startswith("k") for k in keys)
    assert from_a == 300
    # zstd stream has 120 samples and is asked for 100: no repeats inside one epoch
    assert len({k for k in keys if not k.startswith("k")}) == 100
    again = [s["__key__"] for s in StreamingDataset(mix, epoch_size=400, seed=1, window=4)]
    assert keys == again
    rep = StreamingDataset([Stream(zstd_url, repeat=2.5)], seed=0)
    rk = [s["__key__"] for s in rep]
    assert len(rk) == 300 and all(rk.count(k) in (2, 3) for k in set(rk))
    with pytest.raises(PlanError):
        Stream(ds_url, weight=1, repeat=2)


def test_mixing_resumes(ds_url, zstd_url):
    mix = [Stream(ds_url, weight=1), Stream(zstd_url, weight=1)]
    full = [s["__key__"] for s in StreamingDataset(mix, epoch_size=200, seed=4)]
    ds = StreamingDataset(mix, epoch_size=200, seed=4)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(77)]
    state = ds.state_dict()
    it.close()
    ds2 = StreamingDataset(mix, epoch_size=200, seed=4)
    ds2.load_state_dict(state)
    assert head + [s["__key__"] for s in ds2] == full
    with pytest.raises(StateMismatchError):
        StreamingDataset(mix, epoch_size=300, seed=4).load_state_dict(state)


def test_state_from_another_dataset_or_seed(ds_url, zstd_url):
    state = StreamingDataset(ds_url, seed=1).state_dict(0)
    with pytest.raises(StateMismatchError, match="seed"):
        StreamingDataset(ds_url, seed=2).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="another dataset"):
        StreamingDataset(zstd_url, seed=1).load_state_dict(state)
    with pytest.raises(StateMismatchError):
        StreamingDataset(ds_url, seed=1).load_state_dict({"epoch": "x"})
    ds = StreamingDataset(ds_url, seed=1)
    with pytest.raises(PlanError):
        ds.state_dict(N + 1)


def test_missing_and_empty_datasets(tmp_path):
    with pytest.raises(ObjectNotFoundError, match="no dataset"):
        StreamingDataset(str(tmp_path / "nope"))
    try:
        with ShardWriter(str(tmp_path / "empty")):
            pass
    except DatapipeError:
        pytest.skip("the writer refuses to write an empty dataset")
    with pytest.raises(PlanError, match="no sample"):
        StreamingDataset(str(tmp_path / "empty"))


def _copy_dataset(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _corrupt(url, shard_index, *, truncate=False):
    from datapipe import open_index

    ix = open_index(url)
    info, table = ix.shards[shard_index], ix.shard_samples(shard_index)
    path = os.path.join(url, info.name)
    victim = 3
    if truncate:
        with open(path, "r+b") as f:
            f.truncate(int(table.offsets[victim]) + 10)
    else:
        with open(path, "r+b") as f:
            f.seek(int(table.offsets[victim]) + 600)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    return info.name, table.keys[victim]


def test_corrupt_shard_mid_epoch_names_shard_and_sample(ds_url, tmp_path):
    url = _copy_dataset(ds_url, tmp_path / "c")
    name, key = _corrupt(url, 4)
    with pytest.raises((ChecksumError, CorruptShardError)) as e:
        list(StreamingDataset(url, window=2, seed=0))
    assert name in str(e.value) and key in str(e.value)
    with pytest.warns(RuntimeWarning, match="skipped 1 unreadable"):
        ds = StreamingDataset(url, window=2, seed=0, on_error="skip")
        got = _ids(ds)
    assert len(got) == N - 1 and ds.skipped[0][1] == key


def test_truncated_shard_names_shard_and_sample(ds_url, tmp_path):
    url = _copy_dataset(ds_url, tmp_path / "t")
    name, key = _corrupt(url, 2, truncate=True)
    with pytest.raises(CorruptShardError, match="truncated") as e:
        list(StreamingDataset(url, shuffle=False))
    assert name in str(e.value) and key in str(e.value)
    with pytest.warns(RuntimeWarning):
        ds = StreamingDataset(url, shuffle=False, on_error="skip")
        got = _ids(ds)
    assert len(got) == N - (37 - 3) and len(ds.skipped) == 37 - 3


def test_missing_shard_file_is_named(ds_url, tmp_path):
    url = _copy_dataset(ds_url, tmp_path / "m")
    from datapipe import open_index

    name = open_index(url).shards[1].name
    os.unlink(os.path.join(url, name))
    with pytest.raises(ObjectNotFoundError, match=name):
        list(StreamingDataset(url, shuffle=False))


def test_bad_arguments(ds_url):
    with pytest.raises(PlanError):
        StreamingDataset(ds_url, window=0)
    with pytest.raises(ValueError):
        StreamingDataset(ds_url, on_error="ignore")
    with pytest.raises(PlanError):
        StreamingDataset([])
    with pytest.raises(PlanError):
        list(StreamingDataset(ds_url, rank=3, world_size=2))
    with pytest.raises(ValueError):
        StreamingDataset(ds_url, decode=42)


def test_topology_from_environment(ds_url, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ds = StreamingDataset(ds_url, seed=0)
    assert len(ds) == -(-N // 4)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(PlanError, match="not integers"):
        len(StreamingDataset(ds_url))


class _FakeShard:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_prefetcher_stays_inside_its_byte_budget():
    sizes = {g: 100 for g in range(40)}
    made, lock = [], threading.Lock()

    def fetch(g):
        time.sleep(0.001)
        shard = _FakeShard()
        with lock:
            made.append(shard)
        return shard

    def chunks():
        for k in range(20):
            shard = np.array([2 * k, 2 * k + 1, 2 * k, 2 * k + 1])
            yield Chunk.make(k, np.arange(4), shard, np.zeros(4, np.int64))

    pre = Prefetcher(chunks(), fetch, sizes.__getitem__, max_bytes=450, concurrency=4)
    order = []
    for chunk in pre:
        for g in chunk.shards:
            assert isinstance(pre.shard(g), _FakeShard)
            order.append(g)
        pre.done(chunk)
    pre.close()
    assert order == list(range(40))
    assert pre.peak_bytes <= 450
    assert len(made) == 40 and all(s.closed for s in made)  # every shard released once read


def _events_of(chunk_units, tags):
    """(events, peak bytes) of a prefetcher over chunks reading ``chunk_units`` (100 bytes a
    unit), tagged ``tags``: ("fetch", unit) and ("read", chunk number, tag) in order."""
    events, lock = [], threading.Lock()

    def fetch(g):
        with lock:
            events.append(("fetch", g))
        return _FakeShard()

    chunks = (Chunk.make(n, np.arange(len(units)), np.array(units), np.zeros(len(units), np.int64), tag=tag)
              for n, (units, tag) in enumerate(zip(chunk_units, tags)))
    pre = Prefetcher(chunks, fetch, lambda g: 100, max_bytes=10_000, concurrency=2)
    for chunk in pre:
        pre.fetched(chunk)
        with lock:
            events.append(("read", chunk.number, chunk.tag))
        pre.done(chunk)
    pre.close()
    return events, pre.peak_bytes


@pytest.mark.parametrize("chunks_per_pass", [1, 3])
def test_a_read_ahead_into_the_next_pass_is_handed_what_the_last_chunk_holds(chunks_per_pass):
    """The units the last chunk of a pass and the first of the next both read are handed on
    (fetched once for both, as between the chunks of one pass): a pass that reads all its
    units in every chunk is fetched once over all its passes, one chunk's units held."""
    units = [[0, 1, 2, 3, 4, 5]] * (3 * chunks_per_pass)
    events, peak = _events_of(units, [n // chunks_per_pass for n in range(3 * chunks_per_pass)])
    assert peak == 600
    assert [e for e in events if e[0] == "fetch"] == [("fetch", g) for g in range(6)]
    assert [e[1] for e in events if e[0] == "read"] == list(range(3 * chunks_per_pass))


@pytest.mark.parametrize("how", ["raised", "held"])
def test_a_fetch_that_failed_is_fetched_again_by_the_next_pass_not_handed_on(how):
    """Within a pass a failed fetch is handed on like any (its chunks all meet the error);
    the next pass of a read ahead fetches it again, as a pass of its own would, and hands
    on the fetch that landed whole."""
    calls, closed = [], []

    class Failed:  # what ShardSource.fetch gives for a shard that fails its checksum
        error = ValueError("fails its checksum")

        def close(self):
            closed.append(self)

    def fetch(g):
        calls.append(g)
        if len(calls) == 1:
            if how == "raised":
                raise OSError("the store went away")
            return Failed()
        return _FakeShard()

    chunks = (Chunk.make(n, np.arange(1), np.array([0]), np.zeros(1, np.int64), tag=tag)
              for n, tag in enumerate([0, 0, 1, 1, 2]))
    pre = Prefetcher(chunks, fetch, lambda g: 100, max_bytes=10_000, concurrency=2)
    got = []
    for chunk in pre:
        try:
            got.append(type(pre.shard(0)).__name__)
        except OSError:
            got.append("OSError")
        pre.done(chunk)
    pre.close()
    first = "OSError" if how == "raised" else "Failed"
    assert got == [first, first, "_FakeShard", "_FakeShard", "_FakeShard"]
    assert calls == [0, 0]  # the failed one, then once for passes 1 and 2
    assert len(closed) == (how == "held") and pre._held == 0  # the failed shard closed once, nothing held


def test_a_read_ahead_into_the_next_pass_holds_no_more_than_was_held_before():
    """Chunks of a later pass than the one being read are fetched within the most bytes held
    so far, into what the pass being read let go: the next pass's units that the last chunk
    does not hold are fetched only once it has been read; those it holds are handed on."""
    events, peak = _events_of([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8], [6, 7, 8, 0, 1, 2]], [0, 1, 2])
    assert peak == 600  # one chunk's units at a time, never a second set beside them
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    fetched = [sorted(e[1] for e in events[a:b] if e[0] == "fetch") for a, b in itertools.pairwise([0, *reads])]
    assert fetched == [[0, 1, 2, 3, 4, 5], [6, 7, 8], [0, 1, 2]]


def test_prefetcher_reads_a_window_larger_than_its_budget():
    def chunks():
        yield Chunk.make(0, np.arange(6), np.arange(6), np.zeros(6, np.int64))
        yield Chunk.make(1, np.arange(6), np.arange(6, 12), np.zeros(6, np.int64))

    pre = Prefetcher(chunks(), lambda g: _FakeShard(), lambda g: 100, max_bytes=150)
    got = []
    for c in pre:
        got += [g for g in c.shards if isinstance(pre.shard(g), _FakeShard)]
        pre.done(c)
    pre.close()
    assert sorted(got) == list(range(12))


def test_prefetch_error_surfaces_in_order():
    def fetch(g):
        if g == 2:
            raise ObjectNotFoundError("no object at shard-2")
        return _FakeShard()

    def chunks():
        for k in range(4):
            yield Chunk.make(k, np.arange(1), np.array([k]), np.zeros(1, np.int64))

    pre = Prefetcher(chunks(), fetch, lambda g: 1)
    got = []
    with pytest.raises(ObjectNotFoundError, match="shard-2"):
        for c in pre:
            got.append(pre.shard(c.shards[0]))
            pre.done(c)
    pre.close()
    assert len(got) == 2


def test_early_break_stops_the_prefetch_thread(ds_url):
    before = set(threading.enumerate())
    ds = StreamingDataset(ds_url, window=2)
    for _ in itertools.islice(ds, 3):
        pass
    import gc

    gc.collect()  # the abandoned pass closes its prefetcher
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("datapipe")]
    for t in started:
        t.join(10)  # the wait is on the threads themselves ending, not on a fixed time
    assert not [t for t in started if t.is_alive()]
    assert threading.active_count() <= len(before) + 1


def test_shuffle_quality_is_reported(ds_url):
    wide = StreamingDataset(ds_url, window=None, seed=0).shuffle_quality(batch_size=32)
    narrow = StreamingDataset(ds_url, window=1, seed=0).shuffle_quality(batch_size=32)
    stored = StreamingDataset(ds_url, shuffle=False).shuffle_quality(batch_size=32)
    assert stored["position_correlation"] > 0.99
    assert narrow["mean_shards_per_batch"] < 2.5 < wide["mean_shards_per_batch"]
    assert abs(wide["position_correlation"]) < 0.3


def test_state_from_a_repacked_dataset_with_the_same_layout(tmp_path):
    a = _write(tmp_path / "a", 60, 20)
    b = _write(tmp_path / "b", 60, 20, prefix="q")  # same counts, other samples
    state = StreamingDataset(a, seed=0).state_dict(0)
    with pytest.raises(StateMismatchError, match="another dataset"):
        StreamingDataset(b, seed=0).load_state_dict(state)


def test_plain_iterator_without_torch(ds_url):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"  # makes `import torch` fail, as if absent
        "from datapipe.loader import StreamingDataset\n"
        f"ds = StreamingDataset({ds_url!r}, window=2)\n"
        "assert type(ds).__mro__[1] is object\n"
        "print(len(sorted(s['cls'] for s in ds)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(N)


def test_cache_with_an_unusable_warm_dir_reads_through(ds_url, tmp_path):
    from datapipe.cache import TieredCache

    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")  # a warm_dir under a regular file can never be created
    cache = TieredCache(hot_bytes=4 << 20, warm_dir=str(blocker / "warm"), warm_bytes=1 << 20)
    with pytest.warns(RuntimeWarning, match="unusable"):
        assert not cache.has_warm_tier()
    ds = StreamingDataset(ds_url, cache=cache, window=3, seed=1)
    assert sorted(_ids(list(ds))) == list(range(N))
    assert cache.stats()["cold_reads"] >= len(ds.source.indexes[0].shards)
    good = TieredCache(warm_dir=str(tmp_path / "warm"), warm_bytes=1 << 20)
    assert good.has_warm_tier()


def test_a_failed_read_of_a_pinned_copy_releases_the_pin(ds_url, tmp_path, monkeypatch):
    from datapipe.cache import TieredCache
    from datapipe.errors import StorageError
    from datapipe.loader import source

    def no_memory(path, limit, pool):
        raise OSError(12, "Cannot allocate memory", path)

    monkeypatch.setattr(source, "_read_into", no_memory)  # the fault: no memory for the copy (ENOMEM)
    cache = TieredCache(warm_dir=str(tmp_path / "warm"), warm_bytes=4 << 20)
    with pytest.raises(StorageError, match=r"cannot read the warm copy of .*shard"):
        list(StreamingDataset(ds_url, cache=cache, window=3, seed=1))
    assert cache.stats()["pinned"] == 0


def test_a_warm_copy_is_read_into_private_memory_and_unpinned_at_once(ds_url, tmp_path):
    from datapipe.cache import TieredCache

    cache = TieredCache(warm_dir=str(tmp_path / "warm"), warm_bytes=4 << 20)
    ds = StreamingDataset(ds_url, cache=cache)
    data = ds.source.fetch(0, cache)
    assert data.verified and cache.stats()["pinned"] == 0  # the copy needs no pin
    assert not isinstance(data.src, bytes) and len(data.src) == ds.source.shard_bytes(0)
    data.close()


def test_shard_data_close_is_once_and_returns_when_closed(ds_url):
    """The prefetcher's consumer and a fetch task may both close one shard: its buffer goes
    back to the pool once (twice would hand one buffer to two shards), and neither close()
    returns before that is done."""
    ds = StreamingDataset(ds_url)
    pool = ds.source.buffers
    data = ds.source.fetch(0)
    buf = data.src
    entered, go, calls = threading.Event(), threading.Event(), []
    give_back = data._closer

    def slow_release():  # the first closer is slow to give the buffer back
        calls.append(1)
        entered.set()
        go.wait(10)
        give_back()

    data._closer = slow_release
    first = threading.Thread(target=data.close)
    first.start()
    assert entered.wait(10)
    seen = []
    second = threading.Thread(target=lambda: (data.close(), seen.append([b is buf for b in pool._idle].count(True))))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # a second close() waits for the first, it does not return at once
    go.set()
    first.join(10)
    second.join(10)
    data.close()  # and a later one does nothing
    assert seen == [1] and calls == [1] and [b is buf for b in pool._idle].count(True) == 1
    assert data.src == b""  # a closed shard no longer reaches the buffer another shard gets


def test_prefetcher_close_names_a_fetch_that_does_not_stop():
    started, gate, made = threading.Event(), threading.Event(), {}

    def fetch(g):
        made[g] = _FakeShard()
        if g == 1:
            started.set()
            gate.wait(30)  # a fetch stuck on a store that does not answer
        return made[g]

    def chunks():
        for k in range(2):
            yield Chunk.make(k, np.arange(1), np.array([k]), np.zeros(1, np.int64))

    pre = Prefetcher(chunks(), fetch, lambda g: 1, close_timeout_s=0.2)
    first = next(iter(pre))
    pre.shard(first.shards[0])
    assert started.wait(10)
    with pytest.warns(RuntimeWarning, match=r"did not stop within 0.2 s.*shard 1"):
        pre.close()
    gate.set()
    pre._thread.join(10)
    assert not pre._thread.is_alive()
    assert made[0].closed


@pytest.mark.parametrize("where", ["fetch", "planner"])
def test_close_on_the_prefetchers_own_thread_does_not_wait_on_itself(where):
    """Garbage collection runs finalizers on whatever thread allocates: a read-ahead's
    closer can run on one of the prefetcher's own threads. It must not join the planner
    from there (the planner waits for its fetch threads; joining the current thread
    raises), and the shards held are still closed once the planner ends."""
    made, calls, errors, gate = {}, [], [], threading.Event()
    pre_box: list[Prefetcher] = []

    def close_here():
        assert gate.wait(30)  # once the consumer holds chunk 0
        calls.append(threading.current_thread().name)
        try:
            pre_box[0].close()
        except BaseException as e:  # what the finalizer would have printed as unraisable
            errors.append(e)

    def fetch(g):
        made[g] = _FakeShard()
        if where == "fetch" and g == 2:
            close_here()
        return made[g]

    def size(g):
        if where == "planner" and g == 2:
            close_here()
        return 1

    def chunks():
        for k in range(6):
            yield Chunk.make(k, np.arange(1), np.array([k]), np.zeros(1, np.int64))

    pre = Prefetcher(chunks(), fetch, size, close_timeout_s=60)
    pre_box.append(pre)
    assert next(iter(pre)).number == 0  # (not read: the planner case holds the loop that lands fetches)
    gate.set()
    # a close waiting on itself would hold the planner for the 60 s close timeout
    pre._thread.join(30)
    assert calls and not errors and not pre._thread.is_alive()
    assert made and all(s.closed for s in made.values())


def test_a_fetch_cut_off_by_close_has_its_shard_closed_when_it_lands():
    """A shard fetched through a cache holds a pin: one whose fetch was still running at
    close() must be closed when the fetch returns, not dropped with its pin held."""
    started, gate, made = threading.Event(), threading.Event(), {}

    def fetch(g):
        made[g] = _FakeShard()
        if g == 1:
            started.set()
            gate.wait(30)
        return made[g]

    def chunks():
        for k in range(6):
            yield Chunk.make(k, np.arange(1), np.array([k]), np.zeros(1, np.int64))

    # a short queue: the planner is blocked handing out a chunk when close() stops it
    pre = Prefetcher(chunks(), fetch, lambda g: 1, lookahead_chunks=1, close_timeout_s=0.2)
    first = next(iter(pre))
    pre.shard(first.shards[0])
    assert started.wait(10)
    with pytest.warns(RuntimeWarning, match="shard 1"):
        pre.close()
    gate.set()
    pre._thread.join(10)
    assert not pre._thread.is_alive()
    assert made[0].closed and made[1].closed


def test_a_fetch_after_interpreter_shutdown_began_is_an_error_in_its_slot(monkeypatch, caplog):
    """At interpreter exit concurrent.futures refuses new work before atexit hooks run: a
    read-ahead still planning then gets that error in the shard's place, not a "Task
    exception was never retrieved" log line per shard at exit."""
    import concurrent.futures.thread as cft
    import gc
    import logging

    monkeypatch.setattr(cft, "_shutdown", True)  # what Python's exit sets first

    def chunks():
        for k in range(3):
            yield Chunk.make(k, np.arange(1), np.array([k]), np.zeros(1, np.int64))

    pre = Prefetcher(chunks(), lambda g: _FakeShard(), lambda g: 1)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(RuntimeError, match="interpreter shutdown"):
            for c in pre:
                pre.shard(c.shards[0])
        pre.close()
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
