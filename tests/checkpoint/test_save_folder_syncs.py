"""Which folders a save of several ranks fsyncs: each rank its chunk folder, once, before
its part is visible; the folders above it (the attempt's, the step's, the root) are every
rank's and only the committing rank syncs them, the attempt folder again once every part
is in it and before the manifest exists. Real ranks over gloo, real fsyncs (the spy only
records them), a shared local folder."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

WORLD = 2


def _rank(rank: int, port: int, root: str, out: str) -> None:
    from datapipe.checkpoint import CheckpointWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    ckpt = os.path.join(root, "ckpt")
    syncs: list[dict[str, object]] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            files = [f for d, _, fs in os.walk(ckpt) for f in fs]
            syncs.append({"path": os.readlink(f"/proc/self/fd/{fd}"),
                          "parts": sorted(f for f in files if f.startswith("part-")),
                          "manifest": "manifest.json" in files})
        real_fsync(fd)

    with CheckpointWriter(ckpt, background="thread", io_threads=2, commit_timeout=60) as w:
        os.fsync = spy
        try:
            m = w.save(1, {"w": torch.full((1 << 16,), float(rank))}).wait()
        finally:
            os.fsync = real_fsync
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"syncs": syncs, "committed": bool(m.get("committed"))}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_only_the_committing_rank_syncs_the_folders_every_rank_shares(tmp_path):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name a descriptor's folder")
    root, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(root)
    os.makedirs(out)
    spawn_ranks(_rank, (free_port(), root, out), WORLD)
    got = [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(WORLD)]
    ckpt = os.path.realpath(os.path.join(root, "ckpt"))
    step_dir = os.path.join(ckpt, "step-000000000001")
    (attempt,) = [n for n in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, n))]
    attempt_dir = os.path.join(step_dir, attempt)
    chunk_dir = [os.path.join(attempt_dir, f"rank-{r:05d}") for r in range(WORLD)]
    parts = [f"part-{r:05d}.json" for r in range(WORLD)]
    assert got[0]["committed"]
    # rank 1: its chunk folder, once, before its part existed; nothing above it (the old
    # code synced the attempt, step and root folders after its chunks and the attempt
    # folder again with its part: 5 directory fsyncs, 4 of them rank 0's too)
    assert [s["path"] for s in got[1]["syncs"]] == [chunk_dir[1]], got[1]["syncs"]
    assert parts[1] not in got[1]["syncs"][0]["parts"]
    r0 = [s["path"] for s in got[0]["syncs"]]
    # rank 0: its chunk folder and the shared ones above it, after its own chunks
    assert r0[:4] == [chunk_dir[0], attempt_dir, step_dir, ckpt], r0
    # the attempt folder once more with every part (and the parts index) in it, before the manifest
    last_attempt = [s for s in got[0]["syncs"] if s["path"] == attempt_dir][-1]
    assert last_attempt["parts"] == parts and not last_attempt["manifest"], got[0]["syncs"]
    from datapipe.checkpoint import load_checkpoint

    for r in range(WORLD):
        assert torch.equal(load_checkpoint(ckpt, rank=r)["w"], torch.full((1 << 16,), float(r)))
