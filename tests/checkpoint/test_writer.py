"""One writer per URL (the lease), a writer shared between threads, and what the writer
does around the commit: `latest` failing, steps going backwards, retention against
readers and in-flight saves, states JSON cannot hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.checkpoint.commit import apply_retention
from datapipe.checkpoint.format import encode_doc, manifest_key
from datapipe.errors import CheckpointError, UnsupportedStateError
from datapipe.storage import open_store

LEASE_KEY = "writer.lease"  # docs/CHECKPOINT_FORMAT.md
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A writer in its own process: says whether it got the URL, then waits for a line on
# stdin before it saves its steps and closes.
HOLDER = r"""
import json, sys
import numpy as np
from datapipe.checkpoint import CheckpointWriter
from datapipe.errors import CheckpointError
url, name, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    w = CheckpointWriter(url, storage_options=opts or None, keep_last=10, chunk_bytes=4096)
except CheckpointError as e:
    print("REFUSED", e, flush=True)
    sys.exit(0)
print("HOLDING", flush=True)
sys.stdin.readline()
for step in (1, 2, 3):
    w.save(step, {"who": name, "step": step, "w": np.full(2000, float(step))}).wait()
w.close()
print("DONE", flush=True)
"""


def _holder(url, name, opts=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-c", HOLDER, url, name, json.dumps(opts or {})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _finish(p, timeout=120):
    out, err = p.communicate("go\n", timeout=timeout)
    assert p.returncode == 0, err
    return out


# -- item 4: two writers on one URL -------------------------------------------------------------

def test_two_processes_on_one_url_one_is_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    procs = {name: _holder(url, name) for name in ("a", "b")}  # started together: they race
    first = {name: p.stdout.readline().split(" ", 1) for name, p in procs.items()}
    outs = {name: _finish(p) for name, p in procs.items()}
    holding = [n for n, line in first.items() if line[0].strip() == "HOLDING"]
    refused = [n for n, line in first.items() if line[0].strip() == "REFUSED"]
    assert len(holding) == 1 and len(refused) == 1, first
    assert "another checkpoint writer holds this URL" in first[refused[0]][1]
    assert "DONE" in outs[holding[0]]
    for step in (1, 2, 3):
        assert load_checkpoint(url, step=step)["who"] == holding[0]
    assert not os.path.exists(os.path.join(url, LEASE_KEY))  # released at close


def test_a_killed_writer_frees_a_local_url_at_once(tmp_path):
    url = str(tmp_path / "ckpt")
    p = _holder(url, "a")
    assert p.stdout.readline().startswith("HOLDING")
    with pytest.raises(CheckpointError, match=r"another checkpoint writer.*pid"):
        CheckpointWriter(url)
    p.kill()
    p.wait()
    with CheckpointWriter(url) as w:  # the kernel dropped the dead writer's lock
        w.save(5, {"x": 1}).wait()
    assert load_checkpoint(url) == {"x": 1}


def test_s3_second_writer_is_refused_until_the_first_closes(s3):
    root, opts = s3
    url = f"{root}/ckpt"
    p = _holder(url, "a", opts)
    assert p.stdout.readline().startswith("HOLDING")
    with pytest.raises(CheckpointError, match=r"another checkpoint writer holds this URL.*heartbeat"):
        CheckpointWriter(url, storage_options=opts)
    assert "DONE" in _finish(p)
    with CheckpointWriter(url, storage_options=opts, keep_last=10) as w:
        w.save(4, {"who": "b"}).wait()
    assert [i.step for i in list_checkpoints(url, storage_options=opts)] == [1, 2, 3, 4]


def _lease_doc(heartbeat_ago: float, ttl: float = 60.0) -> bytes:
    now = time.time()
    return encode_doc({"writer": "dead", "run_id": "gone", "host": "elsewhere", "pid": 1,
                       "acquired_unix": now - 3600, "heartbeat_unix": now - heartbeat_ago,
                       "ttl_s": ttl}, "lease")


def test_s3_stale_lease_is_taken_over_and_a_fresh_one_is_waited_for(s3):
    root, opts = s3
    url = f"{root}/ckpt"
    store = open_store(url, opts)
    store.put(LEASE_KEY, _lease_doc(heartbeat_ago=3600))
    with CheckpointWriter(url, storage_options=opts) as w:  # stale: taken over
        assert b'"writer": "dead"' not in store.get(LEASE_KEY)
        w.save(1, {"x": 1}).wait()
    store.put(LEASE_KEY, _lease_doc(heartbeat_ago=0))
    with pytest.raises(CheckpointError, match="another checkpoint writer"):
        CheckpointWriter(url, storage_options=opts)
    store.put(LEASE_KEY, _lease_doc(heartbeat_ago=0, ttl=1.0))
    with CheckpointWriter(url, storage_options=opts, lease_wait=30) as w:  # goes stale after 1 s
        w.save(2, {"x": 2}).wait()
    assert load_checkpoint(url, storage_options=opts) == {"x": 2}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_writer_that_lost_its_lease_does_not_commit(tmp_path, s3, where):
    root, opts = s3
    url, opts = (str(tmp_path / "ckpt"), None) if where == "local" else (f"{root}/ckpt", opts)
    store = open_store(url, opts)
    w = CheckpointWriter(url, storage_options=opts)
    w.save(1, {"x": 1}).wait()
    # another writer took the URL over (it found this one stale)
    if where == "local":
        os.unlink(store.path(LEASE_KEY))
    store.put(LEASE_KEY, _lease_doc(heartbeat_ago=0))
    with pytest.raises(CheckpointError, match="lost its lease"):
        w.save(2, {"x": 2}).wait()
    assert not store.exists(manifest_key(2))
    w.close()
    assert store.exists(LEASE_KEY)  # never deletes the lease it no longer holds


class _SlowDict(dict):
    """A dict whose items() waits: the first save() is still inside flatten when a second
    thread calls save()."""

    def __init__(self, *a, entered, release, **kw):
        super().__init__(*a, **kw)
        self.entered, self.release = entered, release

    def items(self):
        self.entered.set()
        self.release.wait(30)
        return super().items()


def test_a_writer_used_from_two_threads_at_once_raises(tmp_path):
    url = str(tmp_path / "ckpt")
    entered, release = threading.Event(), threading.Event()
    w = CheckpointWriter(url)
    errors = []

    def first():
        try:
            w.save(1, _SlowDict({"x": torch.ones(10)}, entered=entered, release=release)).wait()
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(30)
    try:
        with pytest.raises(CheckpointError, match="another thread"):
            w.save(2, {"x": torch.zeros(10)})
    finally:
        release.set()
        t.join()
    assert not errors
    w.save(3, {"x": torch.full((10,), 3.0)}).wait()  # sequential use from any thread is fine
    w.close()
    assert torch.equal(load_checkpoint(url, step=1)["x"], torch.ones(10))
    assert [i.step for i in list_checkpoints(url)] == [1, 3]


def test_retention_keeps_a_rank_s_save_that_rank_0_has_not_made_yet(tmp_path):
    """Rank 1 runs ahead and saves step 4 (steps went backwards) before rank 0 commits 10:
    rank 0's retention must not delete rank 1's files of step 4."""
    url = str(tmp_path / "ckpt")
    kw = dict(world_size=2, run_id="job1", keep_last=1, commit_timeout=20)
    r1 = CheckpointWriter(url, rank=1, **kw)
    r0 = CheckpointWriter(url, rank=0, **kw)
    r1.save(10, {"r": 1, "s": 10}).wait()
    with pytest.warns(UserWarning, match="below step 10"):
        r1.save(4, {"r": 1, "s": 4}).wait()
    r0.save(10, {"r": 0, "s": 10}).wait()
    with pytest.warns(UserWarning, match="below step 10"):
        h = r0.save(4, {"r": 0, "s": 4})
    h.wait()
    r0.close()
    r1.close()
    assert load_checkpoint(url, step=4, rank=1) == {"r": 1, "s": 4}


def test_retention_deletes_only_files_of_the_format(tmp_path):
    url = str(tmp_path / "ckpt")
    with CheckpointWriter(url, keep_last=1) as w:
        w.save(1, {"x": torch.ones(3)}).wait()
        notes = tmp_path / "ckpt" / "step-000000000001" / "notes.txt"
        notes.write_text("mine")
        m = w.save(2, {"x": torch.ones(3)}).wait()
    assert m["deleted_steps"] == [1]
    assert notes.read_text() == "mine"
    assert not (tmp_path / "ckpt" / "step-000000000001" / "manifest.json").exists()


# -- item 9: states JSON cannot hold fail at save() -----------------------------------------------

@pytest.mark.parametrize("bad", [10**5000, -(10**5000), {10**5000: 1}], ids=["int", "negative", "key"])
def test_an_int_json_cannot_read_back_is_refused_at_save(tmp_path, bad):
    with CheckpointWriter(str(tmp_path / "ckpt")) as w:
        with pytest.raises(UnsupportedStateError, match=r"state path 'x'.*too large"):
            w.save(1, {"x": bad})
        w.save(2, {"x": 2**1000}).wait()  # large, but readable: kept exactly
    assert load_checkpoint(str(tmp_path / "ckpt")) == {"x": 2**1000}


def test_a_state_nested_too_deep_is_refused_at_save(tmp_path):
    deep = []
    for _ in range(200):
        deep = [deep]
    with CheckpointWriter(str(tmp_path / "ckpt")) as w:
        with pytest.raises(UnsupportedStateError, match="nested deeper"):
            w.save(1, {"x": deep})


# -- unclear or surprising ------------------------------------------------------------------------

def test_latest_failing_does_not_fail_a_committed_save(tmp_path):
    url = tmp_path / "ckpt"
    with CheckpointWriter(str(url), keep_last=1) as w:
        w.save(1, {"x": 1}).wait()
        leftover = url / ".tmp-0123456789ab-latest"  # of a write that died (disk full, kill)
        leftover.write_bytes(b"{")
        os.unlink(url / "latest")
        (url / "latest").mkdir()  # the rename onto `latest` now fails
        (url / "latest" / "x").write_text("")
        with pytest.warns(UserWarning, match="step 2 is committed.*latest"):
            m = w.save(2, {"x": 2}).wait()
    assert m["committed"] and "latest_error" in m
    assert m["deleted_steps"] == [1]  # retention ran
    assert not leftover.exists()
    assert load_checkpoint(str(url)) == {"x": 2}


def test_retention_keeps_the_step_latest_names(tmp_path):
    url = str(tmp_path / "ckpt")
    with CheckpointWriter(url, keep_last=5) as w:
        for s in (1, 2, 3):
            w.save(s, {"s": s}).wait()
    store = open_store(url)
    attempt = json.loads(store.get(manifest_key(3)))["attempt"]
    # `latest` still names step 1: its updates for 2 and 3 failed
    store.put("latest", encode_doc({"step": 1, "attempt": "x-0"}, "latest"))
    assert apply_retention(store, 3, attempt, keep_last=1, keep_every=None) == [2]
    assert [i.step for i in list_checkpoints(url)] == [1, 3]


def test_saving_a_lower_step_warns(tmp_path):
    url = str(tmp_path / "ckpt")
    with CheckpointWriter(url) as w:
        w.save(10, {"s": 10}).wait()
        with pytest.warns(UserWarning, match=r"below step 10.*loads the highest"):
            w.save(4, {"s": 4}).wait()
    with CheckpointWriter(url) as w:  # a restarted job, same URL
        with pytest.warns(UserWarning, match="below step 10"):
            w.save(5, {"s": 5}).wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            w.save(11, {"s": 11}).wait()


_ON_OPEN: list = []


def _audit(event, args):
    if _ON_OPEN and event == "open" and isinstance(args[0], str):
        _ON_OPEN[0](args[0])


sys.addaudithook(_audit)  # cannot be removed: it acts only while _ON_OPEN holds a callback


def test_a_load_whose_step_is_deleted_by_a_commit_lists_again(tmp_path):
    """The race a reader loses against a writer with keep_last=1: it listed step 1 as the
    newest, then step 2 committed and retention deleted step 1 before the reader opened
    it. Made deterministic: the reader's first open of step 1's manifest runs that commit."""
    url = str(tmp_path / "ckpt")
    w = CheckpointWriter(url, keep_last=1)
    w.save(1, {"s": 1}).wait()
    me = threading.get_ident()

    def commit_newer(path):
        if threading.get_ident() == me and path.endswith(os.path.join("step-000000000001", "manifest.json")):
            _ON_OPEN.clear()
            assert w.save(2, {"s": 2}).wait()["deleted_steps"] == [1]

    _ON_OPEN.append(commit_newer)
    try:
        got = load_checkpoint(url)
    finally:
        _ON_OPEN.clear()
        w.close()
    assert got == {"s": 2}


def test_a_forked_child_exiting_leaves_the_parent_s_lease(tmp_path):
    """DataLoader workers are forks of the training process: their exit hooks must not
    close the parent's writer or release its lease."""
    import multiprocessing as mp

    url = str(tmp_path / "ckpt")
    with CheckpointWriter(url) as w:
        w.save(1, {"x": 1}).wait()
        p = mp.get_context("fork").Process(target=int)
        p.start()
        p.join()
        assert p.exitcode == 0
        w.save(2, {"x": 2}).wait()  # still holds the lease: commits
    assert load_checkpoint(url) == {"x": 2}


def test_a_store_without_conditional_writes_still_refuses_a_second_live_writer():
    import uuid

    url = f"memory://lease-{uuid.uuid4().hex[:8]}/ckpt"  # fsspec memory://: no conditional PUT
    with CheckpointWriter(url) as w:
        with pytest.raises(CheckpointError, match="another checkpoint writer"):
            CheckpointWriter(url)
        w.save(1, {"x": 1}).wait()
    with CheckpointWriter(url) as w:  # released at close
        w.save(2, {"x": 2}).wait()
    assert load_checkpoint(url) == {"x": 2}


def test_a_symlink_planted_as_the_lease_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious user data\n")
    url = tmp_path / "ckpt"
    url.mkdir()
    os.symlink(victim, url / LEASE_KEY)
    with pytest.raises(CheckpointError, match="symbolic link"):
        CheckpointWriter(str(url))
    assert victim.read_text() == "precious user data\n"
    assert os.path.islink(url / LEASE_KEY)


# -- chunks per save ---------------------------------------------------------------------------

def test_chunk_size_leaves_no_io_thread_without_a_chunk():
    from datapipe.checkpoint.persist import chunk_bytes_for

    mib = 1 << 20
    assert chunk_bytes_for(96 * mib, 64 * mib, 4) == 24 * mib  # was 64 + 32: two threads idle
    assert chunk_bytes_for(1000 * mib, 64 * mib, 4) == 64 * mib  # enough chunks: as asked
    assert chunk_bytes_for(6 * mib, 64 * mib, 4) == 2 * mib  # whole 1 MiB blocks
    assert chunk_bytes_for(10, 64 * mib, 4) == mib  # tiny: one chunk
    assert chunk_bytes_for(96 * mib, 4096, 4) == 4096  # smaller than asked: never larger


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_part_smaller_than_io_threads_chunks_is_split_for_them(tmp_path, background):
    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(6 * (1 << 20) // 4, dtype=torch.float32), "b": torch.ones(7)}
    with CheckpointWriter(url, io_threads=4, background=background, nice=0) as w:
        w.save(1, state).wait()
    part = next(os.path.join(d, f) for d, _, fs in os.walk(url) for f in fs if f.startswith("part"))
    with open(part) as f:
        doc = json.load(f)
    # 6 MiB and a few bytes over 4 threads: 1.5 MiB each, rounded up to whole 1 MiB blocks
    assert doc["chunk_bytes"] == 2 << 20
    assert [c["bytes"] for c in doc["chunks"]] == [2 << 20] * 3 + [doc["data_bytes"] - (6 << 20)]
    got = load_checkpoint(url)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
