"""A token dataset's document packing table: counted by the first TokenDataset that packs
documents at a seq_len, stored beside the manifest, read (not counted again) by every later
one; a damaged or stale table is counted again with a warning, and a folder that refuses the
table still reads."""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest

from datapipe import TokenDataset
from datapipe.errors import PlanError
from datapipe.plan import DocumentTable
from tests.token_datasets import random_documents, write_tokens

L, CHUNK = 16, 256  # blocks of 64 x 16 tokens: chunk_tokens // block = 1 block a chunk
KEY = os.path.join("plans", f"documents-{L}-{64 * L}-1.table")


def _dataset(root, **kw):
    return TokenDataset(root, L, packing="documents", seed=3, chunk_tokens=CHUNK, **kw)


def _rows(ds):
    return [{k: v.numpy().copy() for k, v in item.items() if k != "padding"} for item in ds]


def test_the_first_reader_stores_the_table_and_later_ones_read_it(tmp_path):
    rng = np.random.default_rng(1)
    write_tokens(tmp_path, [random_documents(rng, 300), random_documents(rng, 200)])
    first = _dataset(tmp_path)
    stored = (tmp_path / KEY).read_bytes()
    table = DocumentTable.from_bytes(stored, KEY, identity=first.source.identity)
    assert np.array_equal(table.counts, first.layout.counts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _dataset(tmp_path)
    assert (tmp_path / KEY).read_bytes() == stored
    assert again.fingerprint == first.fingerprint
    assert np.array_equal(again.sequences(), first.sequences())
    got, want = _rows(again), _rows(first)
    assert len(got) == len(want) == len(first.sequences())
    for a, b in zip(got, want):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # a resume state taken on one loads into the other
    again.load_state_dict(first.state_dict())


def test_the_later_reader_takes_the_stored_counts_and_repacking_checks_them(tmp_path):
    rng = np.random.default_rng(2)
    write_tokens(tmp_path, [random_documents(rng, 300)])
    first = _dataset(tmp_path)
    t = first.layout.table
    counts = t.counts.copy()
    counts[0] += 1  # well formed, checksums right, but not what these documents pack into
    forged = dataclasses.replace(t, counts=counts)
    (tmp_path / KEY).write_bytes(forged.to_bytes(first.source.identity))
    later = _dataset(tmp_path, shuffle=False)
    assert np.array_equal(later.layout.counts, counts)  # read, not counted
    with pytest.raises(PlanError, match="chunk 0 packs into"):
        _rows(later)


def test_a_damaged_or_stale_table_is_counted_again_and_replaced(tmp_path):
    rng = np.random.default_rng(3)
    write_tokens(tmp_path / "a", [random_documents(rng, 200)])
    write_tokens(tmp_path / "b", [random_documents(rng, 200)])
    a = _dataset(tmp_path / "a")
    good = (tmp_path / "a" / KEY).read_bytes()
    (tmp_path / "a" / KEY).write_bytes(good[:-3] + bytes([good[-3] ^ 4]) + good[-2:])
    with pytest.warns(RuntimeWarning, match="payload checksum.*counting the documents again"):
        again = _dataset(tmp_path / "a")
    assert np.array_equal(again.layout.counts, a.layout.counts)
    assert (tmp_path / "a" / KEY).read_bytes() == good
    _dataset(tmp_path / "b")
    (tmp_path / "a" / KEY).write_bytes((tmp_path / "b" / KEY).read_bytes())  # another dataset's table
    with pytest.warns(RuntimeWarning, match="computed for .*counting the documents again"):
        again = _dataset(tmp_path / "a")
    assert np.array_equal(again.sequences(), a.sequences())
    assert (tmp_path / "a" / KEY).read_bytes() == good


def test_a_folder_that_refuses_the_table_still_reads(tmp_path):
    rng = np.random.default_rng(4)
    stream = write_tokens(tmp_path, [random_documents(rng, 100)])
    (tmp_path / "plans").write_bytes(b"someone else's file")  # no folder can be made there
    with pytest.warns(RuntimeWarning, match="could not be stored.*counts its documents again"):
        ds = _dataset(tmp_path)
    rows = _rows(ds)
    assert (tmp_path / "plans").read_bytes() == b"someone else's file"
    assert len(rows) == ds.num_sequences
    assert sum(int((r["labels"] != -100).sum()) for r in rows) <= stream.size


def test_on_s3_the_table_is_an_object_beside_the_manifest(tmp_path, s3):
    import s3fs

    url, opts = s3
    rng = np.random.default_rng(5)
    write_tokens(tmp_path, [random_documents(rng, 150), random_documents(rng, 50)])
    fs = s3fs.S3FileSystem(**opts)
    for name in os.listdir(tmp_path):
        fs.put(str(tmp_path / name), f"{url}/tables/{name}")
    first = _dataset(f"{url}/tables", storage_options=opts)
    fs.invalidate_cache()
    stored = fs.cat(f"{url}/tables/{KEY}")
    assert np.array_equal(DocumentTable.from_bytes(stored, KEY, identity=first.source.identity).counts,
                          first.layout.counts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _dataset(f"{url}/tables", storage_options=opts)
    assert np.array_equal(again.sequences(), first.sequences())
    assert len(_rows(again)) == len(first.sequences())
