"""Mixtures: exact per-batch counts, each source's epochs served without repeats across weight
changes, and resume at any step on any data-parallel size equal to the uninterrupted run."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import OptionError, PlanError, StateMismatchError
from datapipe.plan.mixture import MixturePlan, WorkerSteps, mixture_counts, worker_steps

weights_st = st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10.0)), min_size=1, max_size=4).filter(any)
sources_st = st.lists(st.one_of(st.integers(1, 40), st.lists(st.integers(0, 9), min_size=1, max_size=5)
                                .filter(lambda c: sum(c) > 0)), min_size=4, max_size=4)


def plan_for(sources, weights, B, dp, seed=1, window=2):
    try:
        return MixturePlan(sources[:len(weights)], weights, B, seed=seed, dp_size=dp, window=window)
    except OptionError as e:
        assert "rounds to 0" in str(e)
        return None


def full_batch(plan, step, dp):
    parts = [plan.batch(step, r) for r in range(dp)]
    return [np.concatenate([getattr(p, f) for p in parts]) for f in ("source", "chunk", "sample", "draw")]


@given(weights=weights_st, B=st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_counts_are_largest_remainder_and_exact(weights, B):
    try:
        c = mixture_counts(weights, B)
    except OptionError as e:
        assert "rounds to 0" in str(e)
        return
    assert sum(c) == B
    total = sum(weights)
    for w, n in zip(weights, c):
        assert abs(n - w / total * B) < 1 + 1e-9  # within one of its quota
        assert (n == 0) == (w == 0)


def test_extreme_weights_work_or_are_refused_by_name():
    assert mixture_counts([1.0, 0.0, 3.0], 8) == (2, 0, 6)
    assert mixture_counts([1, 1, 1], 8) == (3, 3, 2)  # ties to the lower index
    with pytest.raises(OptionError, match="rounds to 0"):
        mixture_counts([1e-300, 1.0], 2**40)
    with pytest.raises(OptionError, match=r"weights\[0\]=1e-09 .* rounds to 0"):
        mixture_counts([1e-9, 1.0], 1024)
    assert mixture_counts([1e-9, 1.0], 10**10) == (10, 10**10 - 10)
    for bad, match in (([0.0, 0.0], "all zero"), ([-1.0, 1.0], "finite number"), ([float("nan")], "finite"),
                       ([float("inf"), 1.0], "finite"), ([True, 1.0], "finite")):
        with pytest.raises(OptionError, match=match):
            mixture_counts(bad, 8)
    with pytest.raises(OptionError, match="holds no sequence"):
        MixturePlan([np.array([0, 0]), 5], [1, 1], 4)
    with pytest.raises(OptionError, match="multiple of dp_size"):
        MixturePlan([5, 5], [1, 1], 6, dp_size=4)
    with pytest.raises(OptionError, match="2 entries for 3 sources"):
        MixturePlan([5, 5, 5], [1, 1], 4)


@given(sources=sources_st, weights=weights_st, new=weights_st, B=st.sampled_from([1, 2, 4, 6, 8, 12]),
       seed=st.integers(0, 2**32), steps=st.integers(1, 30), change=st.integers(0, 30))
@settings(max_examples=60, deadline=None)
def test_batches_hold_exact_counts_and_each_source_epoch_has_no_repeats(sources, weights, new, B, seed, steps, change):
    dp = next(d for d in (4, 3, 2, 1) if B % d == 0)
    plan = plan_for(sources, weights, B, dp, seed=seed)
    if plan is None:
        return
    new = (new * 4)[:len(weights)]
    try:  # a new mixture mid-run: each source goes on from its own draw counter
        plan.set_weights(new, from_step=change)
    except OptionError as e:
        assert any(m in str(e) for m in ("rounds to 0", "holds no sequence", "all zero"))
    served: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k in range(steps):
        src, chunk, sample, draw = full_batch(plan, k, dp)
        assert Counter(src.tolist()) == {s: c for s, c in enumerate(plan.counts(k)) if c}
        for s, c, i, d in zip(src.tolist(), chunk.tolist(), sample.tolist(), draw.tolist()):
            served.setdefault((s, d // plan.sizes[s]), []).append((c, i))
    for (s, _epoch), seqs in served.items():
        assert len(set(seqs)) == len(seqs)  # within one epoch of a source: no repeats
        counts = plan.sources[s]
        assert all(0 <= c < counts.size and 0 <= i < counts[c] for c, i in seqs)
    for (s, epoch), seqs in served.items():  # a whole epoch served is exactly the source
        if (s, epoch + 1) in served:
            assert len(seqs) == plan.sizes[s]


def test_small_sources_are_upsampled_by_whole_epochs():
    plan = MixturePlan([3, 1000], [1, 1], 8, seed=5)
    draws = np.concatenate([plan.batch(k).draw[plan.batch(k).source == 0] for k in range(6)])
    assert sorted(draws.tolist()) == list(range(24))
    per_epoch = {}
    for k in range(6):
        b = plan.batch(k)
        for d, i in zip(b.draw[b.source == 0].tolist(), b.sample[b.source == 0].tolist()):
            per_epoch.setdefault(d // 3, set()).add(i)
    assert all(v == {0, 1, 2} for v in per_epoch.values()) and len(per_epoch) == 8


@given(sources=sources_st, weights=weights_st, new=weights_st, B=st.sampled_from([2, 4, 8, 12]),
       change=st.integers(0, 12), at=st.integers(0, 20), dp_a=st.sampled_from([1, 2, 4]),
       dp_b=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_resume_on_another_dp_size_is_the_uninterrupted_run(sources, weights, new, B, change, at, dp_a, dp_b, seed):
    n = min(len(weights), len(new))
    weights, new = weights[:n], new[:n]
    if not any(weights) or not any(new) or B % dp_a or B % dp_b:
        return
    base = plan_for(sources, weights, B, dp_a, seed=seed)
    if base is None:
        return
    try:
        base.set_weights(new, from_step=change)
    except OptionError as e:
        assert "rounds to 0" in str(e)
        return
    horizon = 24
    want = [full_batch(base, k, dp_a) for k in range(horizon)]
    state = json.loads(json.dumps(base.state_dict(at)))  # JSON-able
    assert len(json.dumps(state)) < 400 + 60 * n
    resumed = MixturePlan.from_state(sources[:n], state, global_batch=B, seed=seed, dp_size=dp_b, window=2)
    for k in range(at, horizon):
        got = full_batch(resumed, k, dp_b)
        for g, w in zip(got, want[k]):
            assert np.array_equal(g, w), k
    if at:
        with pytest.raises(PlanError, match="before this plan's start"):
            resumed.batch(at - 1)


def test_weight_changes_continue_each_source_and_fold_into_the_state():
    plan = MixturePlan([np.array([4, 4]), 6, 10], [1, 1, 2], 4, seed=2)
    assert plan.counts(0) == (1, 1, 2)
    plan.set_weights([0, 1, 1], from_step=3)
    plan.set_weights([1, 0, 3], from_step=5)
    assert plan.consumed(3).tolist() == [3, 3, 6]
    assert plan.consumed(5).tolist() == [3, 7, 10]
    assert plan.consumed(7).tolist() == [5, 7, 16]
    state = plan.state_dict(6)
    assert state["consumed"] == [4, 7, 13] and state["pending"] == []
    assert set(state) == {"version", "kind", "fingerprint", "global_batch", "step", "consumed", "counts",
                          "weights", "pending"}
    early = plan.state_dict(4)  # a change still to come travels with the state
    assert early["pending"] == [[5, [1.0, 0.0, 3.0]]]
    again = MixturePlan.from_state([np.array([4, 4]), 6, 10], early, global_batch=4, seed=2)
    for k in range(4, 9):
        assert np.array_equal(again.batch(k).draw, plan.batch(k).draw)
    with pytest.raises(OptionError, match="already fixed"):
        again.set_weights([1, 1, 1], from_step=3)
    # a new mixture on resume (Megatron-LM PR #725): from the resume step, no source rewinds
    mixed = MixturePlan.from_state([np.array([4, 4]), 6, 10], early, global_batch=4, seed=2, weights=[1, 3, 0])
    assert mixed.counts(4) == (1, 3, 0) and mixed.consumed(4).tolist() == plan.consumed(4).tolist()


def test_state_must_belong_to_the_same_sources_and_seed():
    plan = MixturePlan([5, 7], [1, 1], 4, seed=3)
    state = plan.state_dict(2)
    for kwargs in ({"seed": 4}, {"window": 5}):
        with pytest.raises(StateMismatchError, match="fingerprint"):
            MixturePlan.from_state([5, 7], state, global_batch=4, **{"seed": 3, **kwargs})
    with pytest.raises(StateMismatchError, match="fingerprint"):
        MixturePlan.from_state([5, 8], state, global_batch=4, seed=3)
    for bad in ({**state, "version": 9}, {**state, "kind": "epoch"}, {**state, "consumed": [1]},
                {**state, "counts": [1, 1]}, {**state, "step": -1}, {**state, "pending": [[1, [1, 1]]]}, []):
        with pytest.raises(StateMismatchError):
            MixturePlan.from_state([5, 7], bad, global_batch=4, seed=3)
    # another global batch: the state's weights rounded afresh from its step on
    wider = MixturePlan.from_state([5, 7], state, global_batch=8, seed=3)
    assert wider.counts(2) == (4, 4) and wider.consumed(2).tolist() == [4, 4]


def test_workers_take_global_steps_round_robin():
    assert list(worker_steps(10, 1, 3, 20)) == [11, 14, 17]
    every = sorted(k for w in range(3) for k in worker_steps(10, w, 3, 20))
    assert every == list(range(10, 20))
    with pytest.raises(OptionError):
        worker_steps(0, 3, 3, 10)


def test_a_workers_steps_index_like_a_sequence_and_refuse_what_they_cannot_be():
    ws = worker_steps(10, 1, 3, 20, group=2)  # groups (10, 11) (12, 13) ... taken in turn: worker 1 gets 12, 13, 18, 19
    assert list(ws) == [12, 13, 18, 19] == ws[0:4]
    assert (ws[0], ws[3], ws[-1], ws[-4]) == (12, 19, 19, 12)
    assert list(ws[1:]) == [13, 18, 19] and ws[1:][0] == 13
    with pytest.raises(IndexError):
        ws[4]
    with pytest.raises(OptionError, match="in order only"):
        ws[::2]
    for bad in (dict(worker=0, num_workers=0), dict(worker=-1, num_workers=2), dict(worker=0, num_workers=2, group=0)):
        with pytest.raises(OptionError):
            WorkerSteps(0, stop=10, **bad)


def test_a_batch_is_a_function_of_the_step_only():
    a = MixturePlan([100, 50], [0.3, 0.7], 16, seed=9, dp_size=4)
    b = MixturePlan([100, 50], [0.3, 0.7], 16, seed=9, dp_size=1)
    for k in (0, 7, 1000):
        assert np.array_equal(np.concatenate([a.batch(k, r).source for r in range(4)]), b.batch(k).source)
    assert not np.array_equal(a.batch(0).source, a.batch(1).source)
    with pytest.raises(OptionError, match="dp_rank"):
        a.batch(0, 4)
