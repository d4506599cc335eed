"""``restore_checkpoint(reshard=True)``: one call restores a checkpoint saved by another
world size, with real ranks over gloo. 2 "nodes" x 2 ranks save DTensors (FSDP-style
``Shard(0)`` on a 1-D mesh and HSDP-style ``(Replicate, Shard(0))`` on a 2x2 mesh) to
node-local tiers with peer replicas; node 1 is lost with its disk, and the two ranks left
restore 4 -> 2 from their own folders and the replicas node 0 keeps of ranks 2 and 3. They
save at world size 2; node 1 comes back with an empty disk and the job of 4 restores 2 -> 4,
node 1's ranks getting the parts they overlap from node 0 over gloo. A corrupt copy is
skipped for another one; a world size no copy can give ends in NoCheckpointError."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ranks import free_port, spawn_ranks

RPN = 2
ROWS, COLS = 8, 3


def _full(i: int, step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (i + 1) + step


def _tiers(root: str, rank: int, world: int, remote: bool):
    """This node's local tier (a peer replica on the other node when there are two), and
    the shared one where ``remote``."""
    from datapipe.checkpoint import Tier

    local = Tier(os.path.join(root, f"node{rank // RPN}"), node_local=True, keep_last=3,
                 replicate=1 if world // RPN >= 2 else 0)
    return [local, Tier(os.path.join(root, "remote"), keep_last=3)] if remote else [local]


def _saved_state(rank: int, world: int, step: int):
    """What a job of ``world`` ranks saves: its DTensors' boxes of the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from datapipe.checkpoint import Replicated

    mesh = init_device_mesh("cpu", (world,))
    n = ROWS // world
    state = {"model": {"fsdp": DTensor.from_local(_full(0, step)[rank * n : (rank + 1) * n].clone(), mesh, [Shard(0)],
                                                  run_check=False)},
             "optim": Replicated({"t": torch.tensor(float(step)), "lr": 0.5}),
             "loader": {"epoch": 1, "world": world}, "step": step}
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2))
        c = hsdp.get_coordinate()[1]
        state["model"]["hsdp"] = DTensor.from_local(_full(1, step)[c * 4 : (c + 1) * 4].clone(), hsdp,
                                                    [Replicate(), Shard(0)], run_check=False)
    return state


def _target(world: int, with_hsdp: bool):
    """This rank's state on a 1-D mesh of ``world`` ranks, zeros to be filled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    n = ROWS // world
    model = {"fsdp": DTensor.from_local(torch.zeros(n, COLS), mesh, [Shard(0)], run_check=False)}
    if with_hsdp:
        model["hsdp"] = DTensor.from_local(torch.zeros(n, COLS), mesh, [Shard(0)], run_check=False)
    return {"model": model, "optim": {"t": torch.zeros(())}}


def _check_boxes(got, rank: int, world: int, step: int, with_hsdp: bool) -> None:
    n = ROWS // world
    assert torch.equal(got["model"]["fsdp"].to_local(), _full(0, step)[rank * n : (rank + 1) * n])
    if with_hsdp:
        assert torch.equal(got["model"]["hsdp"].to_local(), _full(1, step)[rank * n : (rank + 1) * n])
    assert float(got["optim"]["t"]) == float(step) and got["optim"]["lr"] == 0.5
    assert got["step"] == step and got["loader"]["epoch"] == 1


def _save(rank: int, world: int, root: str, step: int, remote: bool) -> None:
    from datapipe.checkpoint import CheckpointWriter

    with CheckpointWriter(tiers=_tiers(root, rank, world, remote), ranks_per_node=RPN, chunk_bytes=4096,
                          commit_timeout=60, background="thread") as w:
        w.save(step, _saved_state(rank, world, step)).wait()


def _four(rank: int, port: int, root: str, phase: str) -> None:
    from datapipe.checkpoint import restore_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    if phase == "save":  # step 10 to the node-local tiers (with peer replicas) and a shared one
        _save(rank, 4, root, 10, remote=True)
    else:  # node 1 is back with an empty disk: the newest step is the 2-rank save of step 20
        tiers = _tiers(root, rank, 4, remote=False)
        r = restore_checkpoint(tiers, ranks_per_node=RPN, reshard=True, into=_target(4, False), timeout_s=60)
        assert (r.step, r.saved_world_size, r.resharded) == (20, 2, True), r
        _check_boxes(r.state, rank, 4, 20, False)
        # node 1's ranks overlap rank 1's part only: it is sent from node 0
        assert r.sources == ["local", "local", "peer replica", "peer replica"], r.sources
        # without into=, every global tensor whole
        whole = restore_checkpoint(tiers, ranks_per_node=RPN, reshard=True, timeout_s=60)
        assert torch.equal(whole.state["model"]["fsdp"], _full(0, 20)) and whole.step == 20
        # without reshard, the newest step of this world size: step 10, node 1's parts from
        # the replicas node 0 keeps
        # (rank 0's part from the shared tier where its own copy was damaged)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the damaged copy, named
            same = restore_checkpoint(_tiers(root, rank, 4, remote=True), ranks_per_node=RPN, timeout_s=60)
        assert (same.step, same.saved_world_size, same.resharded) == (10, 4, False), same
        assert same.sources[0] in ("local", "remote"), same.sources
        assert same.sources[1:] == ["local", "peer replica", "peer replica"], same.sources

    dist.barrier()
    dist.destroy_process_group()


def _two(rank: int, port: int, root: str, corrupt: bool) -> None:
    from datapipe.checkpoint import restore_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tiers = _tiers(root, rank, 2, remote=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers, reshard=True, into=_target(2, True), timeout_s=60)
    assert (r.step, r.saved_world_size, r.resharded) == (10, 4, True), r
    _check_boxes(r.state, rank, 2, 10, True)
    said = [str(w.message) for w in caught]
    if corrupt:  # rank 0's own folder was damaged: skipped by name, its part read from the shared tier
        assert any("skipping the local copy of rank 0's part of step 10" in m for m in said), said
        assert "remote" in r.sources, r.sources
    else:  # ranks 2 and 3 left with their disk: their parts come from the replicas node 0 keeps
        # (rank 0 overlaps the parts of ranks 0 and 1 only, read from its own node's folders)
        assert r.sources == ["local", "peer replica"] and not said, (r.sources, said)
    _save(rank, 2, root, 20, remote=False)
    dist.barrier()
    dist.destroy_process_group()


def _flip_chunk(folder: str) -> None:
    for d, _sub, files in os.walk(folder):
        for f in sorted(files):
            if f.startswith("chunk-"):
                path = os.path.join(d, f)
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0x40
                open(path, "wb").write(bytes(data))
                return
    raise AssertionError(f"no chunk under {folder}")


@pytest.mark.parametrize("corrupt", [False, True])
def test_restore_reshards_four_ranks_to_two_and_back(tmp_path, corrupt):
    root = str(tmp_path)
    spawn_ranks(_four, (free_port(), root, "save"), 4)
    # node 1 is lost with its local disk: its ranks' parts live on only in node 0's replicas
    shutil.rmtree(os.path.join(root, "node1"))
    assert sorted(os.listdir(os.path.join(root, "node0"))) == [
        "rank-00000", "rank-00001", "replica-of-rank-00002", "replica-of-rank-00003"]
    if corrupt:  # and rank 0's own copy is damaged: the shared tier's copy of its part is left
        _flip_chunk(os.path.join(root, "node0", "rank-00000"))
    spawn_ranks(_two, (free_port(), root, corrupt), 2)
    os.makedirs(os.path.join(root, "node1"))  # back, empty
    spawn_ranks(_four, (free_port(), root, "grow"), 4)


# -- damaged copies, in one process ------------------------------------------------------------
# Two writers of one process save ranks 0 and 1 of a 2-rank job to one node-local tier (each
# commits its own folder, no process group needed); a 1-rank restore then joins both parts.

def _two_part_tier(root: str):
    from datapipe.checkpoint import CheckpointWriter, LocalShard, Tier

    tier = Tier(root, node_local=True)
    for r in range(2):
        with CheckpointWriter(tiers=[tier], rank=r, world_size=2, run_id="damaged", background="thread") as w:
            w.save(3, {"w": LocalShard(_full(0, 3)[r * 4 : (r + 1) * 4].clone(), (ROWS, COLS), (r * 4, 0)),
                       "k": r}).wait()
    return tier


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("two-parts") / "tier")
    _two_part_tier(root)
    return root


@settings(max_examples=40)
@given(which=st.integers(0, 1 << 16), at=st.integers(0, 1 << 30), flip=st.integers(1, 255),
       truncate=st.booleans())
def test_a_damaged_copy_restores_exactly_or_is_refused_by_name(two_parts, which, at, flip, truncate):
    """Any byte of any file of the two parts flipped (or the file cut there): the restore
    onto one rank gives the saved rows exactly, or a NoCheckpointError naming the damaged
    copy; never other bytes, never another exception."""
    import tempfile

    from datapipe.checkpoint import LocalShard, Tier, restore_checkpoint
    from datapipe.errors import NoCheckpointError

    with tempfile.TemporaryDirectory() as tmp:
        tier = os.path.join(tmp, "tier")
        shutil.copytree(two_parts, tier)
        files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(tier) for f in fs)
        path = files[which % len(files)]
        data = bytearray(open(path, "rb").read())
        if data:
            i = at % len(data)
            data = data[:i] if truncate else data[:i] + bytes([data[i] ^ flip]) + data[i + 1 :]
            open(path, "wb").write(bytes(data))
        into = {"w": LocalShard(torch.zeros(6, COLS), (ROWS, COLS), (1, 0))}  # rows of both parts
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                r = restore_checkpoint([Tier(tier, node_local=True)], rank=0, world_size=1, reshard=True, into=into)
            except NoCheckpointError as e:
                assert "skipped" in str(e)
                return
        assert torch.equal(r.state["w"].tensor, _full(0, 3)[1:7]) and r.state["k"] == 0, caught
        assert (r.step, r.saved_world_size, r.resharded) == (3, 2, True)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_reshard_must_be_a_bool(tmp_path, bad):
    from datapipe.checkpoint import Tier, restore_checkpoint
    from datapipe.errors import CheckpointOptionError

    with pytest.raises(CheckpointOptionError, match="reshard must be True or False"):
        restore_checkpoint([Tier(str(tmp_path), node_local=True)], rank=0, world_size=1, reshard=bad)


def test_a_one_rank_restore_joins_the_parts_of_two(two_parts):
    """Without into=, each global tensor whole; with into=, only the box asked for, and the
    values that hold no arrays from the saved rank 0."""
    from datapipe.checkpoint import LocalShard, Tier, restore_checkpoint

    tier = Tier(two_parts, node_local=True)
    whole = restore_checkpoint([tier], rank=0, world_size=1, reshard=True)
    assert torch.equal(whole.state["w"], _full(0, 3)) and whole.state["k"] == 0
    assert (whole.step, whole.saved_world_size, whole.resharded, whole.sources) == (3, 2, True, ["local"])
    box = LocalShard(torch.zeros(3, COLS), (ROWS, COLS), (5, 0))
    got = restore_checkpoint([tier], rank=0, world_size=1, reshard=True, into={"w": box})
    assert got.state["w"] is box and torch.equal(box.tensor, _full(0, 3)[5:]) and got.state["k"] == 0
    # into= without reshard: steps of this world size (1) only
    from datapipe.errors import NoCheckpointError

    with pytest.raises(NoCheckpointError, match="1 ranks"):
        restore_checkpoint([tier], rank=0, world_size=1, into={"w": box})
