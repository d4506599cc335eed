"""A token dataset's document packing table: counted by the first TokenDataset that packs
documents at a seq_len, stored beside the manifest, read (not counted again) by every later
one; a damaged or stale table is counted again with a warning, and a folder that refuses the
table still reads."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from datapipe import TokenDataset, TokenMix, index_tokens
from datapipe.checksum import canonical_json, checksum
from datapipe.errors import CorruptIndexError, PlanError
from datapipe.format.tokens import HEADER_BYTES, write_idx
from datapipe.plan import DocumentTable
from datapipe.plan.tokens import TABLE_MAGIC, LengthReader
from datapipe.tokens.read import TokenSource
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


# --- with the table there, a rank reads no .idx whole: a chunk's lengths are range-read -------


def _idx(root, part=0):
    return root / f"part-{part:05d}-000.idx"


def _garble_past_the_sizes(path):
    """The .idx's pointers and document indices (everything after the header and the
    sizes) overwritten with garbage of the same size: a reader that read it whole would
    refuse it (the manifest's checksum of it), one that range-reads the sizes does not."""
    raw = bytearray(path.read_bytes())
    sequences = int.from_bytes(raw[18:26], "little")
    start = HEADER_BYTES + 4 * sequences
    raw[start:] = np.random.default_rng(0).integers(0, 256, size=len(raw) - start, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(raw))


def test_with_the_table_no_idx_is_read_whole_and_the_sequences_are_the_counted_ones(tmp_path):
    rng = np.random.default_rng(11)
    write_tokens(tmp_path, [random_documents(rng, 300), random_documents(rng, 250)])
    first = _dataset(tmp_path)  # counts (reads every .idx whole) and stores the table
    assert all(isinstance(x, LengthReader) for x in first.layout.doc_lengths)  # the counter holds none
    counted = _rows(first)
    for p in (0, 1):
        _garble_past_the_sizes(_idx(tmp_path, p))
    with pytest.raises(CorruptIndexError, match=r"part-00000-000\.idx: checksum"):
        TokenSource(str(tmp_path)).part_lengths(0)  # what a whole read would meet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _dataset(tmp_path)
    assert all(isinstance(x, LengthReader) for x in again.layout.doc_lengths)
    assert again.layout.table.part_ranged.tolist() == [1, 1]
    assert np.array_equal(again.sequences(), first.sequences())
    got = _rows(again)
    assert len(got) == len(counted) == first.num_sequences
    for a, b in zip(got, counted):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("where", ["sizes", "header"])
def test_a_flipped_byte_in_an_idx_range_a_chunk_uses_is_a_named_error_on_fetch(tmp_path, where):
    rng = np.random.default_rng(12)
    write_tokens(tmp_path, [random_documents(rng, 200)])
    _dataset(tmp_path)
    raw = bytearray(_idx(tmp_path).read_bytes())
    raw[HEADER_BYTES + 4 * 5 + 1 if where == "sizes" else 20] ^= 0x10  # document 5's size; the sequence count
    _idx(tmp_path).write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = _dataset(tmp_path, shuffle=False)  # opening reads no .idx
    match = (r"part-00000-000.idx bytes \[34, \d+\): chunk 0's document lengths do not match.*Index or pack"
             if where == "sizes" else r"part-00000-000.idx: the header names .*index or pack the dataset again")
    with pytest.raises(CorruptIndexError, match=match):
        _rows(ds)


def _version_1_table(table: DocumentTable, identity: str) -> bytes:
    """``table`` as the version 1 format stored it (no part_ranged, no chunk checksums)."""
    payload = b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes() for a in (
        table.part_docs, table.part_tokens, table.chunk_doc_start, table.chunk_token_start, table.counts))
    doc = {"format": "datapipe-document-table", "version": 1, "identity": identity, "seq_len": table.seq_len,
           "block_tokens": table.block_tokens, "chunk_blocks": table.chunk_blocks,
           "parts": int(table.part_docs.size), "chunks": int(table.counts.size), "payload_checksum": checksum(payload)}
    doc["header_checksum"] = checksum(canonical_json(doc))
    header = canonical_json(doc)
    return TABLE_MAGIC + len(header).to_bytes(8, "little") + header + payload


def test_an_old_version_table_is_counted_again_and_replaced(tmp_path):
    rng = np.random.default_rng(13)
    write_tokens(tmp_path, [random_documents(rng, 200), random_documents(rng, 100)])
    first = _dataset(tmp_path)
    good = (tmp_path / KEY).read_bytes()
    (tmp_path / KEY).write_bytes(_version_1_table(first.layout.table, first.source.identity))
    with pytest.warns(RuntimeWarning, match="version 1; this datapipe reads version 2.*counting the documents again"):
        again = _dataset(tmp_path)
    assert (tmp_path / KEY).read_bytes() == good
    assert np.array_equal(again.sequences(), first.sequences())


@pytest.mark.parametrize("bad", ["documents past the parts'", "tokens past the parts'"])
def test_a_table_whose_chunks_lie_outside_the_parts_is_counted_again_and_replaced(tmp_path, bad):
    rng = np.random.default_rng(14)
    write_tokens(tmp_path, [random_documents(rng, 200), random_documents(rng, 100)])
    first = _dataset(tmp_path)
    good = (tmp_path / KEY).read_bytes()
    t = first.layout.table
    # well sealed and a partition of its own sizes: only the manifest can tell it is wrong
    if bad.startswith("documents"):
        forged = dataclasses.replace(t, part_docs=t.part_docs + 7,
                                     chunk_doc_start=np.append(t.chunk_doc_start[:-1], t.chunk_doc_start[-1] + 14))
        match = "document counts are not the manifest's.*counting the documents again"
    else:
        forged = dataclasses.replace(t, part_tokens=t.part_tokens + 3, chunk_token_start=np.append(
            t.chunk_token_start[:-1], t.chunk_token_start[-1] + 6))
        match = "token counts are not the manifest's.*counting the documents again"
    assert forged.defect() == ""
    (tmp_path / KEY).write_bytes(forged.to_bytes(first.source.identity))
    with pytest.warns(RuntimeWarning, match=match):
        again = _dataset(tmp_path)
    assert (tmp_path / KEY).read_bytes() == good
    assert np.array_equal(again.layout.chunk_doc_start, first.layout.chunk_doc_start)
    assert len(_rows(again)) == first.num_sequences


def test_a_file_at_the_table_path_that_is_no_table_is_never_overwritten(tmp_path):
    rng = np.random.default_rng(15)
    write_tokens(tmp_path / "counted", [random_documents(rng, 150)])
    shutil.copytree(tmp_path / "counted", tmp_path / "theirs")
    want = _rows(_dataset(tmp_path / "counted"))
    (tmp_path / "theirs" / "plans").mkdir()
    theirs = b'{"my": "own notes, named as a table happens to be"}'
    (tmp_path / "theirs" / KEY).write_bytes(theirs)
    for _ in range(2):  # every process counts, none stores
        with pytest.warns(RuntimeWarning, match="is not a datapipe document packing table.*left as it is"):
            ds = _dataset(tmp_path / "theirs")
        assert (tmp_path / "theirs" / KEY).read_bytes() == theirs
    got = _rows(ds)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


# --- Megatron files whose documents are several sequences: those parts are read whole -----


def _sentence_split_pair(prefix, rng, docs: int) -> list[np.ndarray]:
    """A Megatron pair whose documents are 1-3 sequences each (doc_idx is not 0..n), as
    Megatron's preprocessing writes with sentence splitting; returns its documents."""
    per = rng.integers(1, 4, size=docs)
    sizes = rng.integers(1, 40, size=int(per.sum())).astype(np.int32)
    doc_index = np.concatenate(([0], np.cumsum(per)))
    tokens = rng.integers(0, 1000, size=int(sizes.sum())).astype(np.uint16)
    Path(f"{prefix}.bin").write_bytes(tokens.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        write_idx(f, sizes, doc_index, np.uint16)
    cum = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    return [tokens[cum[a]:cum[b]] for a, b in itertools.pairwise(doc_index.tolist())]


def _one_per_document_pair(prefix, rng, docs: int) -> list[np.ndarray]:
    sizes = rng.integers(1, 60, size=docs).astype(np.int32)
    tokens = rng.integers(0, 1000, size=int(sizes.sum())).astype(np.uint16)
    Path(f"{prefix}.bin").write_bytes(tokens.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        write_idx(f, sizes, np.arange(docs + 1), np.uint16)
    return np.split(tokens, np.cumsum(sizes)[:-1])


def test_parts_of_several_sequences_a_document_are_read_whole_and_the_rest_in_ranges(tmp_path):
    rng = np.random.default_rng(16)
    split = _sentence_split_pair(tmp_path / "a", rng, 120)
    plain = _one_per_document_pair(tmp_path / "b", rng, 150)
    index_tokens([str(tmp_path / "a"), str(tmp_path / "b")], vocab_size=1000)
    first = _dataset(tmp_path)
    assert first.layout.table.part_ranged.tolist() == [0, 1]
    stored = DocumentTable.from_bytes((tmp_path / KEY).read_bytes(), KEY, identity=first.source.identity)
    assert stored.part_ranged.tolist() == [0, 1]
    # the split part's lengths are whole documents' (summed over their sequences), held
    np.testing.assert_array_equal(first.layout.doc_lengths[0], [d.size for d in split])
    assert isinstance(first.layout.doc_lengths[1], LengthReader)
    counted = _rows(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _dataset(tmp_path)
    assert isinstance(again.layout.doc_lengths[1], LengthReader)
    got = _rows(again)
    assert len(got) == len(counted) == first.num_sequences
    for a, b in zip(got, counted):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    stream = np.concatenate(split + plain).astype(np.int64)
    assert int(again.layout.num_tokens) == stream.size
    # a table that says the split part may be range-read is refused, counted again and replaced
    good = (tmp_path / KEY).read_bytes()
    forged = dataclasses.replace(stored, part_ranged=np.array([1, 1], dtype=np.int64))
    (tmp_path / KEY).write_bytes(forged.to_bytes(first.source.identity))
    with pytest.warns(RuntimeWarning, match=r"parts \[0\]'s lengths in ranges.*counting the documents again"):
        _dataset(tmp_path)
    assert (tmp_path / KEY).read_bytes() == good


def test_a_mix_of_documents_packed_sources_reads_no_idx_whole_with_their_tables(tmp_path):
    rng = np.random.default_rng(17)
    names = []
    for i, n in enumerate((160, 90)):
        write_tokens(tmp_path / f"s{i}", [random_documents(rng, n, mean=20)])
        names.append(str(tmp_path / f"s{i}"))
    kw = dict(global_batch=6, chunk_tokens=64, steps=8, seed=5, packing="documents")
    counted = [{k: v.clone() for k, v in b.items()} for b in TokenMix({names[0]: 2, names[1]: 1}, 8, **kw)]
    for name in names:
        _garble_past_the_sizes(Path(name) / "part-00000-000.idx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mix = TokenMix({names[0]: 2, names[1]: 1}, 8, **kw)
    assert all(isinstance(x, LengthReader) for lay in mix.layouts for x in lay.doc_lengths)
    got = [{k: v.clone() for k, v in b.items()} for b in mix]
    assert len(got) == len(counted) == 8
    for g, w in zip(got, counted):
        for k in w:
            assert torch.equal(g[k], w[k]), k
