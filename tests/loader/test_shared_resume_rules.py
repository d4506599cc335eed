"""The resume rules StreamingDataset and the token loaders share are one mechanism each
(``loader.set_resumable_epoch``, ``loader.check_worker_state``), with the messages the
loaders gave before they shared them; and ``storage.DelegatingStore`` passes every
operation through to the store it wraps."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader, IterableDataset

from datapipe import ShardWriter
from datapipe.errors import LoaderOptionError, StateMismatchError
from datapipe.loader import StreamingDataset, check_worker_state, set_resumable_epoch
from datapipe.storage import DelegatingStore, MemoryStore
from datapipe.tokens import TokenDataset
from tests.token_datasets import random_documents, write_tokens

MAIN_PROCESS = ("this state is one DataLoader worker's (torchdata's StatefulDataLoader saves one per worker, inside "
                "the workers): load it with StatefulDataLoader.load_state_dict(), which hands each worker its own, "
                "not into the dataset in the main process")


@pytest.fixture(scope="module")
def loaders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-rules")
    with ShardWriter(str(root / "ds"), max_samples=8) as w:
        for i in range(20):
            w.write({"__key__": f"k{i:03d}", "cls": str(i)})
    write_tokens(root / "tok", [random_documents(np.random.default_rng(0), 30)])
    return (lambda: StreamingDataset(str(root / "ds"), batch_size=4),
            lambda: TokenDataset(str(root / "tok"), 16, batch_size=4))


def test_one_set_epoch_serves_both_loaders(loaders):
    assert StreamingDataset.set_epoch is set_resumable_epoch
    assert TokenDataset.set_epoch is set_resumable_epoch
    for make in loaders:
        ds = make()
        state = ds.state_dict(samples_seen=4)
        ds.load_state_dict(state)
        ds.set_epoch(0)  # the resume state's own epoch: kept
        assert ds._resume is not None
        ds.set_epoch(1)  # another epoch: the pass starts it afresh
        assert ds.epoch == 1 and ds._resume is None
        with pytest.raises(LoaderOptionError, match=r"^epoch=-1"):
            ds.set_epoch(-1)


def test_a_worker_state_is_refused_in_the_main_process_with_one_message(loaders):
    for make in loaders:
        ds = make()
        state = {**ds.state_dict(samples_seen=0), "worker": {"id": 0, "num_workers": 2, "batch_size": 4, "taken": 0}}
        with pytest.raises(StateMismatchError) as e:
            ds.load_state_dict(state)
        assert str(e.value) == MAIN_PROCESS


_ENTRIES = [("batch_size", {"id": 0, "num_workers": 1, "batch_size": 4, "taken": "1"}),
            ("batch_size", {"id": 0, "num_workers": 3, "batch_size": 4, "taken": 0}),
            ("batch size", {"id": 0, "num_workers": 1, "batch_size": 8, "taken": 0}),
            ("batch_size", {"id": 0, "num_workers": 1, "batch_size": 4, "taken": 12})]


class _Checks(IterableDataset):  # type: ignore[type-arg]
    """In a DataLoader worker (id 0 of 1): the message each bad worker entry gets."""

    def __iter__(self):
        for name, entry in _ENTRIES:
            try:
                check_worker_state(entry, 4, lambda worker, num_workers: 10 + worker + num_workers, batch_name=name)
            except StateMismatchError as e:
                yield str(e)
        yield check_worker_state({"id": 0, "num_workers": 1, "batch_size": 4, "taken": 11}, 4, lambda w, n: 11)


def test_a_worker_state_is_checked_against_the_worker_it_loads_in():
    out = list(DataLoader(_Checks(), batch_size=None, num_workers=1, multiprocessing_context="fork"))
    assert out[:4] == [
        "the state's worker entry {'id': 0, 'num_workers': 1, 'batch_size': 4, 'taken': '1'} is not "
        "{id, num_workers, batch_size, taken: int}",
        "the state is of a pass with worker num_workers 3, this one's is 1: resume with the same num_workers and "
        "batch_size",
        "the state is of a pass with worker batch_size 8, this one's is 4: resume with the same num_workers and "
        "batch size",
        "the state's worker took 12 steps of a share of 11",
    ]
    assert out[4] == 11


def test_a_delegating_store_passes_everything_through():
    inner = MemoryStore("mem://x")
    store = DelegatingStore(inner)
    store.put("a/b", b"hello")
    with store.open_writer("c") as f:
        f.write(b"world")
    assert store.root == inner.root and store.url("a/b") == inner.url("a/b")
    assert store.get("a/b") == b"hello" and store.get_range("c", 1, 3) == b"or"
    assert store.size("c") == 5 and store.exists("c") and store.list() == ["a/b", "c"]
    size, version = store.stat("a/b")
    assert size == 5 and store.get_range_at("a/b", 0, 2, version) == b"he"
    store.delete("c")
    assert not inner.exists("c")
