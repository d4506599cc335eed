"""TokenDataset batches sent by DataLoader workers in groups: a worker writes a group of
consecutive batches of its stream (a BatchGroup) into one ring slot, one message through
torch's worker queue, and the StreamingDataLoader hands them out one by one. Through real
worker processes: the batches equal the in-process pass's, in order; a resume from inside
a group is exact (on another number of workers too); a batch kept keeps its bytes while the
rest of its group and the groups after it go by; drop_last drops only the short last batch;
a TokenMix's workers send groups of consecutive global steps. In one process: a group's
slot is free again only once none of its batches is viewed."""

from __future__ import annotations

import gc
import multiprocessing
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from datapipe import StreamingDataLoader, TokenDataset, TokenMix
from datapipe.errors import LoaderOptionError
from datapipe.loader import Batch, BatchGroup, LazyTensor
from datapipe.loader.ring import BatchRing
from tests.token_datasets import random_documents, write_tokens

L = 16
KW = dict(seed=5, window=3, chunk_tokens=256)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(1)
    write_tokens(path, [random_documents(rng, 200), random_documents(rng, 150)])
    return str(path)


def _inprocess(root, batch, state=None, **kw):
    ds = TokenDataset(root, L, batch_size=batch, batched=True, **(KW | kw))
    if state is not None:
        ds.load_state_dict(state)
    return [{k: v.clone() for k, v in b.items()} for b in ds]


def _same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert sorted(g.keys()) == sorted(w.keys()), i
        for k in w.keys():
            assert torch.equal(g[k], w[k]), (i, k)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("packing,workers", [("concat", 2), ("documents", 2), ("concat", 3)])
def test_groups_of_batches_come_one_message_each_and_equal_the_in_process_pass(root, packing, workers):
    want = _inprocess(root, 2, packing=packing)
    loader = StreamingDataLoader(TokenDataset(root, L, packing=packing, **KW), batch_size=2, num_workers=workers,
                                 multiprocessing_context="fork")
    got = [{k: v.clone() for k, v in b.items()} for b in loader]
    _same(got, want)
    ring = loader.ring
    assert ring.fallbacks == 0 and ring.opened == len(want)
    # 16 batches a message (the last of each worker's pass fewer), not one each
    assert ring.messages <= -(-len(want) // 16) + workers, (ring.messages, len(want))
    assert len(loader) == len(want)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("taken", [1, 5, 17, 40])
def test_a_resume_from_inside_a_group_is_exact(root, taken):
    """The loader counts the batches it handed out, not the groups that came: its state
    after ``taken`` batches (most of them inside a group) resumes the rest exactly, through
    another number of workers too."""
    full = _inprocess(root, 2)
    loader = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=2, num_workers=2,
                                 multiprocessing_context="fork")
    it = iter(loader)
    head = [{k: v.clone() for k, v in next(it).items()} for _ in range(taken)]
    state = loader.state_dict()
    del it
    assert state == TokenDataset(root, L, **KW).state_dict(samples_seen=2 * taken)
    for workers in (1, 3):
        again = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=2, num_workers=workers,
                                    multiprocessing_context="fork", persistent_workers=False)
        again.load_state_dict(state)
        rest = [{k: v.clone() for k, v in b.items()} for b in again]
        _same(head + rest, full)


def test_a_batch_kept_keeps_its_bytes_while_the_rest_goes_by(root):
    """Every seventh batch kept, not copied: its group's slot stays taken (the groups after
    it come through the other slots, or pickled when none is free) and its tensor still
    holds its own sequences at the end of the pass."""
    want = _inprocess(root, 2)
    loader = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=2, num_workers=2,
                                 multiprocessing_context="fork")
    kept = {}
    for i, b in enumerate(loader):
        assert torch.equal(b["input_ids"], want[i]["input_ids"]), i
        if i % 7 == 0:
            kept[i] = b
    assert loader.ring.opened > 0
    for i, b in kept.items():
        assert torch.equal(b["input_ids"], want[i]["input_ids"]), i


def test_drop_last_drops_only_the_short_last_batch(root):
    n = len(TokenDataset(root, L, **KW))
    batch = next(b for b in (3, 4, 5, 7) if n % b)  # the pass ends with a short batch
    want = _inprocess(root, batch)
    loader = StreamingDataLoader(TokenDataset(root, L, **KW), batch_size=batch, num_workers=2,
                                 multiprocessing_context="fork", drop_last=True)
    got = [{k: v.clone() for k, v in b.items()} for b in loader]
    _same(got, want[:-1])
    assert len(loader) == len(want) - 1


def _group(n, rows=2):
    def fill(k):
        return lambda out: out.__setitem__(Ellipsis, np.arange(out.size).reshape(out.shape) + 100 * k)

    return BatchGroup([Batch({"input_ids": LazyTensor((rows, 4), torch.int64, fill(k))}, rows) for k in range(n)], n)


def test_a_groups_slot_is_free_again_only_once_none_of_its_batches_is_viewed():
    ring = BatchRing(1, 1, multiprocessing.get_context("fork"))
    written = ring.write(0, _group(3))
    assert written is not None and len(written.group) == 3
    rb = pickle.loads(pickle.dumps(written))
    with pytest.raises(LoaderOptionError, match="open_all"):
        ring.open(rb)
    batches = ring.open_all(rb)
    assert [b.steps for b in batches] == [2, 2, 2] and ring.opened == 3 and ring.messages == 1
    for k, b in enumerate(batches):
        assert torch.equal(b["input_ids"], torch.arange(8).reshape(2, 4) + 100 * k)
    assert ring.write(0, _group(1)) is None  # the one slot is taken
    last = batches[2]["input_ids"]
    del batches, b
    gc.collect()
    assert ring.write(0, _group(1)) is None  # one tensor of the group still views it
    del last
    gc.collect()
    assert ring.write(0, _group(1)) is not None


def test_batches_that_share_one_tensors_rows_have_it_cut_and_written_once():
    """A concat group's batches view rows of one LazyTensor (GroupCut): the ring measures
    and writes it once (one fill), each batch's field views its rows in the slot; sent
    pickled (no slot free), each batch is its rows."""
    from datapipe.loader import LazyRows
    from datapipe.loader.ring import _measure

    fills = []

    def fill(out):
        fills.append(out.shape)
        out[...] = np.arange(out.size).reshape(out.shape)

    def group():
        whole = LazyTensor((6, 4), torch.int64, fill)
        return BatchGroup([Batch({"input_ids": whole.rows(a, b), "k": a}, b - a) for a, b in ((0, 2), (2, 5), (5, 6))],
                          3)

    want = torch.arange(24).reshape(6, 4)
    g = group()
    assert isinstance(g[1]["input_ids"], LazyRows) and g[1]["input_ids"].shape == (3, 4)
    assert _measure(g) == 6 * 4 * 8  # once, not once a batch
    ring = BatchRing(1, 1, multiprocessing.get_context("fork"))
    written = ring.write(0, g)
    assert written is not None and fills == [(6, 4)]
    batches = ring.open_all(pickle.loads(pickle.dumps(written)))
    assert [b.steps for b in batches] == [2, 3, 1] and [b["k"] for b in batches] == [0, 2, 5]
    for b, (a, e) in zip(batches, ((0, 2), (2, 5), (5, 6))):
        assert torch.equal(b["input_ids"], want[a:e])
    fills.clear()
    sent = pickle.loads(pickle.dumps(group()))  # the fallback: each batch its own tensor
    assert fills == [(6, 4)]
    assert [torch.equal(b["input_ids"], want[a:e]) for b, (a, e) in zip(sent, ((0, 2), (2, 5), (5, 6)))] == [True] * 3
    assert sent[0]["input_ids"].untyped_storage().nbytes() == 2 * 4 * 8  # its rows, not the whole


def test_a_group_sent_pickled_is_its_batches():
    group = pickle.loads(pickle.dumps(_group(2)))
    assert isinstance(group, BatchGroup) and group.of == 2 and group.steps == 4 and group.full
    assert torch.equal(group[1]["input_ids"], torch.arange(8).reshape(2, 4) + 100)
    assert not BatchGroup(list(group)[:1], 2).full


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("packing", ["concat", "documents"])
def test_a_mixes_workers_send_groups_of_consecutive_steps(root, tmp_path, packing, monkeypatch):
    """TokenMix: a worker builds groups of consecutive global steps in turn (16 here), one
    message each; the loader's batches are the in-process mix's in step order, and its
    state after a batch inside a group resumes the rest exactly."""
    import datapipe.tokens.dataset

    monkeypatch.setattr(datapipe.tokens.dataset, "GROUP_BATCHES", 16)  # forked workers see it too
    rng = np.random.default_rng(2)
    other = str(tmp_path / "other")
    write_tokens(other, [random_documents(rng, 120)])

    def mix():
        return TokenMix({root: 2, other: 1}, L, global_batch=3, steps=45, seed=1, chunk_tokens=256, packing=packing)

    want = [{k: v.clone() for k, v in b.items()} for b in mix()]
    loader = StreamingDataLoader(m := mix(), batch_size=m.per_rank_batch(), num_workers=2,
                                 multiprocessing_context="fork")
    got = [{k: v.clone() for k, v in b.items()} for b in loader]
    _same(got, want)
    assert loader.ring.opened == 45 and loader.ring.messages == 3 and loader.ring.fallbacks == 0
    it = iter(loader)
    head = [{k: v.clone() for k, v in next(it).items()} for _ in range(21)]
    state = loader.state_dict()
    del it
    assert state["step"] == 21
    again = StreamingDataLoader(m := mix(), batch_size=m.per_rank_batch(), num_workers=3,
                                multiprocessing_context="fork", persistent_workers=False)
    again.load_state_dict(state)
    _same(head + [{k: v.clone() for k, v in b.items()} for b in again], want)


@given(start=st.integers(0, 50), n=st.integers(0, 200), workers=st.integers(1, 5), group=st.integers(1, 17),
       skip=st.integers(0, 60))
def test_worker_steps_partition_the_steps_in_groups_taken_in_turn(start, n, workers, group, skip):
    from datapipe.plan import WorkerSteps, worker_steps

    stop = start + n
    mine = [WorkerSteps(start, w, workers, stop, group) for w in range(workers)]
    listed = [ws[0:len(ws)] for ws in mine]
    assert sorted(k for steps in listed for k in steps) == list(range(start, stop))
    # the stream in torch's order: a group from each worker in turn
    stream, taken = [], [0] * workers
    while len(stream) < n:
        for w in range(workers):
            stream += listed[w][taken[w]:taken[w] + group]
            taken[w] += group
    assert stream == list(range(start, stop))
    for ws, steps in zip(mine, listed):
        rest = ws[skip:]
        assert len(rest) == len(steps[skip:]) and rest[0:len(rest)] == steps[skip:]
        assert list(ws) == steps  # iterated one by one: the same steps as sliced
        if group == 1:  # torch's round-robin order
            assert steps == list(range(start + ws.worker, stop, workers))
            assert list(worker_steps(start, ws.worker, workers, stop)) == steps


def test_batches_go_in_groups_of_up_to_four_mebibytes_and_larger_ones_alone():
    from datapipe.tokens.dataset import message_batches

    assert message_batches(8 * 2049 * 8) == 31  # 8 x 2,049 int64: 128 KiB and a bit
    assert message_batches(8 * 2049 * 4) == 63  # int32: 64 KiB
    assert message_batches(64) == 64  # tiny batches: at most 64 a message
    assert message_batches(8 * 8193 * 8) == 7  # 512 KiB and a bit
    assert message_batches(2 << 20) == 2 and message_batches((2 << 20) + 1) == 1  # more than 2 MiB: alone
    assert message_batches(64 << 20) == 1


def test_a_group_counts_every_tensor_of_a_batch():
    from datapipe.tokens.dataset import group_batches, message_batches

    assert group_batches(8, 2048, "concat", "int64") == message_batches(8 * 2049 * 8) == 31
    assert group_batches(8, 2048, "concat", "int64", extra=0) == message_batches(8 * 2048 * 8)
    # documents: input_ids, position_ids and labels, each L wide
    assert group_batches(8, 2048, "documents", "int32") == message_batches(8 * 3 * 2048 * 4) == 21
    assert group_batches(8, 8192, "documents", "int64") == 2  # 1.5 MiB a batch
    assert group_batches(16, 8192, "documents", "int64") == 1
