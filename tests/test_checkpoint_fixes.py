"""Regression tests for reviewed checkpoint defects: each runs real files (and, where
ranks talk, real gloo processes) and failed before its fix."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from datapipe.checkpoint import CheckpointWriter, Tier, load_checkpoint
from datapipe.checkpoint.dtensor import Replicated
from datapipe.errors import CheckpointError, CorruptCheckpointError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- 1: a Replicated value in a node-local tier of a multi-rank job ---------------------------
def test_node_local_tier_refuses_replicated_values(tmp_path):
    """Rank 1 of 2 would store an empty `replica` leaf in its one-part node-local checkpoint:
    the save is refused on every rank (rank 0 stores the bytes, but its part is refused
    alike, so no rank waits for the other), naming the value and what to do."""
    d = str(tmp_path / "node")
    for rank in (0, 1):
        w = CheckpointWriter(tiers=[Tier(d, node_local=True)], rank=rank, world_size=2, run_id="r1")
        with pytest.raises(CheckpointError, match=r"node-local.*\['w'\].*shared tier"):
            w.save(1, {"w": Replicated(np.arange(4)), "b": np.ones(3)})
        w.close()
    assert not os.path.exists(os.path.join(d, "rank-00001", "step-000000000001"))


def test_one_part_checkpoint_with_replica_leaf_is_refused_on_load(tmp_path):
    """A node-local part written before the refusal existed (rank 1's, holding an empty
    replica leaf) loads as a named CorruptCheckpointError, not as an empty array."""
    d = str(tmp_path / "node")
    w = CheckpointWriter(tiers=[Tier(d, node_local=True)], rank=1, world_size=2, run_id="r1")
    w._refuse_replicas_in_node_local = lambda due, leaves: None  # as the writer did before the fix
    w.save(1, {"w": Replicated(np.arange(4))}).wait()
    w.close()
    with pytest.raises(CorruptCheckpointError, match=r"replica leaves without bytes.*'w'.*shared tier"):
        load_checkpoint(os.path.join(d, "rank-00001"), step=1)


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
    import torch.multiprocessing as mp

    mp.spawn(_broken_link_worker, args=(_free_port(), str(tmp_path), background), nprocs=2, join=True)


# -- 3: a failed load into= leaves no unverified bytes in the caller's tensors -----------------
def test_failed_load_into_writes_no_unverified_bytes(tmp_path):
    url = str(tmp_path / "ck")
    with CheckpointWriter(url) as w:
        w.save(1, {"w": np.arange(1 << 14, dtype=np.int64)})
    chunks = [os.path.join(d, f) for d, _s, fs in os.walk(url) for f in fs if f.endswith(".bin")]
    assert len(chunks) == 1
    data = bytearray(open(chunks[0], "rb").read())
    data[len(data) // 2] ^= 0x01
    open(chunks[0], "wb").write(bytes(data))
    into = {"w": np.zeros(1 << 14, dtype=np.int64)}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_checkpoint(url, step=1, into=into)
    assert not into["w"].any(), "corrupt bytes were written into the caller's array"


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
    import torch.multiprocessing as mp

    mp.spawn(_process_header_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)


# -- 6/7: any failure of a rank's copy in a restore is agreed on, never a hang ------------------
def _restore_failure_worker(rank: int, port: int, root: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    from datapipe.checkpoint import restore as restore_mod
    from datapipe.checkpoint import restore_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tiers = [Tier(os.path.join(root, "shared"))]
    with CheckpointWriter(tiers=tiers, chunk_bytes=4096, commit_timeout=30) as w:
        for step in (1, 2):
            w.save(step, {"w": torch.full((10,), float(step)), "rank": rank}).wait()
    if rank == 1:  # an unexpected error (not a CheckpointError) reading rank 1's part of step 2
        real = restore_mod._load_step

        def load_step(store, step, *args, **kw):
            if step == 2:
                raise OSError("injected: the disk went away")
            return real(store, step, *args, **kw)

        restore_mod._load_step = load_step
    before = dist.distributed_c10d._world.group_count
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers, timeout_s=30)
    assert r.step == 1 and r.state["rank"] == rank and torch.equal(r.state["w"], torch.full((10,), 1.0))
    assert any("OSError" in str(x.message) and "injected" in str(x.message) for x in seen)
    # the restore's own group is destroyed: only the default group's entry remains
    groups = [g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD]
    assert dist.distributed_c10d._world.group_count == before + 1 and groups == [], groups
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_restore_agrees_on_any_failure_and_destroys_its_group(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_restore_failure_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)


# -- 5: a rank that fails constructing its writer leaves no other rank in a collective ---------
def _construct_failure_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from datapipe.errors import CheckpointError as CkError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tier = Tier(os.path.join(root, f"node{rank}"), replicate=1)
    try:
        w = CheckpointWriter(tiers=[tier], ranks_per_node=1, commit_timeout=10)
    except CkError as e:
        assert rank == 1 and "lease" in str(e).lower(), e  # rank 1's folder is held by another writer
    else:
        assert rank == 0
        w.close()  # no save: nothing waits for rank 1
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_writer_construction_failure_on_one_rank_does_not_stall_the_others(tmp_path):
    import torch.multiprocessing as mp

    from datapipe.checkpoint.lease import Lease
    from datapipe.storage import open_store

    held = Lease(open_store(str(tmp_path / "node1" / "rank-00001")), "another_run", 600.0, 0.0).acquire()
    try:
        mp.spawn(_construct_failure_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    finally:
        held.release()
