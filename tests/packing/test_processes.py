"""pack against real processes: two writers at once, kill -9 at chosen points, killed
workers, and the cleanup a rerun does (deleting exactly what the killed pack wrote)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import datapipe
from datapipe.errors import DestinationBusyError
from tools.corpus import generate_corpus, read_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--shard-samples", "10", "-q"]  # the same options in every run of one test: a rerun resumes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses Linux signals")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    generate_corpus(str(root), 300, seed=2, mean_bytes=1024, per_dir=100)
    return str(root)


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _pack_cli(src, dest, *extra):
    return subprocess.Popen([sys.executable, "-m", "datapipe.cli", "pack", src, dest, *ARGS, *extra],
                            env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_cli(src, dest, *extra, timeout=120):
    p = _pack_cli(src, dest, *extra)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


# A `datapipe pack` that holds mid-run, deterministically: every process that packs (the
# pack itself with --workers 1, each forked worker otherwise) finishes one shard, then
# touches HOLD/held and waits before finishing its next one until HOLD/go exists.
# argv: HOLD, then the CLI's arguments
_HELD = """
import os, sys, time
from datapipe.cli import main
from datapipe.format.shard import ShardBuilder

hold = sys.argv[1]
real_finish, count = ShardBuilder.finish, {}
def finish(self):
    count[os.getpid()] = count.get(os.getpid(), 0) + 1
    if count[os.getpid()] >= 2:
        open(os.path.join(hold, "held"), "a").close()
        while not os.path.exists(os.path.join(hold, "go")):
            time.sleep(0.01)
    return real_finish(self)
ShardBuilder.finish = finish
sys.exit(main(sys.argv[2:]))
"""


class _HeldPack:
    """A pack held before its second shard (see _HELD): ``wait_held()``, then ``go()``."""

    def __init__(self, hold, src, dest, *extra):
        self.hold = str(hold)
        os.makedirs(self.hold, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _HELD, self.hold, "pack", src, dest, *ARGS, *extra],
                                     env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def wait_held(self):
        _wait_for(lambda: os.path.exists(os.path.join(self.hold, "held")) or self.proc.poll() is not None,
                  "the pack to hold")
        assert self.proc.poll() is None, self.proc.communicate()[1]

    def go(self):
        open(os.path.join(self.hold, "go"), "a").close()


# A pack that kills itself (SIGKILL, no cleanup of any kind) at a chosen point; argv: src dest point
_KILL_AT = """
import os, signal, sys
import datapipe
from datapipe.format.shard import ShardBuilder
from datapipe.publish import Journal
from datapipe.storage import LocalStore

def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)

point = sys.argv[3]
if point == "mid-shard":  # the second shard's temporary file exists, unpublished
    real_finish, count = ShardBuilder.finish, [0]
    def finish(self):
        count[0] += 1
        if count[0] == 2:
            die()
        return real_finish(self)
    ShardBuilder.finish = finish
elif point == "before-cleanup":  # the manifest is written, the journal not yet removed
    Journal.remove = die
elif point == "mid-cleanup":  # the first key of the journal is deleted, the rest not
    real_delete = LocalStore.delete
    def delete(self, key):
        real_delete(self, key)
        if key.startswith("_pack/") and self.exists("manifest.json"):
            die()
    LocalStore.delete = delete
datapipe.pack(sys.argv[1], sys.argv[2], shard_samples=10, workers=1)
"""


def _kill_at(src, dest, point):
    p = subprocess.run([sys.executable, "-c", _KILL_AT, src, dest, point], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr


def _all_samples(url, storage_options=None):
    return {s["__key__"]: s for s in datapipe.open_dataset(url, storage_options)}


def _wait_for(cond, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _proc_state(pid):
    """(state, ppid) of a live process, None once it is gone (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]))


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_state(int(d))
            if st is not None and st[1] == pid:
                out.append(int(d))
    return out


def _kill_all(pids):
    """End the processes this test started (packs and their workers), by id, with any
    worker still alive under them."""
    for pid in pids:
        for p in [*_children(pid), pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- item 5: one writer per destination -------------------------------------------------


def test_second_pack_into_one_destination_is_refused(corpus, tmp_path):
    dest = str(tmp_path / "ds")
    first = _HeldPack(tmp_path / "hold", corpus, dest, "--workers", "2")
    try:
        first.wait_held()  # mid-run: its lock taken, no manifest
        rc, _out, err = _run_cli(corpus, dest)
        assert rc == 2, err
        assert "another pack is writing" in err and dest in err and "Traceback" not in err
        first.go()
        _out, err = first.proc.communicate(timeout=120)
        assert first.proc.returncode == 0, err
    finally:
        _kill_all([first.pid])
    assert _all_samples(dest) == read_corpus(corpus)
    assert sorted(os.listdir(dest)) == sorted(["manifest.json", "samples.parquet", "shards.parquet"] + [
        f"shard-{i:06d}.tar" for i in range(30)])


def test_in_process_second_writer_gets_busy_error(corpus, tmp_path):
    dest = str(tmp_path / "ds")
    first = _HeldPack(tmp_path / "hold", corpus, dest, "--workers", "1")
    try:
        first.wait_held()
        with pytest.raises(DestinationBusyError, match=f"pid {first.pid}"):
            datapipe.pack(corpus, dest, shard_samples=10, overwrite=True)
        first.go()
        _out, err = first.proc.communicate(timeout=120)
        assert first.proc.returncode == 0, err
    finally:
        _kill_all([first.pid])
    assert _all_samples(dest) == read_corpus(corpus)


# --- item 3 (and 5's stale lock): what a rerun after kill -9 cleans ---------------------


def test_rerun_after_kill_deletes_exactly_the_killed_packs_temporaries(corpus, tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    foreign = dest / ".tmp-0123456789ab-shard-000001.tar"  # another writer's in-flight file
    foreign.write_bytes(b"not ours")
    _kill_at(corpus, str(dest), "mid-shard")
    lock = json.loads((dest / "_pack" / "writer.lock").read_bytes())
    ours = [p for p in os.listdir(dest) if p.startswith(f".tmp-{lock['token']}-")]
    assert ours == [f".tmp-{lock['token']}-shard-000001.tar"]  # the kill left it behind
    rc, out, err = _run_cli(corpus, str(dest))  # the lock of the killed pack is no obstacle
    assert rc == 0, err
    assert "already done by an earlier run" in out
    assert foreign.read_bytes() == b"not ours"
    assert sorted(p for p in os.listdir(dest) if p.startswith(".tmp-")) == [foreign.name]
    assert not (dest / "_pack").exists()
    assert _all_samples(str(dest)) == read_corpus(corpus)


def test_pack_never_deletes_temporaries_it_did_not_write(tmp_path):
    dest = tmp_path / "ds"
    src = dest / "inputs"  # a source inside the destination
    src.mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a")
    planted = [dest / ".tmp-0123456789ab-shard-000000.tar",  # another writer's in-flight temporary
               dest / "notes" / ".tmp-draft.md",  # an unrelated folder
               src / ".tmp-user-file",  # inside the source
               dest / "_pack" / ".tmp-0123456789ab-x.json"]
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"keep")
    with pytest.raises(datapipe.errors.InputFileError):
        datapipe.pack(str(tmp_path / "missing.jsonl"), str(dest))  # a pack that fails
    assert all(p.read_bytes() == b"keep" for p in planted)
    with pytest.raises(datapipe.errors.EmptyInputError):
        datapipe.pack(str(dest / "notes"), str(dest))  # one that fails after taking the lock
    assert all(p.read_bytes() == b"keep" for p in planted)
    datapipe.pack(str(src), str(dest))
    datapipe.pack(str(src), str(dest), overwrite=True)
    assert all(p.read_bytes() == b"keep" for p in planted)
    assert _all_samples(str(dest)) == {"a": {"__key__": "a", "txt": b"a"}}


# --- item 11: killed after the manifest, before the journal is gone ---------------------


@pytest.mark.parametrize("point", ["before-cleanup", "mid-cleanup"])
def test_pack_killed_during_cleanup_finishes_on_rerun(corpus, tmp_path, point):
    dest = str(tmp_path / "ds")
    _kill_at(corpus, dest, point)
    assert os.path.exists(os.path.join(dest, "manifest.json")) and os.path.isdir(os.path.join(dest, "_pack"))
    published = {n: os.stat(os.path.join(dest, n)).st_ino for n in os.listdir(dest) if n != "_pack"}
    rc, out, err = _run_cli(corpus, dest)
    assert rc == 0, err
    assert "packed 300 samples into 30 shards" in out
    assert not os.path.exists(os.path.join(dest, "_pack"))
    assert {n: os.stat(os.path.join(dest, n)).st_ino for n in os.listdir(dest)} == published  # none rewritten
    assert _all_samples(dest) == read_corpus(corpus)
    assert datapipe.verify_dataset(dest).ok
    # a pack of other input still finds a dataset there
    rc, _out, err = _run_cli(corpus, dest, "--shard-samples", "20")
    assert rc == 2 and "already holds a dataset" in err


# --- item 7: workers die with the pack; a lost worker is a clear error -----------------


def test_killed_pack_takes_its_workers_with_it(corpus, tmp_path):
    dest = str(tmp_path / "ds")
    held = _HeldPack(tmp_path / "hold", corpus, dest, "--workers", "2")
    pack = held.proc
    workers = []
    try:
        held.wait_held()  # a worker holds before its second shard: work is pending
        _wait_for(lambda: len(_children(pack.pid)) >= 2, "two workers")
        os.kill(pack.pid, signal.SIGSTOP)  # the other worker fills its result pipe and blocks, as in the report
        workers = _children(pack.pid)
        os.kill(pack.pid, signal.SIGKILL)
        pack.wait()  # the held worker is never released: only the pack's death may end it
        _wait_for(lambda: all(_proc_state(w) is None for w in workers), "the workers to exit", timeout=20)
    finally:
        _kill_all([pack.pid, *workers])
    rc, _out, err = _run_cli(corpus, dest)
    assert rc == 0, err
    assert _all_samples(dest) == read_corpus(corpus)


def test_lost_worker_is_a_clear_error_and_rerun_resumes(corpus, tmp_path):
    dest = str(tmp_path / "ds")
    held = _HeldPack(tmp_path / "hold", corpus, dest, "--workers", "2", "--shard-samples", "2")
    pack = held.proc
    workers = []
    try:
        held.wait_held()  # work is pending: 150 shards, a worker holds before its second
        _wait_for(lambda: len(_children(pack.pid)) >= 2, "two workers")
        workers = _children(pack.pid)
        os.kill(workers[0], signal.SIGKILL)  # as the out-of-memory killer does
        held.go()
        _out, err = pack.communicate(timeout=120)
    finally:
        _kill_all([pack.pid, *workers])
    assert pack.returncode == 2, err
    assert "Traceback" not in err and "BrokenProcessPool" not in err
    assert "worker process died" in err and "run the same command again" in err and dest in err
    rc, _out, err = _run_cli(corpus, dest, "--shard-samples", "2")
    assert rc == 0, err
    assert _all_samples(dest) == read_corpus(corpus)


# --- the same rules on an object store (lease) -------------------------------------------


def _s3_store(s3):
    from datapipe.storage import open_store

    root, opts = s3
    return open_store(root + "/ds", opts)


def test_object_store_one_writer_and_rerun_after_kill(corpus, s3, tmp_path):
    root, opts = s3
    dest = root + "/ds"
    store = _s3_store(s3)
    first = _HeldPack(tmp_path / "hold", corpus, dest, "--workers", "1", "--shard-samples", "60",
                      "--storage-options", json.dumps(opts))
    try:
        first.wait_held()  # mid-run, its lease taken: no manifest
        with pytest.raises(DestinationBusyError, match="lease"):
            datapipe.pack(corpus, dest, shard_samples=60, storage_options=opts)
        os.kill(first.pid, signal.SIGKILL)  # its lease stays behind, fresh
        first.proc.wait()
    finally:
        _kill_all([first.pid])
    # the writer is gone (same host, its pid is dead): the rerun takes the lease over at once
    r = datapipe.pack(corpus, dest, shard_samples=60, storage_options=opts)
    assert r.samples == 300
    assert _all_samples(dest, opts) == read_corpus(corpus)
    assert not store.list("_pack/")


def test_a_failed_pack_leaves_no_lock_or_folder_behind(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(datapipe.errors.EmptyInputError):
        datapipe.pack(str(tmp_path / "src"), str(tmp_path / "new" / "ds"))
    assert os.listdir(tmp_path) == ["src"]


def test_join_is_refused_while_another_writer_holds_the_destination(tmp_path):
    from datapipe.publish import WriterLock
    from datapipe.storage import open_store

    src = tmp_path / "src"
    for k in "abcd":
        (src / f"{k}.txt").parent.mkdir(exist_ok=True)
        (src / f"{k}.txt").write_bytes(k.encode())
    dest = str(tmp_path / "ds")
    for i in range(2):
        datapipe.pack(str(src), dest, part=(i, 2))
    with WriterLock(open_store(dest)):  # another writer of the top level, as a pack would hold it
        with pytest.raises(DestinationBusyError, match=f"pid {os.getpid()}"):
            datapipe.join_parts(dest)
    assert datapipe.join_parts(dest) == 4
    assert not os.path.exists(os.path.join(dest, "_pack"))


def test_object_store_lease_is_exact_and_checked_before_commit(s3):
    """Writers that start at the same instant: exactly one holds the destination (S3's
    conditional writes, not a read-back); a holder whose lease is gone cannot commit."""
    import threading

    from datapipe.publish import WriterLock

    store = _s3_store(s3)
    start = threading.Barrier(4)
    won, busy = [], []

    def contend():
        lock = WriterLock(store)
        start.wait()
        try:
            lock.__enter__()
        except DestinationBusyError:
            busy.append(lock)
        else:
            won.append(lock)

    threads = [threading.Thread(target=contend) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(won), len(busy)) == (1, 3)
    holder = won[0]
    holder.check()  # still ours
    store.delete("_pack/lease.json")  # gone: taken over, or cleaned up by someone else
    with pytest.raises(DestinationBusyError, match="two packs"):
        holder.check()
    holder.release()
    assert not store.list("_pack/")
