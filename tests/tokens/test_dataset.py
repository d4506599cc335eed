"""TokenDataset in one process: concatenated sequences equal to numpy slices of the token
stream (Megatron GPTDataset's [i*L, (i+1)*L + 1)), packed documents equal to an independent
reference built from the plan's pieces and the documents' boundaries, every sequence once
per epoch over any data-parallel split, resume onto another data-parallel size, a flipped
bit anywhere a named error (never a wrong token), packing through pack_tokens with a BPE
tokenizer trained here, reads through a TieredCache and from S3, and every bad argument a
LoaderOptionError naming it. Property tests (hypothesis) over random document lengths,
sequence lengths, chunk sizes, windows, data-parallel sizes and resume points."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from datapipe import TokenDataset
from datapipe.errors import (
    ChecksumError,
    CorruptIndexError,
    FormatError,
    LoaderOptionError,
    ObjectNotFoundError,
    PlanError,
    StateMismatchError,
    TopologyError,
)
from datapipe.tokens import IGNORE_INDEX
from tests.token_datasets import EOS, random_documents, write_tokens
from tests.tokens_corpus import EOS as EOS_TEXT
from tests.tokens_corpus import expected_documents, make_texts, train_tokenizer, write_jsonl


def _documents(draw_lengths: list[list[int]], seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    parts = []
    for lengths in draw_lengths:
        docs = []
        for k in lengths:
            d = rng.integers(0, EOS, size=k, dtype=np.int64)
            d[-1] = EOS
            docs.append(d)
        parts.append(docs)
    return parts


parts_strategy = st.lists(st.lists(st.integers(1, 90), min_size=0, max_size=12), min_size=1, max_size=3).filter(
    lambda p: sum(map(sum, p)) >= 30)
windows = st.none() | st.integers(1, 4)


def _rows(ds: TokenDataset) -> list[dict]:
    """A pass in this process, as one dict of numpy arrays per sequence (from batches)."""
    out = []
    for b in ds:
        arrays = {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in b.items()}
        for i in range(len(b)):
            out.append({k: v[i] for k, v in arrays.items() if k != "cu_seqlens"} | {"_cu": arrays.get("cu_seqlens")})
    return out


def _expected_document_row(ds: TokenDataset, stream: np.ndarray, doc_ends: set[int], q: int) -> dict:
    """The packed sequence q built from the plan's pieces and the documents' boundaries alone."""
    lay = ds.layout
    p = lay.pieces([q])
    L = ds.seq_len
    ids, labels, pos, segs = [], [], [], []
    for part, a, b in zip(p.part.tolist(), p.start.tolist(), p.stop.tolist()):
        g = int(lay.part_token_starts[part]) + a
        n = b - a
        ids += stream[g:g + n].tolist()
        nxt = stream[g + 1:g + n + 1].tolist() + [IGNORE_INDEX] * (g + n + 1 - stream.size)  # past the end
        if (g + n) in doc_ends:  # the document ended: nothing to predict after it
            nxt[-1] = IGNORE_INDEX
        labels += nxt
        pos += list(range(n))
        segs.append(n)
    pad = L - len(ids)
    ids += [ds.pad_id] * pad
    labels += [IGNORE_INDEX] * pad
    pos += list(range(pad))
    if pad:
        segs.append(pad)
    return {"input_ids": np.array(ids), "labels": np.array(labels), "position_ids": np.array(pos),
            "padding": pad, "segments": segs}


# --- what comes out is the stream's tokens ---------------------------------------------------


@settings(max_examples=25)
@given(parts=parts_strategy, seq_len=st.integers(1, 24), chunk=st.integers(8, 160), window=windows,
       dp=st.integers(1, 3), drop_last=st.booleans(), batch=st.integers(1, 5), seed=st.integers(0, 2**32),
       extra=st.booleans())
def test_concat_sequences_are_the_streams_slices_and_each_comes_once(parts, seq_len, chunk, window, dp, drop_last,
                                                                     batch, seed, extra):
    with tempfile.TemporaryDirectory() as root:
        stream = write_tokens(root, _documents(parts, seed))
        kw = dict(seed=seed, window=window, chunk_tokens=chunk, drop_last=drop_last, batch_size=batch, batched=True,
                  extra_token=extra)
        n = (stream.size - extra) // seq_len
        if n == 0:
            with pytest.raises(PlanError, match="make no sequence"):
                TokenDataset(root, seq_len, **kw)
            return
        seen = []
        for r in range(dp):
            ds = TokenDataset(root, seq_len, dp_rank=r, dp_size=dp, **kw)
            ids = ds.sequences().tolist()
            rows = _rows(ds)
            assert len(rows) == len(ids) == len(ds)
            for q, row in zip(ids, rows):
                assert row["input_ids"].dtype == np.int64
                np.testing.assert_array_equal(row["input_ids"], stream[q * seq_len:q * seq_len + seq_len + extra])
            seen += ids
        assert ds.num_sequences == n
        counts = np.bincount(seen, minlength=n)
        if drop_last:  # at most once; fewer than dp left out
            assert counts.max() <= 1 and n - len(seen) < dp
        else:  # at least once; fewer than dp repeated
            assert counts.min() >= 1 and len(seen) - n < dp


@settings(max_examples=20)
@given(parts=parts_strategy, seq_len=st.integers(2, 40), chunk=st.integers(8, 400), window=windows,
       batch=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_packed_documents_match_the_reference_and_hold_every_token_once(parts, seq_len, chunk, window, batch, seed):
    with tempfile.TemporaryDirectory() as root:
        docs = _documents(parts, seed)
        stream = write_tokens(root, docs)
        doc_ends = set(np.cumsum([d.size for p in docs for d in p]).tolist())
        ds = TokenDataset(root, seq_len, packing="documents", seed=seed, window=window, chunk_tokens=chunk,
                          batch_size=batch, batched=True)
        ids = ds.sequences().tolist()
        assert sorted(ids) == list(range(ds.num_sequences))
        covered = np.zeros(stream.size, dtype=np.int64)
        seen = 0
        for b in ds:
            got = {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in b.items()}
            segs = []
            for i in range(len(b)):
                q = ids[seen + i]
                want = _expected_document_row(ds, stream, doc_ends, q)
                for k in ("input_ids", "labels", "position_ids"):
                    np.testing.assert_array_equal(got[k][i], want[k], err_msg=f"{k} of sequence {q}")
                assert got["padding"][i] == want["padding"]
                segs += want["segments"]
                p = ds.layout.pieces([q])
                for part, a, z in zip(p.part.tolist(), p.start.tolist(), p.stop.tolist()):
                    g = int(ds.layout.part_token_starts[part]) + a
                    covered[g:g + z - a] += 1
            cu = got["cu_seqlens"]
            assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == len(b) * seq_len
            np.testing.assert_array_equal(np.diff(cu), segs)
            seen += len(b)
        assert seen == len(ids)
        np.testing.assert_array_equal(covered, 1)  # every token of the stream in exactly one sequence


def test_items_one_by_one_and_the_int32_option(tmp_path):
    stream = write_tokens(tmp_path, [random_documents(np.random.default_rng(1), 40)])
    ds = TokenDataset(tmp_path, 8, seed=2, window=2, chunk_tokens=64)
    ids = ds.sequences().tolist()
    items = list(ds)
    assert [sorted(x) for x in items[:1]] == [["input_ids"]] and len(items) == len(ids)
    for q, x in zip(ids, items):
        np.testing.assert_array_equal(x["input_ids"].numpy(), stream[q * 8:q * 8 + 9])
    small = TokenDataset(tmp_path, 8, seed=2, window=2, chunk_tokens=64, dtype="int32", packing="documents")
    item = next(iter(small))
    assert sorted(item) == ["input_ids", "labels", "padding", "position_ids"]
    assert item["input_ids"].dtype == item["labels"].dtype == item["position_ids"].dtype == __import__("torch").int32
    assert isinstance(item["padding"], int)


def test_order_is_deterministic_in_seed_and_epoch_and_stored_without_shuffle(tmp_path):
    write_tokens(tmp_path, [random_documents(np.random.default_rng(2), 200)])
    ds = TokenDataset(tmp_path, 4, seed=5, window=3, chunk_tokens=64)
    first = ds.sequences().tolist()
    assert TokenDataset(tmp_path, 4, seed=5, window=3, chunk_tokens=64).sequences().tolist() == first
    assert TokenDataset(tmp_path, 4, seed=6, window=3, chunk_tokens=64).sequences().tolist() != first
    ds.set_epoch(1)
    assert ds.sequences().tolist() != first and sorted(ds.sequences().tolist()) == sorted(first)
    assert TokenDataset(tmp_path, 4, shuffle=False, chunk_tokens=64).sequences().tolist() == list(range(len(first)))


def test_the_default_fetch_budget_is_two_windows_and_a_chunk_and_passes_stay_within_it(tmp_path):
    # a worker's buffers are fresh memory: by default it fetches ahead what the window it
    # reads and the next one hold, not a fixed 512 MiB
    from datapipe.plan import ConcatLayout
    from datapipe.tokens.read import MAX_PREFETCH_BYTES, ChunkFetch

    rng = np.random.default_rng(11)
    write_tokens(tmp_path, [random_documents(rng, 900), random_documents(rng, 700)])
    kw = dict(seed=2, window=3, chunk_tokens=512, chunk_samples=16, batch_size=4, batched=True)
    ds = TokenDataset(tmp_path, 16, **kw)
    lay, src = ds.layout, ds.source
    assert lay.num_chunks > 10
    largest = max(b - a for a, b in map(lay.chunk_token_range, range(lay.num_chunks)))
    assert lay.largest_chunk_tokens() == largest
    budget = 7 * (largest * src.itemsize + src.block_bytes)  # 2 x 3 chunks and one more
    assert ds.prefetch_bytes == budget == src.pool.max_bytes
    whole = TokenDataset(tmp_path, 16, **{**kw, "window": None})  # every chunk in one window
    assert whole.prefetch_bytes == (2 * lay.num_chunks + 1) * (largest * src.itemsize + src.block_bytes)
    assert TokenDataset(tmp_path, 16, prefetch_bytes=12345).prefetch_bytes == 12345
    roomy = TokenDataset(tmp_path, 16, **{**kw, "prefetch_bytes": MAX_PREFETCH_BYTES})
    for epoch in range(3):  # the same sequences; from the second pass on one reads the next ahead
        ds.set_epoch(epoch)
        roomy.set_epoch(epoch)
        got = [b["input_ids"].tolist() for b in ds]
        assert got == [b["input_ids"].tolist() for b in roomy] and sum(map(len, got)) == len(ds)
        if epoch:
            assert 0 < ds._ahead.pre.peak_bytes <= budget
    # the bound is capped: a window of every chunk of a large stream asks for at most 512 MiB
    big = ConcatLayout([1 << 31], 2048)
    assert ChunkFetch([src], [big]).read_ahead_bytes(8) == 17 * (big.largest_chunk_tokens() * src.itemsize
                                                                   + src.block_bytes)
    assert ChunkFetch([src], [big]).read_ahead_bytes(1 << 62) == MAX_PREFETCH_BYTES


def test_passes_after_the_first_read_the_next_one_ahead_and_yield_what_a_fresh_dataset_yields(tmp_path):
    # a first pass in a process reads nothing ahead (its fetches fill fresh memory); from
    # the second on a pass leaves the next epoch's first chunks being fetched, used by it
    write_tokens(tmp_path, [random_documents(np.random.default_rng(3), 200)])
    ds = TokenDataset(tmp_path, 4, seed=5, window=3, chunk_tokens=64)
    pre = None
    for epoch in range(3):
        ds.set_epoch(epoch)
        fresh = TokenDataset(tmp_path, 4, seed=5, window=3, chunk_tokens=64)
        fresh.set_epoch(epoch)
        got, want = [r["input_ids"].tolist() for r in ds], [r["input_ids"].tolist() for r in fresh]
        assert got == want and len(got) == len(ds)
        if epoch == 0:
            assert ds._ahead is None
            continue
        assert ds._ahead is not None and ds._ahead.key.epoch == epoch + 1
        assert pre is None or ds._ahead.pre is pre  # epoch 2 ran on the prefetcher epoch 1 left
        pre = ds._ahead.pre


# --- resume --------------------------------------------------------------------------------


@settings(max_examples=25)
@given(parts=parts_strategy, seq_len=st.integers(1, 16), chunk=st.integers(8, 120), dp_old=st.integers(1, 3),
       dp_new=st.integers(1, 4), frac=st.floats(0, 1), seed=st.integers(0, 2**32), packing=st.sampled_from(
           ["concat", "documents"]))
def test_resume_on_another_data_parallel_size_delivers_the_rest_once(parts, seq_len, chunk, dp_old, dp_new, frac,
                                                                     seed, packing):
    with tempfile.TemporaryDirectory() as root:
        write_tokens(root, _documents(parts, seed))
        kw = dict(seed=seed, window=2, chunk_tokens=chunk, packing=packing)
        try:
            base = TokenDataset(root, seq_len, dp_rank=0, dp_size=dp_old, **kw)
        except PlanError:
            return  # no sequence at all (tested above)
        per = len(base)
        k = int(frac * per)
        state = base.state_dict(samples_seen=k)
        consumed = [x for r in range(dp_old)
                    for x in TokenDataset(root, seq_len, dp_rank=r, dp_size=dp_old, **kw).sequences()[:k].tolist()]
        rest = []
        for r in range(dp_new):
            ds = TokenDataset(root, seq_len, dp_rank=r, dp_size=dp_new, **kw)
            ds.load_state_dict(state)
            rest += ds.sequences().tolist()
        delivered = consumed + rest
        n = base.num_sequences
        assert len(set(delivered)) == len(delivered)  # nothing twice
        assert n - len(delivered) < dp_old + dp_new  # only the drop_last remainders left out


def test_a_state_taken_after_k_items_resumes_at_the_next_item(tmp_path):
    write_tokens(tmp_path, [random_documents(np.random.default_rng(3), 120)])
    ds = TokenDataset(tmp_path, 6, seed=1, window=2, chunk_tokens=50)
    full = [x["input_ids"].tolist() for x in ds]
    it = iter(ds)
    head = [next(it)["input_ids"].tolist() for _ in range(11)]
    state = ds.state_dict()
    assert state == ds.state_dict(samples_seen=11) and isinstance(state["splits"], list)
    it.close()
    again = TokenDataset(tmp_path, 6, seed=1, window=2, chunk_tokens=50)
    again.load_state_dict(state)
    assert head + [x["input_ids"].tolist() for x in again] == full
    # a pass that ran to its end: the next pass is the epoch from its start again
    assert [x["input_ids"].tolist() for x in again] == full


def test_states_of_other_data_or_settings_are_refused(tmp_path):
    write_tokens(tmp_path / "a", [random_documents(np.random.default_rng(4), 60)])
    write_tokens(tmp_path / "b", [random_documents(np.random.default_rng(5), 60)])
    state = TokenDataset(tmp_path / "a", 8, chunk_tokens=64).state_dict(3)
    for other in (TokenDataset(tmp_path / "b", 8, chunk_tokens=64), TokenDataset(tmp_path / "a", 9, chunk_tokens=64),
                  TokenDataset(tmp_path / "a", 8, chunk_tokens=64, seed=1),
                  TokenDataset(tmp_path / "a", 8, chunk_tokens=64, packing="documents")):
        before = other.state_dict()
        with pytest.raises(StateMismatchError):
            other.load_state_dict(state)
        assert other.state_dict() == before  # nothing changed
    with pytest.raises(LoaderOptionError, match="state="):
        TokenDataset(tmp_path / "a", 8).load_state_dict([1, 2])


def test_a_state_of_other_chunks_or_the_old_default_window_says_which_and_resumes_with_them(tmp_path):
    """The defaults changed on 2026-12-03 (chunks of 4 Mi tokens in windows of 8, from 1 Mi in
    windows of 32): a state of other chunks names chunk_tokens, one of another window names
    the window, and each resumes where it was given the settings it was saved with."""
    write_tokens(tmp_path, [random_documents(np.random.default_rng(8), 200)])
    saved = TokenDataset(tmp_path, 8, chunk_tokens=64, window=32)
    it = iter(saved)
    head = [next(it)["input_ids"].tolist() for _ in range(5)]
    state = saved.state_dict()
    it.close()
    with pytest.raises(StateMismatchError, match="chunk_tokens"):
        TokenDataset(tmp_path, 8, chunk_tokens=128, window=32).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="another window"):
        TokenDataset(tmp_path, 8, chunk_tokens=64).load_state_dict(state)  # the default window, 8
    again = TokenDataset(tmp_path, 8, chunk_tokens=64, window=32)
    again.load_state_dict(state)
    assert head + [x["input_ids"].tolist() for x in again] == [x["input_ids"].tolist() for x in saved]
    assert TokenDataset(tmp_path, 8).window == 8


def test_a_second_live_pass_is_refused(tmp_path):
    write_tokens(tmp_path, [random_documents(np.random.default_rng(6), 40)])
    ds = TokenDataset(tmp_path, 8, chunk_tokens=64)
    it = iter(ds)
    next(it)
    with pytest.raises(PlanError, match="already being iterated"):
        next(iter(ds))
    it.close()
    assert len(list(ds)) == len(ds)


# --- topology --------------------------------------------------------------------------------


def test_replicated_ranks_read_the_same_sequences_and_the_environment_is_read(tmp_path, monkeypatch):
    write_tokens(tmp_path, [random_documents(np.random.default_rng(7), 200)])
    kw = dict(seed=3, window=2, chunk_tokens=64)
    by_rank = [TokenDataset(tmp_path, 8, rank=r, world_size=4, replication=2, **kw).sequences().tolist()
               for r in range(4)]
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3] and by_rank[0] != by_rank[2]
    assert by_rank[0] == TokenDataset(tmp_path, 8, dp_rank=0, dp_size=2, **kw).sequences().tolist()
    # pipeline stages are outermost (tp-cp-dp-pp): ranks 0 and 4 are one data-parallel rank
    stages = [TokenDataset(tmp_path, 8, rank=r, world_size=8, replication=2, pipeline=2, **kw).sequences().tolist()
              for r in (0, 4, 2)]
    assert stages[0] == stages[1] != stages[2]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert TokenDataset(tmp_path, 8, **kw).sequences().tolist() == \
        TokenDataset(tmp_path, 8, dp_rank=1, dp_size=2, **kw).sequences().tolist()
    with pytest.raises(TopologyError, match="replication=3"):
        TokenDataset(tmp_path, 8, rank=0, world_size=4, replication=3)


# --- damage: a named error, never a wrong token ---------------------------------------------


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    root = tmp_path_factory.mktemp("intact")
    rng = np.random.default_rng(8)
    stream = write_tokens(root, [random_documents(rng, 40), random_documents(rng, 30)], block_bytes=4096)
    return root, stream


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_file())


@settings(max_examples=40)
@given(data=st.data())
def test_a_flipped_bit_anywhere_is_a_named_error(intact, data):
    src, _stream = intact
    name = data.draw(st.sampled_from(_files(src)))
    packing = data.draw(st.sampled_from(["concat", "documents"]))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        shutil.copytree(src, root)
        raw = bytearray((root / name).read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
        (root / name).write_bytes(bytes(raw))
        try:
            ds = TokenDataset(root, 16, packing=packing, chunk_tokens=256, batch_size=7, batched=True)
            got = [b["input_ids"] for b in ds]
        except (ChecksumError, CorruptIndexError, FormatError) as e:
            assert name in str(e) or "manifest" in str(e), e
            return
        # only a byte no token comes from may go unnoticed: concatenation reads no .idx, and
        # no block past the tail it drops (the dataset's blocks are 4096 bytes, its tokens uint16)
        assert packing == "concat" and name.endswith((".bin", ".idx")), f"a flipped bit in {name} at {at} unnoticed"
        if name.endswith(".idx"):  # every token as the intact dataset gives it
            want = [b["input_ids"] for b in TokenDataset(src, 16, chunk_tokens=256, batch_size=7, batched=True)]
            assert len(got) == len(want) and all(g.equal(w) for g, w in zip(got, want))
            return
        part = int(name.split("-")[1])
        part_start = 0 if part == 0 else (src / "part-00000-000.bin").stat().st_size // 2
        read_bytes = 2 * max(0, min(ds.num_sequences * 16 + 1 - part_start, len(raw) // 2))
        assert at >= -(-read_bytes // 4096) * 4096, (name, at, read_bytes)
        assert sum(x.shape[0] for x in got) == ds.num_sequences


def test_a_bin_truncated_or_extended_is_refused_when_opened(intact, tmp_path):
    src, _ = intact
    for name, change in (("truncated", lambda raw: raw[:-2]), ("extended", lambda raw: raw + b"\x00\x00")):
        root = tmp_path / name
        shutil.copytree(src, root)
        raw = (root / "part-00001-000.bin").read_bytes()
        (root / "part-00001-000.bin").write_bytes(change(raw))
        with pytest.raises(ChecksumError, match=r"part-00001-000\.bin: \d+ bytes, the manifest records"):
            TokenDataset(root, 16)


def test_a_bin_changed_after_the_dataset_was_opened_is_caught_when_read(intact, tmp_path):
    src, _ = intact
    root = tmp_path / "d"
    shutil.copytree(src, root)
    ds = TokenDataset(root, 16, chunk_tokens=256, shuffle=False)
    raw = bytearray((root / "part-00000-000.bin").read_bytes())
    raw[5] ^= 0x40
    (root / "part-00000-000.bin").write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"part-00000-000\.bin: block 0 \(bytes \[0, 4096\)\) fails its checksum"):
        list(ds)


# --- sources: pack_tokens with a tokenizer, a cache, S3 -------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    texts = make_texts(300, seed=11)
    tok = train_tokenizer(make_texts(800, seed=12))
    eos = tok.token_to_id(EOS_TEXT)
    src = write_jsonl(tmp / "docs.jsonl", [{"text": t} for t in texts])
    datapipe.pack_tokens(src, tmp / "out", tokenizer=tok, workers=1, part_bytes=4096)
    stream = np.array([t for d in expected_documents(tok, texts, eos) for t in d], dtype=np.int64)
    return tmp / "out", stream, eos


def test_a_pack_tokens_dataset_reads_back_as_the_tokenizers_ids(packed):
    root, stream, eos = packed
    assert len(datapipe.tokens.pack_tokens.__name__)  # the face's name
    ds = TokenDataset(root, 32, seed=4, chunk_tokens=100, batch_size=4, batched=True)
    assert len(ds.source.manifest.parts) > 2  # sequences straddle parts
    ids = ds.sequences().tolist()
    rows = _rows(ds)
    for q, row in zip(ids, rows):
        np.testing.assert_array_equal(row["input_ids"], stream[q * 32:q * 32 + 33])
    docs = TokenDataset(root, 32, packing="documents", seed=4, chunk_tokens=100)
    assert docs.pad_id == eos
    got = sum(int((x["labels"] != IGNORE_INDEX).sum()) + 0 for x in docs)
    # every token but a document's last is predicted (its next token is in the same document)
    assert got == stream.size - docs.layout.num_documents


def test_files_indexed_in_place_read_where_they_lie(tmp_path):
    """Megatron pairs and a nanoGPT flat file elsewhere, indexed into another folder: the
    parts are named by absolute path, and read from there."""
    rng = np.random.default_rng(9)
    meg = write_tokens(tmp_path / "megatron", [random_documents(rng, 30)])
    flat = rng.integers(0, 60_000, size=3000, dtype=np.uint16)
    flat[::97] = 7
    flat.tofile(tmp_path / "train.bin")
    datapipe.index_tokens([str(tmp_path / "megatron" / "part-00000-000")], index_to=tmp_path / "ix1")
    datapipe.index_tokens([str(tmp_path / "train.bin")], index_to=tmp_path / "ix2", eos_id=7)
    for folder, stream in ((tmp_path / "ix1", meg), (tmp_path / "ix2", flat.astype(np.int64))):
        ds = TokenDataset(folder, 16, seed=1, chunk_tokens=200, batch_size=4, batched=True)
        assert ds.source.manifest.parts[0].prefix.startswith("/")
        ids = ds.sequences().tolist()
        for q, row in zip(ids, _rows(ds)):
            np.testing.assert_array_equal(row["input_ids"], stream[q * 16:q * 16 + 17])
        packed_docs = TokenDataset(folder, 16, packing="documents", chunk_tokens=200)
        assert sum(16 - x["padding"] for x in packed_docs) == stream.size


def test_a_streaming_dataloader_without_workers_cuts_the_same_batches(intact):
    root, _ = intact
    want = [b["input_ids"] for b in TokenDataset(root, 16, seed=1, batch_size=5, batched=True)]
    got = list(datapipe.StreamingDataLoader(TokenDataset(root, 16, seed=1), batch_size=5))
    assert len(got) == len(want) and all(g["input_ids"].equal(w) for g, w in zip(got, want))


MCORE_PYTHON = os.environ.get("DATAPIPE_MCORE_PYTHON", "/work/venv-mcore/bin/python")


def test_megatrons_own_reader_gets_the_tokens_token_dataset_serves(packed, tmp_path):
    """megatron-core (in a venv of its own: it must not replace torch here) reads the parts
    pack_tokens wrote with its IndexedDataset; its documents, laid end to end, are the
    stream TokenDataset cuts its sequences from."""
    import subprocess

    if not os.path.exists(MCORE_PYTHON):
        pytest.skip(f"megatron-core's venv ({MCORE_PYTHON}) is not here")
    root, stream, _ = packed
    ds = TokenDataset(root, 32, chunk_tokens=100)
    prefixes = [str(root / p.prefix) for p in ds.source.manifest.parts]
    code = ("import sys, numpy as np\n"
            "from megatron.core.datasets.indexed_dataset import IndexedDataset\n"
            "parts = [IndexedDataset(p) for p in sys.argv[2:]]\n"
            "np.save(sys.argv[1], np.concatenate([d[i] for d in parts for i in range(len(d))]).astype(np.int64))\n")
    out = tmp_path / "megatron.npy"
    r = subprocess.run([MCORE_PYTHON, "-c", code, str(out), *prefixes], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_array_equal(np.load(out), stream)
    q = ds.sequences()[:5].tolist()
    assert all(np.array_equal(row["input_ids"], np.load(out)[k * 32:k * 32 + 33]) for k, row in
               zip(q, _rows(TokenDataset(root, 32, chunk_tokens=100, batch_size=5, batched=True))))


def test_reads_through_a_tiered_cache_give_the_same_tokens(packed, tmp_path):
    root, stream, _ = packed
    cache = datapipe.TieredCache(hot_bytes=1 << 20, warm_dir=tmp_path / "warm", warm_bytes=8 << 20)
    ds = TokenDataset(root, 32, seed=4, chunk_tokens=100, cache=cache, batch_size=4, batched=True)
    ids = ds.sequences().tolist()
    for q, row in zip(ids, _rows(ds)):
        np.testing.assert_array_equal(row["input_ids"], stream[q * 32:q * 32 + 33])
    stats = cache.stats()
    assert stats["hot_hits"] + stats["hot_misses"] > 0
    cache.close()


def test_a_damaged_copy_in_the_cache_is_read_again_from_the_store(intact, tmp_path):
    src, stream = intact

    class Damaging:  # a cache whose copies have a flipped bit
        def read_range(self, url, start, end):
            with open(url, "rb") as f:
                f.seek(start)
                data = bytearray(f.read(end - start))
            data[len(data) // 2] ^= 4
            return bytes(data)

    ds = TokenDataset(src, 16, cache=Damaging(), chunk_tokens=256, shuffle=False, batch_size=8, batched=True)
    with pytest.warns(RuntimeWarning, match=r"the cache's copy of .*part-0000[01]-000\.bin is damaged"):
        rows = torch.cat([b["input_ids"] for b in ds])
    np.testing.assert_array_equal(rows.numpy(), np.stack([stream[q * 16:q * 16 + 17] for q in range(len(rows))]))
    root = tmp_path / "cut"
    shutil.copytree(src, root)
    ds = TokenDataset(root, 16, chunk_tokens=256, shuffle=False)
    os.truncate(root / "part-00000-000.bin", 1000)  # cut short since the dataset was opened
    with pytest.raises(ChecksumError, match=r"part-00000-000\.bin: bytes \[0, 4096\) read 1000 bytes; .*shorter"):
        list(ds)


def test_a_dataset_on_s3(packed, s3):
    import s3fs

    root, stream, _ = packed
    url, opts = s3
    fs = s3fs.S3FileSystem(**opts)
    for name in os.listdir(root):
        fs.put(str(root / name), f"{url}/tok/{name}")
    ds = TokenDataset(f"{url}/tok", 32, seed=4, chunk_tokens=100, storage_options=opts, batch_size=8, batched=True)
    ids = ds.sequences().tolist()
    rows = _rows(ds)
    assert len(rows) == len(ids)
    for q, row in zip(ids, rows):
        np.testing.assert_array_equal(row["input_ids"], stream[q * 32:q * 32 + 33])


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(seq_len=0), "seq_len=0"),
    (dict(seq_len=1.5), "seq_len=1.5"),
    (dict(packing="bytes"), "packing='bytes'"),
    (dict(window=0), "window=0"),
    (dict(seed=-1), "seed=-1"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(shuffle="yes"), "shuffle='yes'"),
    (dict(dtype="float32"), "dtype='float32'"),
    (dict(prefetch_bytes=0), "prefetch_bytes=0"),
    (dict(chunk_tokens=0), "chunk_tokens=0"),
    (dict(pad_id=-2), "pad_id=-2"),
    (dict(cache=object()), "cache="),
    (dict(rank=2, world_size=2), "rank=2"),
    (dict(rank=0), "give both rank and world_size"),
    (dict(dp_rank=0, dp_size=2, rank=0, world_size=2), "not both"),
    (dict(replication=0), "replication=0"),
    (dict(packing="documents", extra_token=False), "extra_token=False"),
    (dict(source=""), "source=''"),
])
def test_bad_arguments_are_named(intact, kw, match):
    root, _ = intact
    args = dict(source=root, seq_len=16) | kw
    with pytest.raises(LoaderOptionError if "dp_" not in str(kw) or "not both" in match else TopologyError,
                       match=match):
        TokenDataset(args.pop("source"), args.pop("seq_len"), **args)


def test_a_folder_that_is_no_token_dataset_is_a_named_error(tmp_path):
    with pytest.raises(ObjectNotFoundError, match=r"manifest.json does not exist: .* no token dataset .*pack_tokens"):
        TokenDataset(tmp_path, 8)
    (tmp_path / "manifest.json").write_text('{"format": "datapipe", "version": 1}')
    with pytest.raises(FormatError, match="not a datapipe token manifest"):
        TokenDataset(tmp_path, 8)
