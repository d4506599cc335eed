"""TokenDataset through real DataLoader worker processes (fork, forkserver, spawn): a
StreamingDataLoader's batches come through its shared-memory ring as one tensor per field
and equal the in-process pass batch for batch; a plain DataLoader gets the same sequences;
the main process's state_dict() after a pass its workers ran is refused (WorkerStateError),
the loader's resumes exactly, on another number of workers too; persistent workers follow
set_epoch and load_state_dict; torchdata's StatefulDataLoader resumes from any batch;
pin_memory=True without an accelerator is handled."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from datapipe import StreamingDataLoader, TokenDataset
from datapipe.errors import LoaderOptionError, StateMismatchError, WorkerStateError
from tests.token_datasets import random_documents, write_tokens

L = 16
KW = dict(seed=3, window=2, chunk_tokens=96)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    write_tokens(path, [random_documents(rng, 30), random_documents(rng, 25)])
    return str(path)


def _inprocess(root, batch, **kw):
    ds = TokenDataset(root, L, batch_size=batch, batched=True, **(KW | kw))
    return [{k: v.clone() for k, v in b.items()} for b in ds]


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g.keys()) == sorted(w.keys())
        for k in w.keys():
            assert torch.equal(g[k], w[k]), k


@pytest.mark.parametrize("context,packing", [("fork", "concat"), ("forkserver", "documents"), ("spawn", "concat")])
def test_batches_cross_the_ring_as_tensors_equal_to_the_in_process_pass(root, context, packing):
    want = _inprocess(root, 5, packing=packing)
    loader = StreamingDataLoader(TokenDataset(root, L, packing=packing, **KW), batch_size=5, num_workers=2,
                                 multiprocessing_context=context, persistent_workers=False)
    got = [{k: v.clone() for k, v in b.items()} for b in loader]
    _same(got, want)
    assert loader.ring.opened == len(want) and loader.ring.fallbacks == 0  # every batch through shared memory
    assert got[0]["input_ids"].dtype == torch.int64 and got[0]["input_ids"].shape == (5, L + (packing == "concat"))


@pytest.mark.parametrize("packing", ["concat", "documents"])
def test_batches_held_past_the_rings_slots_come_pickled_and_equal(root, packing, monkeypatch):
    """A worker writes each batch (each group of batches, one message) straight into a ring
    slot; a trainer that holds more groups than the ring has slots gets the rest pickled,
    made from the same rows. (batch_size=1: a group holds 16 batches here, so a worker
    sends more groups than it has slots.)"""
    import datapipe.tokens.dataset

    monkeypatch.setattr(datapipe.tokens.dataset, "GROUP_BATCHES", 16)  # forked workers see it too
    want = _inprocess(root, 1, packing=packing)
    loader = StreamingDataLoader(TokenDataset(root, L, packing=packing, **KW), batch_size=1, num_workers=2,
                                 multiprocessing_context="fork", prefetch_factor=1)
    held = list(loader)  # nothing dropped: every slot stays taken
    assert loader.ring.fallbacks > 0 and loader.ring.opened > 0
    _same(held, want)


@settings(max_examples=6)
@given(workers=st.integers(1, 3), batch=st.integers(1, 6), packing=st.sampled_from(["concat", "documents"]),
       seed=st.integers(0, 2**32), skip=st.integers(0, 40))
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_any_number_of_workers_gives_the_rank_stream_in_order(root, workers, batch, packing, seed, skip):
    """Real worker processes (fork), any count and batch size, from a resume point: the
    loader's batches are the in-process pass's, in order."""
    kw = KW | dict(seed=seed, packing=packing)
    state = TokenDataset(root, L, **kw).state_dict(samples_seen=skip)
    ref = TokenDataset(root, L, batch_size=batch, batched=True, **kw)
    ref.load_state_dict(state)
    want = [{k: v.clone() for k, v in b.items()} for b in ref]
    ds = TokenDataset(root, L, **kw)
    loader = StreamingDataLoader(ds, batch_size=batch, num_workers=workers, multiprocessing_context="fork",
                                 persistent_workers=False)
    loader.load_state_dict(state)
    _same([{k: v.clone() for k, v in b.items()} for b in loader], want)


def test_a_plain_dataloader_gets_the_same_sequences(root):
    want = torch.cat([b["input_ids"] for b in _inprocess(root, 4)])
    items = DataLoader(TokenDataset(root, L, batch_size=4, **KW), batch_size=4, num_workers=2,
                       multiprocessing_context="fork")
    assert torch.equal(torch.cat([b["input_ids"] for b in items]), want)
    batches = DataLoader(TokenDataset(root, L, batch_size=4, batched=True, **KW), batch_size=None, num_workers=2,
                         multiprocessing_context="fork")
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), want)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_the_main_process_state_is_refused_and_the_loaders_resumes_exactly(root):
    full = torch.cat([b["input_ids"] for b in _inprocess(root, 4)])
    ds = TokenDataset(root, L, batch_size=4, **KW)
    list(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork"))
    with pytest.raises(WorkerStateError, match=r"StreamingDataLoader\(\.\.\.\)\.state_dict\(\)"):
        ds.state_dict()
    loader = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=4, num_workers=2,
                                 multiprocessing_context="fork")
    it = iter(loader)
    head = [next(it)["input_ids"].clone() for _ in range(5)]
    state = loader.state_dict()
    with pytest.raises(WorkerStateError):
        loader.stream.state_dict()
    del it
    assert state == TokenDataset(root, L, **KW).state_dict(samples_seen=20)
    # the rest through three workers of another loader
    again = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=4, num_workers=3,
                                multiprocessing_context="fork")
    again.load_state_dict(state)
    rest = [b["input_ids"].clone() for b in again]
    assert torch.equal(torch.cat(head + rest), full)


def test_persistent_workers_follow_set_epoch_and_load_state_dict(root):
    ds = TokenDataset(root, L, **KW)
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork",
                                 persistent_workers=True)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        got = torch.cat([b["input_ids"] for b in loader])
        ref = TokenDataset(root, L, batch_size=4, batched=True, **KW)
        ref.set_epoch(epoch)
        assert torch.equal(got, torch.cat([b["input_ids"] for b in ref])), epoch
    state = TokenDataset(root, L, **KW).state_dict(samples_seen=8)
    loader.load_state_dict(state)
    ds.set_epoch(0)
    rest = torch.cat([b["input_ids"] for b in loader])
    assert torch.equal(rest, torch.cat([b["input_ids"] for b in _inprocess(root, 4)])[8:])


def test_pin_memory_without_an_accelerator_is_handled(root):
    want = _inprocess(root, 4)
    loader = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=4, num_workers=2,
                                 multiprocessing_context="fork", pin_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no accelerator is here to pin for
        got = [{k: v.clone() for k, v in b.items()} for b in loader]
    _same(got, want)
    assert not torch.cuda.is_available()


def _stateful(root, state=None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(TokenDataset(root, L, batch_size=4, **KW), batch_size=4, num_workers=2,
                                multiprocessing_context="fork")
    if state is not None:
        loader.load_state_dict(state)
    return loader


def test_stateful_dataloader_resumes_from_any_batch(root):
    pytest.importorskip("torchdata.stateful_dataloader")
    full = torch.cat([b["input_ids"] for b in _stateful(root)])
    batches = -(-full.shape[0] // 4)
    for taken in (0, 3, batches - 1, batches):
        loader = _stateful(root)
        it = iter(loader)
        head = [next(it)["input_ids"] for _ in range(taken)]
        state = loader.state_dict()
        del it
        workers = state["_snapshot"]["_worker_snapshots"]
        assert {w["dataset_state"]["worker"]["id"] for w in workers.values()} == {0, 1}
        rest = [b["input_ids"] for b in _stateful(root, state)]
        assert torch.equal(torch.cat(head + rest), full), taken
    worker_state = workers["worker_0"]["dataset_state"]
    with pytest.raises(StateMismatchError, match=r"StatefulDataLoader\.load_state_dict"):
        TokenDataset(root, L, **KW).load_state_dict(worker_state)


def test_a_lazy_tensor_is_written_straight_into_a_ring_slot_and_made_once_elsewhere():
    import multiprocessing
    import pickle

    from datapipe.loader import Batch
    from datapipe.loader.batch import LazyTensor
    from datapipe.loader.ring import BatchRing

    calls = []

    def fill(out):
        calls.append(out.shape)
        out[...] = np.arange(out.size).reshape(out.shape)

    ring = BatchRing(1, 2, multiprocessing.get_context("fork"))
    written = ring.write(0, Batch({"input_ids": LazyTensor((3, 5), torch.int64, fill)}, 3))
    assert written is not None and written.fields["input_ids"][0] == "tensor"  # in the slot, not pickled
    opened = ring.open(pickle.loads(pickle.dumps(written)), 3)
    assert torch.equal(opened["input_ids"], torch.arange(15).reshape(3, 5)) and calls == [(3, 5)]
    lazy = LazyTensor((2, 2), torch.int32, fill)
    again = pickle.loads(pickle.dumps(lazy))  # sent pickled: the tensor, made once
    assert torch.equal(again, torch.arange(4, dtype=torch.int32).reshape(2, 2)) and lazy.tensor() is lazy.tensor()
    assert calls == [(3, 5), (2, 2)]


def test_the_loader_refuses_what_is_no_dataset_of_its_kind():
    with pytest.raises(LoaderOptionError, match="TokenDataset or TokenMix"):
        StreamingDataLoader([1, 2, 3], batch_size=2)
