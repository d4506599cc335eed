"""One conformance suite, run against every Store implementation (zarr v3's pattern)."""

import os
import pickle
import stat
import uuid

import pytest

from datapipe.errors import ObjectChangedError, ObjectNotFoundError, StorageError, TruncatedReadError
from datapipe.storage import (
    FsspecStore,
    LocalStore,
    MemoryStore,
    join_url,
    open_store,
    split_url,
)
from datapipe.storage.faults import FaultInjectingStore
from datapipe.storage.lease import LeaseBusyError, WriterLease


class StoreConformance:
    """Subclasses provide a fresh ``store`` fixture."""

    def test_put_get_roundtrip(self, store):
        store.put("a.bin", b"hello world")
        assert store.get("a.bin") == b"hello world"
        store.put("a.bin", memoryview(b"replaced"))
        assert store.get("a.bin") == b"replaced"
        assert store.size("a.bin") == 8
        assert store.exists("a.bin")

    def test_ranges(self, store):
        store.put("r", bytes(range(100)))
        assert store.get_range("r", 10, 20) == bytes(range(10, 20))
        assert store.get_range("r", 5, 5) == b""
        with pytest.raises(StorageError):
            store.get_range("r", 20, 10)
        with pytest.raises(TruncatedReadError):
            store.get_range("r", 90, 120)
        buf = bytearray(30)
        assert store.readinto("r", memoryview(buf), 50) == 30
        assert bytes(buf) == bytes(range(50, 80))

    def test_missing_object(self, store):
        assert not store.exists("nope")
        with pytest.raises(ObjectNotFoundError, match="nope"):
            store.get("nope")
        with pytest.raises(ObjectNotFoundError, match="nope"):
            store.size("nope")
        store.delete("nope")  # not an error

    def test_delete_and_list(self, store):
        for k in ("d/b", "d/a", "e/c", "dx"):
            store.put(k, b"x")
        assert store.list("d/") == ["d/a", "d/b"]
        assert store.list("d") == ["d/a", "d/b", "dx"]
        store.delete("d/a")
        assert not store.exists("d/a")
        assert store.list() == ["d/b", "dx", "e/c"]

    def test_writer_publishes_only_on_success(self, store):
        with store.open_writer("w") as f:
            f.write(b"part1")
            f.write(b"part2")
        assert store.get("w") == b"part1part2"
        with pytest.raises(RuntimeError):
            with store.open_writer("w2") as f:
                f.write(b"half")
                raise RuntimeError("boom")
        assert not store.exists("w2")
        assert store.list() == ["w"]

    def test_reads_pinned_to_one_version(self, store):
        store.put("v", b"a" * 100)
        if isinstance(store, LocalStore):  # a rewrite in the same clock tick keeps mtime
            os.utime(store.path("v"), ns=(10**18, 10**18))
        size, version = store.stat("v")
        assert size == 100 and version is not None
        assert store.stat("v") == (size, version)
        assert store.get_range_at("v", 10, 20, version) == b"a" * 10
        store.put("v", b"b" * 100)  # same size, other bytes
        size2, version2 = store.stat("v")
        assert size2 == 100 and version2 != version
        with pytest.raises(ObjectChangedError, match="v"):
            store.get_range_at("v", 10, 20, version)
        assert store.get_range_at("v", 10, 20, version2) == b"b" * 10
        with pytest.raises(ObjectNotFoundError, match="nope"):
            store.stat("nope")

    def test_capabilities(self, store):
        # a local path is a real file with the object's bytes, or there is none
        store.put("d/x", b"abc")
        path = store.local_path("d/x")
        if path is not None:
            with open(path, "rb") as f:
                assert f.read() == b"abc"
        store.sync_parents("d/x")  # never fails where the object exists
        # a writer's view writes the same objects; its leftovers are its own to remove
        mine = store.for_writer("abc123")
        mine.put("d/y", b"yy")
        assert store.get("d/y") == b"yy"
        assert store.remove_temporaries("d", tokens=["abc123"]) == 0  # nothing left half-written
        assert store.list("d/") == ["d/x", "d/y"]

    def test_writer_lease_excludes_a_second_writer(self, store):
        first = WriterLease(store, "w/lease").acquire()
        with pytest.raises(LeaseBusyError) as busy:
            WriterLease(store, "w/lease").acquire()
        assert busy.value.holder is not None and busy.value.holder["writer"] == first.writer
        first.check()
        first.release()
        second = WriterLease(store, "w/lease").acquire()  # free again once released
        second.release()
        assert not store.exists("w/lease")


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self):
        return MemoryStore()


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(str(tmp_path / "root"))

    def test_no_temporary_left_and_url_is_path(self, store, tmp_path):
        store.put("k/v", b"1")
        assert store.url("k/v") == str(tmp_path / "root" / "k" / "v")
        assert [p.name for p in (tmp_path / "root" / "k").iterdir()] == ["v"]

    def test_writer_temporaries_are_named_and_removed_by_token(self, store, tmp_path):
        folder = tmp_path / "root" / "k"
        store.put("k/v", b"1")
        for token in ("tok1", "tok2"):
            with pytest.raises(RuntimeError):
                with store.for_writer(token).open_writer("k/big") as f:
                    f.write(b"x")
                    # a killed writer leaves its temporary: keep a link to it before the
                    # failure below unlinks it
                    os.link(folder / f".tmp-{token}-big", folder / f".tmp-{token}-big2")
                    raise RuntimeError("killed")
        assert sorted(p.name for p in folder.iterdir()) == [".tmp-tok1-big2", ".tmp-tok2-big2", "v"]
        assert store.list("k/") == ["k/v"]  # listings hide temporaries
        assert store.local_path("k/v") == str(folder / "v")
        assert store.remove_temporaries("k", tokens=["tok1"]) == 1
        assert sorted(p.name for p in folder.iterdir()) == [".tmp-tok2-big2", "v"]
        assert store.remove_temporaries("k") == 1  # every writer's
        with pytest.raises(StorageError, match="letters and digits"):
            store.for_writer("../x")


    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("kind", ["fifo", "device", "loop", "through-a-file", "directory"])
    def test_what_is_not_a_file_is_refused_by_name_without_blocking(self, store, tmp_path, kind):
        # a FIFO would block open() forever and /dev/zero read until memory ran out; a
        # symlink loop or a failing disk is an OSError that no caller of a Store expects
        root = tmp_path / "root"
        root.mkdir()
        where = root / "obj"
        if kind == "fifo":
            os.mkfifo(where)
        elif kind == "device":
            try:
                os.mknod(where, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
            except PermissionError:
                pytest.skip("mknod needs privileges here")
        elif kind == "loop":
            os.symlink(where, where)
        elif kind == "directory":
            where.mkdir()
        else:
            (root / "f").write_bytes(b"x")
        key = "f/obj" if kind == "through-a-file" else "obj"
        missing = kind in ("through-a-file", "directory")
        err = ObjectNotFoundError if missing else StorageError
        buf = memoryview(bytearray(8))
        for call in (lambda: store.get(key), lambda: store.size(key), lambda: store.stat(key),
                     lambda: store.get_range(key, 0, 4), lambda: store.get_range_at(key, 0, 4, None),
                     lambda: store.readinto(key, buf)):
            with pytest.raises(err) as e:
                call()
            assert str(where if not missing else store.path(key)) in str(e.value)
        assert not store.exists(key)

class TestFsspecMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self):
        return FsspecStore(f"memory://t-{uuid.uuid4().hex[:8]}")


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store(self, s3):
        root, opts = s3
        return open_store(root, opts)

    def test_pickles_without_its_filesystem(self, store):
        store.put("p", b"1")
        clone = pickle.loads(pickle.dumps(store))
        assert clone._fs is None and clone.get("p") == b"1"


class TestFaultInjectingStore(StoreConformance):
    @pytest.fixture
    def store(self):
        return FaultInjectingStore(MemoryStore())

    def test_plan_is_per_key_and_in_order(self):
        s = FaultInjectingStore(MemoryStore(), errors=1, truncations=1, corruptions=1)
        s.put("k", b"abcdef")
        with pytest.raises(StorageError, match="SlowDown"):
            s.get("k")
        assert s.get("k") == b"abc"
        assert s.get("k") == bytes([ord("a") ^ 0xFF]) + b"bcdef"
        assert s.get("k") == b"abcdef"
        assert s.injected == {"503": 1, "truncate": 1, "corrupt": 1}


def test_url_helpers():
    assert split_url("s3://b/p/x.tar") == ("s3://b/p", "x.tar")
    assert split_url("/data/x.tar") == ("/data", "x.tar")
    assert join_url("s3://b/p/", "/x") == "s3://b/p/x"
    with pytest.raises(StorageError):
        split_url("s3://")
    assert isinstance(open_store("/tmp"), LocalStore)
    assert isinstance(open_store("memory://x"), FsspecStore)
    with pytest.raises(StorageError, match="no fsspec backend"):
        open_store("nosuchproto://x").exists("y")


def test_s3_get_tagged_rewritten_during_its_read_reads_the_new_version(s3):
    """s3fs takes the ETag with a HEAD and reads with If-Match on it: an object rewritten in
    between (another writer taking a lease over) must give that writer's bytes and tag,
    not a raw FileExpired StorageError."""
    root, opts = s3
    store = open_store(root, opts)
    store.put("k", b"one")
    real_open, rewritten = store.fs.open, []

    def racing_open(path, mode="rb", **kw):
        f = real_open(path, mode, **kw)  # the HEAD is made here
        if not rewritten:
            rewritten.append(open_store(root, opts).put_if("k", b"two", str(f.details["ETag"])))
        return f

    store.fs.open = racing_open
    data, tag = store.get_tagged("k")
    assert rewritten[0] is not None  # the rewrite really happened between HEAD and GET
    assert (data, tag) == (b"two", rewritten[0])


def test_s3_contenders_for_a_stale_lease_one_wins_the_others_are_busy(s3):
    import json
    import threading
    import time

    root, opts = s3
    for trial in range(3):
        key = f"l{trial}.lease"
        open_store(root, opts).put(key, json.dumps({"writer": "old", "heartbeat_unix": time.time() - 3600,
                                                    "ttl_s": 60}).encode())
        won, busy, other = [], [], []
        start = threading.Barrier(6)

        def contend(key=key, won=won, busy=busy, other=other, start=start):
            store = open_store(root, opts)
            lease = WriterLease(store, key)
            store.fs  # noqa: B018 - the filesystem is made before the race starts
            start.wait()
            try:
                won.append(lease.acquire())
            except LeaseBusyError:
                busy.append(lease)
            except Exception as e:  # any other outcome fails the test below
                other.append(e)

        threads = [threading.Thread(target=contend) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert (len(won), len(busy), other) == (1, 5, [])
        won[0].release()


def test_a_retried_call_without_a_pool_abandons_an_attempt_after_its_timeout():
    """call_with_retry(pool=None) (the loader's index and shard reads) bounds each attempt
    by attempt_timeout_s like the pooled path does: a request that never answers is
    abandoned and retried, never waited on."""
    import threading
    import time

    from datapipe.storage.retry import RetryPolicy, call_with_retry

    release, calls = threading.Event(), []

    def stalls_once():
        calls.append(1)
        if len(calls) == 1:
            release.wait(30)  # a server that accepts and never answers
        return b"ok"

    policy = RetryPolicy(attempts=2, base_delay_s=0.001, attempt_timeout_s=0.3, deadline_s=20)
    t0 = time.monotonic()
    try:
        assert call_with_retry(stalls_once, "s3://b/x (test)", policy) == b"ok"
        assert time.monotonic() - t0 < 10 and len(calls) == 2
    finally:
        release.set()


def test_attempts_without_a_pool_reuse_their_threads_and_a_hung_one_holds_only_its_own():
    """call_with_retry(pool=None) runs each attempt on a reused daemon thread (starting one
    for each read cost more than reading a local file): many calls in turn add at most one
    thread; an attempt that hangs holds its thread only, and the next call runs on another;
    a forked child runs its attempts on threads of its own."""
    import multiprocessing
    import threading

    from datapipe.storage.retry import RetryPolicy, call_with_retry

    policy = RetryPolicy(attempts=1, attempt_timeout_s=60)

    def attempt_threads():
        return {t.ident for t in threading.enumerate() if t.name == "datapipe-attempt"}

    before = attempt_threads()
    ran = {call_with_retry(threading.get_ident, "t (test)", policy) for _ in range(20)}
    assert threading.get_ident() not in ran and len(attempt_threads() - before) <= 1
    assert ran <= attempt_threads()

    gate, hung, results = threading.Event(), [], []

    def hangs():
        hung.append(threading.get_ident())
        gate.wait(60)
        return "late"

    caller = threading.Thread(target=lambda: results.append(call_with_retry(hangs, "t (test)", policy)))
    caller.start()
    try:
        while not hung:
            gate.wait(0.01)
        assert call_with_retry(threading.get_ident, "t (test)", policy) != hung[0]
    finally:
        gate.set()
        caller.join(60)
    assert results == ["late"]

    ctx = multiprocessing.get_context("fork")
    q = ctx.SimpleQueue()
    child = ctx.Process(target=lambda: q.put(call_with_retry(lambda: "from the child", "t (test)", policy)))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and q.get() == "from the child"


def test_a_lease_released_between_create_and_read_is_taken_at_once():
    """The create (If-None-Match) finds the holder's lease, which is released before it is
    read: the contender tries again at once instead of reporting an unreadable holder."""

    class ReleasedInBetween(MemoryStore):
        supports_conditional_writes = True
        raced = False

        def get_tagged(self, key):
            return self.get(key), str(self.stat(key)[1])

        def put_if(self, key, data, match):
            with self._lock:
                cur, gen = self._objects.get(key), str(self._generation.get(key))
                if (match is None and cur is not None) or (match is not None and match != gen):
                    if not self.raced:  # the holder releases right after our create failed
                        self.raced = True
                        self._objects.pop(key, None)
                    return None
                self._objects[key] = bytes(data)
                self._generation[key] = self._generation.get(key, 0) + 1
                return str(self._generation[key])

    store = ReleasedInBetween()
    store.put("w.lease", b'{"writer": "holder"}')
    lease = WriterLease(store, "w.lease", ttl=60)
    assert lease.acquire() is lease and store.raced
    lease.release()
