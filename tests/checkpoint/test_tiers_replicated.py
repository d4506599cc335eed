"""Values replicated across ranks in node-local tiers (issue #15): 2 "nodes" x 2 ranks over
gloo in spawned processes, a node-local tier with its peer replica plus a shared tier. The
state holds what FSDP/HSDP users always have: a per-rank tensor, a `Replicated` tensor (stored
by rank 0 in the shared tier), the optimizer's step counter in `Replicated`, python values,
and a DTensor on a 2x2 mesh with (Replicate(), Shard(0)) placements (each box held by two
ranks, stored by one of them in the shared tier).

Every rank's node-local part holds every value that rank holds and restores whole: from its
own folder, and, with node 1's folders deleted and without the shared tier, from the peer
replicas. The shared tier still writes each replicated value once: its parts are byte for byte
those of a writer without a node-local tier. A damaged chunk of a replicated value in a peer
replica is caught by its checksum and that copy is skipped with the restore's warning."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

RPN = 2
WORLD = 4
REP = 6000  # float32 elements of the Replicated tensor: a second copy in the shared tier would show
DT_ROWS, DT_COLS = 40, 6



def _rep(step: int) -> torch.Tensor:
    return torch.linspace(-1, 1, REP) + step


def _dt_full(step: int) -> torch.Tensor:
    return torch.arange(DT_ROWS * DT_COLS, dtype=torch.float64).reshape(DT_ROWS, DT_COLS) * 0.5 + step


def _dt_local(rank: int, step: int) -> torch.Tensor:
    # mesh [[0, 1], [2, 3]], (Replicate(), Shard(0)): ranks 0 and 2 hold rows [0, 20), 1 and 3 rows [20, 40)
    half = DT_ROWS // 2
    return _dt_full(step)[(rank % 2) * half:(rank % 2 + 1) * half]


def _state(rank: int, step: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from datapipe.checkpoint import Replicated

    dt = DTensor.from_local(_dt_local(rank, step).clone(), mesh, [Replicate(), Shard(0)], run_check=False)
    return {"plain": torch.full((50, 3), float(rank * 100 + step)),
            "rep": Replicated(_rep(step)),
            "optim": Replicated({"step": torch.tensor(float(step)), "lr": 0.01}),
            "dt": dt,
            "py": {"step": step, "rank": rank, "name": f"r{rank}", "t": (1.5, None, b"\x00\x01")}}


def _check(got: dict, rank: int, step: int, dt_whole: bool = False) -> None:
    """Every value byte for byte (dtype and shape too). A DTensor's part comes back as this
    rank's box from a node-local copy (a one-part checkpoint) and whole from a shared tier."""
    def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (what, a, b)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what

    same(got["plain"], torch.full((50, 3), float(rank * 100 + step)), "plain")
    same(got["rep"], _rep(step), "rep")
    same(got["optim"]["step"], torch.tensor(float(step)), "optim.step")
    assert got["optim"]["lr"] == 0.01
    same(got["dt"], _dt_full(step) if dt_whole else _dt_local(rank, step), "dt")
    assert got["py"] == {"step": step, "rank": rank, "name": f"r{rank}", "t": (1.5, None, b"\x00\x01")}


def _part_docs(step_dir: str) -> dict[int, dict]:
    out = {}
    for d, _s, fs in os.walk(step_dir):
        for f in fs:
            if f.startswith("part-") and f.endswith(".json"):
                with open(os.path.join(d, f)) as fh:
                    doc = json.load(fh)
                out[doc["rank"]] = doc
    return out


def _chunk_bytes_on_disk(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(step_dir) for f in fs
               if f.endswith(".bin"))


def _damage_leaf(folder: str, step: int, path: str) -> str:
    """Flip one byte inside leaf ``path``'s bytes in the chunk of the one-part checkpoint at
    ``folder`` that holds it; return the chunk's key."""
    step_dir = os.path.join(folder, f"step-{step:012d}")
    part = _part_docs(step_dir)[0]
    leaf = next(x for x in part["leaves"] if x["path"] == path)
    at = leaf["offset"] + leaf["nbytes"] // 2
    chunk = next(c for c in part["chunks"] if c["offset"] <= at < c["offset"] + c["bytes"])
    name = os.path.join(folder, chunk["key"])
    data = bytearray(open(name, "rb").read())
    data[at - chunk["offset"]] ^= 0x40
    open(name, "wb").write(bytes(data))
    return chunk["key"]


def _worker(rank: int, port: int, root: str, background: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from datapipe.checkpoint import CheckpointWriter, Tier, restore_checkpoint
    from datapipe.checkpoint.tiers import own_dir, replica_dir

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    local = Tier(os.path.join(root, f"node{rank // RPN}"), every=1, keep_last=2, replicate=1)
    shared = Tier(os.path.join(root, "shared"), every=1, keep_last=2)
    tiers = [local, shared]
    with CheckpointWriter(tiers=tiers, ranks_per_node=RPN, chunk_bytes=4096, commit_timeout=60,
                          background=background) as w:
        for step in (1, 2):
            m = w.save(step, _state(rank, step, mesh)).wait()
            tm = m["tiers"][local.url]
            assert tm["committed"] and tm["replica"]["of_rank"] == (rank - RPN) % WORLD, tm
            assert "error" not in m["tiers"][shared.url] and "replica_error" not in tm, m
    # the same state through a writer without a node-local tier: what the shared tier held before
    with CheckpointWriter(os.path.join(root, "baseline"), chunk_bytes=4096, commit_timeout=60,
                          background=background) as w:
        w.save(2, _state(rank, 2, mesh)).wait()
    dist.barrier()

    # 1. the shared tier: each replicated value once, exactly the bytes and records of the baseline
    if rank == 0:
        sdir = os.path.join(shared.url, "step-000000000002")
        got, base = _part_docs(sdir), _part_docs(os.path.join(root, "baseline", "step-000000000002"))
        assert sorted(got) == sorted(base) == list(range(WORLD))
        for r in range(WORLD):
            for key in ("data_bytes", "chunk_bytes", "leaves", "tree"):
                assert got[r][key] == base[r][key], (r, key)
            assert [c["checksum"] for c in got[r]["chunks"]] == [c["checksum"] for c in base[r]["chunks"]], r
        unique = (WORLD * 50 * 3 * 4 + REP * 4 + 4 + DT_ROWS * DT_COLS * 8)
        leaves = sum(len(p["leaves"]) for p in got.values())
        assert unique <= _chunk_bytes_on_disk(sdir) < unique + 64 * leaves
        assert 64 * leaves < REP * 4  # so a second copy of the Replicated tensor would not fit
        assert all(x["nbytes"] == 0 for r in range(1, WORLD) for x in got[r]["leaves"] if x["path"] == "rep")
    # 2. every node-local part (own and replica) is whole: no leaf without its bytes
    node = local.url
    for folder in (own_dir(rank), replica_dir((rank - RPN) % WORLD)):
        part = _part_docs(os.path.join(node, folder, "step-000000000002"))[0]
        assert not [x["path"] for x in part["leaves"] if x.get("global", {}).get("replica")], folder
        rep = next(x for x in part["leaves"] if x["path"] == "rep")
        assert rep["nbytes"] == REP * 4 and rep["global"]["region"] == [REP]
    dist.barrier()

    # 3. restore from the own local folders
    r = restore_checkpoint(tiers, ranks_per_node=RPN, timeout_s=60)
    assert r.step == 2 and r.sources == ["local"] * WORLD, r.sources
    _check(r.state, rank, 2)
    dist.barrier()

    # 4. node 1 lost with its local disk; restore without the shared tier: node 1's ranks
    # from the peer replicas node 0 keeps
    if rank == 0:
        shutil.rmtree(os.path.join(root, "node1"))
    dist.barrier()
    r = restore_checkpoint(tiers[:1], ranks_per_node=RPN, timeout_s=60)
    assert r.step == 2 and r.sources == ["local", "local", "peer replica", "peer replica"], r.sources
    _check(r.state, rank, 2)
    dist.barrier()

    # 5. the Replicated tensor's bytes damaged in rank 2's peer replica of step 2 (rank 2 is
    # not its owner: the copy only a node-local part holds): the checksum catches it, that
    # copy is skipped with a warning on every rank, and step 1 is restored
    if rank == 0:
        _damage_leaf(os.path.join(node, replica_dir(2)), 2, "rep")
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers[:1], ranks_per_node=RPN, timeout_s=60)
    assert r.step == 1 and r.sources == ["local", "local", "peer replica", "peer replica"], r.sources
    _check(r.state, rank, 1)
    text = [str(x.message) for x in seen]
    assert any("skipping the peer replica copy of rank 2's part of step 2" in t and "replica-of-rank-00002" in t
               and "checksum mismatch" in t for t in text), text
    # with the shared tier, rank 2's part of step 2 comes from there (its global tensors whole)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = restore_checkpoint(tiers, ranks_per_node=RPN, timeout_s=60)
    assert r.step == 2 and r.sources == ["local", "local", "remote", "peer replica"], r.sources
    _check(r.state, rank, 2, dt_whole=rank == 2)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("background", ["thread", "process"])
def test_node_local_parts_hold_replicated_values(tmp_path, background):
    spawn_ranks(_worker, (free_port(), str(tmp_path), background), WORLD)
