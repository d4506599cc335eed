"""The token loaders in 2-rank jobs (torch.distributed over gloo on loopback): the topology
comes from the process group; TokenDataset's ranks, each reading through two DataLoader
workers, deliver every sequence of the epoch once between them, with the stream's tokens;
replicated ranks (one tensor-parallel group) get the same sequences; TokenMix's per-rank
batches, gathered, are global batches holding each source's share exactly; a state saved by
the 2-rank job resumes on one rank with the rest of the epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks
from tests.token_datasets import random_documents, write_tokens

L = 16


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(1)
    streams = {}
    for name, n in (("a", 50), ("b", 30)):
        streams[name] = write_tokens(base / name, [random_documents(rng, n), random_documents(rng, n // 2)])
    return base, streams


def _job(rank: int, world: int, port: int, base: str, out: str) -> None:
    from datapipe import StreamingDataLoader, TokenDataset, TokenMix

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = TokenDataset(f"{base}/a", L, seed=2, window=2, chunk_tokens=96)
        assert ds.data_parallel() == (rank, world)
        loader = StreamingDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
        rows = torch.cat([b["input_ids"] for b in loader])
        ids = ds.sequences()
        assert rows.shape[0] == len(ids)
        # stopped after 3 batches: the state every rank agrees on (ranks advance in lockstep)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        del it
        replicated = TokenDataset(f"{base}/a", L, seed=2, window=2, chunk_tokens=96, replication=2)
        same = replicated.sequences()
        mix = TokenMix({f"{base}/a": 3, f"{base}/b": 1}, L, global_batch=8, steps=6, chunk_tokens=96, seed=1)
        assert mix.per_rank_batch() == 4
        mix_batches = [(b["input_ids"].clone(), b["source"].clone())
                       for b in StreamingDataLoader(mix, batch_size=4, num_workers=2, multiprocessing_context="fork")]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (ids.tolist(), rows.numpy(), state, same.tolist(),
                                          [(x.numpy(), s.numpy()) for x, s in mix_batches]))
        if rank == 0:
            import pickle

            with open(f"{out}/gathered.pkl", "wb") as f:
                pickle.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_the_epoch_and_the_global_batches(roots, tmp_path):
    import pickle

    from datapipe import TokenDataset

    base, streams = roots
    spawn_ranks(_job, (2, free_port(), str(base), str(tmp_path)), 2)
    with open(tmp_path / "gathered.pkl", "rb") as f:
        gathered = pickle.load(f)
    stream = streams["a"]
    all_ids = []
    for ids, rows, _state, _same, _mix in gathered:
        for q, row in zip(ids, rows):
            np.testing.assert_array_equal(row, stream[q * L:q * L + L + 1])
        all_ids += ids
    n = TokenDataset(base / "a", L, chunk_tokens=96).num_sequences
    assert len(set(all_ids)) == len(all_ids) and n - len(all_ids) < 2  # every sequence once (drop_last)
    states = [g[2] for g in gathered]
    assert states[0] == states[1]  # one state for the job
    assert gathered[0][3] == gathered[1][3]  # one tensor-parallel group of two: the same sequences
    # the mix: rank 0's rows then rank 1's are global batch k, holding 6 of a and 2 of b
    for k in range(6):
        sources = np.concatenate([gathered[r][4][k][1] for r in range(2)])
        assert np.bincount(sources, minlength=2).tolist() == [6, 2]
    # the job's state resumes on one rank: the rest of the epoch, nothing twice
    one = TokenDataset(base / "a", L, seed=2, window=2, chunk_tokens=96, rank=0, world_size=1)
    one.load_state_dict(states[0])
    rest = one.sequences().tolist()
    head = [q for g in gathered for q in g[0][:12]]
    assert len(set(head + rest)) == len(head + rest) and n - len(head + rest) < 3
