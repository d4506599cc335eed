"""The laid-out reader and the pooled shard buffers: same items, counts, errors as the strict
sample-by-sample reader; the fast structural check agrees with the strict tar parser."""

from __future__ import annotations

import os
import pickle

import pytest

from datapipe import ShardWriter, open_index
from datapipe.errors import ChecksumError, CorruptShardError, DecodeError
from datapipe.loader import StreamingDataset
from datapipe.loader.readers import CheckedSampleReader, LaidOutShardReader, reader_for
from datapipe.loader.source import BufferPool

N = 300


def _write(path, bad=()):
    with ShardWriter(str(path), max_samples=23) as w:
        for i in range(N):
            meta = b"{not json" if i in bad else {"i": i}
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "json": meta, "bin": bytes([i % 256]) * (i % 90 + 1)})
    return str(path)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("laid") / "ds")


def _per_sample(ds):
    ds.source.find_layouts = False  # no layouts: every sample is checked and parsed on its own
    return ds


def _reader_kind(ds, g=0):
    data = ds.source.fetch(g)
    try:
        return type(reader_for(data))
    finally:
        data.close()


@pytest.mark.parametrize("decode", ["raw", "auto"])
def test_laid_out_reader_equals_the_checked_sample_reader(url, decode):
    kw = dict(window=3, seed=5, decode=decode, return_position=True, batch_size=8, chunk_samples=40)
    fast, slow = StreamingDataset(url, **kw), _per_sample(StreamingDataset(url, **kw))
    for epoch in range(2):
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        got, expected = list(fast), list(slow)
        assert got == expected and len(got) == N
        assert [type(v) for v in got[0].values()] == [type(v) for v in expected[0].values()]
    assert len(fast.source.layouts) and not len(slow.source.layouts)
    assert _reader_kind(fast) is LaidOutShardReader and _reader_kind(slow) is CheckedSampleReader


def _pick(sample):  # a map that builds a new sample: positions are added after it
    return {"cls": sample["cls"], "n": len(sample)}


@pytest.mark.parametrize("decode", [None, "auto"])
def test_positions_go_in_after_the_map_on_both_paths(url, decode):
    kw = dict(window=2, seed=3, decode=decode, map=_pick, return_position=True, batch_size=4)
    fast, slow = StreamingDataset(url, **kw), _per_sample(StreamingDataset(url, **kw))
    got, expected = list(fast), list(slow)
    assert got == expected and got[0]["n"] == 4 and "__shard__" in got[0]


def test_resume_state_counts_every_item_of_a_laid_chunk(url):
    ds = StreamingDataset(url, window=2, seed=1, batch_size=4, chunk_samples=64)
    full = [s["__key__"] for s in ds]
    ds2 = StreamingDataset(url, window=2, seed=1, batch_size=4, chunk_samples=64)
    it = iter(ds2)
    head = [next(it)["__key__"] for _ in range(101)]  # stops inside a chunk
    state = ds2.state_dict()
    it.close()
    ds3 = StreamingDataset(url, window=2, seed=1, batch_size=4, chunk_samples=64)
    ds3.load_state_dict(state)
    assert head + [s["__key__"] for s in ds3] == full


def test_decode_error_in_a_laid_chunk_names_shard_and_sample(tmp_path):
    url = _write(tmp_path / "bad", bad=(7, 150))
    with pytest.raises(DecodeError, match=r"s0007|s0150") as e:
        list(StreamingDataset(url, window=4, seed=2, decode="auto"))
    assert ".tar" in str(e.value)
    kw = dict(window=4, seed=2, on_error="skip", batch_size=5, decode="auto")
    with pytest.warns(RuntimeWarning, match="skipped 2 unreadable"):
        fast = StreamingDataset(url, **kw)
        got = list(fast)
    with pytest.warns(RuntimeWarning, match="skipped 2 unreadable"):
        slow = _per_sample(StreamingDataset(url, **kw))
        expected = list(slow)
    assert got == expected and len(got) == N - 2
    assert sorted(k for _, k, _ in fast.skipped) == ["s0007", "s0150"]
    assert fast.skipped == slow.skipped


def _drop_read_ahead(ds):
    """Stop the prefetch a finished pass left running into the next one (its shards go
    back to the pool); an object's first pass in a process leaves none."""
    ahead = ds._ahead
    first = ds._passes.count == 1
    assert (ahead is None) == first  # a finished pass in the main process reads ahead, but the first
    if first:
        return
    ahead.closer.cancel()
    ahead.pre.close()
    ds._ahead = None


def test_a_shard_changed_on_disk_in_place_is_checked_again(url, tmp_path):
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(url, copy)
    ds = StreamingDataset(copy, window=2, seed=0)
    assert len(list(ds)) == N
    _drop_read_ahead(ds)
    idle = list(ds.source.buffers._idle)
    assert idle  # closed shards gave their buffers back
    assert len(list(ds)) == N
    _drop_read_ahead(ds)
    # reused in the next pass, within the budget
    assert any(any(b is i for i in idle) for b in ds.source.buffers._idle)
    assert ds.source.buffers._held <= ds.prefetch_bytes
    ix = open_index(copy)
    info, table = ix.shards[3], ix.shard_samples(3)
    with open(os.path.join(copy, info.name), "r+b") as f:  # flip a byte in place: same inode
        f.seek(int(table.offsets[4]) + 600)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises((ChecksumError, CorruptShardError)) as e:
        list(ds)
    assert info.name in str(e.value) and table.keys[4] in str(e.value)


def test_dataset_with_pooled_buffers_pickles(url):
    ds = StreamingDataset(url, window=2)
    expected = list(ds)
    assert ds._ahead is None  # a first pass reads nothing ahead
    assert list(ds) == expected
    assert ds._ahead is not None  # the second reads the next pass's first shards
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._ahead is None and clone._passes.count == 0  # a copy runs its own prefetch, its first pass
    _drop_read_ahead(ds)
    assert ds.source.buffers._idle
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone.source.buffers._idle
    assert list(clone) == expected


def test_buffer_pool_stays_inside_its_budget_and_never_refills_a_viewed_buffer():
    pool = BufferPool(12000)  # buffers in use and idle together
    a, b, c = pool.take(5000), pool.take(4000), pool.take(3000)
    for i, buf in enumerate((a, b, c)):
        buf[:] = bytes([i + 1]) * len(buf)
        pool.give(buf)
    assert pool._held == 12000 and len(pool._idle) == 3
    got = pool.take(2900)  # the closest in size is reused, resized to exactly the size asked
    assert got is c and len(got) == 2900 and got[:2] == b"\3\3"
    big = pool.take(9000)  # grown past what it held: readable and writable to the end
    assert big is a and len(big) == 9000
    big[8999] = 7
    assert big[8999] == 7
    pool.give(big)  # 2900 in use + 4000 idle + 9000 > 12000: unmapped, not kept
    assert big.closed and pool._held == 4000 and pool._idle == [b]
    view = memoryview(b)[10:20]  # someone still views it: it is not refilled while viewed
    fresh = pool.take(4000)
    assert fresh is not b and pool._idle == [b] and pool._held == 4000
    assert bytes(view) == b"\2" * 10
    view.release()
    assert pool.take(4000) is b and not pool._idle and pool._held == 0  # reused once nothing views it
    small = BufferPool(100)
    small.give(pool.take(1000))  # larger than the whole budget: not kept
    assert not small._idle and small._held == 0


def _shard(tmp_path, samples):
    with ShardWriter(str(tmp_path / "w"), max_samples=len(samples)) as w:
        for s in samples:
            w.write(s)
    ix = open_index(str(tmp_path / "w"))
    t = ix.shard_samples(0)
    data = bytearray(open(os.path.join(str(tmp_path / "w"), ix.shards[0].name), "rb").read())
    offs = [int(o) for o in t.offsets]
    ends = [int(o + n) for o, n in zip(t.offsets, t.lengths)]
    return data, offs, ends, list(t.keys)


@pytest.mark.parametrize("case", ["uniform", "key_lengths", "dotted_fields", "mixed", "one", "bad_size",
                                  "bad_name", "long_name"])
def test_fast_layout_agrees_with_the_strict_parse(tmp_path, case):
    import numpy as np

    from datapipe.format.layout import MemberTable, ShardLayout, fast_layout, find_layout, shard_members

    samples = []
    for i in range(1 if case == "one" else 30):
        key = f"d/{'x' * (i % 7) if case == 'key_lengths' else ''}{i:03d}"
        if case == "long_name":
            key = "k" * (90 + i)  # past 100 bytes from the 6th sample on: PAX headers
        s = {"__key__": key, "txt": f"t{i}", "bin": bytes([i]) * (i * 131 % 1500)}
        if case == "dotted_fields":
            s["seg.png"] = b"p" * i
        if case == "mixed" and i % 4 == 1:
            s["extra.json"] = {"i": i}
        samples.append(s)
    data, offs, ends, keys = _shard(tmp_path, samples)
    if case == "bad_size":  # a size field that int(..., 8) reads but is not 11 octal digits
        data[offs[5] + 124 : offs[5] + 135] = data[offs[5] + 124 : offs[5] + 135].replace(b"0", b" ", 1)
    if case == "bad_name":
        data[offs[7] + 2] ^= 0x01
    src = bytes(data)

    def strict():
        try:
            return shard_members(src, offs, ends, keys, "shard")
        except CorruptShardError as e:
            return e

    each = strict()
    fast = fast_layout(src, offs, ends, keys)
    if fast is not None:  # whatever the fast check accepts, the strict parse lays out the same way
        assert isinstance(each, ShardLayout) and fast.fields == each.fields and np.array_equal(fast.table, each.table)
    if isinstance(each, CorruptShardError):
        with pytest.raises(CorruptShardError):
            find_layout(src, offs, ends, keys, "shard")
    else:
        got = find_layout(src, offs, ends, keys, "shard")
        assert type(got) is type(each)
        if isinstance(got, ShardLayout):
            assert got.fields == each.fields and np.array_equal(got.table, each.table)
    accepted = {"uniform", "key_lengths", "dotted_fields", "one"}
    assert (fast is not None) == (case in accepted)
    if case == "mixed":
        assert isinstance(each, MemberTable)
    if case == "long_name":  # PAX headers: not the fast check's, laid out by the strict parse
        assert isinstance(each, ShardLayout) and each.samples == 30
    if case in ("bad_size", "bad_name"):  # a header that fails its checksum, a name of another key
        assert isinstance(each, CorruptShardError)
