"""Tiers across real ranks: 2 "nodes" x 2 ranks over gloo in spawned processes, each node
its own local tier folder, the peer replica sent over gloo, a shared tier as the remote.
A node's local tier is deleted; the restore finds its ranks' parts in the peer replicas.
Then the Megatron-LM #5281 scenario: `latest` naming a partial step and a corrupt replica;
the restore skips the corrupt copy with a warning naming it and ends."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

RPN = 2
WORLD = 4



def _state(rank: int, step: int):
    return {"w": torch.full((300, 7), float(step * 10 + rank)), "rank": rank, "step": step,
            "opt": {"m": torch.arange(100, dtype=torch.int64) + step}}


def _tiers(root: str, rank: int):
    from datapipe.checkpoint import Tier

    return [Tier(os.path.join(root, f"node{rank // RPN}"), every=1, keep_last=2, replicate=1),
            Tier(os.path.join(root, "remote"), every=4, keep_last=1)]


def _flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))


def _worker(rank: int, port: int, root: str, background: str) -> None:
    from datapipe.checkpoint import CheckpointWriter, restore_checkpoint
    from datapipe.checkpoint.format import encode_doc
    from datapipe.errors import NoCheckpointError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    tiers = _tiers(root, rank)
    w = CheckpointWriter(tiers=tiers, ranks_per_node=RPN, chunk_bytes=4096, commit_timeout=60,
                         background=background)
    for step in range(1, 7):
        m = w.save(step, _state(rank, step)).wait()
        local = m["tiers"][tiers[0].url]
        assert local["committed"] and local["replica"]["of_rank"] == (rank - RPN) % WORLD
        assert (tiers[1].url in m["tiers"]) == (step % 4 == 0)
    w.close()
    dist.barrier()

    # node 1 is lost with its local disk
    if rank == 0:
        shutil.rmtree(os.path.join(root, "node1"))
    dist.barrier()
    r = restore_checkpoint(tiers, ranks_per_node=RPN)
    assert r.step == 6 and r.state["rank"] == rank and torch.equal(r.state["w"], _state(rank, 6)["w"])
    assert r.sources == ["local", "local", "peer replica", "peer replica"], r.sources
    assert r.source == ("peer replica" if rank >= RPN else "local")
    assert r.bytes > 300 * 7 * 4
    dist.barrier()
    if background == "process":  # the rest is the restore's, the same for both writers
        dist.destroy_process_group()
        return

    # a copy only rank 1 lists as damaged (its own manifest of step 6): with warnings as
    # errors every rank raises the same warning at the same point, none is left waiting
    man = os.path.join(root, "node0", "rank-00001", "step-000000000006", "manifest.json")
    good = open(man, "rb").read()
    dist.barrier()
    if rank == 0:
        _flip(man)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            restore_checkpoint(tiers, ranks_per_node=RPN, timeout_s=60)
            raise AssertionError("restored without the warning")
        except UserWarning as e:
            assert "rank-00001" in str(e) and "manifest.json" in str(e), e
    dist.barrier()
    if rank == 0:
        open(man, "wb").write(good)
    dist.barrier()

    # #5281: a `latest` naming a partial step 7 on node 0, and rank 2's replica of step 6 corrupt
    node0 = os.path.join(root, "node0")
    if rank == 0:
        own = os.path.join(node0, "rank-00000")
        os.makedirs(os.path.join(own, "step-000000000007", "abc-0", "rank-00000"))
        with open(os.path.join(own, "latest"), "wb") as f:
            f.write(encode_doc({"step": 7, "attempt": "abc-0"}, "latest"))
        rep = os.path.join(node0, "replica-of-rank-00002", "step-000000000006")
        chunk = next(os.path.join(d, f) for d, _s, fs in os.walk(rep) for f in fs if f.endswith(".bin"))
        _flip(chunk)
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers, ranks_per_node=RPN)
    assert r.step == 5 and r.state["step"] == 5 and torch.equal(r.state["w"], _state(rank, 5)["w"])
    assert r.sources == ["local", "local", "peer replica", "peer replica"]
    text = [str(x.message) for x in seen]
    assert any("replica-of-rank-00002" in t and "step 6" in t and "checksum" in t for t in text), text
    dist.barrier()

    # every replica of node 1's ranks corrupt: step 4 of the remote tier is the newest left
    if rank == 0:
        for name in ("replica-of-rank-00002", "replica-of-rank-00003"):
            for d, _s, fs in os.walk(os.path.join(node0, name)):
                for f in fs:
                    if f.endswith(".bin"):
                        _flip(os.path.join(d, f))
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = restore_checkpoint(tiers, ranks_per_node=RPN)
    assert r.step == 4 and r.state["step"] == 4
    # (the local tiers keep steps 5 and 6 only)
    assert r.sources == ["remote"] * WORLD, r.sources
    dist.barrier()

    # nothing loadable anywhere: an error, not a loop
    if rank == 0:
        shutil.rmtree(os.path.join(root, "remote"))
        shutil.rmtree(node0)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            restore_checkpoint(tiers, ranks_per_node=RPN)
            raise AssertionError("restored from nothing")
        except NoCheckpointError as e:
            assert "no step is complete" in str(e)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_peer_replica_restore_and_corrupt_copies(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path), "thread"), WORLD)


@pytest.mark.timeout(180)
def test_peer_replica_from_writer_processes(tmp_path):
    """The same saves with background="process": the exchange runs in the training
    process, the writer process persists the received part from shared memory."""
    spawn_ranks(_worker, (free_port(), str(tmp_path), "process"), WORLD)


def _both_ways_worker(rank: int, port: int, root: str, compression: str | None) -> None:
    from datapipe.checkpoint import CheckpointWriter, restore_checkpoint
    from datapipe.checkpoint.tiers import own_dir

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    tiers = _tiers(root, rank)[:1]
    with CheckpointWriter(tiers=tiers, ranks_per_node=RPN, chunk_bytes=4096, commit_timeout=60,
                          compression=compression) as w:
        for step in (1, 2):
            w.save(step, _state(rank, step)).wait()
    dist.barrier()
    shutil.rmtree(os.path.join(tiers[0].url, own_dir(rank)))  # every rank loses its own copy
    dist.barrier()
    r = restore_checkpoint(tiers, ranks_per_node=RPN, timeout_s=60)
    want = _state(rank, 2)
    assert r.step == 2 and r.source == "peer replica" and r.sources == ["peer replica"] * WORLD
    assert torch.equal(r.state["w"], want["w"]) and torch.equal(r.state["opt"]["m"], want["opt"]["m"])
    assert r.bytes >= want["w"].nbytes + want["opt"]["m"].nbytes  # with alignment
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_rank_restores_from_its_peer_while_it_sends_its_peer_one(tmp_path, compression):
    """Every rank's own copy lost: each rank receives its part from the other node while it
    sends the part it holds there (pipelined sends never wait on a receive, so the two
    directions cannot block each other); raw chunks land straight in the state's buffer,
    zstd ones are checked and decompressed."""
    spawn_ranks(_both_ways_worker, (free_port(), str(tmp_path), compression), WORLD)


def _holder_read_failure_worker(rank: int, port: int, root: str) -> None:
    from datapipe.checkpoint import CheckpointWriter, Tier, restore_checkpoint
    from datapipe.checkpoint.tiers import own_dir
    from datapipe.storage.local import LocalStore

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tiers = [Tier(os.path.join(root, f"node{rank}"), every=1, keep_last=2, replicate=1),
             Tier(os.path.join(root, "remote"), every=1, keep_last=2)]
    with CheckpointWriter(tiers=tiers, ranks_per_node=1, chunk_bytes=4096, commit_timeout=60) as w:
        for step in (1, 2):
            w.save(step, _state(rank, step)).wait()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(os.path.join(tiers[0].url, own_dir(1)))
    else:  # the disk holding rank 1's replica fails after the holder has announced its chunks
        real = LocalStore.readinto

        def readinto(self, key, buf, start=0):
            if "replica-of-rank-00001" in self.root and key.endswith("chunk-000001.bin"):
                raise OSError("injected: the replica's disk went away")
            return real(self, key, buf, start)

        LocalStore.readinto = readinto
    dist.barrier()
    # a warning turned into an error stops every rank at the same point, none waits for another
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"rank 0 sending a peer replica of step 2: .*injected"):
            restore_checkpoint(tiers, ranks_per_node=1, timeout_s=60)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers, ranks_per_node=1, timeout_s=60)
    assert r.step == 2 and r.sources == ["local", "remote"], r.sources
    assert torch.equal(r.state["w"], _state(rank, 2)["w"])
    text = [str(x.message) for x in seen]
    assert any("injected" in t for t in text) and any("checksum" in t and "peer replica" in t for t in text), text
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_holder_that_cannot_read_what_it_announced_still_sends_it_all(tmp_path):
    """The holder's disk fails mid-replica: it still sends every chunk it announced (zeros
    from the zero page), the receiver's checksum refuses the copy, every rank names the
    holder's error alike, and the restore takes the remote tier; no rank waits on another."""
    spawn_ranks(_holder_read_failure_worker, (free_port(), str(tmp_path)), 2)
