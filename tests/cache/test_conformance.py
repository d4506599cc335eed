"""What the cache promises when the world changes under it, run against each cold tier:
an object rewritten during its download, a warm copy changed in place, a warm directory
that vanishes or goes read-only, and things planted in the warm directory."""

import functools
import os
import shutil
import subprocess
import sys
import threading
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.cache import TieredCache
from datapipe.cache.warm import url_key
from datapipe.checksum import checksum
from datapipe.errors import CacheBudgetError, ObjectChangedError, StorageError
from datapipe.storage import LocalStore, RetryPolicy, open_store
from datapipe.storage.faults import FaultInjectingStore

PARTS = RetryPolicy(attempts=3, base_delay_s=0.001, part_bytes=16 << 10, max_parts=1)
SIZE = 64 << 10  # four parts


@pytest.fixture(params=["local", "s3"])
def cold(request, tmp_path):
    """(root URL, storage_options) of a cold tier: a local directory or moto S3."""
    if request.param == "local":
        d = tmp_path / "cold"
        d.mkdir()
        return str(d), {}
    root, opts = request.getfixturevalue("s3")
    return root, opts


def _put(root, opts, name, data):
    store = open_store(root, opts)
    store.put(name, data)
    if isinstance(store, LocalStore):
        # A rewrite within the same clock tick as the first write would keep its mtime;
        # real objects are not read within milliseconds of being written.
        os.utime(store.path(name), ns=(10**18, 10**18))
    return f"{root}/{name}"


class Rewriter(FaultInjectingStore):
    """A cold store whose object is rewritten (really, in the store under it) after each of
    the first ``times`` part reads: what another writer does during a long download."""

    def __init__(self, inner, *, versions, times=1, in_place=False):
        super().__init__(inner)
        self.versions, self.times, self.in_place, self.done = versions, times, in_place, 0

    def _after_read(self, key):
        if self.done < self.times:
            data = self.versions[self.done % len(self.versions)]
            self.done += 1
            if self.in_place and isinstance(self.inner, LocalStore):
                with open(self.inner.path(key), "r+b") as f:  # same inode, same size
                    f.write(data)
            else:
                self.inner.put(key, data)

    def get_range(self, key, start, end):
        data = super().get_range(key, start, end)
        self._after_read(key)
        return data

    def get_range_at(self, key, start, end, version):
        data = super().get_range_at(key, start, end, version)
        self._after_read(key)
        return data


# -- object changes during download ------------------------------------------------------
@pytest.mark.parametrize("in_place", [False, True])
def test_object_changes_during_download_never_mixes(tmp_path, cold, in_place):
    root, opts = cold
    old, new = b"O" * SIZE, b"N" * SIZE
    url = _put(root, opts, "s.tar", old)
    wrap = functools.partial(Rewriter, versions=[new], in_place=in_place)
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts,
                        retry=PARTS, cold_wrapper=wrap)
    data = cache.read(url)
    assert data == new  # restarted on the new version: never O...N
    assert cache.stats()["cold_changed"] >= 1
    fresh = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts)
    assert fresh.read(url) == new  # what was published is one version too
    cache.close()
    fresh.close()


def test_concurrent_overwrites_on_s3_never_yield_mixed_bytes(tmp_path, s3):
    """A writer overwrites the object in a loop while readers download it in parallel
    parts: each read is one whole version, or a named error when it kept changing."""
    root, opts = s3
    versions = [bytes([65 + i]) * SIZE for i in range(4)]
    url = _put(root, opts, "s.tar", versions[0])
    store = open_store(root, opts)
    done = threading.Event()

    def overwrite():
        i = 0
        while not done.wait(0.005):  # a rewrite every few ms, as a busy writer would
            i += 1
            store.put("s.tar", versions[i % len(versions)])

    writer = threading.Thread(target=overwrite, daemon=True)
    writer.start()
    seen = []
    try:
        for n in range(4):
            c = TieredCache(warm_dir=tmp_path / f"w{n}", warm_bytes=1 << 20, storage_options=opts,
                            retry=RetryPolicy(attempts=3, base_delay_s=0.001, part_bytes=8 << 10))
            try:
                data = c.read(url)
                assert data in versions, "a mix of versions was served"
                seen.append(data[:1])
            except ObjectChangedError:
                seen.append(None)
            finally:
                c.close()
    finally:
        done.set()
        writer.join()
    assert len(seen) == 4


def test_object_that_keeps_changing_is_a_named_error_and_nothing_is_published(tmp_path, cold):
    root, opts = cold
    url = _put(root, opts, "s.tar", b"0" * SIZE)
    versions = [bytes([65 + i]) * SIZE for i in range(26)]
    wrap = functools.partial(Rewriter, versions=versions, times=10**6)
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts,
                        retry=PARTS, cold_wrapper=wrap)
    with pytest.raises(ObjectChangedError, match=r"s\.tar.*changed"):
        cache.read(url)
    with pytest.raises(ObjectChangedError):
        cache.local_path(url)
    assert os.listdir(tmp_path / "warm" / "objects") == []
    assert os.listdir(tmp_path / "warm" / "tmp") == []
    cache.close()


def test_a_size_change_is_probed_again_not_failed_forever(tmp_path, cold):
    root, opts = cold
    url = _put(root, opts, "s.tar", b"a" * 1000)
    no_tiers = TieredCache(storage_options=opts)
    warm = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts)
    assert no_tiers.read(url) == b"a" * 1000 and warm.read(url) == b"a" * 1000
    for size in (3000, 500):
        _put(root, opts, "s.tar", b"b" * size)
        os.unlink(tmp_path / "warm" / "objects" / url_key(url))  # the old copy goes
        assert no_tiers.read(url) == b"b" * size
        assert warm.read(url) == b"b" * size
        assert no_tiers.read_range(url, 0, 10) == b"b" * 10
    no_tiers.close()
    warm.close()


# -- warm copy changed in place ----------------------------------------------------------
def _flip(path, at=100):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("cold", ["local"], indirect=True)  # the warm side: any cold tier
def test_warm_copy_changed_in_place_after_a_verified_hit(tmp_path, cold):
    root, opts = cold
    data = os.urandom(SIZE)
    url = _put(root, opts, "s.tar", data)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts)
    ck = checksum(data)
    assert c.read(url, checksum=ck) == data
    assert c.read(url, checksum=ck) == data  # a verified hit
    copy = tmp_path / "warm" / "objects" / url_key(url)
    _flip(copy)
    assert c.read(url, checksum=ck) == data
    assert c.stats()["warm_corrupt"] == 1
    with c.pinned(url, checksum=ck) as path:
        assert open(path, "rb").read() == data
    _flip(copy)
    with c.pinned(url, checksum=ck) as path:  # local_path verifies again too
        assert open(path, "rb").read() == data
    assert c.stats()["warm_corrupt"] == 2
    c.close()


@pytest.mark.parametrize("cold", ["local"], indirect=True)  # the warm side: any cold tier
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_warm_copy_without_a_checksum_is_checked_against_its_fill(tmp_path, cold, damage):
    root, opts = cold
    data = os.urandom(SIZE)
    url = _put(root, opts, "s.tar", data)
    filler = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=opts)
    assert filler.read(url) == data
    filler.close()
    copy = tmp_path / "warm" / "objects" / url_key(url)
    if damage == "truncate":
        os.truncate(copy, SIZE // 2)
    elif damage == "flip":
        _flip(copy, SIZE - 1)
    else:
        with open(copy, "ab") as f:
            f.write(b"x")
    # a fresh process: nothing remembered but what the copy itself records
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_READ, str(tmp_path / "warm"), url, repr(opts)],
        capture_output=True, env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout == data
    assert open(copy, "rb").read() == data  # refilled


DAMAGE = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 4095)),
    st.tuples(st.just("flip"), st.integers(0, 4095), st.integers(1, 255)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("rewrite"), st.binary(max_size=8192)),  # in place, any length
    st.tuples(st.just("replace"), st.binary(max_size=8192)),  # another file renamed over it
)


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=DAMAGE, with_checksum=st.booleans())
def test_no_damage_to_a_warm_copy_is_ever_served(tmp_path_factory, damage, with_checksum):
    base = tmp_path_factory.mktemp("dmg")
    data = os.urandom(4096)
    (base / "cold").mkdir()
    url = _put(str(base / "cold"), {}, "s.tar", data)
    ck = checksum(data) if with_checksum else None
    seen = TieredCache(warm_dir=base / "warm", warm_bytes=1 << 20)
    assert seen.read(url, checksum=ck) == data and seen.read(url, checksum=ck) == data
    copy = base / "warm" / "objects" / url_key(url)
    kind, *args = damage
    if kind == "truncate":
        os.truncate(copy, args[0])
    elif kind == "flip":
        with open(copy, "r+b") as f:
            f.seek(args[0])
            b = f.read(1)[0]
            f.seek(args[0])
            f.write(bytes([b ^ args[1]]))
    elif kind == "append":
        with open(copy, "ab") as f:
            f.write(args[0])
    elif kind == "rewrite":
        with open(copy, "r+b") as f:
            f.write(args[0])
            f.truncate(len(args[0]))
    else:
        (base / "other").write_bytes(args[0])
        os.replace(base / "other", copy)
    fresh = TieredCache(warm_dir=base / "warm", warm_bytes=1 << 20)  # remembers nothing
    for c in (seen, fresh):
        assert c.read(url, checksum=ck) == data
        with c.pinned(url, checksum=ck) as path:
            assert open(path, "rb").read() == data
    seen.close()
    fresh.close()


_FRESH_READ = """
import ast, sys
from datapipe.cache import TieredCache
c = TieredCache(warm_dir=sys.argv[1], warm_bytes=1 << 20, storage_options=ast.literal_eval(sys.argv[3]))
data = c.read(sys.argv[2])
s = c.stats()
assert s["warm_corrupt"] == 1 and s["cold_reads"] == 1, s
sys.stdout.buffer.write(data)
"""


# -- warm dir vanishes / goes read-only ---------------------------------------------------
@pytest.mark.parametrize("cold", ["local"], indirect=True)  # the warm side: any cold tier
def test_warm_dir_deleted_under_an_open_cache_is_recreated(tmp_path, cold):
    root, opts = cold
    blobs = {_put(root, opts, f"s{i}.tar", os.urandom(5000)): None for i in range(4)}
    urls = list(blobs)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, storage_options=opts)
    want = {u: open_store(root, opts).get(u.rsplit("/", 1)[1]) for u in urls}
    assert c.read(urls[0]) == want[urls[0]]
    shutil.rmtree(warm)
    with pytest.warns(RuntimeWarning, match="warm cache") as caught:
        assert c.read(urls[1]) == want[urls[1]]
        assert c.read_range(urls[2], 10, 20) == want[urls[2]][10:20]
        with c.pinned(urls[3]) as path:
            assert open(path, "rb").read() == want[urls[3]]
        assert c.read(urls[0]) == want[urls[0]]
        s = c.stats()
        c.stats(node=True)
    assert len([w for w in caught if "warm cache" in str(w.message)]) == 1  # warned once
    assert s["warm_errors"] >= 1
    assert os.path.isdir(warm / "objects") and len(os.listdir(warm / "objects")) >= 1
    c.close()


@pytest.fixture
def ro_mount(tmpfs):
    """A tmpfs we can remount read-only (root: chmod does not stop root's writes)."""
    mnt = tmpfs("8m")
    return mnt.path, mnt.remount


@pytest.mark.parametrize("cold", ["local"], indirect=True)  # the warm side: any cold tier
def test_warm_dir_remounted_read_only_reads_through(tmp_path, cold, ro_mount):
    mnt, remount = ro_mount
    root, opts = cold
    a = _put(root, opts, "a.tar", os.urandom(5000))
    b = _put(root, opts, "b.tar", os.urandom(7000))
    store = open_store(root, opts)
    c = TieredCache(warm_dir=mnt / "warm", warm_bytes=4 << 20, storage_options=opts,
                    stats_interval_s=3600)  # no counter file replaced on a timer meanwhile
    assert c.read(a) == store.get("a.tar")
    remount("ro")
    try:
        with pytest.raises(OSError):
            open(mnt / "warm" / "probe", "wb")  # really read-only, even for root
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert c.read(b) == store.get("b.tar")  # a miss reads through
            assert c.read(a) == store.get("a.tar")  # a hit is still served
            assert c.read_range(b, 5, 50) == store.get("b.tar")[5:50]
            s = c.stats()
            c.stats(node=True)
            with pytest.raises(StorageError, match=r"b\.tar"):
                c.local_path(b)  # a new local copy cannot be made: a named error
        assert len([w for w in caught if "warm cache" in str(w.message)]) == 1
        assert s["warm_errors"] >= 1
    finally:
        c.close()
        remount("rw")


# -- things planted in the warm directory -------------------------------------------------
@pytest.mark.parametrize("cold", ["local"], indirect=True)  # the warm side: any cold tier
def test_a_symlink_planted_in_objects_is_never_followed(tmp_path, cold):
    root, opts = cold
    data = os.urandom(3000)
    url = _put(root, opts, "s.tar", data)
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 3000)
    warm = tmp_path / "warm"
    layout = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    assert layout.has_warm_tier()  # creates the layout
    layout.close()
    link = warm / "objects" / url_key(url)
    os.symlink(secret, link)
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, storage_options=opts)
    assert c.read(url) == data
    with c.pinned(url) as path:
        assert not os.path.islink(path) and open(path, "rb").read() == data
    assert secret.read_bytes() == b"S" * 3000  # the target is untouched
    c.close()


def test_clear_refuses_a_folder_that_is_not_a_datapipe_cache(tmp_path):
    d = tmp_path / "not-a-cache"
    (d / "objects").mkdir(parents=True)
    (d / "objects" / "precious.txt").write_text("keep me")
    from datapipe.cache import clear_warm_dir, warm_dir_stats

    with pytest.raises(StorageError, match="not a datapipe warm cache"):
        clear_warm_dir(d)
    with pytest.raises(StorageError, match="not a datapipe warm cache"):
        warm_dir_stats(d)
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "cache", "clear", str(d)],
                         capture_output=True, env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert out.returncode != 0 and b"not a datapipe warm cache" in out.stderr
    assert (d / "objects" / "precious.txt").read_text() == "keep me"


# -- budgets -------------------------------------------------------------------------------
@pytest.mark.parametrize("cold", ["local"], indirect=True)  # the warm side: any cold tier
def test_hot_budget_smaller_than_the_object_fails_before_downloading(tmp_path, cold):
    root, opts = cold
    url = _put(root, opts, "s.tar", os.urandom(5000))
    c = TieredCache(hot_bytes=1000, warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                    storage_options=opts)
    for call in (lambda: c.read(url), lambda: c.read_range(url, 0, 10)):
        with pytest.raises(CacheBudgetError, match="hot_bytes to at least 5000"):
            call()
    assert c.stats()["cold_reads"] == 0
    assert os.listdir(tmp_path / "warm" / "objects") == []
    c.close()


def test_no_room_for_a_pin_says_what_holds_the_budget(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(4):
        (cold / f"s{i}.tar").write_bytes(bytes([i]) * 1000)
        urls.append(str(cold / f"s{i}.tar"))
    warm = tmp_path / "warm"
    a = TieredCache(warm_dir=warm, warm_bytes=3000)
    b = TieredCache(warm_dir=warm, warm_bytes=3000, pin_wait_s=0.2)
    a.local_path(urls[0])
    a.local_path(urls[1])
    b.local_path(urls[2])
    with pytest.raises(CacheBudgetError) as err:
        b.local_path(urls[3])
    msg = str(err.value)
    assert "s3.tar" in msg and "after waiting" in msg and "pin_wait_s=0.2" in msg
    assert "3000 bytes are pinned" in msg and "warm_bytes to at least 4000" in msg
    a.close()
    b.close()


def test_a_copy_replaced_behind_our_back_is_never_served_by_read_range(tmp_path):
    """read() refuses a warm copy without its fill record (where the filesystem keeps
    records); read_range() must refuse it too, not serve the planted bytes."""
    (tmp_path / "cold").mkdir()
    data = os.urandom(4096)
    url = _put(str(tmp_path / "cold"), {}, "s.tar", data)
    filler = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20)
    assert filler.read(url) == data
    if not filler._state().warm.records:
        pytest.skip("this filesystem keeps no extended attributes: copies carry no fill record")
    filler.close()
    copy = tmp_path / "warm" / "objects" / url_key(url)
    (tmp_path / "other").write_bytes(b"X" * len(data))  # same size, no fill record
    os.replace(tmp_path / "other", copy)
    fresh = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20)
    assert fresh.read_range(url, 0, 64) == data[:64]
    assert fresh.stats()["warm_corrupt"] == 1
    assert open(copy, "rb").read() == data  # refilled from cold
    fresh.close()
