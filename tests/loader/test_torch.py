"""StreamingDataset under torch: DataLoader worker processes, and ranks over gloo."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader

from datapipe import ShardWriter
from datapipe.loader import StreamingDataLoader, StreamingDataset
from tests.ranks import free_port, spawn_ranks

N = 300


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("tds") / "ds")
    with ShardWriter(url, max_samples=23) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "txt": f"t{i}"})
    return url


def _ids(batches):
    return [int(x) for b in batches for x in b["cls"]]


def test_dataloader_with_workers_yields_the_rank_stream_in_order(ds_url):
    expected = [s["cls"] for s in StreamingDataset(ds_url, window=3, seed=9, batch_size=8, decode="auto")]
    ds = StreamingDataset(ds_url, window=3, seed=9, decode="auto")  # cls as int: collated into a tensor
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    got = _ids(loader)
    assert got == expected
    assert sorted(got) == list(range(N))
    assert all(isinstance(b["cls"], torch.Tensor) for b in StreamingDataLoader(ds, batch_size=8))


def test_plain_dataloader_with_workers_delivers_exactly_once(ds_url):
    ds = StreamingDataset(ds_url, window=4, seed=1, batch_size=5)
    loader = DataLoader(ds, batch_size=5, num_workers=3)
    assert sorted(_ids(loader)) == list(range(N))
    assert len(ds) == N


def test_resume_through_dataloader_workers(ds_url):
    full = _ids(StreamingDataLoader(StreamingDataset(ds_url, window=3, seed=4), batch_size=8))
    ds = StreamingDataset(ds_url, window=3, seed=4)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    head = []
    for k, b in enumerate(loader):
        head += [int(x) for x in b["cls"]]
        if k == 6:
            break
    state = loader.state_dict()
    assert state["splits"][0][3] == 56
    ds2 = StreamingDataset(ds_url, window=3, seed=4)
    loader2 = StreamingDataLoader(ds2, batch_size=8, num_workers=3)  # more workers than before
    loader2.load_state_dict(state)
    assert head + _ids(loader2) == full



def _rank_main(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = StreamingDataset(url, window=2, seed=7, drop_last=False)
        # built before any rank knows its place; topology is read at iteration time
        loader = StreamingDataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork")
        ids = _ids(loader)
        n = torch.tensor([len(ids)])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        state = ds.state_dict(len(ids))
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(" ".join(map(str, ids)) + "\n" + str(int(n)) + "\n" + repr(state["splits"]))
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo(ds_url, tmp_path):
    port = free_port()
    spawn_ranks(_rank_main, (2, port, ds_url, str(tmp_path)), 2)
    per_rank = []
    for r in range(2):
        ids_line, max_line, splits = (tmp_path / f"rank{r}.txt").read_text().splitlines()
        ids = [int(x) for x in ids_line.split()]
        per_rank.append(ids)
        assert int(max_line) == len(ids)  # every rank yields as many: DDP cannot hang
        assert splits == repr([[N, 2, N // 2, N // 2]])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(N))
    assert not set(per_rank[0]) & set(per_rank[1])


def test_persistent_workers_follow_set_epoch_and_load_state_dict(ds_url):
    """Persistent workers (the default with workers) keep their dataset copy across passes:
    each pass's epoch and resume point reach them through the loader's pass control."""
    ref = StreamingDataset(ds_url, window=3, seed=2, batch_size=8)
    ds = StreamingDataset(ds_url, window=3, seed=2)
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    assert loader.persistent_workers
    for epoch in (0, 1, 4):
        ref.set_epoch(epoch)
        ds.set_epoch(epoch)
        assert _ids(loader) == [int(s["cls"]) for s in ref]
    ref.set_epoch(7)
    ds.set_epoch(7)
    head = []
    for k, b in enumerate(loader):
        head += [int(x) for x in b["cls"]]
        if k == 3:
            break
    state = loader.state_dict()
    ds.load_state_dict(state)
    assert head + _ids(loader) == [int(s["cls"]) for s in ref]
