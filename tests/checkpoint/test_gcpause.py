"""A load runs no cyclic garbage collection (gcpause.py): the collector is off while the
load builds its metadata and back as it was afterwards, whatever the load's outcome."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, load_checkpoint
from datapipe.checkpoint.gcpause import collections_paused
from datapipe.errors import CheckpointError


@pytest.fixture
def collections():
    """The collections that run while the test does (generation of each)."""
    seen: list[int] = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    old = gc.get_threshold()
    gc.callbacks.append(cb)
    try:
        yield seen
    finally:
        gc.callbacks.remove(cb)
        gc.set_threshold(*old)


def _many_leaves(tmp_path):
    url = str(tmp_path / "ckpt")
    state = {f"layer{i}": {"w": torch.full((3,), float(i)), "meta": {"i": i, "tags": [i, str(i)]}}
             for i in range(1500)}
    with CheckpointWriter(url) as w:
        w.save(1, state).wait()
    return url, state


def test_a_load_of_many_leaves_runs_no_collection_but_at_its_end(tmp_path, collections):
    url, state = _many_leaves(tmp_path)
    gc.set_threshold(50, 1, 1)  # collections every few dozen new containers: a load would run many
    collections.clear()  # those the save ran
    got = load_checkpoint(url)
    during = list(collections)
    assert gc.isenabled()
    # the load's own temporaries run none; the state it returns (1500 new dicts) may run
    # one as the collector comes back on (any loader's result would)
    assert len(during) <= 1, f"{len(during)} collections ran inside the load"
    assert torch.equal(got["layer1499"]["w"], state["layer1499"]["w"])
    assert got["layer7"]["meta"] == state["layer7"]["meta"]


def test_a_failed_load_enables_the_collector_again(tmp_path):
    url, _ = _many_leaves(tmp_path)
    with pytest.raises(CheckpointError):
        load_checkpoint(url, step=2)
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled(tmp_path):
    url, _ = _many_leaves(tmp_path)
    gc.disable()
    try:
        load_checkpoint(url)
        assert not gc.isenabled()
    finally:
        gc.enable()


class _PausedElsewhere:
    """Another thread inside a pause (a load in progress) until ``release()``."""

    def __init__(self) -> None:
        self._inside, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        with collections_paused():
            self._inside.set()
            self._release.wait(10)

    def start(self) -> None:
        self._thread.start()
        assert self._inside.wait(10)

    def release(self) -> None:
        self._release.set()
        self._thread.join(10)


def test_overlapping_pauses_enable_the_collector_when_the_last_ends():
    other = _PausedElsewhere()
    with collections_paused():
        other.start()
        assert not gc.isenabled()
    assert not gc.isenabled(), "the other thread's load is still inside its pause"
    other.release()
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_child_forked_during_another_threads_load_collects_again():
    """A DataLoader worker forked while another thread loads a checkpoint: the child runs
    none of the load, so its collector is on (as it was in the parent before the load) and
    a pause of its own works (the lock is not inherited held)."""
    other = _PausedElsewhere()
    other.start()
    try:
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 0 if gc.isenabled() else 3
            with collections_paused():
                code = code or (0 if not gc.isenabled() else 4)
            code = code or (0 if gc.isenabled() else 5)
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "3: collector off in the child; 4/5: its own pause"
    finally:
        other.release()
    assert gc.isenabled()
