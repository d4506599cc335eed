"""``restore_checkpoint(into=)`` when ``into`` does not fit the newest step, and the values
of ``into`` that are not tensors. Three ranks saved steps 1 and 2 to node-local tiers (the
model grew between them: another global shape, another dtype, a key gone); a restore whose
``into`` fits only step 1 is refused by name on every rank, never answered with step 1,
and no copy is skipped for it. Real files, real gloo ranks."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, spawn_ranks

COLS = 3
ROWS = {1: 6, 2: 8}  # the global rows of "w" at each step
SAVED = 3  # the ranks that saved


def _rows(step: int, r: int) -> tuple[int, int]:
    n = -(-ROWS[step] // SAVED)
    return r * n, min(ROWS[step], (r + 1) * n)


def _full(step: int) -> torch.Tensor:
    return torch.arange(ROWS[step] * COLS, dtype=torch.float32).reshape(ROWS[step], COLS) + 100 * step


def _extra(step: int) -> torch.Tensor:
    return torch.arange(5) + 1000 * step


def _state(step: int, r: int) -> dict:
    from datapipe.checkpoint import LocalShard, Replicated

    a, b = _rows(step, r)
    state = {"w": LocalShard(_full(step)[a:b].clone(), (ROWS[step], COLS), (a, 0)),
             # float64 at step 1, float32 at step 2
             "v": Replicated(torch.arange(4, dtype=torch.float64 if step == 1 else torch.float32)),
             "k": r}
    if step == 1:
        state["old"] = Replicated(torch.ones(2))  # gone at step 2
    if r == 0:
        state["extra"] = _extra(step)  # a plain tensor that only saved rank 0 holds
    return state


def _save_steps(folder_of) -> None:
    """Saved ranks 0-2 commit steps 1 and 2, each to the node-local tier ``folder_of(rank)``."""
    from datapipe.checkpoint import CheckpointWriter, Tier

    for r in range(SAVED):
        with CheckpointWriter(tiers=[Tier(folder_of(r), node_local=True)], rank=r, world_size=SAVED,
                              run_id="grew", background="thread") as w:
            for step in (1, 2):
                w.save(step, _state(step, r)).wait()


def _box(step: int, rank: int, world: int):
    """This rank's rows of "w" as the model of ``step`` has them, zeros to be filled."""
    from datapipe.checkpoint import LocalShard

    n = ROWS[step] // world
    return LocalShard(torch.zeros(n, COLS), (ROWS[step], COLS), (rank * n, 0))


def _misfits(rank: int, world: int) -> dict[str, tuple[dict, str]]:
    """``into``s that fit step 1 and not step 2, and the key each is refused for."""
    return {
        "shape": ({"w": _box(1, rank, world)}, r"'w' has global shape \[6, 3\], the checkpoint's is \[8, 3\]"),
        "dtype": ({"v": torch.zeros(4, dtype=torch.float64)}, r"'v' is float64, the checkpoint holds float32"),
        "key": ({"old": torch.zeros(2)}, r"'old' is not in the checkpoint"),
    }


def _no_skips(caught) -> None:
    said = [str(x.message) for x in caught]
    assert not any("skipping" in m for m in said), said


@pytest.mark.parametrize("misfit", ["shape", "dtype", "key"])
def test_an_into_that_does_not_fit_the_newest_step_is_refused_by_name(tmp_path, misfit):
    """One process: the restore raises CheckpointOptionError naming the key (not step 1,
    whose shapes fit), skips no copy, and the same call with a fitting ``into`` gets step 2."""
    from datapipe.checkpoint import Tier, restore_checkpoint
    from datapipe.errors import CheckpointOptionError

    root = str(tmp_path / "node0")
    _save_steps(lambda r: root)
    tiers = [Tier(root, node_local=True)]
    into, why = _misfits(0, 1)[misfit]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointOptionError, match=why):
            restore_checkpoint(tiers, rank=0, world_size=1, reshard=True, into=into)
    _no_skips(caught)
    box = _box(2, 0, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers, rank=0, world_size=1, reshard=True, into={"w": box})
    _no_skips(caught)
    assert (r.step, r.saved_world_size, r.resharded) == (2, SAVED, True), r
    assert r.state["w"] is box and torch.equal(box.tensor, _full(2))


def _two_ranks(rank: int, port: int, root: str) -> None:
    """Node 0 keeps saved rank 0's part, node 1 those of saved ranks 1 and 2; one rank each."""
    from datapipe.checkpoint import Tier, restore_checkpoint
    from datapipe.errors import CheckpointOptionError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tiers = [Tier(os.path.join(root, f"node{rank}"), node_local=True)]
    fitting = {"w": _box(2, rank, 2)}
    for into, why in _misfits(rank, 2).values():
        # both ranks' into= fit step 1 only: both raise, naming the key
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointOptionError, match=why):
                restore_checkpoint(tiers, reshard=True, into=into, timeout_s=60)
        _no_skips(caught)
        # only rank 1's does not fit: rank 0 raises too, naming rank 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointOptionError,
                               match=why if rank == 1 else rf"rank 1's into= does not fit step 2: .*{why}"):
                restore_checkpoint(tiers, reshard=True, into=into if rank == 1 else fitting, timeout_s=60)
        _no_skips(caught)
    # a plain tensor of saved rank 0's own, asked for by rank 1: no world size but that one
    # places it
    why = r"'extra' was saved per rank by ranks \[0\] \(a plain tensor\), and rank 1 has none"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointOptionError, match=why if rank == 1 else rf"rank 1's into= .*{why}"):
            restore_checkpoint(tiers, reshard=True, into={"extra": torch.zeros(5, dtype=torch.int64)}
                               if rank == 1 else fitting, timeout_s=60)
    _no_skips(caught)
    # a DTensor this reader cannot place (a padded local shard): its own error, on both ranks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from datapipe.errors import UnsupportedStateError

    padded = DTensor.from_local(torch.zeros(5, COLS), init_device_mesh("cpu", (2,)), [Shard(0)], run_check=False,
                                shape=torch.Size((ROWS[2], COLS)), stride=(COLS, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UnsupportedStateError, match=r"'w'.*padded shards are not supported"):
            restore_checkpoint(tiers, reshard=True, into={"w": padded}, timeout_s=60)
    _no_skips(caught)
    # nothing was skipped: a fitting into= gets step 2. Rank 1's rows (4-8) overlap only the
    # parts on its own node, but its "extra" (not a tensor in into=) is saved rank 0's array:
    # that part is sent from node 0 too
    into = {"w": _box(2, rank, 2), "extra": None} if rank == 1 else {"w": _box(2, rank, 2)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = restore_checkpoint(tiers, reshard=True, into=into, timeout_s=60)
    _no_skips(caught)
    assert (r.step, r.saved_world_size, r.resharded) == (2, SAVED, True), r
    assert torch.equal(into["w"].tensor, _full(2)[rank * 4 : (rank + 1) * 4])
    assert r.state["k"] == 0
    if rank == 1:
        assert torch.equal(r.state["extra"], _extra(2))
    else:  # a saved array into= does not name is not read
        assert "extra" not in r.state, r.state
    assert r.sources == ["peer replica", "peer replica"], r.sources  # each got a part sent by the other
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_ranks_refuse_a_misfit_into_alike_and_send_the_parts_of_its_other_values(tmp_path):
    root = str(tmp_path)
    _save_steps(lambda r: os.path.join(root, f"node{min(r, 1)}"))
    spawn_ranks(_two_ranks, (free_port(), root), 2)
