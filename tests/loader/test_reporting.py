"""Loader errors a user can act on (issue 9, "unclear errors"): arguments named as passed,
skips in DataLoader worker processes reported in the main process (with an exact resume
point), and a second live pass over one StreamingDataset refused instead of corrupting
its resume state."""

from __future__ import annotations

import warnings

import pytest

from datapipe import ShardWriter
from datapipe.errors import PlanError
from datapipe.loader import StreamingDataLoader, StreamingDataset

N = 120
BAD = ("s0007", "s0093")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = tmp_path_factory.mktemp("reporting") / "ds"
    with ShardWriter(str(path), max_samples=17) as w:
        for i in range(N):
            meta = b"{not json" if f"s{i:04d}" in BAD else {"i": i}
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "json": meta})
    return str(path)


def _keys(batch):  # a module-level collate function: it pickles into worker processes
    return [s["__key__"] for s in batch]


@pytest.mark.parametrize("value", [0, -1])
def test_a_bad_prefetch_budget_is_named_as_the_user_passed_it(url, value):
    with pytest.raises(PlanError, match=rf"prefetch_bytes={value}\b") as e:
        StreamingDataset(url, prefetch_bytes=value)
    assert "max_bytes" not in str(e.value) and "lookahead" not in str(e.value)
    with pytest.raises(PlanError, match=r"concurrency=0\b"):
        StreamingDataset(url, concurrency=0)


def _loader(url, **kw):
    ds = StreamingDataset(url, window=3, seed=4, decode="auto", on_error="skip")
    return StreamingDataLoader(ds, batch_size=5, num_workers=2, collate_fn=_keys, **kw)


def test_skips_in_worker_processes_are_reported_in_the_main_process(url):
    loader = _loader(url)
    with pytest.warns(RuntimeWarning, match="skipped 2 unreadable") as rec:
        keys = [k for batch in loader for k in batch]
    text = " ".join(str(w.message) for w in rec if "skipped" in str(w.message))
    assert all(k in text for k in BAD) and ".tar" in text
    assert len(keys) == N - 2 and not set(BAD) & set(keys) and len(set(keys)) == N - 2
    assert sorted(k for _, k, _ in loader.skipped) == sorted(BAD)
    assert sorted(k for _, k, _ in loader.dataset.skipped) == sorted(BAD)
    assert all(".tar" in u and "json" in why.lower() for u, _, why in loader.skipped)
    assert loader.samples_seen == N  # skipped samples are consumed plan steps too


def test_resume_after_a_skip_in_a_worker_is_exact(url):
    # the plan's order, read without decoding (nothing to skip)
    order = [s["__key__"] for s in StreamingDataset(url, window=3, seed=4, decode=None)]
    full = [k for k in order if k not in BAD]
    batches = min(order.index(k) for k in BAD) // 5 + 3  # two batches past the first skip
    loader = _loader(url)
    head = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        it = iter(loader)
        for _ in range(batches):
            head += next(it)
        state = loader.state_dict()
        it.close()
    again = _loader(url)
    again.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rest = [k for batch in again for k in batch]
    assert head + rest == full


def test_a_batch_of_only_skipped_samples_is_counted_not_yielded(url):
    ds = StreamingDataset(url, shuffle=False, decode="auto", on_error="skip")
    loader = StreamingDataLoader(ds, batch_size=None, num_workers=1)  # one sample per "batch"
    with pytest.warns(RuntimeWarning, match="skipped 2 unreadable"):
        got = [s["__key__"] for s in loader]
    assert got == [f"s{i:04d}" for i in range(N) if f"s{i:04d}" not in BAD]
    assert loader.samples_seen == N


def test_a_second_live_pass_is_refused_and_the_first_keeps_its_state(url):
    ds = StreamingDataset(url, window=3, seed=2, decode=None)
    full = [s["__key__"] for s in StreamingDataset(url, window=3, seed=2, decode=None)]
    first = iter(ds)
    head = [next(first)["__key__"] for _ in range(10)]
    second = iter(ds)
    with pytest.raises(PlanError, match="already being iterated"):
        next(second)
    head += [next(first)["__key__"] for _ in range(5)]
    state = ds.state_dict()  # still the first pass's: 15 samples in
    first.close()
    resumed = StreamingDataset(url, window=3, seed=2, decode=None)
    resumed.load_state_dict(state)
    assert head + [s["__key__"] for s in resumed] == full
    assert next(iter(ds))["__key__"] == full[0]  # closed (or dropped) passes free the dataset
    assert next(iter(ds))["__key__"] == full[0]


def test_a_second_live_pass_of_one_loader_is_refused(url):
    ds = StreamingDataset(url, window=3, seed=2, decode=None)
    loader = StreamingDataLoader(ds, batch_size=4, collate_fn=_keys)
    first = iter(loader)
    next(first)
    with pytest.raises(PlanError, match="already being iterated"):
        next(iter(loader))
    next(first)
    assert loader.samples_seen == 8
    first.close()
    assert len([k for b in loader for k in b]) == N


def test_skips_reach_the_main_process_from_spawned_workers(url):
    """Spawned workers get the dataset, the markers and the collate wrapper by pickle."""
    ds = StreamingDataset(url, window=3, seed=4, decode="auto", on_error="skip")
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn")
    with pytest.warns(RuntimeWarning, match="skipped 2 unreadable"):
        keys = [k for batch in loader for k in batch["__key__"]]  # the default collate
    assert len(keys) == N - 2 and sorted(k for _, k, _ in loader.skipped) == sorted(BAD)
    assert loader.samples_seen == N


def test_the_main_copy_read_directly_during_a_worker_pass_yields_samples_only(url):
    ds = StreamingDataset(url, window=3, seed=4, decode="auto", on_error="skip")
    loader = StreamingDataLoader(ds, batch_size=5, num_workers=1, collate_fn=_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        it = iter(loader)
        next(it)
        direct = list(ds)  # this process's copy is not the one the worker reads
        it.close()
    assert len(direct) == N - 2 and all(isinstance(s, dict) for s in direct)
