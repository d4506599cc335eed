"""A run_id given again by a later run (the README's fixed ``run_id="demo"``, a job id that
survives a requeue) never mixes the two runs: each writer instance writes its saves into
attempt folders of its own, agreed by its ranks at construction, so a commit takes only
parts of this save and no save writes where another one (committed or not) lies. Ranks that
have no process group to agree through are told by name that their run_id was used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.errors import CheckpointError
from tests.ranks import free_port, spawn_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _attempts(url: str, step: int) -> list[str]:
    d = os.path.join(url, f"step-{step:012d}")
    return sorted(x for x in os.listdir(d) if os.path.isdir(os.path.join(d, x)))


# -- two ranks over gloo: run 2 commits only its own parts ---------------------------------------

def _run1(rank: int, port: int, url: str, run_id: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)  # as a trainer does: every run starts from the same random state
    w = CheckpointWriter(url, run_id=run_id, commit_timeout=60)
    w.save(1, {"w": torch.tensor(1.0 + rank)}).wait()
    if rank == 1:  # rank 0 dies before its part of step 2: rank 1's is left behind
        w.save(2, {"w": torch.tensor(2.0)}).wait()
    w.close()
    dist.destroy_process_group()


def _run2(rank: int, port: int, url: str, run_id: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    w = CheckpointWriter(url, run_id=run_id, commit_timeout=60)  # the ranks draw this writer's id
    assert torch.equal(torch.get_rng_state(), rng)  # not from torch's generator: the ranks' streams stay alike
    step2 = os.path.join(url, "step-000000000002")
    if rank == 0:
        h = w.save(2, {"w": torch.tensor(20.0)})
    else:
        # rank 1 saves only once rank 0's part of this run is written: a rank 0 that took the
        # earlier run's rank-1 part for this save's has committed by then
        while not any(os.path.exists(os.path.join(step2, a, "part-00000.json")) for a in os.listdir(step2)):
            time.sleep(0.005)
        h = w.save(2, {"w": torch.tensor(21.0)})
    h.wait()
    w.close()
    dist.barrier()
    if rank == 0:
        assert float(load_checkpoint(url, step=2, rank=0)["w"]) == 20.0
        assert float(load_checkpoint(url, step=2, rank=1)["w"]) == 21.0  # this run's, not the earlier 2.0
        assert float(load_checkpoint(url, step=1, rank=1)["w"]) == 2.0  # the earlier run's step 1, untouched
    dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("run_id", ["demo", None], ids=["given", "drawn"])
def test_a_later_run_never_mixes_with_an_earlier_one_in_one_commit(tmp_path, run_id):
    """run 1 dies after rank 1 wrote its part of step 2; run 2, given the same run_id (or
    drawing one from the same seeded state), commits step 2 from its own two parts."""
    url = str(tmp_path / "ckpt")
    spawn_ranks(_run1, (free_port(), url, run_id), 2)
    assert [(s, c) for s, c in list_checkpoints(url)] == [(1, True), (2, False)]
    (earlier,) = _attempts(url, 1)
    spawn_ranks(_run2, (free_port(), url, run_id), 2)
    # the earlier run's leftover attempt of step 2 went with the commit's retention
    (attempt,) = _attempts(url, 2)
    assert attempt.endswith("-0") and attempt != earlier, (attempt, earlier)
    assert attempt.startswith("demo_") if run_id else "_" not in attempt


# -- one rank: a re-save killed half way leaves the committed step whole -------------------------

KILLED_RESAVE = r"""
import os, signal, sys, torch
import datapipe.checkpoint.persist as persist
from datapipe.checkpoint import CheckpointWriter

write_chunks = persist.Persister._write_chunks

def killed_after_the_chunks(self, *args, **kwargs):
    write_chunks(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # the part and the commit never come

persist.Persister._write_chunks = killed_after_the_chunks
w = CheckpointWriter(sys.argv[1], run_id="demo", background="thread", chunk_bytes=1 << 16)
w.save(2, {"w": torch.full((1 << 18,), 3.0)}).wait()
"""


def test_a_resave_with_a_reused_run_id_killed_half_way_keeps_the_committed_step(tmp_path):
    url = str(tmp_path / "ckpt")
    with CheckpointWriter(url, run_id="demo", chunk_bytes=1 << 16) as w:
        w.save(1, {"w": torch.full((1 << 18,), 1.0)}).wait()
        w.save(2, {"w": torch.full((1 << 18,), 2.0)}).wait()
    (committed,) = _attempts(url, 2)
    out = subprocess.run([sys.executable, "-c", KILLED_RESAVE, url], env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert len(_attempts(url, 2)) == 2 and committed in _attempts(url, 2)  # the killed save wrote elsewhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step is skipped: step 2 verifies
        state = load_checkpoint(url)
    assert torch.equal(state["w"], torch.full((1 << 18,), 2.0))


def test_each_writer_given_one_run_id_writes_attempts_of_its_own(tmp_path):
    url = str(tmp_path / "ckpt")
    long_id = "r" * 64  # the longest run_id: its attempt names stay within the format's 64 characters
    for value in (1.0, 2.0):
        with CheckpointWriter(url, run_id=long_id) as w:
            assert w.run_id == long_id
            w.save(5, {"w": torch.tensor(value)}).wait()
            w.save(5, {"w": torch.tensor(value + 0.5)}).wait()  # a re-save by one writer: its next attempt
    (attempt,) = _attempts(url, 5)  # retention removed the older attempts, of both writers
    run, n = attempt.rsplit("-", 1)
    assert len(run) == 64 and run.startswith("r" * 51 + "_") and n == "1"
    assert float(load_checkpoint(url)["w"]) == 2.5


# -- ranks without a process group: the run_id is all they share --------------------------------

def test_ranks_without_a_process_group_are_told_their_run_id_was_used(tmp_path):
    """Two writers in one process stand in for two ranks, as in the README. A later run given
    the same run_id cannot be told from the earlier one by any rank: rank 0 refuses it at
    construction, and a rank that saves anyway never writes into the earlier run's folders."""
    url = str(tmp_path / "ckpt")
    first = [CheckpointWriter(url, rank=r, world_size=2, run_id="demo") for r in range(2)]
    for h in [w.save(1, {"w": torch.tensor(1.0 + r)}) for r, w in enumerate(first)]:
        h.wait()
    first[1].save(2, {"w": torch.tensor(2.0)}).wait()  # rank 0 dies before its part of step 2
    first[1].close()
    first[0].close()
    before = {p: os.path.getmtime(p) for p in _files(url)}

    with pytest.raises(CheckpointError, match=r"run_id 'demo' was used by an earlier writer.*fresh one"):
        CheckpointWriter(url, rank=0, world_size=2, run_id="demo")
    rank1 = CheckpointWriter(url, rank=1, world_size=2, run_id="demo")
    for step in (1, 2):
        with pytest.raises(CheckpointError, match=r"part-00001.json exists already.*nothing was written"):
            rank1.save(step, {"w": torch.tensor(9.0)}).wait()
    rank1.close()
    assert {p: os.path.getmtime(p) for p in _files(url)} == before
    with pytest.warns(UserWarning, match="incomplete checkpoint step 2"):
        assert float(load_checkpoint(url, rank=1)["w"]) == 2.0  # step 1 of the first run, whole

    # a fresh run_id is a new run
    second = [CheckpointWriter(url, rank=r, world_size=2, run_id="demo2") for r in range(2)]
    for h in [w.save(2, {"w": torch.tensor(20.0 + r)}) for r, w in enumerate(second)]:
        h.wait()
    for w in second:
        w.close()
    assert [float(load_checkpoint(url, step=2, rank=r)["w"]) for r in range(2)] == [20.0, 21.0]


def _files(url: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _dirs, fs in os.walk(url) for f in fs if f != "writer.lease")
