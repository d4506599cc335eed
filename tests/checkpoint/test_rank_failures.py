"""A failure on one rank is agreed on by all, never a hang: a restore whose copy fails on one
rank (and destroys its own group), a writer whose construction fails on one rank; real
gloo processes."""

from __future__ import annotations

import os

import pytest

from datapipe.checkpoint import CheckpointWriter, Tier
from tests.ranks import free_port, spawn_ranks


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
