"""Whose state is it: a StreamingDataset read through DataLoader worker processes is
iterated only in copies of it, so the main process's ds.state_dict() would describe an
unread pass (it returned 'splits': [[N, 1, N, 0]] after 640 samples). It raises a
WorkerStateError naming StreamingDataLoader.state_dict() instead, under every start
method. torchdata's StatefulDataLoader, which asks each worker's copy for its state and
hands it back on resume, resumes exactly: every sample once, in the uninterrupted order."""

from __future__ import annotations

import copy
import pickle

import pytest
from torch.utils.data import DataLoader

from datapipe import ShardWriter
from datapipe.errors import StateMismatchError, WorkerStateError
from datapipe.loader import StreamingDataLoader, StreamingDataset

N = 42  # batches of 4: the last one short, so the two workers' shares differ
KW = dict(seed=3, window=2, batch_size=4)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker-state") / "ds"
    with ShardWriter(str(path), max_samples=8) as w:
        for i in range(N):
            w.write({"__key__": f"k{i:03d}", "cls": str(i)})
    return str(path)


def _keys(batch):  # module level: it pickles into spawned workers
    return [s["__key__"] for s in batch]


def _full(url):
    return [s["__key__"] for s in StreamingDataset(url, **KW)]


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_the_main_process_state_after_worker_passes_is_refused(url, context):
    ds = StreamingDataset(url, **KW)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context, collate_fn=_keys)
    it = iter(loader)
    head = [k for _ in range(5) for k in next(it)]
    with pytest.raises(WorkerStateError, match=r"StreamingDataLoader\(.*\)\.state_dict\(\)") as e:
        ds.state_dict()  # before: the state of an unread pass, 'splits': [[42, 1, 42, 0]]
    assert "samples_seen" in str(e.value) and "StatefulDataLoader" in str(e.value)
    # the count the trainer took is the way out that needs no other loader
    state = ds.state_dict(samples_seen=len(head))
    del it
    resumed = StreamingDataset(url, **KW)
    resumed.load_state_dict(state)
    assert head + [s["__key__"] for s in resumed] == _full(url)


def test_the_state_is_here_again_once_this_process_knows_it(url):
    ds = StreamingDataset(url, **KW)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", collate_fn=_keys)
    assert len([k for b in loader for k in b]) == N
    with pytest.raises(WorkerStateError):
        ds.state_dict()
    ds.set_epoch(1)  # the next pass is this process's to describe: nothing of it is read yet
    assert ds.state_dict()["epoch"] == 1
    with pytest.raises(WorkerStateError):  # ... until workers read it
        list(loader) and ds.state_dict()
    state = StreamingDataset(url, **KW).state_dict(8)
    ds.load_state_dict(state)
    assert ds.state_dict() == state
    fresh = StreamingDataset(url, **KW)
    assert len([k for b in DataLoader(fresh, batch_size=4, num_workers=2, multiprocessing_context="fork",
                                      collate_fn=_keys) for k in b]) == N
    it = iter(fresh)  # a pass in this process: its own progress is the state again
    [next(it) for _ in range(6)]
    assert fresh.state_dict() == StreamingDataset(url, **KW).state_dict(6)


def test_copies_that_are_not_workers_do_not_count(url):
    ds = StreamingDataset(url, **KW)
    for other in (copy.deepcopy(ds), pickle.loads(pickle.dumps(ds))):
        assert len(list(other)) == N
    assert ds.state_dict() == StreamingDataset(url, **KW).state_dict(0)


def test_streaming_dataloader_keeps_the_state_and_the_dataset_refuses(url):
    ds = StreamingDataset(url, **KW)
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=2, collate_fn=_keys)
    it = iter(loader)
    head = [k for _ in range(3) for k in next(it)]
    state = loader.state_dict()
    with pytest.raises(WorkerStateError):
        ds.state_dict()
    it.close()
    resumed = StreamingDataset(url, **KW)
    resumed.load_state_dict(state)
    assert head + [s["__key__"] for s in resumed] == _full(url)


# -- torchdata's StatefulDataLoader -------------------------------------------------------


def _stateful(url, context, state=None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(StreamingDataset(url, **KW), batch_size=4, num_workers=2, collate_fn=_keys,
                                multiprocessing_context=context)
    if state is not None:
        loader.load_state_dict(state)
    return loader


@pytest.mark.parametrize("context", ["fork", "forkserver"])  # forkserver: the dataset is pickled into workers
def test_stateful_dataloader_resumes_every_sample_once_from_any_batch(url, context):
    pytest.importorskip("torchdata.stateful_dataloader")
    full = _full(url)
    assert [k for b in _stateful(url, context) for k in b] == full
    batches = -(-N // 4)
    points = range(batches + 1) if context == "fork" else (0, 3, batches)  # a few: each start costs more
    for taken in points:
        loader = _stateful(url, context)
        it = iter(loader)
        head = [k for _ in range(taken) for k in next(it)]
        state = loader.state_dict()
        del it
        workers = state["_snapshot"]["_worker_snapshots"]
        assert {w["dataset_state"]["worker"]["id"] for w in workers.values()} == {0, 1}
        rest = [k for b in _stateful(url, context, state) for k in b]
        assert head + rest == full, taken  # every sample once, in the uninterrupted order


def test_one_workers_state_does_not_load_into_the_main_process(url):
    pytest.importorskip("torchdata.stateful_dataloader")
    loader = _stateful(url, "fork")
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    worker_state = state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]
    ds = StreamingDataset(url, **KW)
    with pytest.raises(StateMismatchError, match=r"StatefulDataLoader\.load_state_dict"):
        ds.load_state_dict(worker_state)
    assert ds.state_dict() == StreamingDataset(url, **KW).state_dict(0)
