"""Readers beside a live writer whose retention deletes each step as it commits the next
(keep_last=1): neither ``list_checkpoints`` nor ``load_checkpoint`` ever sees no checkpoint,
on a local folder and on S3 (moto on loopback). The writer is a real process saving as fast
as it can; the reader, the test process, runs a bounded number of rounds. Nothing is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from datapipe.checkpoint import list_checkpoints, load_checkpoint
from datapipe.errors import CheckpointError, NoCheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Saves step after step until its stdin closes; every value of step k is k, so a state
# mixed from two steps shows. Says "ready" once step 0 is committed.
WRITER = r"""
import json, os, sys, threading, torch
from datapipe.checkpoint import CheckpointWriter
url, options = sys.argv[1], json.loads(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with CheckpointWriter(url, keep_last=1, background="thread", storage_options=options) as w:
    step = 0
    while not stop.is_set():
        w.save(step, {"x": torch.full((64,), float(step)), "n": step}).wait()
        if step == 0:
            print("ready", flush=True)
        step += 1
print("saved", step, flush=True)
"""


def _read_beside_the_writer(url: str, options: dict | None, rounds: int) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url, json.dumps(options)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert writer.stdout.readline().strip() == "ready"
        seen = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step in flight is incomplete, and says so
            for i in range(rounds):
                complete = [c.step for c in list_checkpoints(url, options) if c.complete]
                assert complete, f"round {i}: list_checkpoints shows no complete step"
                try:
                    state = load_checkpoint(url, storage_options=options)
                except NoCheckpointError as e:
                    pytest.fail(f"round {i}: load_checkpoint found no checkpoint: {e}")
                except CheckpointError as e:
                    # every step it chose was deleted before it was read: a writer that
                    # commits faster than a load reads can outrun it; said by name, never
                    # "no checkpoint" (the README's resume would start from scratch)
                    assert "kept being deleted" in str(e) and "keep_last" in str(e), e
                    continue
                n = state["n"]
                assert torch.equal(state["x"], torch.full((64,), float(n))), f"round {i}: a torn state of step {n}"
                seen.add(n)
    finally:
        writer.stdin.close()  # the writer finishes the save in flight and exits
        out = writer.stdout.read()
        writer.wait(timeout=120)
    assert writer.returncode == 0, out
    saved = int(out.split()[-1])
    assert len(seen) > 1 and saved > max(seen)  # the reads raced a writer that kept committing


@pytest.mark.timeout(600)
def test_a_local_folder_under_retention_always_shows_a_checkpoint(tmp_path, tmpfs):
    # a tmpfs where one can be mounted: fsync is free there, so the writer commits (and
    # deletes) as fast as a reader lists and loads, which is where readers lost both steps
    disk = tmpfs("256m", optional=True)
    url = str((disk.path if disk is not None else tmp_path) / "ckpt")
    _read_beside_the_writer(url, None, rounds=1000)


@pytest.mark.timeout(600)
def test_s3_under_retention_always_shows_a_checkpoint(s3):
    root, options = s3
    _read_beside_the_writer(f"{root}/ckpt", options, rounds=20)
