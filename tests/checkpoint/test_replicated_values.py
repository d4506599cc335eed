"""Replicated values in a node-local tier of a multi-rank job: each rank's node-local part
holds their bytes and loads on its own, the shared tier stores them once; a one-part
checkpoint holding a replica leaf without bytes is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from datapipe.checkpoint import CheckpointWriter, Tier, load_checkpoint
from datapipe.checkpoint.dtensor import Replicated
from datapipe.errors import CorruptCheckpointError


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
