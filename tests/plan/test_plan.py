"""Planning: orders are permutations, partitions deliver exactly once, resume continues."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import PlanError, StateMismatchError
from datapipe.plan import (
    EpochPlan,
    batch_steps,
    epoch_order,
    feistel_permute,
    order_quality,
    worker_batches,
)

layouts = st.lists(st.integers(0, 40), min_size=1, max_size=25)
seeds = st.integers(0, 2**32)
windows = st.integers(1, 30)


@given(m=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
@settings(max_examples=60, deadline=None)
def test_feistel_is_a_permutation(m, key):
    img = feistel_permute(np.arange(m), m, key)
    assert np.array_equal(np.sort(img), np.arange(m))


def test_feistel_depends_on_key_and_rejects_outside():
    a = feistel_permute(np.arange(1000), 1000, 1)
    b = feistel_permute(np.arange(1000), 1000, 2)
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(1000))
    with pytest.raises(ValueError):
        feistel_permute(np.array([1000]), 1000, 1)


def _all_pairs(counts):
    return {(s, i) for s, c in enumerate(counts) for i in range(c)}


@given(counts=layouts, seed=seeds, epoch=st.integers(0, 50), window=windows,
       algo=st.sampled_from(["window", "none"]))
@settings(max_examples=80, deadline=None)
def test_epoch_order_is_a_permutation(counts, seed, epoch, window, algo):
    order = epoch_order(np.array(counts), seed, epoch, window, algo)
    n = sum(counts)
    assert order.num_samples == n
    shard, sample = order.locate(np.arange(n))
    pairs = list(zip(shard.tolist(), sample.tolist()))
    assert len(set(pairs)) == n
    assert set(pairs) == _all_pairs(counts)


@given(counts=layouts, seed=seeds, window=windows)
@settings(max_examples=40, deadline=None)
def test_window_keeps_samples_inside_their_window(counts, seed, window):
    order = epoch_order(np.array(counts), seed, 0, window)
    for w, (lo, hi) in enumerate(zip(order.window_starts[:-1], order.window_starts[1:])):
        shards = set(order.locate(np.arange(lo, hi))[0].tolist())
        slots = set(order.shard_order[w * order.window:(w + 1) * order.window].tolist())
        assert shards <= slots


def test_order_is_deterministic_and_changes_by_epoch():
    counts = np.full(20, 50)
    a = epoch_order(counts, 7, 1, 4).locate(np.arange(1000))
    b = epoch_order(counts, 7, 1, 4).locate(np.arange(1000))
    c = epoch_order(counts, 7, 2, 4).locate(np.arange(1000))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0] * 100 + a[1], c[0] * 100 + c[1])


def _rank_stream(plan, rank, start=None):
    start = plan.start if start is None else start
    return plan.rank_samples(rank, np.arange(start, plan.per_rank))


def _worker_streams(plan, rank, num_workers, batch_size, start=None):
    """Steps each worker reads, interleaved by batch the way DataLoader collects them."""
    start = plan.start if start is None else start
    per_worker = []
    for w in range(num_workers):
        b = worker_batches(start, plan.per_rank, batch_size, w, num_workers)
        per_worker.append(batch_steps(start, plan.per_rank, batch_size, b))
    # DataLoader round robin: batch k comes from worker k % num_workers
    out, k = [], 0
    cursors = [0] * num_workers
    while any(cursors[w] < len(per_worker[w]) for w in range(num_workers)):
        w = k % num_workers
        if cursors[w] < len(per_worker[w]):
            out.append(per_worker[w][cursors[w]:cursors[w] + batch_size])
            cursors[w] += batch_size
        k += 1
    return np.concatenate(out) if out else np.empty(0, np.int64)


@given(counts=layouts, seed=seeds, window=windows, world=st.integers(1, 9),
       workers=st.integers(1, 4), batch=st.integers(1, 7), drop=st.booleans())
@settings(max_examples=80, deadline=None)
def test_exactly_once_across_ranks_and_workers(counts, seed, window, world, workers, batch, drop):
    plan = EpochPlan(np.array(counts), seed=seed, window=window, world=world, drop_last=drop)
    n = sum(counts)
    seen = []
    for r in range(world):
        steps = _worker_streams(plan, r, workers, batch)
        # workers together read the rank's stream in order
        assert np.array_equal(steps, np.arange(plan.per_rank))
        shard, sample, pad = plan.rank_samples(r, steps)
        assert len(shard) == plan.per_rank  # equal counts on every rank
        seen += [(s, i) for s, i, p in zip(shard.tolist(), sample.tolist(), pad.tolist()) if not p]
    assert len(seen) == len(set(seen))
    if drop:
        assert n - len(seen) < world
        assert plan.per_rank == n // world
    else:
        assert set(seen) == _all_pairs(counts)
        assert plan.per_rank == -(-n // world)


def test_ranks_read_mostly_disjoint_shards():
    counts = np.full(64, 100)
    plan = EpochPlan(counts, seed=1, window=4, world=8)
    sets = [set(_rank_stream(plan, r)[0].tolist()) for r in range(8)]
    shared = sum(len(a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    assert all(len(s) <= 8 for s in sets)  # a rank touches about 2 windows, not all 64 shards
    assert shared <= 8


@given(counts=layouts, seed=seeds, window=windows, world=st.integers(1, 6),
       new_world=st.integers(1, 6), drop=st.booleans(), frac=st.floats(0, 1))
@settings(max_examples=80, deadline=None)
def test_resume_at_a_random_point(counts, seed, window, world, new_world, drop, frac):
    counts = np.array(counts)
    plan = EpochPlan(counts, seed=seed, epoch=3, window=window, world=world, drop_last=drop)
    c = int(frac * plan.per_rank)
    state = plan.state_dict(consumed=c)
    # same world: the rest of the uninterrupted stream, sample for sample
    same = EpochPlan.from_state(counts, state, seed=seed, window=window, world=world, drop_last=drop)
    assert same.start == c
    for r in range(world):
        full = _rank_stream(plan, r, start=0)
        rest = _rank_stream(same, r)
        assert all(np.array_equal(f[c:], x) for f, x in zip(full, rest))
    # changed world: what was read plus what is left is every sample exactly once
    moved = EpochPlan.from_state(counts, state, seed=seed, window=window, world=new_world, drop_last=False)
    seen = []
    for r in range(world):
        s, i, p = plan.rank_samples(r, np.arange(c))
        seen += [(a, b) for a, b, q in zip(s.tolist(), i.tolist(), p.tolist()) if not q]
    per_rank = {len(_rank_stream(moved, r)[0]) for r in range(new_world)}
    assert len(per_rank) == 1
    for r in range(new_world):
        s, i, p = _rank_stream(moved, r)
        seen += [(a, b) for a, b, q in zip(s.tolist(), i.tolist(), p.tolist()) if not q]
    assert len(seen) == len(set(seen))
    assert set(seen) == _all_pairs(counts)


@given(seed=seeds, worlds=st.lists(st.integers(1, 7), min_size=2, max_size=5),
       fracs=st.lists(st.floats(0, 1), min_size=5, max_size=5))
@settings(max_examples=40, deadline=None)
def test_repeated_elastic_resume_is_exactly_once(seed, worlds, fracs):
    counts = np.array([13, 0, 7, 29, 31, 5, 17])
    plan = EpochPlan(counts, seed=seed, window=3, world=worlds[0])
    seen = []
    for new_world, frac in zip([*worlds[1:], 1], fracs):
        c = int(frac * (plan.per_rank - plan.start)) + plan.start
        for r in range(plan.world):
            s, i, p = plan.rank_samples(r, np.arange(plan.start, c))
            seen += [(a, b) for a, b, q in zip(s.tolist(), i.tolist(), p.tolist()) if not q]
        plan = EpochPlan.from_state(counts, plan.state_dict(c), seed=seed, window=3, world=new_world)
    for r in range(plan.world):
        s, i, p = _rank_stream(plan, r)
        seen += [(a, b) for a, b, q in zip(s.tolist(), i.tolist(), p.tolist()) if not q]
    assert len(seen) == len(set(seen)) == counts.sum()


def test_state_is_a_few_integers_and_json():
    import json

    plan = EpochPlan(np.array([10, 20, 30]), seed=5, epoch=2, window=2, world=2)
    state = plan.state_dict(7)
    assert json.loads(json.dumps(state)) == state
    assert state["epoch"] == 2 and state["splits"] == [[60, 2, 30, 7]]


def test_state_from_another_dataset_or_seed_is_refused():
    counts = np.array([10, 20, 30])
    state = EpochPlan(counts, seed=5, window=2).state_dict(3)
    with pytest.raises(StateMismatchError, match="seed"):
        EpochPlan.from_state(counts, state, seed=6, window=2)
    with pytest.raises(StateMismatchError, match="another dataset"):
        EpochPlan.from_state(np.array([10, 20, 31]), state, seed=5, window=2)
    with pytest.raises(StateMismatchError, match="window"):
        EpochPlan.from_state(counts, state, seed=5, window=3)
    with pytest.raises(StateMismatchError):
        EpochPlan.from_state(counts, {"version": 99}, seed=5, window=2)
    with pytest.raises(StateMismatchError):
        EpochPlan.from_state(counts, [1, 2], seed=5, window=2)
    bad = dict(state, splits=[[60, 1, 60, 61]])
    with pytest.raises(StateMismatchError, match="inconsistent"):
        EpochPlan.from_state(counts, bad, seed=5, window=2)


def test_bad_layouts_are_refused():
    with pytest.raises(PlanError):
        EpochPlan(np.array([3, -1]))
    with pytest.raises(PlanError):
        EpochPlan(np.array([[3, 1]]))
    with pytest.raises(PlanError):
        EpochPlan(np.array([3, 1]), window=0)
    with pytest.raises(PlanError):
        epoch_order(np.array([3]), 0, 0, 1, "bogus")
    with pytest.raises(PlanError):
        EpochPlan(np.array([3]), world=0)


def test_empty_layout_plans_nothing():
    plan = EpochPlan(np.array([0, 0]), world=3)
    assert plan.per_rank == 0
    assert len(plan.rank_samples(0, np.arange(0))[0]) == 0


def test_quality_reports_what_a_window_costs():
    counts = np.full(200, 100)
    none = order_quality(epoch_order(counts, 0, 0, 1, "none"), counts, batch_size=64)
    w1 = order_quality(epoch_order(counts, 0, 0, 1), counts, batch_size=64)
    w8 = order_quality(epoch_order(counts, 0, 0, 8), counts, batch_size=64)
    full = order_quality(epoch_order(counts, 0, 0, 200), counts, batch_size=64)
    assert none["position_correlation"] > 0.99 and none["mean_shards_per_batch"] < 1.7
    assert w1["mean_shards_per_batch"] < 1.7
    assert 5 < w8["mean_shards_per_batch"] <= 9  # batches straddling two windows see up to 16
    assert full["mean_shards_per_batch"] > 40
    assert abs(full["position_correlation"]) < 0.05


def test_huge_plan_stays_in_o_shards_memory():
    counts = np.full(10**6, 10**4, dtype=np.int64)  # 10^10 samples in 10^6 shards
    tracemalloc.start()
    try:
        plan = EpochPlan(counts, seed=3, window=64, world=1000)
        shard, sample, pad = plan.rank_samples(999, np.arange(plan.per_rank - 4096, plan.per_rank))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20
    assert plan.per_rank == 10**7
    assert shard.max() < 10**6 and sample.max() < 10**4 and not pad.any()
