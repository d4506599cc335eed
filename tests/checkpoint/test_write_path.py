"""The save's write path: the io threads live as long as the writer (none started per save),
a chunk folder is fsync'd once per save after all of its chunks (not once per chunk), and
still before the part that names them is visible; the parts a commit waits for are read
in rank order. Real stores, real fsyncs (the spy only records them), real threads."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.checkpoint.commit import await_parts
from datapipe.checkpoint.format import encode_doc, json_depth, part_key
from datapipe.checkpoint.persist import IOThreads
from datapipe.errors import CheckpointError
from datapipe.storage import MemoryStore

MIB = 1 << 20


def _io_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name == "datapipe-ckpt-io" and t.ident is not None}


def _state(step: int) -> dict[str, object]:
    # 4 MiB over io_threads=4: four 1 MiB chunks (persist.chunk_bytes_for)
    return {"w": np.arange(MIB, dtype=np.float32) + step, "step": step}


def test_io_threads_run_every_index_once_and_raise_the_first_error() -> None:
    io = IOThreads(4, 0)
    try:
        for count in (0, 1, 3, 17):  # 0: an empty state writes no chunk, and must not wait
            seen: list[int] = []
            lock = threading.Lock()

            def record(i: int, seen: list[int] = seen, lock: threading.Lock = lock) -> None:
                with lock:
                    seen.append(i)

            io.run(count, record)
            assert sorted(seen) == list(range(count))

        def fail(i: int) -> None:
            if i == 2:
                raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space"):
            io.run(8, fail)
        io.run(2, lambda i: None)  # still serves after an error
    finally:
        io.close()
    assert not _io_threads()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_io_threads_serve_a_forked_child(tmp_path) -> None:
    # a thread writer's process forks (DataLoader workers): the child has none of the
    # parent's threads, and a run there must not wait for them
    io = IOThreads(3, 0)
    try:
        io.run(5, lambda i: None)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                done: list[int] = []
                io.run(5, done.append)
                code = 0 if sorted(done) == list(range(5)) else 1
            finally:
                os._exit(code)
        deadline_polls = 0
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                break
            deadline_polls += 1
            if deadline_polls > 600:  # 60 s: the child hangs
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("IOThreads.run in a forked child waited for its parent's threads")
            threading.Event().wait(0.1)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        io.close()


def test_io_threads_are_kept_from_save_to_save(tmp_path) -> None:
    before = _io_threads()
    with CheckpointWriter(str(tmp_path), background="thread", io_threads=4) as w:
        w.save(1, _state(1)).wait()
        first = _io_threads() - before
        w.save(2, _state(2)).wait()
        second = _io_threads() - before
        # the caller's thread is one of the four: three helpers, the same ones in both saves
        assert len(first) == 3, first
        assert second == first
    assert not (_io_threads() - before)  # close() ends them
    assert load_checkpoint(str(tmp_path))["w"].tolist() == _state(2)["w"].tolist()


def test_a_save_syncs_its_chunk_folder_once_before_its_part_is_visible(tmp_path, monkeypatch) -> None:
    real_fsync = os.fsync
    dir_syncs: list[tuple[str, bool]] = []  # (folder, whether a part document existed then)

    def spy(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            path = os.readlink(f"/proc/self/fd/{fd}")
            parts = [f for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith("part-")]
            dir_syncs.append((path, bool(parts)))
        real_fsync(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name a descriptor's folder")
    with CheckpointWriter(str(tmp_path), background="thread", io_threads=4) as w:
        monkeypatch.setattr(os, "fsync", spy)
        m = w.save(1, _state(1)).wait()
        monkeypatch.setattr(os, "fsync", real_fsync)
    assert m["committed"]
    chunk_dirs = {os.path.dirname(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path) for f in fs
                  if f.startswith("chunk-")}
    assert len(chunk_dirs) == 1
    (chunk_dir,) = chunk_dirs
    assert len([f for f in os.listdir(chunk_dir) if f.startswith("chunk-")]) == 4
    syncs = [seen for path, seen in dir_syncs if path == chunk_dir]
    # once for the four chunks (the old code fsync'd it after each chunk's rename: 4), and
    # while no part document named them yet
    assert syncs == [False], dir_syncs
    assert load_checkpoint(str(tmp_path))["w"].tolist() == _state(1)["w"].tolist()


def test_await_parts_reads_the_parts_in_rank_order_and_names_the_missing() -> None:
    store = MemoryStore()
    world = 5

    def publish(r: int) -> None:
        doc = {"step": 3, "attempt": "a-0", "rank": r, "world_size": world, "data_bytes": r, "stored_bytes": r}
        store.put(part_key(3, "a-0", r), encode_doc(doc, "part"))

    for r in (0, 1, 3, 4):  # rank 2 is missing
        publish(r)
    with pytest.raises(CheckpointError, match=r"ranks \[2\]") as e:
        await_parts(store, 3, "a-0", world, timeout=0.05)
    assert "part-00002" in str(e.value)
    publish(2)
    parts, docs = await_parts(store, 3, "a-0", world, timeout=0.05, keep_docs=1 << 20)
    assert [p["rank"] for p in parts] == list(range(world))
    assert [p["data_bytes"] for p in parts] == list(range(world))
    assert docs is not None and len(docs) == world


def test_json_depth_counts_across_its_slices() -> None:
    # more brackets than one slice of the count holds: the level carries over
    n = (1 << 20) + 7
    text = b"[" * n + b"1" + b"]" * n
    assert json_depth(text) == n
    assert json_depth(b'{"a": "[[[[", "b": [[1], {"c": "\\"]]"}]}') == 3


_FAIL_MID_CHUNK = """
import os, resource, signal, sys
import numpy as np
from datapipe.checkpoint import CheckpointWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
w = CheckpointWriter(sys.argv[1], background="thread", io_threads=1)
resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 19, resource.RLIM_INFINITY))  # 1.5 MiB files
try:
    w.save(1, {"w": np.ones(1 << 20, np.float32)}).wait()  # one 4 MiB chunk
except Exception as e:
    print("failed:", type(e).__name__, e)
else:
    print("saved")
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
w.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc"), reason="needs RLIMIT_FSIZE (Linux)")
def test_a_chunk_that_fails_while_it_is_written_leaves_nothing(tmp_path) -> None:
    # a real failure in the middle of a chunk's blocks (the file size limit: EFBIG after
    # 1.5 MiB of 4): the save fails and neither the chunk, its temporary nor a part is left
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _FAIL_MID_CHUNK, str(tmp_path / "c")], capture_output=True,
                         text=True, timeout=300, cwd=root)
    assert out.stdout.startswith("failed:"), (out.stdout, out.stderr[-2000:])
    assert "[Errno 27]" in out.stdout, out.stdout  # EFBIG, from the chunk's write
    left = [f for d, _, fs in os.walk(tmp_path) for f in fs]
    assert not [f for f in left if f.startswith((".tmp-", "chunk-", "part-", "manifest"))], left
    assert list_checkpoints(str(tmp_path / "c")) == []
