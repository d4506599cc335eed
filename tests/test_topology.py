"""The one rank/world-size resolver and the policies its three callers keep."""

import pytest

from datapipe import CheckpointWriter
from datapipe.errors import CheckpointError, DatapipeError, PlanError, TopologyError
from datapipe.loader import resolve_topology
from datapipe.topology import Topology


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


def test_explicit_wins_each_argument_on_its_own(no_env):
    no_env.setenv("RANK", "1")
    no_env.setenv("WORLD_SIZE", "4")
    assert Topology.resolve(2, 3, environment=True) == Topology(2, 3)
    assert Topology.resolve(world_size=8, environment=True) == (1, 8)  # rank from the environment
    assert Topology.resolve(environment=True) == (1, 4)
    assert Topology.resolve(environment=False) == (0, 1)  # the checkpoint writer's policy


def test_environment_defaults_and_errors(no_env):
    assert Topology.from_environment() is None
    no_env.setenv("WORLD_SIZE", "3")
    assert Topology.from_environment() == (0, 3)
    no_env.setenv("RANK", "x")
    with pytest.raises(TopologyError, match="not integers"):
        Topology.from_environment()
    no_env.setenv("RANK", "3")
    with pytest.raises(TopologyError, match="rank 3 is not inside world size 3"):
        Topology.from_environment()


@pytest.mark.parametrize("rank, world", [(-1, 2), (2, 2), (0, 0), ("0", 1), (0, 1.0)])
def test_checked_refuses_what_does_not_fit(rank, world):
    with pytest.raises(TopologyError) as info:
        Topology.checked(rank, world)
    assert isinstance(info.value, DatapipeError) and isinstance(info.value, ValueError)


def test_no_process_group_means_none():
    assert Topology.distributed() is None


def test_each_caller_keeps_its_error_class(no_env, tmp_path):
    with pytest.raises(PlanError, match="give both"):
        resolve_topology(rank=1)
    with pytest.raises(PlanError, match="not inside"):
        resolve_topology(3, 2)
    with pytest.raises(CheckpointError, match="rank 5 is not inside world size 2"):
        CheckpointWriter(str(tmp_path / "ckpt"), rank=5, world_size=2, run_id="r")
    no_env.setenv("RANK", "1")
    no_env.setenv("WORLD_SIZE", "2")
    assert resolve_topology() == (1, 2)
    with CheckpointWriter(str(tmp_path / "ckpt")) as w:  # the writer reads no environment
        assert (w.rank, w.world_size) == (0, 1)


@pytest.mark.parametrize("rank, world_size", [(True, 2), (False, True), (0, True)])
def test_bools_are_not_ranks(no_env, rank, world_size):
    with pytest.raises(TopologyError, match="not inside world size"):
        Topology.resolve(rank, world_size, environment=False)
    with pytest.raises(CheckpointError, match="not inside world size"):
        CheckpointWriter("/nonexistent-never-created", rank=rank, world_size=world_size)
