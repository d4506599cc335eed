"""Attacks on the StreamingDataLoader's shared-memory batch ring, through real DataLoader
worker processes (fork, spawn, forkserver): bytes under a live view never change, slots
grow and come back, odd values travel intact, resources do not leak, a killed worker does
not hang the trainer."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe import ShardWriter
from datapipe.loader import StreamingDataLoader, StreamingDataset
from datapipe.loader.batch import Batch, Column
from datapipe.loader.control import PassControl
from datapipe.loader.ring import BatchRing

N = 120
BIG = 77  # the sample whose bytes are far larger than the rest (slots must grow for it)


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * (i % 53 + 1) + i.to_bytes(4, "little")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "ds"
    with ShardWriter(str(path), max_samples=23) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "jpg": _payload(i), "cls": str(i).encode(), "nil": b""})
    return str(path)


def _number(sample) -> int:
    return int(bytes(sample["cls"]))


def _hostile(sample):
    """A map whose output has every kind of field: bytes of very different sizes (one far
    larger), empty bytes, tensors of odd dtypes, 0-d and non-contiguous tensors, empty
    tensors, strings, None and dicts."""
    i = _number(sample)
    big = bytes(sample["jpg"]) * (4000 if i == BIG else 1)
    return {
        "__key__": sample["__key__"],
        "jpg": big,
        "nil": bytes(sample["nil"]),
        "i8": torch.tensor([i % 128, -(i % 128)], dtype=torch.int8),
        "f16": torch.tensor(i / 7, dtype=torch.float16),  # 0-d per sample
        "bf16": torch.full((2, 2), i, dtype=torch.bfloat16),
        "c64": torch.tensor([complex(i, -i)], dtype=torch.complex64),
        "flag": torch.tensor(i % 2 == 0),
        "t": (torch.arange(6, dtype=torch.float32).view(2, 3) * i).T,  # non-contiguous
        "empty": torch.zeros(0, 3, dtype=torch.int16),
        "n": i,
        "x": i / 3,
        "name": f"sample {i}",
        "none": None,
        "meta": {"i": i, "even": i % 2 == 0},
    }


def _reference(sample) -> dict:
    """What the batch must show for one sample (copies)."""
    out = _hostile(sample)
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _loader(url, ctx="fork", **kw):
    ds = StreamingDataset(url, window=2, seed=3, decode=None, map=kw.pop("map", _hostile))
    return ds, StreamingDataLoader(ds, batch_size=kw.pop("batch_size", 6), num_workers=kw.pop("num_workers", 2),
                                   multiprocessing_context=ctx, **kw)


def _ref_by_key(url) -> dict:
    return {s["__key__"]: _reference(s) for s in StreamingDataset(url, decode=None, shuffle=False)}


# -- the views of a batch never change -------------------------------------------------------

@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_every_kind_of_view_outlives_its_batch_unchanged(url, ctx):
    """Views of every kind taken from every fourth batch of the first epoch are kept (the
    batch itself dropped) over three epochs, while the other batches' slots are reused (and
    grown, for the big sample) all along; at the end every kept view still shows its
    sample's bytes."""
    ref = _ref_by_key(url)
    ds, loader = _loader(url, ctx, prefetch_factor=6)  # 8 slots a worker: most stay in use
    kept = []  # (keys, views) of the batches whose views are kept
    checked = 0
    for epoch in range(3):
        ds.set_epoch(epoch)
        for k, b in enumerate(loader):
            assert isinstance(b, Batch)
            keys = list(b["__key__"])
            for j, key in enumerate(keys):  # the batch is right when it arrives
                want = ref[key]
                for name in ("i8", "f16", "bf16", "c64", "flag", "t", "empty"):
                    assert _same(b[name][j], want[name]), (name, key)
                assert bytes(b["jpg"][j]) == want["jpg"] and bytes(b["nil"][j]) == b""
                assert b["name"][j] == want["name"] and b["none"][j] is None and b["meta"][j] == want["meta"]
                assert int(b["n"][j]) == want["n"] and float(b["x"][j]) == pytest.approx(want["x"])
                checked += 1
            if epoch or k % 4:
                continue
            col = b["jpg"]
            data, offsets = col.contiguous()
            tdata, toffsets = col.as_tensor()
            views = {
                "items": [col[j] for j in range(len(col))],  # memoryviews
                "slice": col[1:],  # a Column slice
                "data": (data, offsets),  # numpy from contiguous()
                "tensor": (tdata, toffsets),  # as_tensor()
                "bf16": b["bf16"],  # tensors taken out of the batch
                "row": b["c64"][0],  # a view of a tensor of the batch
                "t": b["t"],
                "flag": b["flag"],
            }
            kept.append((keys, views))
        del b
    for keys, v in kept:
        for j, key in enumerate(keys):
            want = ref[key]
            assert bytes(v["items"][j]) == want["jpg"]
            assert bytes(v["data"][0][v["data"][1][j]:v["data"][1][j + 1]]) == want["jpg"]
            t, o = v["tensor"]
            assert bytes(t[int(o[j]):int(o[j + 1])].numpy()) == want["jpg"]
            assert _same(v["bf16"][j], want["bf16"]) and _same(v["t"][j], want["t"])
            assert _same(v["flag"][j], want["flag"])
        assert v["slice"].tolist() == [ref[key]["jpg"] for key in keys[1:]]
        assert _same(v["row"], ref[keys[0]]["c64"])
    assert checked == 3 * N
    ring = loader.ring
    # the kept batches' slots stay taken (their workers send some batches pickled); the
    # others were reused many times over
    assert ring is not None and ring.opened + ring.fallbacks == 3 * len(loader)
    assert ring.opened >= 2 * len(loader), (ring.opened, ring.fallbacks)
    assert max(generation for generation, _ in ring._maps.values()) > 0  # a slot grew for the big sample


# -- resources -------------------------------------------------------------------------------

def _open_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return sorted(out)


def _left_behind(before: list[str], names=_open_fds, timeout: float = 10.0) -> list[str]:
    """The descriptors open now that were not open ``before`` (as a multiset), once closes
    still in flight are done: DataLoader workers' pipes and the fd-sharing thread
    (multiprocessing.resource_sharer) close theirs a moment after the objects are gone.
    Polled for at most ``timeout`` seconds; descriptors that were open before and are
    closed now do not count."""
    deadline = time.monotonic() + timeout
    while True:
        extra = sorted((Counter(names()) - Counter(before)).elements())
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.02)


def _plain_loader(url, ctx="fork", **kw):
    ds = StreamingDataset(url, window=2, seed=1, decode=None)
    workers = kw.pop("num_workers", 1)
    return ds, StreamingDataLoader(ds, batch_size=kw.pop("batch_size", 8), num_workers=workers,
                                   multiprocessing_context=ctx if workers else None, **kw)


def test_loaders_made_and_dropped_leave_no_descriptor_behind(url):
    """A trainer that makes a loader per epoch must not run out of file descriptors."""
    def one_pass():
        _, loader = _plain_loader(url)
        assert sum(len(b) for b in loader) == N
        del loader
        gc.collect()

    one_pass()
    gc.collect()
    before = _open_fds()
    for _ in range(5):
        one_pass()
    gc.collect()
    assert _left_behind(before) == []


def test_many_passes_of_one_loader_leave_no_descriptor_behind(url):
    ds, loader = _plain_loader(url, num_workers=2, prefetch_factor=1)

    def passes(epochs):
        for epoch in epochs:
            ds.set_epoch(epoch)
            seen = 0
            for k, b in enumerate(loader):
                seen += len(b)
                if epoch % 3 == 0 and k == 1:
                    break  # passes broken off too
            assert seen == N or epoch % 3 == 0
        gc.collect()

    def split(names):  # the maps of ring slots, and every other descriptor
        slots = [n for n in names if "datapipe-batch" in n]
        return slots, [n for n in names if "datapipe-batch" not in n]

    passes(range(4))
    _, before = split(_open_fds())
    passes(range(4, 14))
    assert _left_behind(before, lambda: split(_open_fds())[1]) == []
    slots, _ = split(_open_fds())
    assert len(slots) <= 2 * 3  # one map per slot the workers made (workers x slots), at most
    ds.set_epoch(99)
    assert sum(len(b) for b in loader) == N and loader.ring.fallbacks == 0


def test_pass_control_descriptors_close_with_it():
    pickle.loads(pickle.dumps(PassControl()))  # starts this process's fd-sharing thread (and its socket)
    gc.collect()
    before = _open_fds()
    control = PassControl()
    control.write(3, {"epoch": 3})
    twin = pickle.loads(pickle.dumps(control))  # as a spawned worker attaches (fd passed)
    assert twin.read() == (3, {"epoch": 3})
    del control, twin
    gc.collect()
    assert _left_behind(before) == []


# -- values the ring cannot hold travel the ordinary way -------------------------------------

def _ring(slots=2):
    import multiprocessing

    return BatchRing(1, slots, multiprocessing.get_context("fork"))


def _through(ring, rb):
    """``rb`` as the main process gets it (pickled through a pipe), opened."""
    return ring.open(pickle.loads(pickle.dumps(rb)))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning",
                            "ignore:Sparse CSR tensor support:UserWarning",
                            "ignore:The PyTorch API of nested tensors:UserWarning",
                            "ignore:TypedStorage is deprecated:UserWarning")
def test_tensors_that_bytes_cannot_rebuild_do_not_go_into_a_slot():
    """A quantized tensor (its scale lives outside its bytes; writing it raw crashed the
    worker with SIGSEGV or arrived as garbage), a sparse CSR one and a nested one travel as
    values; a plain tensor beside them still goes into the slot."""
    ring = _ring()
    q = torch.quantize_per_tensor(torch.tensor([[0.5, 1.0], [1.5, 2.0]]), 0.5, 0, torch.qint8)
    csr = torch.eye(3).to_sparse_csr()
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)])
    plain = torch.arange(4, dtype=torch.float16)
    rb = ring.write(0, Batch({"q": q, "csr": csr, "nested": nested, "plain": plain}, 2))
    assert rb is not None and {k: v[0] for k, v in rb.fields.items()} == \
        {"q": "value", "csr": "value", "nested": "value", "plain": "tensor"}
    b = _through(ring, rb)
    assert b["q"].is_quantized and torch.equal(b["q"].dequantize(), q.dequantize())
    assert b["csr"].layout == torch.sparse_csr and torch.equal(b["csr"].to_dense(), torch.eye(3))
    assert b["nested"].is_nested and torch.equal(b["plain"], plain)


def test_a_write_that_fails_midway_keeps_its_slot():
    """A batch that cannot be written (here a column claiming more bytes than its buffer
    holds) leaves its slot free and the count intact: the batch goes pickled (where such a
    batch raises), and the next batches still use both slots."""
    ring = _ring()
    bad = Batch({"a": Column([np.zeros(4, np.uint8)], np.array([0]), np.array([10]))}, 1)
    for _ in range(3):
        assert ring.write(0, bad) is None
    written = [ring.write(0, Batch({"a": Column.from_bytes([b"ok"])}, 1)) for _ in range(3)]
    assert [w is not None for w in written] == [True, True, False]  # both slots, then none free
    assert [_through(ring, w)["a"].tolist() for w in written[:2]] == [[b"ok"], [b"ok"]]


# -- a worker killed mid-pass ----------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_a_worker_killed_mid_pass_raises_and_leaves_nothing(url, ctx, monkeypatch):
    """SIGKILL one worker after the second batch: the loader raises a RuntimeError naming a
    worker (not the ConnectionRefusedError that fetching a slot's descriptor from the dead
    worker hit), and again on the next pass, never hangs, and leaves no file in /dev/shm
    (slots are memfds). torch notices a dead worker of a resumed pass when its status
    check runs: every 5 s (MP_STATUS_CHECK_INTERVAL, bound as _try_get_data's default
    timeout), here every 0.5 s; the same check, sooner (it was ~5 s of this test's ~6 s)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    assert _MultiProcessingDataLoaderIter._try_get_data.__defaults__ == (5.0,)  # what this shortens
    monkeypatch.setattr(_MultiProcessingDataLoaderIter._try_get_data, "__defaults__", (0.5,))
    shm = set(os.listdir("/dev/shm"))
    _, loader = _plain_loader(url, ctx, num_workers=2, batch_size=4)
    got = 0
    with pytest.raises(RuntimeError, match="worker"):
        for k, b in enumerate(loader):
            got += len(b)
            if k == 1:
                worker = loader._iterator._workers[0]
                os.kill(worker.pid, signal.SIGKILL)
                # reaped here: torch's SIGCHLD handler may raise now, not later in pytest
                worker.join(10)
    assert got < N
    with pytest.raises(RuntimeError, match="worker"):
        for _ in loader:
            pass
    del loader, b
    gc.collect()
    # (spawn: torch's queues of the dead worker keep a named semaphore of multiprocessing's
    # until exit, when its resource tracker unlinks it; nothing of the ring's is there)
    assert {name for name in set(os.listdir("/dev/shm")) - shm if not name.startswith("sem.mp-")} == set()


# -- persistent workers follow the main process's epoch and resume point ---------------------

def _keys(loader) -> list[str]:
    return [k for b in loader for k in b["__key__"]]


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_load_state_dict_mid_pass_reaches_persistent_workers(url, ctx):
    ds, loader = _plain_loader(url, ctx, num_workers=2, batch_size=5)
    want = {}
    for epoch in (3, 7):
        ds.set_epoch(epoch)
        want[epoch] = _keys(loader)
    assert want[3] != want[7] and sorted(want[3]) == sorted(want[7])
    ds.set_epoch(3)
    head = []
    for k, b in enumerate(loader):  # broken off in epoch 3, with batches in flight
        head += b["__key__"]
        if k == 4:
            break
    state = loader.state_dict()
    del b
    ds.set_epoch(7)
    assert _keys(loader) == want[7]  # the workers moved on to another epoch meanwhile
    loader.load_state_dict(state)
    assert head + _keys(loader) == want[3]  # and came back to the resume point
    assert _keys(loader) == want[3]  # the pass after a resumed one starts its epoch afresh
    assert loader.ring.fallbacks == 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 cores
@pytest.mark.parametrize("ctx,workers,prefetch", [("fork", 1, 1), ("fork", 3, 4), ("spawn", 2, 1),
                                                  ("forkserver", 3, 2)])
def test_passes_broken_off_give_every_slot_back(url, ctx, workers, prefetch):
    """Passes broken off after 0, 1 and 5 batches (their batches in flight dropped unopened),
    then whole passes: every slot came back (no batch goes pickled) and the stream is the
    one-process stream."""
    ds0, plain = _plain_loader(url, num_workers=0, batch_size=4)
    want = {}
    for epoch in (0, 1, 2, 3):
        ds0.set_epoch(epoch)
        want[epoch] = _keys(plain)
    ds, loader = _plain_loader(url, ctx, num_workers=workers, batch_size=4, prefetch_factor=prefetch)
    for epoch, stop in ((0, 0), (1, 1), (2, 5)):
        ds.set_epoch(epoch)
        head = []
        for k, b in enumerate(loader):
            head += b["__key__"]
            if k == stop:
                break
        assert head == want[epoch][: len(head)]
    del b
    for epoch in (3, 1):
        ds.set_epoch(epoch)
        assert _keys(loader) == want[epoch]
    assert loader.ring.fallbacks == 0 and loader.ring.opened >= 2 * len(loader)


# -- skipped samples, whole batches of them --------------------------------------------------

def _fails_below_60(sample):
    i = _number(sample)
    if i < 60:
        raise ValueError(f"sample {i} is unlucky")
    return {"__key__": sample["__key__"], "x": torch.tensor([i, i], dtype=torch.int16), "jpg": bytes(sample["jpg"])}


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_whose_every_sample_is_skipped(url, workers):
    ds = StreamingDataset(url, shuffle=False, decode=None, map=_fails_below_60, on_error="skip")
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=workers)
    for _ in range(2):  # twice: the slots of a pass with empty batches all come back
        keys = []
        with pytest.warns(RuntimeWarning, match="skipped 60"):
            for b in loader:  # the first 15 batches of the plan are skipped whole
                assert len(b) == 4 and torch.equal(b["x"][:, 0], b["x"][:, 1])
                keys += b["__key__"]
        assert keys == [f"s{i:04d}" for i in range(60, N)]
        assert loader.samples_seen == N and len(loader.skipped) == 60
    state = loader.state_dict()
    assert state["splits"][0][3] == N  # everything consumed, the skipped batches too
    if workers:
        assert loader.ring.fallbacks == 0


# -- pickling and the forms a batch unwraps to -----------------------------------------------

def test_ring_batches_pickle_as_their_own_bytes(url):
    ref = _ref_by_key(url)
    ds, loader = _loader(url, batch_size=8)
    copies = []
    for b in loader:
        copies.append(pickle.loads(pickle.dumps(b)))
        payload = b["jpg"].nbytes + sum(v.numel() * v.element_size() for v in b.values() if isinstance(v, torch.Tensor))
        assert len(pickle.dumps(b["jpg"][2:])) < b["jpg"].nbytes + 1000  # a slice: its samples' bytes only
        assert len(pickle.dumps(b)) < payload + 20_000  # not the whole slot (it grew for the big sample)
    assert loader.ring.opened == len(loader)
    del b
    ds.set_epoch(1)
    assert len(_keys(loader)) == N  # the slots are rewritten; the copies hold their own bytes
    for c in copies:
        assert isinstance(c, Batch) and isinstance(c["jpg"], Column)
        for j, key in enumerate(c["__key__"]):
            assert bytes(c["jpg"][j]) == ref[key]["jpg"] and c["meta"][j] == ref[key]["meta"]
            assert _same(c["bf16"][j], ref[key]["bf16"]) and _same(c["t"][j], ref[key]["t"])


def _just_bytes(sample):
    return bytes(sample["jpg"])


def _just_tensor(sample):
    return torch.full((3,), _number(sample), dtype=torch.int32)


def _pair(sample):
    return torch.tensor(_number(sample)), bytes(sample["jpg"])


def test_each_form_unwraps_as_default_collate_would(url):
    _, loader = _loader(url, map=_just_bytes, batch_size=8)
    got = [bytes(v) for col in loader for v in col]  # a single bytes value per sample: a Column
    assert sorted(got) == sorted(_payload(i) for i in range(N))
    _, loader = _loader(url, map=_just_tensor, batch_size=8)
    xs = [x for x in loader]  # a tensor per sample: one stacked tensor
    assert all(isinstance(x, torch.Tensor) and x.shape[1:] == (3,) for x in xs)
    assert sorted(int(v) for x in xs for v in x[:, 0]) == list(range(N))
    _, loader = _loader(url, map=_pair, batch_size=8)
    for i, jpg in loader:  # a tuple per sample: a tuple of collated positions
        assert isinstance(jpg, Column) and i.dtype == torch.int64
        assert [bytes(v) for v in jpg] == [_payload(int(k)) for k in i]
    assert loader.ring.opened == len(loader)


# -- Column.from_bytes: what counts as a sample's bytes --------------------------------------

def _wide_views(sample):
    i = _number(sample)
    wide = np.arange(i % 5 + 1, dtype=np.int32) + i
    return {"__key__": sample["__key__"], "wide": memoryview(wide), "strided": memoryview(bytes(sample["jpg"]))[::2]}


@pytest.mark.parametrize("workers", [0, 2])
def test_memoryviews_of_any_format_and_stride_collate_to_their_bytes(url, workers):
    """A memoryview counts as bytes: a sample's bytes are all of its bytes (not ``len``
    items of one byte: an int32 view lost three quarters of them), strided ones included
    (they made ``b"".join`` raise)."""
    ds = StreamingDataset(url, window=2, seed=1, decode=None, map=_wide_views)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=workers)
    seen = 0
    for b in loader:
        for key, wide, strided in zip(b["__key__"], b["wide"], b["strided"]):
            i = int(key[1:])
            assert bytes(wide) == (np.arange(i % 5 + 1, dtype=np.int32) + i).tobytes()
            assert bytes(strided) == _payload(i)[::2]
            seen += 1
    assert seen == N


def test_columns_made_or_unpickled_here_are_writable_like_slot_columns():
    """as_tensor() of a collated or unpickled column views writable memory, as one of a
    slot does (torch warns on tensors over read-only numpy arrays)."""
    col = Column.from_bytes([b"ab", memoryview(b"cde"), bytearray(b"")])
    assert col.tolist() == [b"ab", b"cde", b""]
    for c in (col, pickle.loads(pickle.dumps(col)), pickle.loads(pickle.dumps(col[1:]))):
        data, _ = c.contiguous()
        assert data.flags.writeable
    assert pickle.loads(pickle.dumps(col[1:])).tolist() == [b"cde", b""]


# -- pinned memory (where an accelerator is present) -----------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch pins only where an accelerator is present")
def test_pinned_batches_are_pinned_copies_and_free_their_slots(url):
    ref = _ref_by_key(url)
    ds, loader = _loader(url, pin_memory=True, batch_size=8)
    kept = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        for b in loader:
            data, offsets = b["jpg"].as_tensor()
            assert data.is_pinned() and b["bf16"].is_pinned() and b["t"].is_pinned()
            on_gpu = data.to("cuda", non_blocking=True)
            bf16 = b["bf16"].to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            for j, key in enumerate(b["__key__"]):
                got = bytes(on_gpu[int(offsets[j]):int(offsets[j + 1])].cpu().numpy())
                assert got == ref[key]["jpg"] and _same(bf16[j].cpu(), ref[key]["bf16"])
            kept.append((list(b["__key__"]), b["jpg"]))  # pinned copies: they hold no slot
    assert loader.ring.fallbacks == 0 and loader.ring.opened == 2 * len(loader)
    for keys, col in kept:
        assert col.tolist() == [ref[k]["jpg"] for k in keys]


# -- a slot's descriptor that never reaches the main process ---------------------------------

def _write_in_child(ring, conn):
    written = ring.write(0, Batch({"a": Column.from_bytes([b"lost"])}, 1))
    conn.send_bytes(pickle.dumps(written))  # then exit: nobody serves the descriptor any more


def test_a_batch_whose_worker_exited_is_refused_clearly_and_dropped_quietly(monkeypatch):
    import multiprocessing
    import sys

    ctx = multiprocessing.get_context("fork")
    ring = BatchRing(1, 2, ctx)
    raw = []
    for _ in range(2):
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_write_in_child, args=(ring, theirs))
        child.start()
        raw.append(ours.recv_bytes())
        child.join(10)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    rb = pickle.loads(raw[0])
    assert rb.fd is None and rb.fd_error  # fetched as it was unpickled: the worker had gone
    with pytest.raises(RuntimeError, match="worker 0 could not hand over its slot 0"):
        ring.open(rb)
    dropped = pickle.loads(raw[1])
    del rb, dropped  # dropped unopened: the discard finds no worker to give the slot back to
    gc.collect()
    assert unraisable == []


# -- batches released from another thread ----------------------------------------------------

def test_batches_released_by_another_thread_stay_intact_until_then(url):
    """A trainer thread takes the batches, keeps the last three, and checks each one's bytes
    only when it lets it go (so its slot's finalizer runs in that thread, while the main
    thread opens new batches into the slots freed before)."""
    import queue
    import threading

    ref = _ref_by_key(url)
    ds, loader = _loader(url, batch_size=4, prefetch_factor=4)
    handoff: queue.Queue = queue.Queue(maxsize=2)
    bad: list[str] = []
    checked = [0]

    def trainer():
        held = []
        while True:
            b = handoff.get()
            if b is None:
                break
            held.append((list(b["__key__"]), b["jpg"][0], b["jpg"], b["bf16"]))
            del b
            while len(held) > 3 or (held and handoff.empty() and len(held) > 1):
                keys, first, col, bf16 = held.pop(0)
                if bytes(first) != ref[keys[0]]["jpg"] or col.tolist() != [ref[k]["jpg"] for k in keys]:
                    bad.append(keys[0])
                if not all(_same(bf16[j], ref[k]["bf16"]) for j, k in enumerate(keys)):
                    bad.append(keys[0])
                checked[0] += len(keys)
                del first, col, bf16  # the last views: the slot is freed here, in this thread
        for keys, _, col, _ in held:
            checked[0] += len(keys)
            if col.tolist() != [ref[k]["jpg"] for k in keys]:
                bad.append(keys[0])

    for epoch in range(3):
        ds.set_epoch(epoch)
        thread = threading.Thread(target=trainer)
        thread.start()
        for b in loader:
            handoff.put(b)
        del b
        handoff.put(None)
        thread.join()
    assert bad == [] and checked[0] == 3 * N
    assert loader.ring.opened > len(loader)


# -- slots grow for batches of very different sizes ------------------------------------------

def _sized_by_batch(sample):
    """A tensor whose size depends on the sample's batch (samples in order, 5 a batch):
    from 1 to 200k elements, up and down."""
    i = _number(sample)
    n = (1, 200_000, 3, 50_000, 7)[(i // 5) % 5]
    return torch.full((n,), i, dtype=torch.int32)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_tensors_of_very_different_sizes_per_batch(url, ctx):
    ds = StreamingDataset(url, shuffle=False, decode=None, map=_sized_by_batch)
    loader = StreamingDataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context=ctx)
    kept = []
    for epoch in range(2):
        for k, x in enumerate(loader):
            first = int(x[0, 0])
            assert x.shape == (5, (1, 200_000, 3, 50_000, 7)[(first // 5) % 5])
            assert torch.equal(x, torch.arange(first, first + 5, dtype=torch.int32)[:, None].expand_as(x))
            if epoch == 0 and k % 7 == 0:
                kept.append((first, x[:, :2]))  # a view of each 7th batch's tensor, kept
        del x
    for first, view in kept:
        assert torch.equal(view, torch.arange(first, first + 5, dtype=torch.int32)[:, None].expand_as(view))
    ring = loader.ring
    assert ring.opened + ring.fallbacks == 2 * len(loader) and ring.opened > len(loader)
    assert max(generation for generation, _ in ring._maps.values()) > 0  # slots grew


# -- property: anything a batch holds comes out of a slot as it went in -----------------------

_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


@st.composite
def _batches(draw):
    n = draw(st.integers(1, 6))
    fields = {}
    for k in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["column", "multi", "tensor", "value"]))
        if kind == "column":
            fields[f"c{k}"] = Column.from_bytes(draw(st.lists(st.binary(max_size=300), min_size=n, max_size=n)))
        elif kind == "multi":  # a column over several buffers, as cut from shards
            bufs = [np.frombuffer(bytearray(draw(st.binary(min_size=1, max_size=200))), np.uint8) for _ in range(2)]
            which = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.intp)
            starts, ends = [], []
            for w in which:
                a = draw(st.integers(0, len(bufs[w])))
                starts.append(a)
                ends.append(draw(st.integers(a, len(bufs[w]))))
            fields[f"m{k}"] = Column(bufs, np.array(starts, np.int64), np.array(ends, np.int64), which)
        elif kind == "tensor":
            dtype = draw(st.sampled_from(_DTYPES))
            shape = (n, *draw(st.lists(st.integers(0, 4), max_size=2)))
            t = (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * 1.7 - 3).to(dtype)
            if len(shape) > 1 and draw(st.booleans()):
                t = t.transpose(0, -1).contiguous().transpose(0, -1)  # non-contiguous
            fields[f"t{k}"] = t
        else:
            fields[f"v{k}"] = draw(st.lists(st.one_of(st.none(), st.text(max_size=5), st.integers()),
                                            min_size=n, max_size=n))
    return Batch(fields, n, form=draw(st.sampled_from(["dict", "single", "tuple"])))


def _assert_same_batch(got, batch):
    assert len(got) == len(batch) and got.form == batch.form and list(got.keys()) == list(batch.keys())
    for name, want in batch.items():
        have = got[name]
        if isinstance(want, Column):
            assert isinstance(have, Column) and have.tolist() == want.tolist()
        elif isinstance(want, torch.Tensor):
            assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)
        else:
            assert have == want


@settings(deadline=None, max_examples=60)
@given(batches=st.lists(_batches(), min_size=1, max_size=6))
def test_any_batch_comes_out_of_a_slot_as_it_went_in(batches):
    """Written into a ring of two slots in turn (through a real pickle, as the queue carries
    it), each batch opens equal to what went in, while the batch before it is still held;
    slots grow as needed and come back as batches are dropped."""
    ring = _ring(2)
    previous = None
    for batch in batches:
        rb = ring.write(0, batch)
        assert rb is not None  # one batch held, one being written: two slots suffice
        got = _through(ring, rb)
        _assert_same_batch(got, batch)
        if previous is not None:  # the batch before is intact after this one was written
            _assert_same_batch(previous[1], previous[0])
        previous = (batch, got)
        del got
    del previous
    # scans only what was made since this test started: conftest froze everything alive
    # before it (a full collection of the suite's heap per example was most of its time)
    gc.collect()
    assert ring.free[0].get_value() == 2  # every slot came back


@settings(deadline=None, max_examples=200)
@given(values=st.lists(st.binary(max_size=40), max_size=12),
       start=st.none() | st.integers(-14, 14), stop=st.none() | st.integers(-14, 14),
       step=st.none() | st.integers(-3, 3).filter(bool))
def test_column_slices_behave_as_list_slices(values, start, stop, step):
    col = Column.from_bytes(values)[start:stop:step]
    want = values[start:stop:step]
    assert col.tolist() == want and len(col) == len(want) and col.nbytes == sum(map(len, want))
    data, offsets = col.contiguous()
    assert [bytes(data[offsets[i]:offsets[i + 1]]) for i in range(len(want))] == want
    assert pickle.loads(pickle.dumps(col)).tolist() == want
    t, o = col.as_tensor()
    assert bytes(t.numpy()) == b"".join(want) and o.tolist() == offsets.tolist()


def _keys_of(samples):
    return [s["__key__"] for s in samples]


def test_set_epoch_reaches_persistent_workers_with_a_collate_fn(url):
    want = {}
    for epoch in (0, 5):
        ds = StreamingDataset(url, window=2, seed=1, decode=None)
        ds.set_epoch(epoch)
        want[epoch] = [s["__key__"] for s in ds]
    ds = StreamingDataset(url, window=2, seed=1, decode=None)
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=2, collate_fn=_keys_of)
    assert loader.persistent_workers and not loader.columnar
    for epoch in (0, 5, 0):
        ds.set_epoch(epoch)
        got = [k for keys in loader for k in keys]
        assert sorted(got) == sorted(want[epoch])
        # a plain DataLoader's batches come from the workers in turn: the order is the stream's
        assert got == want[epoch]


def test_out_of_order_delivery_is_refused(url):
    """torch's in_order=False hands out whichever worker's batch is ready first; the resume
    point counts a prefix of the stream, so a resume after it lost 12 of 120 samples and
    repeated 12 others (worker 0 slowed down, break after 6 batches)."""
    from datapipe.errors import PlanError

    ds = StreamingDataset(url, window=2, seed=1, decode=None)
    with pytest.raises(PlanError, match="in_order"):
        StreamingDataLoader(ds, batch_size=4, num_workers=2, in_order=False)
    assert StreamingDataLoader(ds, batch_size=4, num_workers=2, in_order=True).columnar
