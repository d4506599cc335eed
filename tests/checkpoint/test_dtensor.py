"""dtensor_box shares the work of DTensors alike (same mesh, placements and global shape)
through a memo that lives for one walk: the answers with the memo are those without it;
each box two ranks hold is stored by exactly one of them, whatever order each walked its
state in, and each stores its share of the bytes (boxes of unequal sizes); and the refusals (a
_StridedShard after an equal-looking Shard, a padded local tensor, a rank outside the
mesh) still fire for every DTensor. 4 real ranks over gloo on a 2x2 CPU mesh."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

WORLD = 4



def _refused(fn) -> str:
    from datapipe.errors import UnsupportedStateError

    try:
        fn()
    except UnsupportedStateError as e:
        return str(e)
    return "accepted"


def _worker(rank: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from datapipe.checkpoint.dtensor import dtensor_box
    from datapipe.checkpoint.flatten import flatten

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    memo: dict = {}
    model = {}
    for i in range(24):  # alike: one mesh, (Replicate, Shard(0)), global (8, 3)
        x = DTensor.from_local(torch.full((4, 3), float(i)), mesh, [Replicate(), Shard(0)], run_check=False)
        got = dtensor_box(x, f"model.layer{i}", memo)
        assert got == dtensor_box(x, f"model.layer{i}")  # without the memo: the same
        assert got.offset == (4 * coord[1], 0) and got.shape == (4, 3) and got.shared
        assert got.holders == ((0, 2) if coord[1] == 0 else (1, 3)) and got.rank == rank
        model[f"layer{i}"] = x
    for i in range(5):  # and some of other sizes: rows 4 * (i + 1) of 3 on each holder pair
        model[f"big{i}"] = DTensor.from_local(torch.full((4 * (i + 1), 3), -1.0), mesh, [Replicate(), Shard(0)],
                                              run_check=False)
    # the ranks of the second mesh row walk the state in another order: the same choice
    names = sorted(model, reverse=coord[0] == 1)
    _tree, leaves = flatten({"model": {k: model[k] for k in names}}, rank=rank)
    out = {"replica": {leaf.path: bool(leaf.shard["replica"]) for leaf in leaves},
           "bytes": sum(leaf.nbytes for leaf in leaves)}
    # equal-looking but not alike: a _StridedShard on the same mesh and global shape
    strided = DTensor.from_local(torch.zeros(4, 3), mesh, [Replicate(), _StridedShard(0, split_factor=2)],
                                 run_check=False)
    out["strided"] = _refused(lambda: dtensor_box(strided, "strided", memo))
    # alike but padded: the local tensor is not the box the placements give
    padded = DTensor.from_local(torch.zeros(5, 3), mesh, [Replicate(), Shard(0)], run_check=False,
                                shape=torch.Size((8, 3)), stride=(3, 1))
    out["padded"] = _refused(lambda: dtensor_box(padded, "padded", memo))
    # a mesh of ranks 0 and 1: ranks 2 and 3 are outside it, every time
    half = DeviceMesh("cpu", [0, 1])
    if rank >= 2:
        outsider = DTensor.from_local(torch.zeros(2), half, [Shard(0)], run_check=False,
                                      shape=torch.Size((4,)), stride=(1,))
        out["outside"] = [_refused(lambda j=j: dtensor_box(outsider, f"o{j}", memo)) for j in range(2)]
    with open(os.path.join(root, f"r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_memoised_boxes_agree_and_refusals_still_fire(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD)
    got = [json.load(open(tmp_path / f"r{r}.json")) for r in range(WORLD)]
    # ranks r and r+2 hold the same box (they differ in the Replicate coordinate): exactly
    # one of them stores each path, though they walked the state in opposite orders
    assert len(got[0]["replica"]) == 29
    for path in got[0]["replica"]:
        for a, b in ((0, 2), (1, 3)):
            assert got[a]["replica"][path] != got[b]["replica"][path], path
    # each holder stores its share: 24 boxes of 48 bytes and 5 of 48-240 bytes (1,872 per
    # pair) dealt largest first to the holder with fewer bytes: within one box of the half
    total = 24 * 48 + sum(48 * (i + 1) for i in range(5))
    stored = [g["bytes"] for g in got]
    for a, b in ((0, 2), (1, 3)):
        assert stored[a] + stored[b] == total and abs(stored[a] - stored[b]) <= 48, stored
    for r in range(WORLD):
        assert "_StridedShard" in got[r]["strided"] and "'strided'" in got[r]["strided"]
        assert "padded shards" in got[r]["padded"] and "'padded'" in got[r]["padded"]
    for r in (2, 3):
        assert len(got[r]["outside"]) == 2
        assert all("not in the DTensor's mesh" in m for m in got[r]["outside"]), got[r]["outside"]
