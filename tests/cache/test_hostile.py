"""Attacks on the cache's promises, each reproduced with real processes and real files:
a pinned copy is never removed or changed until released; a folder is claimed (and
re-created) only when nothing in it is someone else's; a forked child holds none of its
parent's locks; the internal SizeChanged never escapes; one folder is never two tiers."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from functools import partial

import pytest

from datapipe.cache import CacheTier as Tier
from datapipe.cache import TieredCache
from datapipe.cache.warm import url_key
from datapipe.checksum import checksum
from datapipe.errors import CacheBudgetError, ObjectChangedError, StorageError
from datapipe.storage.faults import FaultInjectingStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in another process: read `url` through a cache of `warm`, print what happened.
_OTHER = """
import json, sys
from datapipe.cache import TieredCache
from datapipe.errors import DatapipeError
warm, url, how, ck, start, end = sys.argv[1:7]
c = TieredCache(warm_dir=warm, warm_bytes=100_000)
try:
    if how == "read":
        out = c.read(url, checksum=ck).decode()
    else:
        out = c.read_range(url, int(start), int(end), checksum=ck).decode()
except DatapipeError as e:
    out = type(e).__name__
c.close()
print(json.dumps(out))
"""


def _other_process(warm, url, how, ck, start=0, end=0):
    done = subprocess.run([sys.executable, "-c", _OTHER, str(warm), url, how, ck, str(start), str(end)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_copy_pinned_elsewhere_is_never_removed_or_replaced_by_a_reader_that_refuses_it(tmp_path):
    url = str(tmp_path / "obj.bin")
    v1, v2 = b"A" * 5000, b"B" * 5000
    with open(url, "wb") as f:
        f.write(v1)
    warm = tmp_path / "warm"
    cache = TieredCache(warm_dir=warm, warm_bytes=100_000)
    path = cache.local_path(url, checksum=checksum(v1))
    ino = os.stat(path).st_ino
    # another process asks with a checksum the copy does not have: its error, our file
    assert _other_process(warm, url, "read", "xxh3_64:0123456789abcdef") == "ChecksumError"
    assert os.path.exists(path) and os.stat(path).st_ino == ino
    # the object is rewritten; other processes read the new version around the pinned copy
    with open(url + ".new", "wb") as f:
        f.write(v2)
    os.replace(url + ".new", url)
    assert _other_process(warm, url, "read", checksum(v2)) == v2.decode()
    assert _other_process(warm, url, "range", checksum(v2[10:20]), 10, 20) == v2[10:20].decode()
    with open(path, "rb") as f:
        assert f.read() == v1
    assert os.stat(path).st_ino == ino
    cache.release(url)
    # released: the next reader that refuses it may replace it
    assert _other_process(warm, url, "read", checksum(v2)) == v2.decode()
    with open(path, "rb") as f:
        assert f.read() == v2
    cache.close()


@pytest.mark.parametrize("tier,folder", [("warm_dir", "stats"), ("shared_dir", "gets"), ("shared_dir", "records"),
                                         ("shared_dir", "leases"), ("warm_dir", "locks")])
def test_an_unmarked_folder_with_files_in_a_layout_folder_is_refused_untouched(tmp_path, tier, folder):
    src = tmp_path / "obj.bin"
    src.write_bytes(b"x" * 100)
    mine = tmp_path / "mine"
    (mine / folder).mkdir(parents=True)
    (mine / folder / "epoch1.json").write_text('{"acc": 0.9}')
    kw = {"warm_dir": mine, "warm_bytes": 10_000} if tier == "warm_dir" else {"shared_dir": mine,
                                                                               "shared_bytes": 10_000}
    with pytest.raises(StorageError, match=f"did not write \\({folder}/epoch1.json\\)"):
        TieredCache(**kw).read(str(src))
    assert sorted(p.name for p in mine.rglob("*")) == ["epoch1.json", folder]
    assert (mine / folder / "epoch1.json").read_text() == '{"acc": 0.9}'


def test_a_deleted_warm_dir_replaced_by_someone_elses_folder_is_given_up_untouched(tmp_path):
    urls = []
    for i in range(3):
        (tmp_path / f"o{i}.bin").write_bytes(bytes([i]) * 1000)
        urls.append(str(tmp_path / f"o{i}.bin"))
    w = tmp_path / "warm"
    c = TieredCache(warm_dir=w, warm_bytes=1500)
    assert c.read(urls[0]) == b"\x00" * 1000
    for p in sorted(w.rglob("*"), reverse=True):  # deleted by a cleanup job ...
        p.unlink() if not p.is_dir() else p.rmdir()
    w.rmdir()
    (w / "tmp").mkdir(parents=True)  # ... and the path reused for someone else's files
    (w / "meta.json").write_text('{"owner": "alice"}')
    (w / "tmp" / "draft.txt").write_text("alice's draft")
    with pytest.warns(RuntimeWarning, match="unusable"):
        for i in (1, 2, 0):
            assert c.read(urls[i]) == bytes([i]) * 1000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert c.read(urls[1]) == b"\x01" * 1000
        assert c.read_range(urls[2], 5, 10) == b"\x02" * 5
    assert not c.has_warm_tier()
    c.close()
    assert (w / "meta.json").read_text() == '{"owner": "alice"}'
    assert (w / "tmp" / "draft.txt").read_text() == "alice's draft"
    assert sorted(p.name for p in w.rglob("*")) == ["draft.txt", "meta.json", "tmp"]


def test_a_child_forked_during_a_fill_holds_none_of_the_parents_locks(tmp_path):
    url = str(tmp_path / "a.bin")
    with open(url, "wb") as f:
        f.write(os.urandom(1000))
    w = tmp_path / "warm"
    slow = partial(FaultInjectingStore, delays=1, delay_s=1.5)
    cache = TieredCache(warm_dir=w, warm_bytes=1 << 20, cold_wrapper=slow)
    assert cache.has_warm_tier()  # this process's state (and the warm dir's layout) made first
    t = threading.Thread(target=cache.read, args=(url,))
    t.start()
    deadline = time.monotonic() + 10
    while not os.listdir(w / "tmp") and time.monotonic() < deadline:  # the fill reserved: it holds its locks
        time.sleep(0.01)
    assert os.listdir(w / "tmp")
    pid = os.fork()  # a DataLoader worker starting now
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        t.join(30)
        assert not t.is_alive()
        # nothing of the warm dir stays locked: every lock file can be taken at once
        lock_files = [w / "locks" / n for n in os.listdir(w / "locks")] + [w / "budget.lock"]
        for p in lock_files:
            fd = os.open(p, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child held it
            finally:
                os.close(fd)
        # and the parent reads its copy again without waiting on its child
        t0 = time.monotonic()
        assert len(cache.read(url)) == 1000
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        cache.close()


class _Resizer(FaultInjectingStore):
    """A cold store whose object is rewritten with another size each time its size is asked
    (really, in the store under it): what a writer that never stops does."""

    def __init__(self, inner):
        super().__init__(inner)
        self.n = 0

    def stat(self, key):
        out = super().stat(key)
        self.n += 1
        self.inner.put(key, bytes([self.n % 256]) * (1000 + self.n))
        return out


@pytest.mark.parametrize("how", ["shared", "hot+shared", "range"])
def test_an_object_that_keeps_changing_size_in_the_shared_tier_is_object_changed_error(tmp_path, how):
    url = str(tmp_path / "cold" / "obj.bin")
    os.makedirs(tmp_path / "cold")
    with open(url, "wb") as f:
        f.write(b"0" * 1000)
    c = TieredCache(hot_bytes=(1 << 20) if how == "hot+shared" else 0, shared_dir=tmp_path / "shared",
                    shared_bytes=1 << 20, cold_wrapper=_Resizer)
    with pytest.raises(ObjectChangedError, match="changed"):
        if how == "range":
            c.read_range(url, 0, 10)
        else:
            c.read(url)
    c.close()


@pytest.mark.parametrize("layout", ["warm=local", "warm=shared", "local in warm", "warm in shared",
                                    "local=local"])
def test_one_folder_given_as_two_tiers_is_refused_naming_both(tmp_path, layout):
    w, s = tmp_path / "warm", tmp_path / "shared"
    kw: dict = {"warm_dir": w, "warm_bytes": 10_000}
    if layout == "warm=local":
        kw["local_tiers"] = [Tier(w, 20_000)]
        names = ("warm_dir", "local_tiers[0]")
    elif layout == "warm=shared":
        kw.update(shared_dir=w, shared_bytes=20_000)
        names = ("warm_dir", "shared_dir")
    elif layout == "local in warm":
        kw["local_tiers"] = [Tier(w / "slow", 20_000)]
        names = ("warm_dir", "local_tiers[0]")
    elif layout == "warm in shared":
        kw.update(warm_dir=s / "node", shared_dir=s, shared_bytes=20_000)
        names = ("warm_dir", "shared_dir")
    else:
        kw["local_tiers"] = [Tier(tmp_path / "a", 20_000), Tier(tmp_path / "a", 20_000)]
        names = ("local_tiers[0]", "local_tiers[1]")
    with pytest.raises(CacheBudgetError, match="folder") as info:
        TieredCache(**kw)
    assert all(n in str(info.value) for n in names)
    assert not os.path.exists(w) and not os.path.exists(s)  # refused before anything is made
    # separate folders side by side are fine
    c = TieredCache(warm_dir=tmp_path / "w2", warm_bytes=10_000, local_tiers=[Tier(tmp_path / "l2", 20_000)],
                    shared_dir=tmp_path / "s2", shared_bytes=20_000)
    src = tmp_path / "obj.bin"
    src.write_bytes(b"y" * 100)
    assert c.read(str(src)) == b"y" * 100
    c.close()
    assert url_key(str(src)) in os.listdir(tmp_path / "w2" / "objects")


def test_a_warm_dir_deleted_under_a_running_cache_is_re_created_not_given_up(tmp_path):
    """The counter flusher writes while the folder is gone: it must not re-create the cache
    folder itself (its own counter file would then look like someone else's file to the
    repair, and the tier would be given up for good)."""
    import shutil

    warm = tmp_path / "warm"
    srcs = []
    for i in range(2):
        p = tmp_path / f"o{i}.bin"
        p.write_bytes(bytes([i]) * 1000)
        srcs.append(str(p))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = TieredCache(warm_dir=str(warm), warm_bytes=100_000, stats_interval_s=0.05)
        assert c.read(srcs[0]) == bytes([0]) * 1000
        shutil.rmtree(warm)
        time.sleep(0.5)  # several flushes while the folder is gone
        assert not warm.exists()
        assert c.read(srcs[1]) == bytes([1]) * 1000
        path = c.local_path(srcs[1])  # needs the warm tier: still there, re-created
    assert os.path.dirname(path) == str(warm / "objects") and open(path, "rb").read() == bytes([1]) * 1000
    c.release(srcs[1])
    c.close()


def test_close_after_the_warm_dir_became_a_file_raises_nothing(tmp_path):
    import shutil

    warm = tmp_path / "warm"
    src = tmp_path / "o.bin"
    src.write_bytes(b"x" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = TieredCache(warm_dir=str(warm), warm_bytes=100_000)
        c.read(str(src))
        shutil.rmtree(warm)
        warm.write_text("a user's file")
        assert c.read(str(src)) == b"x" * 100
        c.close()
    assert warm.read_text() == "a user's file"


def test_no_child_forked_while_a_thread_probes_the_copies_keeps_a_lock(tmp_path):
    """warm_dir_stats probes each copy's lock for a moment; a child forked in that moment
    (a DataLoader worker starting) must not keep it, or every reader of the copy hangs."""
    from datapipe.cache import warm_dir_stats

    warm = str(tmp_path / "warm")
    c = TieredCache(warm_dir=warm, warm_bytes=10**7)
    for i in range(100):
        p = tmp_path / f"o{i}.bin"
        p.write_bytes(bytes([i]) * 100)
        c.read(str(p))
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            warm_dir_stats(warm)

    t = threading.Thread(target=probe)
    t.start()
    kids = []
    try:
        for _ in range(30):
            pid = os.fork()
            if pid == 0:  # a child that lives on without touching the cache
                time.sleep(30)
                os._exit(0)
            kids.append(pid)
            time.sleep(0.005)
        stop.set()
        t.join()
        c.close()  # its own threads may probe a copy for a moment too: only the children are left
        objects = os.path.join(warm, "objects")

        def locked() -> set[str]:
            out = set()
            for name in os.listdir(objects):
                fd = os.open(os.path.join(objects, name), os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    out.add(name)
                finally:
                    os.close(fd)
            return out

        first = locked()
        time.sleep(0.2)
        assert first & locked() == set()  # a child's lock lasts as long as the child (30 s)
    finally:
        stop.set()
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        c.close()
