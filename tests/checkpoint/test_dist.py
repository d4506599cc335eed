"""Two ranks over gloo in spawned processes: per-rank parts, commit by rank 0 through
storage only (the process group is destroyed before the saves), per-rank loading."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks


def _rank_state(rank: int, step: int):
    torch.manual_seed(rank)
    return {"model": {"w": torch.full((64, 33), float(step * 10 + rank), dtype=torch.bfloat16)},
            "rank": rank, "step": step, "rng": torch.get_rng_state()}


def _worker(rank: int, world: int, port: int, port2: int, url: str) -> None:
    from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
    from datapipe.errors import CheckpointError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # commit_timeout is set to 1.5 s below for step 3: 600 s would run past the test's timeout if the
    # writer process kept the one it started with
    w = CheckpointWriter(url, keep_last=2, commit_timeout=600, chunk_bytes=4096)  # agrees on run_id
    assert (w.rank, w.world_size) == (rank, world)
    # From here on the training group is gone: the background must not need it.
    dist.barrier()
    dist.destroy_process_group()
    for step in (1, 2):
        m = w.save(step, _rank_state(rank, step)).wait()
        assert m.get("committed", False) == (rank == 0)
    if rank == 0:
        # rank 1 never publishes step 3: rank 0 must not commit it
        w.commit_timeout = 1.5
        h = w.save(3, _rank_state(rank, 3))
        try:
            h.wait()
            raise AssertionError("step 3 committed without rank 1")
        except CheckpointError as e:
            assert "ranks [1] did not publish" in str(e), e
    w.close()

    # loading: rank from the (re-initialised) group, each rank gets its own part
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank, world_size=world)
    dist.barrier()  # rank 0 has given up on step 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step 3 is incomplete and says so
        state = load_checkpoint(url)
    expect = _rank_state(rank, 2)
    assert state["rank"] == rank and state["step"] == 2
    assert torch.equal(state["model"]["w"], expect["model"]["w"])
    assert torch.equal(state["rng"], expect["rng"])
    other = load_checkpoint(url, step=1, rank=1 - rank)
    assert other["rank"] == 1 - rank and other["step"] == 1
    assert [(s, c) for s, c in list_checkpoints(url)] == [(1, True), (2, True), (3, False)]
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_gloo(tmp_path):
    url = str(tmp_path / "ckpt")
    port = free_port()
    spawn_ranks(_worker, (2, port, free_port(), url), 2)
    from datapipe.checkpoint import load_checkpoint
    from datapipe.errors import CheckpointError

    with pytest.raises(CheckpointError, match="2 ranks: pass rank="):
        load_checkpoint(url, step=2)
    assert load_checkpoint(url, step=2, rank=1)["rank"] == 1
