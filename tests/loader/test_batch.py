"""Columnar batches: the batched StreamingDataset mode and the StreamingDataLoader's
shared-memory ring through real DataLoader worker processes.

Every mode must deliver exactly the per-sample stream (same samples, same order, same
bytes), resume exactly, and never show bytes that changed under a batch still held."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe import ShardWriter
from datapipe.loader import StreamingDataLoader, StreamingDataset
from datapipe.loader.batch import Batch, Column
from datapipe.loader.batch import distinct as _distinct

N = 300


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * (i % 97 + 1) + i.to_bytes(4, "little")


def _write(path, n=N, compression=None, mixed=False):
    with ShardWriter(str(path), max_samples=37, compression=compression) as w:
        for i in range(n):
            s = {"__key__": f"s{i:04d}", "jpg": _payload(i), "cls": str(i).encode()}
            if not mixed or i % 3:
                s["json"] = b'{"i": %d}' % i
            w.write(s)
    return str(path)


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    return {"laid": _write(root / "laid"), "mixed": _write(root / "mixed", mixed=True),
            "zstd": _write(root / "zstd", compression="zstd")}


def _stream(url, **kw):
    return [dict(s) for s in StreamingDataset(url, decode=None, **kw)]


def _flatten(batches):
    out = []
    for b in batches:
        assert isinstance(b, Batch)
        for s in b.samples():
            out.append({k: (v if k == "__key__" or v is None else bytes(v)) for k, v in s.items()})
    return out


@pytest.mark.parametrize("kind", ["laid", "mixed", "zstd"])
def test_batched_mode_is_the_sample_stream_cut_into_batches(urls, kind):
    kw = dict(window=3, seed=4, batch_size=16, chunk_samples=40)
    want = _stream(urls[kind], **kw)
    batches = list(StreamingDataset(urls[kind], decode=None, batched=True, **kw))
    assert [len(b) for b in batches[:-1]] == [16] * (len(batches) - 1) and 0 < len(batches[-1]) <= 16
    got = _flatten(batches)
    # the mixed shards' samples differ in fields: a batch holds the fields its samples share
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if v is not None} == w


def test_batched_columns_view_the_shard_buffers_until_dropped(urls):
    ds = StreamingDataset(urls["laid"], decode=None, batched=True, batch_size=32, window=2, seed=1)
    batches = list(ds)  # every batch held: no buffer they view may be refilled
    ref = {s["__key__"]: s for s in _stream(urls["laid"], window=2, seed=1)}
    ds.set_epoch(1)
    for _ in ds:  # another epoch reads into other buffers, never into viewed ones
        pass
    for b in batches:
        col = b["jpg"]
        assert isinstance(col, Column) and isinstance(col[0], memoryview)
        for key, value in zip(b["__key__"], col):
            assert value == ref[key]["jpg"]


def test_column_api(urls):
    b = next(iter(StreamingDataset(urls["laid"], decode=None, batched=True, batch_size=8, window=2, seed=3)))
    ref = {s["__key__"]: s for s in _stream(urls["laid"], window=2, seed=3)}
    col = b["jpg"]
    want = [ref[k]["jpg"] for k in b["__key__"]]
    assert len(col) == 8 and col.tolist() == want and bytes(col[-1]) == want[-1]
    assert col[2:5].tolist() == want[2:5]
    with pytest.raises(IndexError):
        col[8]
    data, offsets = col.as_tensor()
    assert data.dtype == torch.uint8 and offsets.tolist()[-1] == sum(map(len, want))
    assert [bytes(data[offsets[i]:offsets[i + 1]].numpy()) for i in range(8)] == want
    # pickled as the samples' bytes, not the shard buffers they view
    assert len(pickle.dumps(col)) < sum(map(len, want)) + 1000
    assert pickle.loads(pickle.dumps(col)).tolist() == want
    assert "jpg" in b and set(b.keys()) == {"__key__", "jpg", "cls", "json"} and len(b) == 8


@given(which=st.lists(st.integers(0, 40), max_size=300), extra=st.integers(0, 5))
def test_distinct_buffers_of_a_batch_match_numpy_unique(which, extra):
    w = np.array(which, dtype=np.intp)
    used, place = _distinct(w, max(which, default=-1) + 1 + extra)
    want_used, want_place = np.unique(w, return_inverse=True)
    assert used == want_used.tolist() and place.tolist() == want_place.reshape(-1).tolist()


@settings(deadline=None, max_examples=60)
@given(sizes=st.lists(st.integers(1, 3 << 13), min_size=1, max_size=4), data=st.data())
def test_gather_into_copies_each_sample_in_order(sizes, data):
    # samples of a few bytes to many KiB: both ways of gathering (joined, or one slice
    # assignment each) must give the samples one after the other, from one or many buffers
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    n = data.draw(st.integers(0, 40))
    which = rng.integers(0, len(buffers), n)
    starts = np.array([rng.integers(0, sizes[w]) for w in which], dtype=np.int64)
    ends = np.array([rng.integers(a, sizes[w] + 1) for a, w in zip(starts, which)], dtype=np.int64)
    col = Column(buffers, starts, ends, which)
    want = b"".join(bytes(buffers[w][a:b]) for w, a, b in zip(which, starts, ends))
    out = bytearray(len(want) + 7)
    offsets = col.gather_into(memoryview(out))
    assert bytes(out[: len(want)]) == want and offsets[-1] == len(want)
    assert offsets.tolist() == [0, *np.cumsum(ends - starts).tolist()]
    assert col.contiguous()[0].tobytes() == want


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 3), batch=st.integers(1, 23), window=st.integers(1, 9), seed=st.integers(0, 5),
       stop=st.integers(0, 12), chunk=st.integers(1, 90))
def test_batched_mode_partitions_exactly_and_resumes_exactly(urls, world, batch, window, seed, stop, chunk):
    url = urls["laid"]
    seen = []
    for rank in range(world):
        kw = dict(window=window, seed=seed, batch_size=batch, rank=rank, world_size=world, drop_last=True,
                  chunk_samples=chunk)
        full = [k for b in StreamingDataset(url, decode=None, batched=True, **kw) for k in b["__key__"]]
        assert full == [s["__key__"] for s in _stream(url, **kw)]
        ds = StreamingDataset(url, decode=None, batched=True, **kw)
        it = iter(ds)
        head = []
        for _ in range(stop):
            b = next(it, None)
            if b is None:
                break
            head += b["__key__"]
        state = ds.state_dict()
        del it
        again = StreamingDataset(url, decode=None, batched=True, **kw)
        again.load_state_dict(state)
        assert head + [k for b in again for k in b["__key__"]] == full
        seen += full
    assert len(seen) == len(set(seen)) == N - N % world


# -- through DataLoader worker processes ---------------------------------------------------

def _keys(loader):
    return [k for b in loader for k in b["__key__"]]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_deliver_the_stream_through_the_ring(urls, context):
    url = urls["laid"]
    ref = _stream(url, window=3, seed=6, batch_size=16)
    ds = StreamingDataset(url, window=3, seed=6, decode=None)
    loader = StreamingDataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context=context)
    got = []
    for b in loader:
        assert isinstance(b, Batch) and isinstance(b["jpg"][0], memoryview)
        got += _flatten([b])
    assert got == ref
    assert loader.ring is not None and loader.ring.opened == len(loader) and loader.ring.fallbacks == 0


def test_ring_batches_held_past_the_ring_stay_intact(urls):
    url = urls["laid"]
    ref = {s["__key__"]: s for s in _stream(url, window=3, seed=2)}
    ds = StreamingDataset(url, window=3, seed=2, decode=None)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    held = list(loader)  # 38 batches; each worker has prefetch_factor + 2 = 4 slots
    assert loader.ring.fallbacks > 0 and loader.ring.opened == 8  # the rest came pickled
    ds.set_epoch(1)
    for _ in loader:  # slots that are still viewed are never written again
        pass
    n = 0
    for b in held:
        for key, jpg, cls in zip(b["__key__"], b["jpg"], b["cls"]):
            assert jpg == ref[key]["jpg"] and cls == ref[key]["cls"]
            n += 1
    assert n == N
    del held, b, jpg, cls
    gc.collect()
    ds.set_epoch(2)
    before = loader.ring.fallbacks
    assert len(_keys(loader)) == N and loader.ring.fallbacks == before  # released slots came back


def test_a_pass_cut_short_gives_its_slots_back(urls):
    ds = StreamingDataset(urls["laid"], window=3, seed=2, decode=None)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    for epoch in range(4):  # in-flight batches of a pass broken off are dropped unopened
        ds.set_epoch(epoch)
        for k, _ in enumerate(loader):
            if k == 2:
                break
    ds.set_epoch(9)
    assert len(_keys(loader)) == N and loader.ring.fallbacks == 0


def _to_example(sample):
    i = int(bytes(sample["cls"]))
    return torch.full((3, 4), i, dtype=torch.int32), i, sample["__key__"]


def test_tensors_from_map_travel_through_the_ring(urls):
    url = urls["laid"]
    ds = StreamingDataset(url, window=2, seed=8, decode=None, map=_to_example)
    loader = StreamingDataLoader(ds, batch_size=10, num_workers=2)
    seen = []
    for x, y, keys in loader:
        assert x.shape[1:] == (3, 4) and x.dtype == torch.int32 and y.dtype == torch.int64
        assert torch.equal(x[:, 0, 0].long(), y) and [f"s{int(i):04d}" for i in y] == keys
        seen += keys
    assert loader.ring.opened == len(loader)
    assert seen == [s["__key__"] for s in _stream(url, window=2, seed=8, batch_size=10)]


def test_skips_in_workers_are_counted_in_columnar_batches(tmp_path):
    url = _write(tmp_path / "ds", n=120)
    import os

    from datapipe import open_index

    ix = open_index(url)
    info, rows = ix.shards[1], ix.shard_samples(1)
    path = os.path.join(url, info.name)
    with open(path, "r+b") as f:  # damage one sample's payload: its shard fails, that sample is named
        f.seek(int(rows.offsets[3]) + 600)
        f.write(b"\xff")
    ds = StreamingDataset(url, window=2, seed=1, decode=None, on_error="skip")
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    with pytest.warns(RuntimeWarning, match="skipped 1 unreadable"):
        keys = _keys(loader)
    assert len(keys) == 119 and rows.keys[3] not in keys
    assert [k for _, k, _ in loader.skipped] == [rows.keys[3]]
    assert loader.samples_seen == 120


def test_drop_last_and_len(urls):
    ds = StreamingDataset(urls["laid"], window=2, seed=1, decode=None)
    loader = StreamingDataLoader(ds, batch_size=64, num_workers=1, drop_last=True)
    sizes = [len(b) for b in loader]
    assert sizes == [64] * (N // 64) and len(loader) == N // 64
    assert len(StreamingDataLoader(ds, batch_size=64)) == -(-N // 64)


def test_non_persistent_workers_and_no_workers_give_the_same_stream(urls):
    url = urls["mixed"]
    ref = [s["__key__"] for s in StreamingDataset(url, window=2, seed=5, decode=None, batch_size=8)]
    for kw in ({"num_workers": 0}, {"num_workers": 2, "persistent_workers": False}):
        ds = StreamingDataset(url, window=2, seed=5, decode=None)
        assert _keys(StreamingDataLoader(ds, batch_size=8, **kw)) == ref


def test_a_user_collate_fn_gets_samples(urls):
    ds = StreamingDataset(urls["laid"], window=2, seed=5, decode=None)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2, collate_fn=lambda xs: [x["__key__"] for x in xs])
    assert not loader.columnar and loader.ring is None
    keys = [k for b in loader for k in b]
    assert sorted(keys) == sorted(f"s{i:04d}" for i in range(N))


def test_a_batch_views_its_slot_without_a_copy(urls):
    ds = StreamingDataset(urls["laid"], window=2, seed=5, decode=None)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=1)
    b = next(iter(loader))
    col = b["jpg"]
    data, _ = col.contiguous()
    assert len(col.buffers) == 1 and np.shares_memory(data, col.buffers[0])  # no gather needed
    t, _ = col.as_tensor()
    assert t.data_ptr() == data.ctypes.data


def _decode_cls(sample):
    if int(bytes(sample["cls"])) % 50 == 7:
        raise ValueError("unlucky sample")
    return {"__key__": sample["__key__"], "n": int(bytes(sample["cls"])), "jpg": bytes(sample["jpg"])}


@pytest.mark.parametrize("batched", [False, True])
def test_map_threads_keep_the_order_the_skips_and_the_resume_point(urls, batched):
    kw = dict(window=3, seed=1, decode=None, map=_decode_cls, on_error="skip", batch_size=8, chunk_samples=50,
              batched=batched)

    def keys(ds):
        out = []
        with pytest.warns(RuntimeWarning, match="skipped"):
            for x in ds:
                out += x["__key__"] if batched else [x["__key__"]]
        return out

    want = keys(StreamingDataset(urls["laid"], **kw))
    assert len(want) == N - 6
    assert keys(StreamingDataset(urls["laid"], map_threads=3, **kw)) == want
    ds = StreamingDataset(urls["laid"], map_threads=2, **kw)
    it = iter(ds)
    head = []
    for _ in range(20):
        x = next(it)
        head += x["__key__"] if batched else [x["__key__"]]
    state = ds.state_dict()
    del it
    again = StreamingDataset(urls["laid"], map_threads=2, **kw)
    again.load_state_dict(state)
    assert head + keys(again) == want


def test_pin_memory_without_an_accelerator_still_delivers(urls):
    ds = StreamingDataset(urls["laid"], window=2, seed=5, decode=None)
    loader = StreamingDataLoader(ds, batch_size=16, num_workers=1, pin_memory=True)
    with pytest.warns(UserWarning, match="pin"):  # torch: no accelerator, nothing pinned
        assert len(_keys(loader)) == N


def test_chunks_over_shards_far_apart_read_the_right_samples(tmp_path):
    """A global shuffle over many small shards: a chunk's shards lie far apart (the search
    path of the chunk's shard lookup)."""
    url = str(tmp_path / "many")
    with ShardWriter(url, max_samples=2) as w:
        for i in range(400):
            w.write({"__key__": f"k{i:04d}", "bin": _payload(i)})
    for batched in (False, True):
        ds = StreamingDataset(url, window=None, seed=3, decode=None, batch_size=2, chunk_samples=2,
                              batched=batched)
        got = _flatten(ds) if batched else [dict(s) for s in ds]
        assert sorted(s["__key__"] for s in got) == [f"k{i:04d}" for i in range(400)]
        assert all(s["bin"] == _payload(int(s["__key__"][1:])) for s in got)


def test_a_batch_of_skipped_samples_is_not_yielded_in_one_process(tmp_path):
    def fail_some(sample):
        if int(bytes(sample["cls"])) < 16:
            raise ValueError("unlucky")
        return sample

    url = _write(tmp_path / "ds", n=64)
    ds = StreamingDataset(url, shuffle=False, decode=None, map=fail_some, on_error="skip", batch_size=8, batched=True)
    with pytest.warns(RuntimeWarning, match="skipped 16"):
        batches = list(ds)
    assert [len(b) for b in batches] == [8] * 6 and all("__key__" in b for b in batches)


def test_passes_of_workers_that_are_not_persistent_open_every_batch(tmp_path):
    # a worker that is not persistent may exit (told by torch once it reads the worker's
    # end-of-pass marker) before its last batch, kept back to be handed out in order, is
    # opened: the batch's slot must not depend on the worker still being there
    with ShardWriter(str(tmp_path / "d"), max_samples=7) as w:
        for i in range(27):
            w.write({"__key__": f"k{i:03d}", "cls": str(i).encode()})
    for _ in range(8):
        loader = StreamingDataLoader(StreamingDataset(str(tmp_path / "d"), decode=None), batch_size=10,
                                     num_workers=2, persistent_workers=False)
        assert sorted(k for b in loader for k in b["__key__"]) == [f"k{i:03d}" for i in range(27)]


def _collect():
    gc.collect()


def test_a_forked_child_collecting_a_dropped_batch_leaves_the_slot_to_the_parent(tmp_path):
    import multiprocessing

    with ShardWriter(str(tmp_path / "d"), max_samples=20) as w:
        for i in range(400):
            w.write({"__key__": f"k{i:04d}", "jpg": bytes([i % 256]) * 64})
    ref = {f"k{i:04d}": bytes([i % 256]) * 64 for i in range(400)}
    loader = StreamingDataLoader(StreamingDataset(str(tmp_path / "d"), decode=None, shuffle=False), batch_size=4,
                                 num_workers=1, prefetch_factor=1)  # one persistent worker, 3 slots
    gc.disable()  # collected by hand, as training loops often do
    try:
        it = iter(loader)
        b = next(it)
        cycle = [b]
        cycle.append(cycle)
        del b, cycle  # garbage in a cycle, not collected yet
        held = [next(it)]
        child = multiprocessing.get_context("fork").Process(target=_collect)  # collects its copy of it
        child.start()
        child.join()
        held += [next(it) for _ in range(6)]
        gc.collect()  # the parent's own collection frees that slot, once
        held += [next(it) for _ in range(20)]
        changed = [k for b in held for k, v in zip(b["__key__"], b["jpg"]) if bytes(v) != ref[k]]
        assert changed == []
        del it
    finally:
        gc.enable()


def test_no_batching_through_workers_keeps_the_stream_order_and_resumes_exactly(tmp_path):
    with ShardWriter(str(tmp_path / "d"), max_samples=10) as w:
        for i in range(40):
            w.write({"__key__": f"k{i:03d}", "cls": str(i).encode()})
    url = str(tmp_path / "d")
    stream = [s["__key__"] for s in StreamingDataset(url, decode=None, shuffle=False)]
    # a dataset that was batched before: the loader without batching takes it one sample at a time
    loader = StreamingDataLoader(StreamingDataset(url, decode=None, shuffle=False, batch_size=4),
                                 batch_size=None, num_workers=2)
    assert [s["__key__"] for s in loader] == stream
    it = iter(loader)
    head = [next(it)["__key__"] for _ in range(6)]
    state = loader.state_dict()
    it.close()
    again = StreamingDataLoader(StreamingDataset(url, decode=None, shuffle=False, batch_size=4),
                                batch_size=None, num_workers=2)
    again.load_state_dict(state)
    assert head + [s["__key__"] for s in again] == stream


@pytest.mark.parametrize("kind", ["laid", "zstd"])
def test_positions_are_tensors_however_the_shards_are_stored(urls, kind):
    for workers in (0, 2):
        loader = StreamingDataLoader(StreamingDataset(urls[kind], decode=None, return_position=True),
                                     batch_size=8, num_workers=workers)
        b = next(iter(loader))
        assert isinstance(b["__shard__"], torch.Tensor) and isinstance(b["__sample__"], torch.Tensor)
        assert b["__sample__"].dtype == torch.int64 and len(b["__sample__"]) == 8
    b = next(iter(StreamingDataset(urls[kind], decode=None, return_position=True, batched=True, batch_size=8)))
    assert isinstance(b["__sample__"], torch.Tensor) and b["__shard__"].dtype == torch.int64
