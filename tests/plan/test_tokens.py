"""Token sequence plans: concat ranges are numpy slices of the stream, document packing is
next-fit within blocks, and every sequence is read exactly once per epoch over any ranks,
workers, resume points and changes of data-parallel size."""

from __future__ import annotations

import itertools
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import OptionError, PlanError, StateMismatchError, TopologyError
from datapipe.format.tokens import TokenPartWriter, read_idx
from datapipe.plan import batch_steps, worker_batches
from datapipe.plan.tokens import (
    CHUNK_TOKENS,
    ConcatLayout,
    DocumentLayout,
    cu_seqlens,
    data_parallel,
    position_ids,
)

part_sizes = st.lists(st.integers(0, 60), min_size=1, max_size=6)
doc_lists = st.lists(st.lists(st.integers(0, 70), max_size=25), min_size=1, max_size=4)


def stream_of(sizes):
    """Token values equal to their position in the stream, cut into parts."""
    stream = np.arange(sum(sizes), dtype=np.int64)
    return stream, np.split(stream, np.cumsum(sizes)[:-1])


def gather(parts, pieces, j):
    a, b = pieces.offsets[j], pieces.offsets[j + 1]
    return np.concatenate([parts[p][s:e] for p, s, e in zip(pieces.part[a:b], pieces.start[a:b], pieces.stop[a:b])]
                          + [np.empty(0, np.int64)])


# --- concat --------------------------------------------------------------------------------


@given(sizes=part_sizes, L=st.integers(1, 20), extra=st.booleans(), k=st.integers(1, 7))
@settings(max_examples=150, deadline=None)
def test_concat_sequences_are_slices_of_the_stream(sizes, L, extra, k):
    lay = ConcatLayout(sizes, L, chunk_sequences=k, extra_token=extra)
    T = sum(sizes)
    n = max(T - extra, 0) // L  # Megatron: (T - add_extra_token) // L
    assert lay.num_sequences == n == int(lay.counts.sum())
    assert (lay.counts[:-1] == k).all() if n else lay.counts.size == 0
    stream, parts = stream_of(sizes)
    ids = np.arange(n)
    start, stop = lay.token_range(ids)
    pieces = lay.pieces(ids)
    assert (pieces.stop > pieces.start).all()
    for i in range(n):
        want = stream[i * L:(i + 1) * L + extra]
        assert len(want) == L + extra
        assert np.array_equal(gather(parts, pieces, i), want)
        assert (start[i], stop[i]) == (i * L, (i + 1) * L + extra)
    for c in range(lay.num_chunks):
        a, b = lay.chunk_token_range(c)
        ids_c = lay.sequence_ids(np.full(lay.counts[c], c), np.arange(lay.counts[c]))
        s, e = lay.token_range(ids_c)
        assert a == s.min() and b == e.max()
        assert np.array_equal(gather(parts, lay.chunk_pieces(c), 0), stream[a:b])
        assert np.array_equal(lay.chunk_of(ids_c)[0], np.full(ids_c.size, c))


def test_concat_matches_megatron_build_sample_idx():
    helpers = pytest.importorskip("megatron.core.datasets.helpers",
                                  reason="pip install megatron-core torch==2.13.0 (in a separate venv)")
    rng = np.random.default_rng(0)
    for trial in range(30):
        sizes = rng.integers(1, 50, size=rng.integers(1, 30)).astype(np.int32)
        L = int(rng.integers(2, 40))
        T = int(sizes.sum())
        for extra in (True, False):
            if T - extra < L:
                continue
            idx = helpers.build_sample_idx(sizes, np.arange(sizes.size, dtype=np.int32), L, 1, T, True, extra)
            doc_start = np.concatenate(([0], np.cumsum(sizes)))
            bounds = doc_start[idx[:, 0]] + idx[:, 1]  # where each sample starts; the last row ends the last
            lay = ConcatLayout(sizes, L, extra_token=extra)
            assert lay.num_sequences == idx.shape[0] - 1, (trial, extra)
            s, e = lay.token_range(np.arange(lay.num_sequences))
            assert np.array_equal(s, bounds[:-1])
            assert np.array_equal(e, bounds[1:] + extra)


def test_concat_arguments_are_checked():
    with pytest.raises(OptionError, match="seq_len"):
        ConcatLayout([10], 0)
    with pytest.raises(OptionError, match="negative"):
        ConcatLayout([10, -1], 4)
    with pytest.raises(OptionError, match="1-d integer"):
        ConcatLayout([[1, 2]], 4)
    lay = ConcatLayout([10], 4)
    with pytest.raises(PlanError):
        lay.token_range([2])
    assert ConcatLayout([0, 0], 4).num_sequences == 0
    assert ConcatLayout([10**12], 2048).chunk_sequences == CHUNK_TOKENS // 2048


# --- documents -----------------------------------------------------------------------------------


def reference_packing(lengths, L, block_tokens):
    """Blocks of (document, start, length) sequences by a plain next-fit, document by document."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(lengths) else np.empty(0, np.int64)
    blocks, prev = [], None
    for d, n in enumerate(lengths):
        key = int(starts[d]) // block_tokens
        if key != prev:
            blocks.append([])
            prev = key
        blocks[-1].append((d, int(n)))
    packed, first_docs = [], [b[0][0] for b in blocks]
    for docs in blocks:
        seqs, cur, fill = [], [], 0
        for d, n in docs:
            off = 0
            while off < n:
                ln = min(L, n - off)
                if fill + ln > L:
                    seqs.append(cur)
                    cur, fill = [], 0
                cur.append((d, off, ln))
                fill += ln
                off += ln
        if cur:
            seqs.append(cur)
        packed.append(seqs)
    return packed, first_docs


@given(docs=doc_lists, L=st.integers(1, 40), bt=st.integers(1, 300), k=st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_documents_pack_by_next_fit_within_blocks(docs, L, bt, k):
    lay = DocumentLayout([np.array(d, dtype=np.int32) for d in docs], L, block_tokens=bt, chunk_blocks=k)
    flat = [n for d in docs for n in d]
    ref, first_docs = reference_packing(flat, L, bt)
    chunks = [[seq for block in ref[c:c + k] for seq in block] for c in range(0, len(ref), k)]
    assert lay.counts.tolist() == [len(s) for s in chunks]
    doc_start = np.concatenate(([0], np.cumsum(flat))).astype(np.int64)
    part_of_doc = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    part_first_tok = np.concatenate(([0], np.cumsum([sum(d) for d in docs])))
    covered = np.zeros(sum(flat), dtype=np.int64)
    for c, seqs in enumerate(chunks):
        ch = lay.chunk(c)
        assert ch.num_sequences == len(seqs)
        assert ch.first_sequence == int(lay.counts[:c].sum())
        for j, seq in enumerate(seqs):
            a, z = ch.offsets[j], ch.offsets[j + 1]
            got = list(zip(ch.doc[a:z].tolist(), ch.length[a:z].tolist()))
            assert got == [(d, ln) for d, _, ln in seq]
            for (d, off, ln), p, s in zip(seq, ch.part[a:z], ch.start[a:z]):
                assert p == part_of_doc[d]
                g = part_first_tok[p] + s  # the piece's place in the stream
                assert g == doc_start[d] + off and g + ln <= doc_start[d + 1]
                covered[g:g + ln] += 1
        tokens = ch.tokens()
        assert (tokens <= L).all() and (tokens > 0).all()
        assert np.array_equal(ch.padding(), L - tokens)
        assert np.array_equal(ch.continued, [off + ln < flat[d] for seq in seqs for d, off, ln in seq])
        a, z = lay.chunk_token_range(c)
        d1 = first_docs[(c + 1) * k] if (c + 1) * k < len(first_docs) else len(flat)
        assert (a, z) == (doc_start[first_docs[c * k]], doc_start[d1])
        assert (lay.chunk_doc_start[c], lay.chunk_doc_start[c + 1]) == (first_docs[c * k], d1)
    assert (covered == 1).all()  # every token in exactly one sequence


@given(docs=doc_lists, L=st.integers(1, 30), bt=st.integers(1, 200), data=st.data())
@settings(max_examples=80, deadline=None)
def test_document_pieces_positions_and_cu_seqlens(docs, L, bt, data):
    parts = [np.array(d, dtype=np.int64) for d in docs]
    lay = DocumentLayout(parts, L, block_tokens=bt, chunk_blocks=2)
    if not lay.num_sequences:
        return
    ids = np.array(data.draw(st.lists(st.integers(0, lay.num_sequences - 1), min_size=1, max_size=12)))
    pieces = lay.pieces(ids)
    chunk, local = lay.chunk_of(ids)
    segs, per = [], []
    for i, (c, j) in enumerate(zip(chunk, local)):
        blk = lay.chunk(int(c))
        one = blk.pieces([j])
        a, z = pieces.offsets[i], pieces.offsets[i + 1]
        assert np.array_equal(pieces.part[a:z], one.part) and np.array_equal(pieces.start[a:z], one.start)
        s, n = blk.segment_lengths([j])
        assert s.sum() == L and n.tolist() == [s.size]
        segs.append(s)
        per.append(int(n[0]))
    seg = np.concatenate(segs)
    cu = cu_seqlens(seg)
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == L * ids.size
    assert np.array_equal(np.diff(cu), seg)
    pos = position_ids(seg, L)
    assert pos.shape == (ids.size, L)
    flat = pos.ravel()
    for a, b in itertools.pairwise(cu):
        assert np.array_equal(flat[a:b], np.arange(b - a))
    # a chunk's segments all at once
    blk = lay.chunk(int(chunk[0]))
    s_all, n_all = blk.segment_lengths(np.arange(blk.num_sequences))
    assert s_all.sum() == L * blk.num_sequences and n_all.sum() == s_all.size


def test_documents_from_a_written_part_read_back_whole(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.lognormal(3, 1.2, size=300).astype(int)]
    with TokenPartWriter(tmp_path / "p", vocab_size=1000) as w:
        for d in docs:
            w.add_document(d)
    for tmp, final in w.renames:
        os.replace(tmp, final)
    idx = read_idx(np.memmap(tmp_path / "p.idx", mode="r"), bin_size=(tmp_path / "p.bin").stat().st_size)
    lengths = idx.document_lengths()
    assert isinstance(lengths.base, (np.memmap, memoryview)) or lengths.base is not None  # a view, no copy
    tokens = np.memmap(tmp_path / "p.bin", dtype=idx.dtype, mode="r")
    lay = DocumentLayout([lengths], 64, block_tokens=500, chunk_blocks=3)
    got = [[] for _ in docs]
    for c in range(lay.num_chunks):
        blk = lay.chunk(c)
        for d, s, ln in zip(blk.doc.tolist(), blk.start.tolist(), blk.length.tolist()):
            got[d].append(tokens[s:s + ln])
    for d, pieces in zip(docs, got):
        assert np.array_equal(np.concatenate([*pieces, np.empty(0, np.uint16)]), d)


def test_document_layout_arguments_are_checked():
    with pytest.raises(OptionError, match="one array per part"):
        DocumentLayout(np.array([1, 2, 3]), 4)
    with pytest.raises(OptionError, match="negative"):
        DocumentLayout([np.array([1, -2])], 4)
    with pytest.raises(OptionError, match="block_tokens"):
        DocumentLayout([np.array([1])], 4, block_tokens=0)
    empty = DocumentLayout([np.array([], np.int32), np.array([0, 0])], 4)
    assert empty.num_sequences == 0 and empty.num_chunks <= 1


def test_document_plan_memory_is_bounded():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(6.4, 1.0, size=1 << 21).astype(np.int32)  # 8 MB of lengths, 2**21 documents
    tracemalloc.start()
    lay = DocumentLayout([lengths], 2048)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 48 << 20, peak
    kept = lay.counts.nbytes + lay.chunk_doc_start.nbytes + lay.chunk_token_start.nbytes
    assert kept < 32 * lay.num_chunks + 1024


# --- every sequence exactly once, over ranks, workers, resumes and elastic changes ----------------


def epoch_ids(layout, seed, window, schedule, batch_size, workers):
    """Sequence ids read by every rank and worker, resuming after each (world, steps) leg."""
    seen: list[np.ndarray] = []
    state = None
    for world, steps in schedule:
        plan = layout.epoch_plan(seed=seed, window=window, world=world, state=state)
        start = plan.start
        stop = plan.per_rank if steps is None else min(start + steps, plan.per_rank)
        for rank in range(world):
            for worker in range(workers):
                local = batch_steps(start, stop, batch_size, worker_batches(start, stop, batch_size, worker, workers))
                chunk, sample, pad = plan.rank_samples(rank, local)
                seen.append(layout.sequence_ids(chunk[~pad], sample[~pad]))
        state = plan.state_dict(consumed=stop)
    return np.concatenate([*seen, np.empty(0, np.int64)])


@given(kind=st.sampled_from(["concat", "documents"]), docs=doc_lists, L=st.integers(1, 16),
       seed=st.integers(0, 2**32), window=st.integers(1, 8),
       legs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12)), min_size=0, max_size=3),
       last_world=st.integers(1, 6), batch_size=st.integers(1, 4), workers=st.integers(1, 3))
@settings(max_examples=120, deadline=None)
def test_every_sequence_exactly_once_per_epoch(kind, docs, L, seed, window, legs, last_world, batch_size, workers):
    if kind == "concat":
        layout = ConcatLayout([sum(d) for d in docs], L, chunk_sequences=3)
    else:
        layout = DocumentLayout([np.array(d, np.int64) for d in docs], L, block_tokens=40, chunk_blocks=2)
    schedule = [*legs, (last_world, None)]
    ids = epoch_ids(layout, seed, window, schedule, batch_size, workers)
    assert np.array_equal(np.sort(ids), np.arange(layout.num_sequences))


def test_resume_is_the_uninterrupted_run_on_any_world():
    lay = DocumentLayout([np.random.default_rng(1).integers(0, 300, size=2000)], 128, chunk_blocks=2)
    full = lay.epoch_plan(seed=4, window=3, world=1)
    order = lay.sequence_ids(*full.rank_samples(0, np.arange(full.per_rank))[:2])
    a = lay.epoch_plan(seed=4, window=3, world=1)
    state = a.state_dict(consumed=777)
    b = lay.epoch_plan(seed=4, window=3, world=4, state=state)
    rest = np.concatenate([lay.sequence_ids(*b.rank_samples(r, np.arange(b.start, b.per_rank))[:2])
                           [~b.rank_samples(r, np.arange(b.start, b.per_rank))[2]] for r in range(4)])
    assert sorted(rest.tolist()) == sorted(order[777:].tolist())
    other = DocumentLayout([np.random.default_rng(2).integers(0, 300, size=2000)], 128, chunk_blocks=2)
    with pytest.raises(StateMismatchError, match="another dataset"):
        other.epoch_plan(seed=4, window=3, world=2, state=state)
    with pytest.raises(StateMismatchError, match="another dataset"):
        lay.epoch_plan(seed=4, window=3, world=2, state=state, identity="another manifest")


# --- data-parallel groups --------------------------------------------------------------------------


def test_data_parallel_groups():
    # 16 ranks, tensor x context parallel 2, pipeline 2: dp 4, ranks of one tp group read alike
    got = [data_parallel(r, 16, 2, pipeline=2) for r in range(16)]
    assert got == [((r // 2) % 4, 4) for r in range(16)]
    assert got[0] == got[1] and got[0] == got[8]  # same tp group, and the same dp slot on stage 2
    assert data_parallel(5, 8) == (5, 8)
    assert data_parallel(dp_rank=3, dp_size=4) == (3, 4)
    for kwargs, match in (({"rank": 0, "world_size": 6, "replication": 4}, "multiple"),
                          ({"rank": 8, "world_size": 8}, "inside"),
                          ({"rank": 0, "world_size": 8, "replication": 0}, "replication"),
                          ({"rank": True, "world_size": 8}, "rank"),
                          ({"dp_rank": 4, "dp_size": 4}, "inside"),
                          ({"dp_rank": 1}, "both"),
                          ({}, "give rank")):
        with pytest.raises(TopologyError, match=match):
            data_parallel(**kwargs)
    assert issubclass(TopologyError, OptionError)
