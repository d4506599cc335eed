"""Peer replicas (Tier(replicate=1)) between real gloo ranks: one broken replica link does
not break its peer's, and a writer process's replica is checked against the chunk
checksums its sender sent."""

from __future__ import annotations

import os

import pytest

from datapipe.checkpoint import CheckpointWriter, Tier, load_checkpoint
from tests.ranks import free_port, spawn_ranks


# -- 2: one broken replica link must not break its peer's ---------------------------------------
def _broken_link_worker(rank: int, port: int, root: str, background: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tier = Tier(os.path.join(root, f"node{rank}"), replicate=1)
    w = CheckpointWriter(tiers=[tier], ranks_per_node=1, chunk_bytes=4096, commit_timeout=8,
                         background=background)
    state = {"w": torch.full((64,), float(rank))}
    assert "replica" in w.save(1, state).wait()["tiers"][tier.url]
    if rank == 0:  # rank 0's link broke in an earlier exchange
        w._link.broken = "injected: a failed exchange"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in (2, 3):
            m = w.save(step, state).wait()["tiers"][tier.url]  # no save fails, none waits 8 s
            assert m["committed"]
            if rank == 1:  # rank 0 sent a header saying "no data": named, not written
                assert "sent no replica" in m["replica_error"] and "injected" in m["replica_error"], m
                assert "replica" not in m
            else:  # rank 0 still received rank 1's part
                assert m["replica"]["of_rank"] == 1 and "replica_error" not in m, m
    if rank == 1 and background == "thread":  # (a writer process warns in its own stderr)
        assert any("sent no replica" in str(x.message) for x in seen)
    w.close()
    dist.barrier()
    if rank == 0:
        on_node1 = os.listdir(os.path.join(root, "node1", "replica-of-rank-00000"))
        assert "step-000000000001" in on_node1 and "step-000000000003" not in on_node1, on_node1
        assert "step-000000000003" in os.listdir(os.path.join(root, "node0", "replica-of-rank-00001"))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", ["thread", "process"])
def test_broken_replica_link_does_not_break_the_peer(tmp_path, background):

    spawn_ranks(_broken_link_worker, (free_port(), str(tmp_path), background), 2)


# -- 4: a writer process's replica header carries the chunk checksums; none is refused --------
def _process_header_worker(rank: int, port: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tier = Tier(os.path.join(root, f"node{rank}"), replicate=1)
    w = CheckpointWriter(tiers=[tier], ranks_per_node=1, chunk_bytes=4096, commit_timeout=30,
                         background="process")
    state = {"w": torch.arange(3000, dtype=torch.float32) + rank}  # 12000 bytes: 3 chunks
    sent: list[dict] = []
    if rank == 0:
        real = w._link.exchange

        def exchange(header, data):
            sent.append(header)
            if header["step"] == 2:  # as a sender without checksums (the old writer process)
                header = {k: v for k, v in header.items() if k != "raw_checksums"}
            return real(header, data)

        w._link.exchange = exchange
    m1 = w.save(1, state).wait()["tiers"][tier.url]
    assert m1["replica"]["of_rank"] == 1 - rank, m1
    if rank == 0:
        assert len(sent[0]["raw_checksums"]) == 3, sent[0].keys()
    m2 = w.save(2, state).wait()["tiers"][tier.url]
    assert m2["committed"]
    if rank == 1:
        assert "does not carry a checksum" in m2["replica_error"] and "replica" not in m2, m2
    w.close()
    dist.barrier()
    if rank == 0:
        on_node1 = os.listdir(os.path.join(root, "node1", "replica-of-rank-00000"))
        assert "step-000000000001" in on_node1 and "step-000000000002" not in on_node1, on_node1
        r = load_checkpoint(os.path.join(root, "node1", "replica-of-rank-00000"), rank=0)
        assert torch.equal(r["w"], state["w"])
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_process_writer_replica_is_checked_against_the_sender(tmp_path):

    spawn_ranks(_process_header_worker, (free_port(), str(tmp_path)), 2)
