"""The chunk size is decided per save (persist.chunk_bytes_for: smaller chunks when a part
would leave io threads idle), so ranks of one step write chunks of different sizes. A
peer replica is written with its sender's chunk size, not its holder's, and every reader
(the restore from peer replicas, the load, the reshard load) follows each part's own
record. Real ranks over gloo in spawned processes, 2 "nodes" x 2 ranks."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

RPN = 2
WORLD = 4
MIB = 1 << 20



def _state(rank: int, step: int):
    # node 0's ranks 1.5 MiB (1 MiB chunks), node 1's 10 MiB (3 MiB chunks), rank 3 also
    # none at all in a second tensor
    n = (3 * MIB // 2 if rank < RPN else 10 * MIB) // 4 + rank
    return {"w": torch.arange(n, dtype=torch.float32) + step, "e": torch.empty(0), "rank": rank}


def _part_doc(folder: str) -> dict:
    parts = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.startswith("part"))
    with open(parts[-1]) as f:
        return json.load(f)


def _worker(rank: int, port: int, root: str, background: str, compression: str | None) -> None:
    from datapipe.checkpoint import CheckpointWriter, Tier, restore_checkpoint
    from datapipe.checkpoint.tiers import own_dir, replica_dir

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    tiers = [Tier(os.path.join(root, f"node{rank // RPN}"), every=1, keep_last=2, replicate=1)]
    with CheckpointWriter(tiers=tiers, ranks_per_node=RPN, io_threads=4, commit_timeout=60,
                          background=background, compression=compression) as w:
        for step in (1, 2):
            m = w.save(step, _state(rank, step)).wait()
            assert m["tiers"][tiers[0].url]["replica"]["of_rank"] == (rank - RPN) % WORLD
    dist.barrier()
    node = tiers[0].url
    own = _part_doc(os.path.join(node, own_dir(rank)))
    held = _part_doc(os.path.join(node, replica_dir((rank - RPN) % WORLD)))
    # each copy in its writer's chunks: 1 MiB on node 0's ranks, 3 MiB on node 1's
    assert own["chunk_bytes"] == (MIB if rank < RPN else 3 * MIB)
    assert held["chunk_bytes"] == (3 * MIB if rank < RPN else MIB)
    assert held["data_bytes"] == held["chunks"][-1]["offset"] + held["chunks"][-1]["bytes"]
    dist.barrier()
    shutil.rmtree(os.path.join(node, own_dir(rank)))  # every rank loses its own copy
    dist.barrier()
    r = restore_checkpoint(tiers, ranks_per_node=RPN, timeout_s=60)
    want = _state(rank, 2)
    assert r.step == 2 and r.sources == ["peer replica"] * WORLD
    assert torch.equal(r.state["w"], want["w"]) and r.state["e"].numel() == 0 and r.state["rank"] == rank
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("background", "compression"), [("thread", None), ("process", "zstd")])
def test_peer_replicas_keep_their_senders_chunk_size(tmp_path, background, compression):
    spawn_ranks(_worker, (free_port(), str(tmp_path), background, compression), WORLD)


def test_chunks_smaller_than_a_block_and_an_empty_state_load(tmp_path):
    """chunk_bytes=4096 (below the 1 MiB block), a part under one block, and a state with
    no array bytes at all (total 0): each loads whole, and by range (into=)."""
    from datapipe.checkpoint import CheckpointWriter, LocalShard, load_checkpoint

    url = str(tmp_path / "ckpt")
    w0 = torch.arange(5000, dtype=torch.float32).reshape(1000, 5)
    with CheckpointWriter(url, chunk_bytes=4096, io_threads=4) as w:
        w.save(1, {"w": w0}).wait()
        w.save(2, {"n": 3, "e": torch.empty(0, 4)}).wait()
        w.save(3, {"w": w0[:10].clone()}).wait()
    doc = _part_doc(os.path.join(url, "step-000000000001"))
    assert doc["chunk_bytes"] == 4096 and len(doc["chunks"]) == -(-doc["data_bytes"] // 4096)
    got = load_checkpoint(url, step=1)
    assert torch.equal(got["w"], w0)
    box = LocalShard(torch.zeros(333, 5), (1000, 5), (600, 0))
    load_checkpoint(url, step=1, into={"w": box})
    assert torch.equal(box.tensor, w0[600:933])
    empty = load_checkpoint(url, step=2)
    assert empty["n"] == 3 and tuple(empty["e"].shape) == (0, 4)
    assert torch.equal(load_checkpoint(url, step=3)["w"], w0[:10])
