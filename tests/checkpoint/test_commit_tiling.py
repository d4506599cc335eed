"""The committing rank refuses a step whose parts do not tile a global tensor exactly once:
nothing unloadable looks complete. Over real part documents in a store, and with 2 real
ranks over gloo whose states differ (rank 0 holds a replicated DTensor rank 1 lacks, so
rank 0 deals it to rank 1, which never stores it): the save raises naming the tensor and
no manifest is written; the same save with equal states commits and loads."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from datapipe.checkpoint.commit import await_parts
from datapipe.checkpoint.format import encode_doc, part_key
from datapipe.errors import CheckpointError
from datapipe.storage import MemoryStore
from tests.ranks import free_port, spawn_ranks


def _publish(store: MemoryStore, world: int, records: list[list[tuple[str, list[int], list[int], list[int], bool]]]
             ) -> None:
    for r, recs in enumerate(records):
        leaves = [{"path": p, "kind": "torch", "dtype": "float32", "shape": region if not rep else [0],
                   "offset": 0, "nbytes": 0,
                   "global": {"shape": shape, "offset": off, "region": region, "replica": rep}}
                  for p, shape, off, region, rep in recs]
        doc = {"step": 1, "attempt": "a-0", "rank": r, "world_size": world, "data_bytes": 0, "stored_bytes": 0,
               "leaves": leaves}
        store.put(part_key(1, "a-0", r), encode_doc(doc, "part"))


def _commit(records) -> str:
    store = MemoryStore()
    _publish(store, len(records), records)
    try:
        await_parts(store, 1, "a-0", len(records), timeout=0.05)
    except CheckpointError as e:
        return str(e)
    return "committed"


def test_the_commit_checks_that_the_parts_tile_every_global_tensor() -> None:
    rows = ("w", [4, 3], [0, 0], [2, 3])
    other = ("w", [4, 3], [2, 0], [2, 3])
    # two ranks each storing half, or one half stored and recorded as a replica elsewhere
    assert _commit([[(*rows, False)], [(*other, False)]]) == "committed"
    assert _commit([[(*rows, False), (*other, True)], [(*rows, True), (*other, False)]]) == "committed"
    # a half that every rank records as a replica: nobody stored it
    hole = _commit([[(*rows, False), (*other, True)], [(*rows, True), (*other, True)]])
    assert "global tensor 'w'" in hole and "6 of 12" in hole and "not committed" in hole
    # a tensor only replicas name: none of it stored
    assert "0 of 12" in _commit([[(*rows, True)], [(*other, True)]])
    # the same half stored twice, and the other half by nobody: the volumes add up
    assert "overlap" in _commit([[(*rows, False)], [(*rows, False)]])
    # overlapping boxes whose volumes add up
    assert "overlap" in _commit([[("w", [4, 3], [0, 0], [3, 3], False)], [("w", [4, 3], [1, 0], [1, 3], False)]])
    # another global shape on another rank
    assert "[4, 3] in" in _commit([[(*rows, False)], [("w", [5, 3], [2, 0], [2, 3], False)]])
    # a box outside the tensor is malformed, not a tiling
    assert "malformed" in _commit([[("w", [4, 3], [3, 0], [2, 3], False)], [(*other, False)]])


def _worker(rank: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))

    def rep(n: int, v: float) -> DTensor:
        return DTensor.from_local(torch.full((n,), v), mesh, [Replicate()], run_check=False)

    out: dict = {}
    state = {"a": rep(64, 1.0), "x": rep(4, 2.0)} if rank == 0 else {"a": rep(64, 1.0)}
    url = os.path.join(root, "unequal")
    with CheckpointWriter(url, commit_timeout=30) as w:
        try:
            w.save(1, state).wait()
            out["unequal"] = "committed"
        except CheckpointError as e:
            out["unequal"] = str(e)
    dist.barrier()
    out["unequal_steps"] = [c.step for c in list_checkpoints(url) if c.complete]
    url = os.path.join(root, "equal")
    with CheckpointWriter(url, commit_timeout=30) as w:
        w.save(1, {"a": rep(64, 1.0), "x": rep(4, 2.0)}).wait()
    dist.barrier()
    got = load_checkpoint(url)
    out["equal"] = {k: v.tolist() for k, v in got.items()} if rank == 0 else None
    with open(os.path.join(root, f"r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_ranks_whose_states_differ_do_not_commit_a_step_with_a_hole(tmp_path) -> None:
    spawn_ranks(_worker, (free_port(), str(tmp_path)), 2)
    r0 = json.load(open(tmp_path / "r0.json"))
    r1 = json.load(open(tmp_path / "r1.json"))
    assert "global tensor 'x'" in r0["unequal"] and "not committed" in r0["unequal"], r0["unequal"]
    assert r0["unequal_steps"] == [] and r1["unequal_steps"] == []
    assert r0["equal"] == {"a": [1.0] * 64, "x": [2.0] * 4}
