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
