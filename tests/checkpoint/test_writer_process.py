"""The writer process (background="process"): real processes, the staging buffer shared
by memfd, SIGKILL of either side."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, Tier, list_checkpoints, load_checkpoint, restore_checkpoint
from datapipe.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_process_writer_tiers_round_trip(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    tiers = [Tier(local, every=1, keep_last=2, node_local=True), Tier(remote, every=2, keep_last=1)]
    with CheckpointWriter(tiers=tiers, background="process", chunk_bytes=4096, compression="zstd") as w:
        pid = w._background.pid
        assert pid != os.getpid() and _alive(pid)
        for step in range(1, 6):
            n = 1000 * step  # the state grows: the shared buffer is replaced and sent again
            m = w.save(step, {"x": torch.arange(n), "step": step}).wait()
            assert m["committed"] and m["due_tiers"] == [t.url for t in tiers if step % t.every == 0]
            assert m["tiers"][local]["durable_s"] <= m["total_s"]
        assert w._staging.buffer_id >= 2 and w._staging.fd is not None
    assert not _alive(pid)  # close() ends it
    assert [c.step for c in list_checkpoints(local + "/rank-00000")] == [4, 5]
    assert [c.step for c in list_checkpoints(remote)] == [4]
    r = restore_checkpoint(tiers)
    assert r.step == 5 and torch.equal(r.state["x"], torch.arange(5000))


def test_process_writer_errors_come_back(tmp_path):
    url = str(tmp_path / "ckpt")
    w = CheckpointWriter(url, background="process", world_size=2, rank=0, run_id="job1", commit_timeout=0.5)
    h = w.save(1, {"x": torch.ones(3)})  # rank 1 never writes its part
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not publish"):
        h.wait()
    # the writer keeps working, and the lease is held by the writer process
    with pytest.raises(CheckpointError, match="another checkpoint writer holds this URL"):
        CheckpointWriter(url, background="process")
    w.close()
    with pytest.raises(CheckpointError, match="background must be"):
        CheckpointWriter(url, background="fork")


def test_writer_process_killed_fails_the_save_in_flight(tmp_path):
    url = str(tmp_path / "ckpt")
    w = CheckpointWriter(url, background="process", chunk_bytes=4096)
    w.save(1, {"x": torch.ones(1 << 20)}).wait()
    os.kill(w._background.pid, signal.SIGSTOP)  # hold it inside nothing: the next save waits
    h = w.save(2, {"x": torch.ones(1 << 20) * 2})
    os.kill(w._background.pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"writer process .* exited"):
        h.wait(timeout=60)
    with pytest.raises(CheckpointError, match="exited"):
        w.save(3, {"x": torch.ones(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.close()
        assert torch.equal(load_checkpoint(url)["x"], torch.ones(1 << 20))


TRAINER = r"""
import sys, torch
from datapipe.checkpoint import CheckpointWriter
w = CheckpointWriter(sys.argv[1], background="process")
w.save(1, {"x": torch.ones(1000)}).wait()
print(w._background.pid, flush=True)
sys.stdin.read()
"""


def test_trainer_killed_writer_process_exits_and_frees_the_url(tmp_path):
    url = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, "-c", TRAINER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=ROOT), text=True)
    writer_pid = int(p.stdout.readline())
    assert _alive(writer_pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdin.close()
    p.stdout.close()
    deadline = time.monotonic() + 30
    while _alive(writer_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(writer_pid)
    with CheckpointWriter(url) as w:  # the lease died with it
        w.save(2, {"x": torch.ones(3)}).wait()
    assert [c.step for c in list_checkpoints(url)] == [1, 2]


def test_auto_runs_a_writer_process_where_one_can_do_the_work(tmp_path):
    with CheckpointWriter(str(tmp_path / "a")) as w:
        assert w.background == "process" and _alive(w._background.pid)
        w.save(1, {"x": torch.ones(4)}).wait()
    # objects in this process's memory: a writer process would write into a memory of its own
    with CheckpointWriter("memory://dp-auto-bg") as w:
        assert w.background == "thread" and w._background.pid is None
        w.save(1, {"x": torch.ones(4)}).wait()
    assert torch.equal(load_checkpoint("memory://dp-auto-bg")["x"], torch.ones(4))
    with pytest.raises(CheckpointError, match=r"background='process' is not possible here: tier 'memory://dp-p'"):
        CheckpointWriter("memory://dp-p", background="process")
    # options a writer process could not be sent
    odd = [Tier(str(tmp_path / "b"), storage_options={"opener": object()})]
    with CheckpointWriter(tiers=odd) as w:
        assert w.background == "thread"
    with pytest.raises(CheckpointError, match="not JSON"):
        CheckpointWriter(tiers=odd, background="process")


TRAINER_MID_SAVE = r"""
import sys, torch
from datapipe.checkpoint import CheckpointWriter
w = CheckpointWriter(sys.argv[1], compression="zstd", zstd_level=19, chunk_bytes=1 << 20)
w.save(1, {"x": torch.ones(3)}).wait()
g = torch.Generator().manual_seed(0)
w.save(2, {"x": torch.randint(0, 4, (64 << 20,), dtype=torch.uint8, generator=g)})  # seconds of zstd -19
print(w._background.pid, flush=True)
sys.stdin.read()
"""


def test_trainer_killed_mid_save_takes_the_writer_process_with_it(tmp_path):
    # a writer process left finishing a save for a dead trainer would hold the URL's lease
    # against the job restarted in its place
    url = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, "-c", TRAINER_MID_SAVE, url], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT), text=True)
    writer_pid = int(p.stdout.readline())
    time.sleep(0.3)  # into the save
    assert _alive(writer_pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdin.close()
    p.stdout.close()
    t0 = time.monotonic()
    while _alive(writer_pid) and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    gone_after = time.monotonic() - t0
    assert not _alive(writer_pid)
    assert gone_after < 2.0, f"the writer process outlived its trainer by {gone_after:.1f} s"
    assert [(s, c) for s, c in list_checkpoints(url)] in ([(1, True)], [(1, True), (2, False)])
    with CheckpointWriter(url) as w:  # the lease died with it
        w.save(3, {"x": torch.ones(3)}).wait()


WARNINGS_AS_ERRORS = r"""
import os, shutil, sys, torch
from datapipe.checkpoint import CheckpointWriter
from datapipe.errors import CheckpointError
url = sys.argv[1]
with CheckpointWriter(url, keep_last=1) as w:
    assert w.background == "process"
    w.save(1, {"x": 1}).wait()
    os.unlink(os.path.join(url, "latest"))
    os.mkdir(os.path.join(url, "latest"))  # the rename onto `latest` fails: a warning
    open(os.path.join(url, "latest", "x"), "w").close()
    try:
        w.save(2, {"x": 2}).wait()
    except CheckpointError as e:
        print("raised:", e)
    shutil.rmtree(os.path.join(url, "latest"))
    w.save(3, {"x": 3}).wait()
    print("saved 3")
"""


def test_a_relayed_warning_that_the_filters_make_an_error_fails_its_save_not_the_writer(tmp_path):
    # under `python -W error` (pytest's filterwarnings = error) the writer process's warning,
    # raised again in the reader thread, is an exception there: it must not end the reader
    # before the save is seen done (every later wait() would hang)
    url = str(tmp_path / "ckpt")
    try:
        out = subprocess.run([sys.executable, "-W", "error", "-c", WARNINGS_AS_ERRORS, url], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a save whose relayed warning is an error under the trainer's filters never finished")
    assert out.returncode == 0, out.stderr
    assert "raised:" in out.stdout and "updating `latest`" in out.stdout and "UserWarning" in out.stdout
    assert "saved 3" in out.stdout
    assert load_checkpoint(url) == {"x": 3}


TRAINER_WITH_A_FORKED_CHILD = r"""
import os, sys, time, torch
from datapipe.checkpoint import CheckpointWriter
w = CheckpointWriter(sys.argv[1])
w.save(1, {"x": torch.ones(3)}).wait()
child = os.fork()  # a worker forked after the writer (a fork Pool, a DataLoader worker): it holds the socket
if child == 0:
    time.sleep(60)
    os._exit(0)
print(w._background.pid, child, flush=True)
sys.stdin.read()
"""


def test_trainer_killed_with_a_forked_child_alive_takes_the_writer_process_with_it(tmp_path):
    # the forked child keeps the trainer's end of the socket open: the hang-up alone does
    # not come while it lives, and the writer process would hold the lease that long
    url = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, "-c", TRAINER_WITH_A_FORKED_CHILD, url], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT), text=True)
    writer_pid, child_pid = map(int, p.stdout.readline().split())
    try:
        assert _alive(writer_pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t0 = time.monotonic()
        while _alive(writer_pid) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        gone_after = time.monotonic() - t0
        assert not _alive(writer_pid), "the writer process outlived its trainer while a forked child lived"
        assert gone_after < 2.0, f"the writer process outlived its trainer by {gone_after:.1f} s"
    finally:
        p.stdin.close()
        p.stdout.close()
        for pid in (child_pid, writer_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    with CheckpointWriter(url) as w:  # the lease died with it
        w.save(2, {"x": torch.ones(3)}).wait()
    assert [c.step for c in list_checkpoints(url)] == [1, 2]
