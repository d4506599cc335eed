"""A shard of BESIDE_BYTES or more has its sample table read on a thread of its own while
its bytes are read (``ShardSource.fetch``). The two halves must meet exactly as they did
one after the other: every sample once and byte-exact, a damaged table or shard a named
error, and no thread of a failed fetch left running."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

import datapipe
from datapipe.errors import DatapipeError
from datapipe.loader import StreamingDataLoader, StreamingDataset
from datapipe.loader.source import BESIDE_BYTES

SAMPLE = 1 << 20


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SAMPLE, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("large") / "ds")
    per = BESIDE_BYTES // SAMPLE + 2  # each shard just over the threshold
    with datapipe.ShardWriter(dest, max_samples=per) as w:
        for i in range(2 * per + 3):
            w.write({"__key__": f"s{i:04d}", "bin": _payload(i), "cls": str(i % 7)})
    index = datapipe.open_dataset(dest).index
    assert index.num_shards == 3 and int(index.shard_sizes[:2].min()) >= BESIDE_BYTES
    return dest, 2 * per + 3


def _table_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "datapipe-table"]


def _check(samples, n):
    keys = [s["__key__"] for s in samples]
    assert sorted(keys) == [f"s{i:04d}" for i in range(n)]
    for s in samples:
        i = int(s["__key__"][1:])
        assert bytes(s["bin"]) == _payload(i) and bytes(s["cls"]) == str(i % 7).encode()


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_of_large_shards_once_and_exact(large, shuffle):
    dest, n = large
    ds = StreamingDataset(dest, shuffle=shuffle, decode=None, seed=3)
    for epoch in range(2):  # the second epoch fetches again (layouts and checksums remembered)
        ds.set_epoch(epoch)
        _check([dict(s) for s in ds], n)
    assert not _table_threads()


def test_large_shards_through_dataloader_workers(large):
    dest, n = large
    ds = StreamingDataset(dest, decode=None, seed=5)
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b)
    _check([s for batch in loader for s in batch], n)


def test_a_damaged_sample_table_of_a_large_shard_is_a_named_error(large, tmp_path):
    dest, _ = large
    bad = str(tmp_path / "bad")
    shutil.copytree(dest, bad)
    path = f"{bad}/samples.parquet"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x10  # a data page: the footer still opens
    open(path, "wb").write(bytes(data))
    with pytest.raises(DatapipeError, match=r"samples\.parquet"):
        for _ in StreamingDataset(bad, shuffle=False, decode=None):
            pass
    assert not _table_threads()


def test_a_flipped_byte_in_a_large_shard_names_that_shard(large, tmp_path):
    dest, _ = large
    bad = str(tmp_path / "bad")
    shutil.copytree(dest, bad)
    index = datapipe.open_dataset(bad).index
    name = index.shards[1].name
    path = f"{bad}/{name}"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01  # inside a sample's payload
    open(path, "wb").write(bytes(data))
    got = []
    with pytest.raises(DatapipeError, match=name):
        for s in StreamingDataset(bad, shuffle=False, decode=None):
            got.append(dict(s))
    # every sample before the damaged one came out, exact
    assert got and all(bytes(s["bin"]) == _payload(int(s["__key__"][1:])) for s in got)
    assert not _table_threads()


def test_a_later_pass_reuses_the_checked_tables_and_a_small_cache_reads_them_again(large, monkeypatch):
    dest, n = large
    ds = StreamingDataset(dest, decode=None, seed=9)
    index = ds.source.indexes[0]
    calls = []
    real = index.shard_samples
    monkeypatch.setattr(index, "shard_samples", lambda i: calls.append(i) or real(i))
    _check([dict(s) for s in ds], n)
    first = len(calls)  # a shard fetched twice at once in a pass may be read twice
    assert set(calls) == {0, 1, 2}
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        _check([dict(s) for s in ds], n)
    assert len(calls) == first  # kept from the first pass
    ds.source.tables = type(ds.source.tables)(max_samples=1)  # too small to keep any
    ds.set_epoch(5)  # not the pass read ahead (whose first chunk has epoch 2's shards handed on): fetched anew
    _check([dict(s) for s in ds], n)
    assert set(calls[first:]) == {0, 1, 2}
