"""TokenMix: every global batch holds each source's share exactly (the largest-remainder
counts), gathered over data-parallel ranks; every row is its source's tokens (numpy slices of
that source's stream); a weight change at step S keeps each source's draws going (no
sequence a source served is served again in that source's epoch); a run stopped at any step
and resumed on another data-parallel size, with or without new weights, gives the batches
the uninterrupted run gives; StreamingDataLoader workers produce whole per-rank batches in
step order through the ring; bad weights and batch sizes are named. Property tests
(hypothesis) over document lengths, weights, global batches, dp sizes, resume points and
weight changes."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe import StreamingDataLoader, TokenMix
from datapipe.errors import LoaderOptionError, PlanError, StateMismatchError, WorkerStateError
from datapipe.plan import MixturePlan, mixture_counts
from tests.token_datasets import random_documents, write_tokens

L = 8


def _sources(root, sizes, seed):
    rng = np.random.default_rng(seed)
    streams = {}
    for i, n in enumerate(sizes):
        path = f"{root}/s{i}"
        streams[path] = write_tokens(path, [random_documents(rng, n, mean=20)])
    return streams


def _batches(mix):
    return [{k: v.clone() for k, v in b.items()} for b in mix]


def _global(root_streams, weights, dp, **kw):
    """Global batch k of every rank's batches, joined in rank order."""
    per_rank = []
    for r in range(dp):
        mix = TokenMix(dict(zip(root_streams, weights)), L, dp_rank=r, dp_size=dp, **kw)
        per_rank.append(_batches(mix))
    return [{k: torch.cat([p[s][k] for p in per_rank]) for k in per_rank[0][s]} for s in range(len(per_rank[0]))]


def _expected_rows(mix, streams, step, dp_rank=None):
    """The rows of global batch ``step`` from the plan and the sources' streams alone."""
    plan = mix._plan
    b = plan.batch(step, dp_rank)
    names = list(streams)
    rows = []
    for s, c, j in zip(b.source.tolist(), b.chunk.tolist(), b.sample.tolist()):
        lay = mix.layouts[s]
        (q,) = lay.sequence_ids([c], [j]).tolist()
        rows.append(streams[names[s]][q * L:q * L + L + 1])
    return np.stack(rows), b


@settings(max_examples=20)
@given(sizes=st.lists(st.integers(3, 40), min_size=2, max_size=3), data=st.data(), seed=st.integers(0, 2**32),
       window=st.integers(1, 3))
def test_every_global_batch_holds_each_sources_share_and_its_tokens(sizes, data, seed, window):
    weights = data.draw(st.lists(st.floats(0, 10), min_size=len(sizes), max_size=len(sizes)))
    dp = data.draw(st.sampled_from([1, 2, 4]))
    batch = dp * data.draw(st.integers(1, 4))
    with tempfile.TemporaryDirectory() as root:
        streams = _sources(root, sizes, seed)
        try:
            counts = mixture_counts(weights, batch)
        except Exception:
            with pytest.raises(LoaderOptionError):
                TokenMix(dict(zip(streams, weights)), L, global_batch=batch, chunk_tokens=48)
            return
        kw = dict(global_batch=batch, seed=seed, window=window, chunk_tokens=48, steps=12)
        glob = _global(streams, weights, dp, **kw)
        assert len(glob) == 12
        one = TokenMix(dict(zip(streams, weights)), L, **kw)
        served = {s: [] for s in range(len(sizes))}
        for step, b in enumerate(glob):
            assert tuple(np.bincount(b["source"].numpy(), minlength=len(sizes))) == counts
            rows, plan_batch = _expected_rows(one, streams, step)
            np.testing.assert_array_equal(b["input_ids"].numpy(), rows)
            np.testing.assert_array_equal(b["source"].numpy(), plan_batch.source)
            for s, d in zip(plan_batch.source.tolist(), plan_batch.draw.tolist()):
                served[s].append(d)
        for draws in served.values():  # each source's draws in order, none twice
            assert sorted(draws) == list(range(len(draws)))


def _draw_ids(mix, streams, steps):
    """(source, epoch, sequence id) of every slot of global batches ``steps``."""
    out = []
    for step in steps:
        b = mix._plan.batch(step)
        for s, c, j, d in zip(b.source.tolist(), b.chunk.tolist(), b.sample.tolist(), b.draw.tolist()):
            (q,) = mix.layouts[s].sequence_ids([c], [j]).tolist()
            out.append((s, d // mix.layouts[s].num_sequences, q))
    return out


@settings(max_examples=20)
@given(sizes=st.lists(st.integers(3, 30), min_size=2, max_size=2), seed=st.integers(0, 2**32),
       change=st.integers(0, 10), stop=st.integers(0, 14), dp_old=st.sampled_from([1, 2]),
       dp_new=st.sampled_from([1, 2, 4]), w1=st.floats(0.5, 3), w2=st.floats(0.5, 3))
def test_a_weight_change_and_a_resume_on_another_dp_size_give_the_uninterrupted_run(sizes, seed, change, stop, dp_old,
                                                                                    dp_new, w1, w2):
    with tempfile.TemporaryDirectory() as root:
        streams = _sources(root, sizes, seed)
        kw = dict(global_batch=4, seed=seed, window=2, chunk_tokens=40, steps=16)
        names = list(streams)
        # the uninterrupted run: weights (1, w1), then (w2, 1) from step `change`
        mix = TokenMix(dict(zip(names, [1.0, w1])), L, **kw)
        mix.set_weights({names[0]: w2, names[1]: 1.0}, from_step=change)
        full = _batches(mix)
        assert len(full) == 16
        for step in range(16):
            want = mixture_counts([1.0, w1] if step < change else [w2, 1.0], 4)
            assert tuple(np.bincount(full[step]["source"].numpy(), minlength=2)) == want
        # no sequence a source served is served again within that source's epoch
        ids = _draw_ids(mix, streams, range(16))
        assert len(set(ids)) == len(ids)
        # stopped at `stop` on dp_old ranks (the change set before or after the stop), resumed on dp_new
        first = TokenMix(dict(zip(names, [1.0, w1])), L, dp_rank=0, dp_size=dp_old, **kw)
        if change < stop:
            first.set_weights([w2, 1.0], from_step=change)
        state = first.state_dict(samples_seen=stop * (4 // dp_old))
        assert state["step"] == stop and len(state["consumed"]) == 2
        rest = []
        for r in range(dp_new):
            again = TokenMix(dict(zip(names, [1.0, w1])), L, dp_rank=r, dp_size=dp_new, **kw)
            again.load_state_dict(state)
            assert again.step == stop
            if change >= stop:
                again.set_weights([w2, 1.0], from_step=change)
            rest.append(_batches(again))
        for k in range(16 - stop):
            joined = {f: torch.cat([rest[r][k][f] for r in range(dp_new)]) for f in full[0]}
            for f in full[0]:
                assert torch.equal(joined[f], full[stop + k][f]), (stop, k, f)


def test_a_small_source_repeats_by_whole_epochs(tmp_path):
    streams = _sources(tmp_path, [60, 4], 1)
    names = list(streams)
    mix = TokenMix({names[0]: 1, names[1]: 1}, L, global_batch=6, chunk_tokens=40, steps=10, window=2)
    small = mix.layouts[1].num_sequences
    ids = _draw_ids(mix, streams, range(10))
    small_ids = [(e, q) for s, e, q in ids if s == 1]
    assert len(small_ids) == 30 > 2 * small
    for e in range(len(small_ids) // small):  # every whole epoch holds each sequence once
        assert sorted(q for ee, q in small_ids if ee == e) == list(range(small))


def test_the_default_fetch_budget_holds_two_windows_and_a_chunk_of_every_source(tmp_path):
    streams = _sources(tmp_path, [200, 4], 4)
    mix = TokenMix(dict.fromkeys(streams, 1), L, global_batch=4, chunk_tokens=40, window=3)
    want = 0
    for src, lay in zip(mix.sources, mix.layouts):  # the small source has fewer chunks than a window
        want += (2 * min(3, lay.num_chunks) + 1) * (lay.largest_chunk_tokens() * src.itemsize + src.block_bytes)
    assert mix.layouts[1].num_chunks < 3 < mix.layouts[0].num_chunks
    assert mix.prefetch_bytes == want and all(src.pool.max_bytes == want for src in mix.sources)
    given = TokenMix(dict.fromkeys(streams, 1), L, global_batch=4, prefetch_bytes=1 << 20)
    assert given.prefetch_bytes == 1 << 20 and given.sources[0].pool.max_bytes == 1 << 20


def test_through_loader_workers_whole_per_rank_batches_in_step_order(tmp_path):
    streams = _sources(tmp_path, [30, 20], 2)
    names = list(streams)
    kw = dict(global_batch=6, chunk_tokens=48, steps=9, seed=4, dp_rank=1, dp_size=2, packing="documents")
    want = _batches(TokenMix({names[0]: 2, names[1]: 1}, L, **kw))
    mix = TokenMix({names[0]: 2, names[1]: 1}, L, **kw)
    loader = StreamingDataLoader(mix, batch_size=mix.per_rank_batch(), num_workers=2, multiprocessing_context="fork")
    got = [{k: v.clone() for k, v in b.items()} for b in loader]
    assert len(got) == 9 and loader.ring.fallbacks == 0 and loader.ring.opened == 9
    for g, w in zip(got, want):
        assert sorted(g.keys()) == sorted(w.keys()) == ["cu_seqlens", "input_ids", "labels", "padding",
                                                         "position_ids", "source"]
        for k in w.keys():
            assert torch.equal(g[k], w[k]), k
    # the loader's state resumes; the main process's own is refused
    it = iter(loader)
    head = [next(it)["input_ids"].clone() for _ in range(4)]
    state = loader.state_dict()
    with pytest.raises(WorkerStateError):
        mix.state_dict()
    del it
    assert state["step"] == 4
    again = TokenMix({names[0]: 2, names[1]: 1}, L, **kw)
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in again]
    assert all(torch.equal(a, w["input_ids"]) for a, w in zip(head + rest, want))


def test_weights_changed_between_passes_reach_persistent_workers(tmp_path):
    streams = _sources(tmp_path, [40, 40], 3)
    names = list(streams)
    kw = dict(global_batch=4, chunk_tokens=48, steps=10, seed=5)
    mix = TokenMix({names[0]: 1, names[1]: 1}, L, **kw)
    loader = StreamingDataLoader(mix, batch_size=4, num_workers=2, multiprocessing_context="fork",
                                 persistent_workers=True)
    it = iter(loader)
    first = [next(it)["source"].clone() for _ in range(4)]
    assert all(torch.bincount(s, minlength=2).tolist() == [2, 2] for s in first)
    with pytest.raises(WorkerStateError, match=r"mix.load_state_dict\(loader.state_dict\(\)\)"):
        mix.set_weights({names[0]: 3, names[1]: 1}, from_step=2)  # the workers served past step 2 already
    state = loader.state_dict()
    del it
    mix.load_state_dict(state)
    assert mix.step == 4
    mix.set_weights({names[0]: 3, names[1]: 1}, from_step=6)
    rest = [b["source"].clone() for b in loader]
    assert [torch.bincount(s, minlength=2).tolist() for s in rest] == [[2, 2]] * 2 + [[3, 1]] * 4
    # the same batches as one uninterrupted run with that schedule
    ref = TokenMix({names[0]: 1, names[1]: 1}, L, **kw)
    ref.set_weights([3, 1], from_step=6)
    assert all(torch.equal(a, b["source"]) for a, b in zip(first + rest, ref))


def test_an_endless_mix_and_the_stateful_dataloader(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    streams = _sources(tmp_path, [30, 30], 4)
    sources = dict.fromkeys(streams, 1.0)
    ref = iter(TokenMix(sources, L, global_batch=4, chunk_tokens=48))
    want = [next(ref)["input_ids"].clone() for _ in range(10)]
    loader = StatefulDataLoader(TokenMix(sources, L, global_batch=4, chunk_tokens=48), batch_size=None,
                                num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    head = [next(it)["input_ids"].clone() for _ in range(3)]
    state = loader.state_dict()
    del it
    loader = StatefulDataLoader(TokenMix(sources, L, global_batch=4, chunk_tokens=48), batch_size=None,
                                num_workers=2, multiprocessing_context="fork")
    loader.load_state_dict(state)
    it = iter(loader)
    rest = [next(it)["input_ids"].clone() for _ in range(7)]
    del it
    assert all(torch.equal(a, b) for a, b in zip(head + rest, want))


def test_a_state_taken_in_this_process_after_k_batches(tmp_path):
    streams = _sources(tmp_path, [30, 30], 6)
    sources = dict.fromkeys(streams, 1.0)
    mix = TokenMix(sources, L, global_batch=4, chunk_tokens=48, steps=8, dp_rank=1, dp_size=2)
    full = [b["input_ids"].clone() for b in mix]
    it = iter(mix)
    head = [next(it)["input_ids"].clone() for _ in range(3)]
    state = mix.state_dict()
    assert state == mix.state_dict(samples_seen=6) and state["step"] == 3
    it.close()
    again = TokenMix(sources, L, global_batch=4, chunk_tokens=48, steps=8, dp_rank=1, dp_size=2)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(head + [b["input_ids"] for b in again], full))


def test_bad_weights_batches_and_changes_are_named(tmp_path):
    streams = _sources(tmp_path, [20, 20], 5)
    a, b = list(streams)
    with pytest.raises(LoaderOptionError, match=r"sources\['.*s1'\]=-1"):
        TokenMix({a: 1, b: -1}, L, global_batch=4)
    with pytest.raises(LoaderOptionError, match="rounds to 0"):
        TokenMix({a: 1000, b: 1}, L, global_batch=4)
    with pytest.raises(LoaderOptionError, match="at least one source"):
        TokenMix({}, L, global_batch=4)
    with pytest.raises(LoaderOptionError, match="global_batch=0"):
        TokenMix({a: 1}, L, global_batch=0)
    mix = TokenMix({a: 1, b: 1}, L, global_batch=6, dp_rank=0, dp_size=4)
    with pytest.raises(LoaderOptionError, match="not a multiple of the data-parallel size 4"):
        mix.per_rank_batch()
    mix = TokenMix({a: 1, b: 1}, L, global_batch=8, dp_rank=0, dp_size=2)
    with pytest.raises(LoaderOptionError, match=r"batch_size=3: .* batch_size=mix.per_rank_batch\(\)"):
        StreamingDataLoader(mix, batch_size=3)
    with pytest.raises(LoaderOptionError, match="missing"):
        mix.set_weights({a: 1}, from_step=3)
    with pytest.raises(LoaderOptionError, match="1 weights for the 2 sources"):
        mix.set_weights([1.0], from_step=3)
    mix.load_state_dict(mix.state_dict(samples_seen=12))  # step 3
    with pytest.raises(LoaderOptionError, match="from_step=2 lies before step 3"):
        mix.set_weights([1, 2], from_step=2)
    it = iter(mix)
    next(it)
    with pytest.raises(PlanError, match="during a pass"):
        mix.set_weights([1, 2], from_step=9)
    it.close()
    with pytest.raises(LoaderOptionError, match="not a whole number"):
        mix.state_dict(samples_seen=5)
    other = TokenMix({a: 1, b: 1}, L, global_batch=8, seed=9)
    with pytest.raises(StateMismatchError):
        other.load_state_dict(mix.state_dict())
    assert MixturePlan  # the plan the mix runs on
