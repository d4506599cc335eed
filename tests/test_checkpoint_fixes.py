"""Regression tests for reviewed checkpoint defects: each runs real files (and, where
ranks talk, real gloo processes) and failed before its fix."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from datapipe.checkpoint import CheckpointWriter, Tier, load_checkpoint
from datapipe.checkpoint.dtensor import Replicated
from datapipe.errors import CorruptCheckpointError
from tests.ranks import free_port, spawn_ranks


# -- 1: a Replicated value in a node-local tier of a multi-rank job ---------------------------
def _part(folder: str) -> dict:
    parts = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.startswith("part-"))
    with open(parts[-1]) as f:
        return json.load(f)


def test_node_local_parts_hold_replicated_values_shared_tier_stores_them_once(tmp_path):
    """2 ranks (two writers in one process: no collective is used without replicate=1),
    a node-local and a shared tier: rank 1's node-local part, a one-part checkpoint,
    holds the bytes of the Replicated array that rank 0 stores for the shared tier, and
    loads whole on its own; the shared tier still stores that array once (rank 1's part
    there records it as a replica of no bytes), and a step the node-local tier is not due
    for stages no copy."""
    node, shared = str(tmp_path / "node"), str(tmp_path / "shared")
    big = np.arange(5000, dtype=np.int64)  # 40000 bytes: a second copy in the shared tier would show
    writers = [CheckpointWriter(tiers=[Tier(node, every=2, node_local=True), Tier(shared)], rank=rank,
                                world_size=2, run_id="r1", chunk_bytes=4096, commit_timeout=30)
               for rank in (0, 1)]
    for step in (1, 2, 3):
        handles = [w.save(step, {"w": Replicated(big + step), "b": np.full(3, rank * 10 + step)})
                   for rank, w in enumerate(writers)]
        metrics = [h.wait() for h in handles]
        # what rank 1 staged: its own array, plus the copy of `w` only at the step the node-local tier takes
        assert (metrics[1]["bytes"] >= big.nbytes) == (step == 2), metrics[1]["bytes"]
        # step 3 stages a prefix of step 2's layout into the same buffer
        assert not metrics[1]["staging_allocated"] or step < 3
    for w in writers:
        w.close()
    for rank in (0, 1):
        got = load_checkpoint(os.path.join(node, f"rank-{rank:05d}"), step=2)
        assert np.array_equal(got["w"], big + 2) and got["w"].dtype == big.dtype
        assert np.array_equal(got["b"], np.full(3, rank * 10 + 2))
        leaf = next(x for x in _part(os.path.join(node, f"rank-{rank:05d}"))["leaves"] if x["path"] == "w")
        assert leaf["global"]["replica"] is False and leaf["nbytes"] == big.nbytes
        for step in (1, 2, 3):
            got = load_checkpoint(shared, step=step, rank=rank)
            assert np.array_equal(got["w"], big + step) and np.array_equal(got["b"], np.full(3, rank * 10 + step))
    for step in (1, 2, 3):  # the shared tier: `w` once, by rank 0, as without a node-local tier
        step_dir = os.path.join(shared, f"step-{step:012d}")
        stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir)
                     for f in fs if f.endswith(".bin"))
        assert big.nbytes + 2 * 3 * 8 <= stored < big.nbytes + 2 * 3 * 8 + 64 * 3, stored
        rank1 = next(os.path.join(dd, f) for dd, _, fs in os.walk(step_dir) for f in fs if f == "part-00001.json")
        with open(rank1) as f:
            leaf = next(x for x in json.load(f)["leaves"] if x["path"] == "w")
        assert leaf["global"]["replica"] is True and leaf["nbytes"] == 0


def test_one_part_checkpoint_with_replica_leaf_is_refused_on_load(tmp_path):
    """A one-part checkpoint holding an empty replica leaf (a node-local part written before
    node-local parts held replicated values; here: a one-rank save of a LocalShard that says
    another rank stores it) loads as a named CorruptCheckpointError, not as an empty array."""
    from datapipe.checkpoint import LocalShard

    d = str(tmp_path / "one")
    with CheckpointWriter(d, rank=0, world_size=1, run_id="r1") as w:
        w.save(1, {"w": LocalShard(np.arange(4), (8,), (4,), replica=True)}).wait()
    with pytest.raises(CorruptCheckpointError, match=r"replica leaves without bytes.*'w'.*shared tier"):
        load_checkpoint(d, step=1)


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

    spawn_ranks(_process_header_worker, (free_port(), str(tmp_path)), 2)


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
        real = restore_mod.read_step

        def load_step(store, step, *args, **kw):
            if step == 2:
                raise OSError("injected: the disk went away")
            return real(store, step, *args, **kw)

        restore_mod.read_step = load_step
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

    spawn_ranks(_restore_failure_worker, (free_port(), str(tmp_path)), 2)


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

    from datapipe.checkpoint.lease import Lease
    from datapipe.storage import open_store

    held = Lease(open_store(str(tmp_path / "node1" / "rank-00001")), "another_run", 600.0, 0.0).acquire()
    try:
        spawn_ranks(_construct_failure_worker, (free_port(), str(tmp_path)), 2)
    finally:
        held.release()
