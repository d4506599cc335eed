"""Real processes: SIGKILL at arbitrary points of a save, and a write failure at the OS level."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Saves forever; every leaf of step k holds the value k, so a torn checkpoint shows as
# leaves that disagree. Prints each step once wait() says it is committed.
SAVER = r"""
import sys, torch
from datapipe.checkpoint import CheckpointWriter
url, first = sys.argv[1], int(sys.argv[2])
w = CheckpointWriter(url, keep_last=2, chunk_bytes=64 << 10)
state = {"a": torch.zeros(1 << 20), "b": torch.zeros(300, 500, dtype=torch.bfloat16), "n": 0}
print("ready", flush=True)
step = first
while True:
    state["a"].fill_(step); state["b"].fill_(step); state["n"] = step
    w.save(step, state).wait()
    print(step, flush=True)
    step += 1
"""


def _check_consistent(state):
    k = state["n"]
    assert bool((state["a"] == k).all()) and bool((state["b"] == k).all()), f"torn checkpoint at step {k}"
    return k


@pytest.mark.timeout(120)
def test_sigkill_at_random_points_leaves_previous_checkpoint(tmp_path):
    url = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=ROOT)
    first = 0
    # Fixed "random" delays so the test is deterministic in what it asks, if not in where
    # the kill lands: early, mid-chunk, mid-commit spread over the save cycle.
    for delay in (0.0, 0.037, 0.11, 0.29):
        p = subprocess.Popen([sys.executable, "-c", SAVER, url, str(first)], stdout=subprocess.PIPE,
                             env=env, text=True)
        assert p.stdout.readline().strip() == "ready"
        committed = []
        deadline = time.monotonic() + delay
        os.set_blocking(p.stdout.fileno(), False)
        while time.monotonic() < deadline or ((not committed) and first == 0):
            line = p.stdout.readline()
            if line.strip():
                committed.append(int(line))
            time.sleep(0.001)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        rest = p.stdout.read() or ""
        committed += [int(x) for x in rest.split()]
        p.stdout.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the killed save is incomplete, and says so
            k = _check_consistent(load_checkpoint(url))
        # never older than what the child was told is committed; at most the save in flight newer
        last = committed[-1] if committed else first - 1
        assert k in (last, last + 1), (k, committed)
        first = k + 1
    steps = list_checkpoints(url)
    assert sum(c for _s, c in steps) <= 3  # keep_last=2, plus possibly one just committed


CHILD_FULL_DISK = r"""
import resource, signal, sys, torch
from datapipe.checkpoint import CheckpointWriter
from datapipe.errors import CheckpointError
url = sys.argv[1]
# threads: the limit set below must bind the writes (a writer process started before it
# keeps the limit it had; the full disk of a writer process is a full tmpfs, below)
w = CheckpointWriter(url, background="thread")
w.save(1, {"x": torch.ones(1000)}).wait()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG from write(), like ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
h = w.save(2, {"x": torch.ones(1_000_000) * 2})
try:
    h.wait()
except CheckpointError as e:
    print("ERROR", e)
w.close()
"""


def test_write_failure_surfaces_and_previous_stays(tmp_path):
    url = str(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", CHILD_FULL_DISK, url], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "step 2" in out.stdout and "File too large" in out.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = load_checkpoint(url)
    assert torch.equal(state["x"], torch.ones(1000))
    assert [(s, c) for s, c in list_checkpoints(url)] in ([(1, True), (2, False)], [(1, True)])


def test_a_full_disk_under_the_writer_process_surfaces_and_previous_stays(tmp_path, tmpfs):
    disk = tmpfs("1m")
    url = str(disk.path / "ckpt")
    with CheckpointWriter(url) as w:
        assert w.background == "process"
        w.save(1, {"x": torch.ones(1000)}).wait()
        with pytest.raises(CheckpointError, match=r"step 2.*No space left"):
            w.save(2, {"x": torch.ones(1_000_000) * 2}).wait()
        w.save(3, {"x": torch.ones(1000) * 3}).wait()  # the writer process goes on after a failure
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(load_checkpoint(url)["x"], torch.ones(1000) * 3)
    assert [s for s, c in list_checkpoints(url) if c] == [1, 3]


def test_a_file_size_limit_under_shared_staging_is_named(tmp_path):
    # a memfd counts against RLIMIT_FSIZE: staging for the writer process cannot grow past
    # it, and the error says so and what to use instead (not a bare OSError)
    out = subprocess.run([sys.executable, "-c", CHILD_FSIZE_STAGING, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CheckpointError" in out.stdout and "ulimit -f" in out.stdout and "background='thread'" in out.stdout
    assert [(s, c) for s, c in list_checkpoints(str(tmp_path / "ckpt"))] == [(1, True)]


CHILD_FSIZE_STAGING = r"""
import resource, signal, sys, torch
from datapipe.checkpoint import CheckpointWriter
with CheckpointWriter(sys.argv[1]) as w:
    w.save(1, {"x": torch.ones(1000)}).wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        w.save(2, {"x": torch.ones(1_000_000) * 2})
    except Exception as e:
        print(type(e).__name__, e)
"""


CHILD_EXIT_WITHOUT_CLOSE = r"""
import sys, torch
from datapipe.checkpoint import CheckpointWriter
w = CheckpointWriter(sys.argv[1], chunk_bytes=1 << 16)
w.save(7, {"x": torch.arange(1 << 20)})
# no wait(), no close(): the interpreter's exit flushes the save in flight
"""


def test_exit_without_close_flushes(tmp_path):
    url = str(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", CHILD_EXIT_WITHOUT_CLOSE, url], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert torch.equal(load_checkpoint(url)["x"], torch.arange(1 << 20))
