"""The shared tier: "nodes" (spawned processes, each with its own local dir) share one
directory over moto's S3 on loopback; exactly one cold GET per object, byte-exact reads,
local budgets kept, a killed or frozen download's lease taken over, nothing partial served."""

import functools
import json
import multiprocessing as mp
import os
import shutil
import signal
import time
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.cache import TieredCache, cache_report, shared_dir_stats
from datapipe.cache.shared import SharedDir
from datapipe.cache.warm import WarmDir, url_key
from datapipe.checksum import checksum
from datapipe.errors import CacheBudgetError, OptionError
from datapipe.storage import open_store
from datapipe.storage.faults import FaultInjectingStore
from datapipe.storage.lease import SharedFileLease

CTX = mp.get_context("spawn")


class CountingStore(FaultInjectingStore):
    """Appends one line per GET request (whole or ranged) to ``log``: the count across
    processes comes from the requests themselves, not from the cache's counters."""

    def __init__(self, inner, *, log, **faults):
        super().__init__(inner, **faults)
        self.log = log

    def _fault(self, key):
        with open(self.log, "a") as f:
            f.write(key + "\n")
        return super()._fault(key)


def _gets(log):
    try:
        with open(log) as f:
            return [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _put_blobs(s3, n, size):
    root, opts = s3
    store = open_store(root, opts)
    blobs = {}
    for i in range(n):
        data = os.urandom(size + i)
        store.put(f"ds/shard-{i:03d}.tar", data)
        blobs[f"{root}/ds/shard-{i:03d}.tar"] = data
    return blobs


def _put(s3, n, size):
    return {u: checksum(b) for u, b in _put_blobs(s3, n, size).items()}


def _node_cache(tmp_path, node, s3, log, *, warm_bytes=4 << 20, shared_bytes=64 << 20, **kw):
    return TieredCache(warm_dir=tmp_path / f"node{node}", warm_bytes=warm_bytes,
                       shared_dir=tmp_path / "shared", shared_bytes=shared_bytes, storage_options=s3[1],
                       cold_wrapper=functools.partial(CountingStore, log=str(log)), **kw)


def _node(cache, sums, order_seed, barrier, q):
    """One node: read every object twice in its own order; report what was wrong."""
    import random

    try:
        barrier.wait(60)
        urls = sorted(sums)
        bad = []
        peak = 0
        local = WarmDir(cache.warm_dir, cache.warm_bytes)
        for _ in range(2):
            random.Random(order_seed).shuffle(urls)
            for u in urls:
                if checksum(cache.read(u)) != sums[u]:
                    bad.append(u)
                peak = max(peak, local.usage())
        q.put((bad, peak, cache.stats()))
    except BaseException as e:  # report instead of dying silently
        q.put(([repr(e)], 0, {}))


def test_nodes_share_one_cold_get_per_object(tmp_path, s3):
    n_nodes, n_objects, size = 4, 6, 150_000
    sums = _put(s3, n_objects, size)
    log = tmp_path / "gets.log"
    warm_bytes = 3 * (size + n_objects)  # half the data: local evictions happen
    caches = [_node_cache(tmp_path, i, s3, log, warm_bytes=warm_bytes) for i in range(n_nodes)]
    barrier, q = CTX.Barrier(n_nodes), CTX.Queue()
    procs = [CTX.Process(target=_node, args=(c, sums, i, barrier, q)) for i, c in enumerate(caches)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert [bad for bad, _, _ in results] == [[]] * n_nodes
    gets = _gets(log)
    assert len(gets) == n_objects and len(set(gets)) == n_objects  # one GET per object, all nodes
    assert all(0 < peak <= warm_bytes for _, peak, _ in results)  # sampled after each read
    stats = [s for _, _, s in results]
    assert sum(s["shared_fills"] for s in stats) == n_objects
    assert sum(s["cold_reads"] for s in stats) == n_objects
    assert sum(s["warm_from_cold"] for s in stats) == n_objects
    assert sum(s["warm_from_shared"] for s in stats) == sum(s["shared_hits"] for s in stats) > 0
    assert sum(s["warm_evictions"] for s in stats) > 0
    ledger = os.listdir(tmp_path / "shared" / "gets")
    assert len(ledger) == n_objects and len({n.rsplit(".", 1)[0] for n in ledger}) == n_objects


def test_second_node_reads_the_shared_copy_not_cold(tmp_path, s3):
    sums = _put(s3, 3, 50_000)
    log = tmp_path / "gets.log"
    a, b = (_node_cache(tmp_path, i, s3, log) for i in (0, 1))
    for u, s in sums.items():
        assert checksum(a.read(u)) == s
    for u, s in sums.items():
        assert checksum(b.read(u)) == s
    assert len(_gets(log)) == 3
    sb = b.stats()
    assert (sb["shared_hits"], sb["cold_reads"], sb["warm_from_shared"]) == (3, 0, 3)
    assert sb["shared_used_bytes"] == sum(50_000 + i for i in range(3))
    # a node without a local dir reads the shared tier too
    c = TieredCache(hot_bytes=1 << 20, shared_dir=tmp_path / "shared", shared_bytes=64 << 20,
                    storage_options=s3[1], cold_wrapper=functools.partial(CountingStore, log=str(log)))
    assert all(checksum(c.read(u)) == s for u, s in sums.items())
    assert c.stats()["hot_from_shared"] == 3 and len(_gets(log)) == 3
    for x in (a, b, c):
        x.close()


def test_constructor_keeps_the_two_tier_form_and_checks_the_shared_one(tmp_path):
    two = TieredCache(1 << 20, tmp_path / "w", 1 << 20)
    assert two.shared_dir is None and two.shared_bytes == 0
    with pytest.raises(CacheBudgetError, match="shared_bytes > 0"):
        TieredCache(warm_dir=tmp_path / "w", warm_bytes=1, shared_dir=tmp_path / "s")
    with pytest.raises(CacheBudgetError, match="without shared_dir"):
        TieredCache(shared_bytes=5)
    with pytest.raises(ValueError, match="lease_timeout_s"):
        TieredCache(shared_dir=tmp_path / "s", shared_bytes=5, lease_timeout_s=0)


# -- a holder that dies or freezes mid-download -------------------------------------------
def _slow_node(cache, url):
    cache.read(url)


def _wait_for_download(shared, url, log, timeout=60):
    """Until the holder has its lease, its temporary file and its GET under way."""
    lease = shared / "leases" / url_key(url)

    def started():
        return lease.exists() and os.listdir(shared / "tmp") and _gets(log)

    deadline = time.monotonic() + timeout
    while not started() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started(), "the download never started"


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_holder_is_taken_over_and_nothing_partial_served(tmp_path, s3, how):
    """SIGKILL: the holder's pid is gone (same host), taken over at once. SIGSTOP: alive but
    silent (as a host that vanished looks), taken over once its heartbeat is
    ``lease_timeout_s`` old. Either way the other node reads the object whole, once."""
    sums = _put(s3, 1, 300_000)
    url = next(iter(sums))
    shared = tmp_path / "shared"
    log = tmp_path / "gets.log"
    slow = TieredCache(warm_dir=tmp_path / "node0", warm_bytes=1 << 20, shared_dir=shared,
                       shared_bytes=1 << 20, storage_options=s3[1], lease_timeout_s=1.0,
                       cold_wrapper=functools.partial(CountingStore, log=str(log), delays=1, delay_s=60))
    p = CTX.Process(target=_slow_node, args=(slow, url))
    p.start()
    try:
        _wait_for_download(shared, url, log)
        os.kill(p.pid, getattr(signal, how))
        assert not (shared / "objects" / url_key(url)).exists()  # nothing published yet
        other = _node_cache(tmp_path, 1, s3, log, lease_timeout_s=1.0, shared_wait_s=120)
        assert checksum(other.read(url)) == sums[url]
        s = other.stats()
        assert s["shared_takeovers"] == 1 and s["shared_fills"] == 1 and s["shared_read_around"] == 0
        assert s["shared_corrupt"] == 0
        # the dead writer's sized temporary file was removed, the published copy is whole
        assert os.listdir(shared / "tmp") == []
        assert checksum((shared / "objects" / url_key(url)).read_bytes()) == sums[url]
        assert len(_gets(log)) == 2  # the dead holder's unanswered GET, and ours
        other.close()
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)


def test_partial_and_planted_files_in_the_shared_dir_are_never_served(tmp_path, s3):
    sums = _put(s3, 2, 80_000)
    (u1, s1), (u2, s2) = sorted(sums.items())
    shared = tmp_path / "shared"
    SharedDir(str(shared), 1 << 20)
    k1, k2 = url_key(u1), url_key(u2)
    # a dead writer's sized temporary file, and a copy without a record
    (shared / "tmp" / f"{k1}.deadwriter").write_bytes(b"\0" * 80_000)
    (shared / "objects" / k1).write_bytes(b"x" * 80_000)
    # a copy whose record says another digest (torn, or of another version)
    (shared / "objects" / k2).write_bytes(b"y" * 80_001)
    (shared / "records" / k2).write_text(json.dumps({"size": 80_001, "digest": checksum(b"y" * 80_001)[:-1] + "0"}))
    log = tmp_path / "gets.log"
    c = _node_cache(tmp_path, 0, s3, log, warm_bytes=1 << 20, shared_bytes=1 << 20)
    assert checksum(c.read(u1)) == s1 and checksum(c.read(u2)) == s2
    s = c.stats()
    assert s["shared_corrupt"] == 2 and s["shared_fills"] == 2 and s["shared_hits"] == 0
    assert checksum((shared / "objects" / k1).read_bytes()) == s1
    assert not (shared / "tmp" / f"{k1}.deadwriter").exists() and s["shared_tmp_cleaned"] == 1
    c.close()


# -- lease files ----------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=300) | st.text(max_size=200).map(str.encode)
       | st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4).map(
           lambda d: json.dumps(d).encode()))
def test_a_lease_file_with_garbage_is_taken_over_once_silent(tmp_path, junk):
    path = tmp_path / f"lease-{checksum(junk)}"
    path.write_bytes(junk)
    lease = SharedFileLease(str(path), timeout_s=0.05)
    rounds = 0
    while not lease.try_acquire():
        rounds += 1
        assert rounds < 200, "a silent lease was never taken over"
        time.sleep(0.01)
    assert lease.held and lease.still_held()
    doc = json.loads(path.read_bytes())
    assert doc["writer"] == lease.writer
    second = SharedFileLease(str(path), timeout_s=0.05)
    assert not second.try_acquire()  # while the heartbeat runs, it is not silent...
    time.sleep(0.06)
    assert not second.try_acquire()  # ...however long a waiter watches
    lease.release()
    assert not path.exists()
    assert second.try_acquire()
    second.release()


def test_a_lease_that_is_not_a_file_is_refused_by_name(tmp_path):
    from datapipe.errors import StorageError

    (tmp_path / "target").write_text("x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(StorageError, match="symbolic link"):
        SharedFileLease(str(tmp_path / "link"), timeout_s=1).try_acquire()
    (tmp_path / "dir").mkdir()
    with pytest.raises(StorageError, match="not a regular file"):
        SharedFileLease(str(tmp_path / "dir"), timeout_s=1).try_acquire()
    assert (tmp_path / "target").read_text() == "x"


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "datapipe.cli", "cache", *map(str, args)],
                          capture_output=True, text=True, check=True).stdout


def test_cache_stats_shows_each_tier_and_cold_gets_per_object(tmp_path, s3):
    sums = _put(s3, 4, 30_000)
    log = tmp_path / "gets.log"
    nodes = [_node_cache(tmp_path, i, s3, log) for i in range(2)]
    for c in nodes:
        for u, s in sums.items():
            assert checksum(c.read(u)) == s
        c.close()  # its counters land in its local dir
    local = [tmp_path / "node0", tmp_path / "node1"]
    report = json.loads(_cli("stats", *local, tmp_path / "shared"))
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert tiers["local"]["fills"] == 8 and tiers["local"]["fills_from"] == {"shared": 4, "cold": 4}
    assert tiers["local"]["budget_bytes"] == 2 * (4 << 20)
    assert (tiers["shared"]["hits"], tiers["shared"]["misses"], tiers["shared"]["fills"]) == (4, 4, 4)
    assert tiers["shared"]["bytes"] == sum(30_000 + i for i in range(4)) and tiers["shared"]["budget_bytes"] == 64 << 20
    assert tiers["cold"]["gets"] == 4 and tiers["cold"]["gets_per_object"] == 1.0
    assert tiers["cold"]["gets_per_object_max"] == 1
    assert [d["tier"] for d in report["dirs"]] == ["local", "local", "shared"]
    one = cache_report([local[0]])  # what `stats DIR` prints for one directory, with its tiers
    assert one["dirs"][0]["counters"]["warm_fills"] == 4
    assert one["tiers"][1]["fills_from"] == {"shared": 0, "cold": 4}
    table = _cli("stats", "--table", *local, tmp_path / "shared")
    assert "shared" in table and "takeovers 0" in table
    assert "removed 4 cached objects" in _cli("clear", tmp_path / "shared")
    assert shared_dir_stats(str(tmp_path / "shared"))["objects"] == 0


def _read_forever(cache, urls, seed):
    import random

    rng = random.Random(seed)
    while True:
        cache.read(rng.choice(urls))


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_any_moment_leaves_only_whole_copies(tmp_path, s3, seed):
    """A node reading, filling and evicting in both directory tiers is killed at a moment
    chosen by ``seed``: every copy left published in either tier is whole and right, and
    the next node reads every object exactly, unblocked by the dead node's leases."""
    import random

    blobs = _put_blobs(s3, 6, 40_000)
    sums = {u: checksum(b) for u, b in blobs.items()}
    log = tmp_path / "gets.log"
    victim = _node_cache(tmp_path, 0, s3, log, warm_bytes=2 * 40_010, shared_bytes=4 * 40_010)
    p = CTX.Process(target=_read_forever, args=(victim, sorted(sums), seed))
    p.start()
    deadline = time.monotonic() + 60
    while len(_gets(log)) < 3 and time.monotonic() < deadline:  # under way: fills and evictions
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0.0, 0.3))
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    by_key = {url_key(u): b for u, b in blobs.items()}
    for tier in (tmp_path / "node0", tmp_path / "shared"):
        for name in os.listdir(tier / "objects"):
            assert (tier / "objects" / name).read_bytes() == by_key[name], f"{tier.name}: {name} is not whole"
    after = _node_cache(tmp_path, 1, s3, log, warm_bytes=2 * 40_010, shared_bytes=4 * 40_010)
    for u, s in sums.items():
        assert checksum(after.read(u)) == s
    assert after.stats()["shared_read_around"] == 0
    after.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=st.binary(max_size=120) | st.fixed_dictionaries(
    {"size": st.integers(-5, 10**6) | st.text(max_size=4) | st.none(), "digest": st.text(max_size=20) | st.integers()}
).map(lambda d: json.dumps(d).encode()), planted=st.binary(max_size=3000))
def test_a_shared_copy_with_a_garbage_record_is_never_served(tmp_path, record, planted):
    case = tmp_path / os.urandom(8).hex()  # hypothesis may replay an example
    cold = case / "cold"
    cold.mkdir(parents=True)
    data = os.urandom(2000)
    (cold / "x.tar").write_bytes(data)
    url = str(cold / "x.tar")
    shared = case / "shared"
    SharedDir(str(shared), 1 << 20)
    (shared / "objects" / url_key(url)).write_bytes(planted)
    (shared / "records" / url_key(url)).write_bytes(record)
    c = TieredCache(shared_dir=shared, shared_bytes=1 << 20)
    assert c.read(url) == data
    c.close()


# -- more than one node-local directory ---------------------------------------------------
def test_a_second_local_dir_fills_from_below_and_serves_what_the_first_evicted(tmp_path):
    from datapipe.cache import CacheTier as Tier

    cold = tmp_path / "cold"
    cold.mkdir()
    blobs = {}
    for i in range(6):
        (cold / f"s{i}.tar").write_bytes(data := os.urandom(10_000 + i))
        blobs[str(cold / f"s{i}.tar")] = data
    fast, big = tmp_path / "nvme", tmp_path / "disk"
    c = TieredCache(warm_dir=fast, warm_bytes=2 * 10_010, local_tiers=[Tier(big, 6 * 10_010)],
                    shared_dir=tmp_path / "shared", shared_bytes=1 << 20)
    peaks = [0, 0]
    for _ in range(2):
        for u, data in blobs.items():
            assert c.read(u) == data
            peaks = [max(peaks[0], WarmDir(str(fast), 1).usage()), max(peaks[1], WarmDir(str(big), 1).usage())]
    s = c.stats()
    # first pass: each object came up from cold (filling shared on the way), then local2, warm
    assert (s["shared_fills"], s["local2_from_cold"], s["local2_fills"]) == (6, 6, 6)
    # second pass: warm (room for two) misses everything; local2 holds all six
    assert s["warm_from_local2"] == 12 and s["local2_hits"] == 6 and s["cold_reads"] == 6
    assert peaks[0] <= 2 * 10_010 and peaks[1] <= 6 * 10_010
    assert s["local2_budget_bytes"] == 6 * 10_010 and s["local2_used_bytes"] == sum(map(len, blobs.values()))
    c.close()
    tiers = {t["tier"]: t for t in cache_report([str(fast)])["tiers"]}
    assert tiers["local"]["fills_from"] == {"shared": 0, "cold": 0, "local2": 12}
    assert tiers["local2"]["hits"] == 6 and tiers["local2"]["fills_from"]["cold"] == 6


def test_local_tiers_are_checked(tmp_path):
    from datapipe.cache import CacheTier as Tier

    with pytest.raises(CacheBudgetError, match="bytes > 0"):
        TieredCache(warm_dir=tmp_path / "a", warm_bytes=1, local_tiers=[Tier(tmp_path / "b", 0)])
    with pytest.raises(CacheBudgetError, match="below warm_dir"):
        TieredCache(local_tiers=[Tier(tmp_path / "b", 10)])
    with pytest.raises(OptionError, match="Tier"):  # a bad argument: OptionError, not a raw TypeError
        TieredCache(warm_dir=tmp_path / "a", warm_bytes=1, local_tiers=[(tmp_path / "b", 10)])


def test_a_shared_dir_deleted_under_us_is_rebuilt_and_fills_again(tmp_path):
    # found by review: the warm directory's repair left out the lease, record and GET
    # folders, so after the shared dir was deleted every miss read cold, for good
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(3):
        (cold / f"o{i}.bin").write_bytes(bytes([i]) * 1000)
        urls.append(str(cold / f"o{i}.bin"))
    shared = tmp_path / "shared"
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, shared_dir=shared, shared_bytes=1 << 20)
    assert c.read(urls[0]) == bytes([0]) * 1000
    shutil.rmtree(shared)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the broken tier may warn once before it is rebuilt
        assert c.read(urls[1]) == bytes([1]) * 1000
    assert c.read(urls[2]) == bytes([2]) * 1000
    st = c.stats()
    assert st["shared_fills"] >= 2, st  # o1 may be read around while the tier is rebuilt, o2 is not
    assert {"leases", "records", "gets", "objects"} <= set(os.listdir(shared))
    c.close()


def test_a_live_holder_in_another_pid_namespace_is_not_taken_over(tmp_path):
    # found by review: same hostname, a pid that means nothing here (a container with the
    # host's network has its own pid namespace): the heartbeat decides, not os.kill
    from datapipe.storage.lease import SharedFileLease, holder_here_fields

    path = str(tmp_path / "k")
    other_ns = {**holder_here_fields(), "pid_ns": "pid:[1]"}
    with open(path, "w") as f:
        json.dump({"writer": "w", **other_ns, "pid": 4_000_000, "timeout_s": 30}, f)
    lease = SharedFileLease(path, timeout_s=30)
    assert lease.try_acquire() is False and lease.takeovers == 0
    # the same document from this namespace, its pid gone: taken over at once
    with open(path, "w") as f:
        json.dump({"writer": "w", **holder_here_fields(), "pid": 4_000_000, "timeout_s": 30}, f)
    lease2 = SharedFileLease(path, timeout_s=30)
    assert lease2.try_acquire() is True and lease2.takeovers == 1
    lease2.release()


def test_a_holder_that_is_a_zombie_here_is_taken_over_at_once(tmp_path):
    # found by the cluster benchmark: where pid 1 reaps nothing, a SIGKILLed holder stays a
    # zombie and kill(pid, 0) succeeds; its lease must not wait for the timeout
    import subprocess
    import sys

    from datapipe.storage.lease import holder_here_fields

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # exited, not reaped: a zombie until wait()
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[0] == b"Z":
                break
        time.sleep(0.01)
    try:
        path = str(tmp_path / "k")
        with open(path, "w") as f:
            json.dump({"writer": "w", **holder_here_fields(), "pid": child.pid, "timeout_s": 30}, f)
        lease = SharedFileLease(path, timeout_s=30)
        assert lease.try_acquire() is True and lease.takeovers == 1
        lease.release()
    finally:
        child.wait()


@pytest.mark.parametrize("tier", ["warm_dir", "shared_dir"])
def test_a_folder_of_someone_elses_files_is_refused_untouched(tmp_path, tier):
    # a cache cleans its temporaries and evicts its copies: pointed at a folder it did
    # not make, it would delete the files there; it refuses the folder instead
    from datapipe.errors import StorageError

    src = tmp_path / "obj.bin"
    src.write_bytes(b"x" * 1000)
    mine = tmp_path / "mine"
    for rel, data in (("tmp/draft.txt", b"draft"), ("objects/model.pt", b"weights"), ("meta.json", b"{}")):
        (mine / rel).parent.mkdir(parents=True, exist_ok=True)
        (mine / rel).write_bytes(data)
    before = {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()}
    kw = {"warm_dir": mine, "warm_bytes": 1500} if tier == "warm_dir" else {"shared_dir": mine, "shared_bytes": 1500}
    with pytest.raises(StorageError, match="did not write"):
        TieredCache(**kw).read(str(src))
    assert {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()} == before
    # an empty folder, or one a cache made, is used
    empty = tmp_path / "empty"
    empty.mkdir()
    kw = {"warm_dir": empty, "warm_bytes": 1500} if tier == "warm_dir" else {"shared_dir": empty, "shared_bytes": 1500}
    for _ in range(2):
        c = TieredCache(**kw)
        assert c.read(str(src)) == b"x" * 1000
        c.close()


def test_a_range_of_a_warm_copy_damaged_in_place_is_read_again_from_below(tmp_path):
    # the same rule as read(): a copy is trusted once verified whole while its identity
    # holds; one written into in place (same size, same fill record) is refused
    src = tmp_path / "obj.bin"
    good = bytes(range(256)) * 16
    src.write_bytes(good)
    warm = tmp_path / "warm"
    filler = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    filler.read(str(src))
    filler.close()
    with open(warm / "objects" / url_key(str(src)), "r+b") as f:
        f.write(b"\xff" * 16)
    reader = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    assert reader.read_range(str(src), 0, 16) == good[:16]
    assert reader.read_range(str(src), 100, 300) == good[100:300]  # the copy filled again: a hit
    stats = reader.stats()
    assert stats["warm_corrupt"] == 1 and stats["warm_hits"] == 1
    reader.close()
