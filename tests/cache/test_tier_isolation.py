"""A cache tier that fails during training is taken out of the path and taken back: the
loader's StreamingDataset reads through TieredCache while its warm folder is made read-only
(for root, whom chmod does not stop: the immutable flag, ``chattr +i``), then removed and
replaced by a file (it cannot be re-created), then freed again. Every sample comes exactly
once, nothing crashes, the tier's failure is said once and its return once."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from datapipe import ShardWriter
from datapipe.cache import CacheTier, TieredCache
from datapipe.errors import OptionError, StorageError
from datapipe.loader import StreamingDataset
from datapipe.telemetry import Telemetry
from tests.folder_faults import ReadOnly

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 240


def _write(path, n=N, per_shard=12):
    with ShardWriter(str(path), max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:05d}", "cls": str(i), "bin": bytes([i % 256]) * 700})
    return str(path)


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("ds") / "a")


def _messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def test_a_warm_tier_made_read_only_then_removed_is_taken_out_and_back(ds_url, tmp_path):
    warm = tmp_path / "warm"
    ro = ReadOnly(warm)
    cache = TieredCache(warm_dir=warm, warm_bytes=64 << 20, tier_retry_s=0)
    # The faults must meet reads still to come: by default the pass is one chunk (8192
    # samples) whose 20 shards are all fetched ahead of the reader, so under load a pass
    # could be fetched whole before sample N // 4, and the faults met no read at all. In
    # chunks of 24 samples with a budget of one byte, a chunk's shards are fetched only once
    # the reader is on it: no fetch runs while a fault is injected, and every chunk after
    # it fetches after the fault (one at a time: a single reader meets each failure).
    ds = StreamingDataset(ds_url, cache=cache, window=2, seed=3, chunk_samples=24, prefetch_bytes=1,
                          concurrency=1)
    epochs: list[list[int]] = []
    marks = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for epoch in range(4):  # epoch 3 is read after the tier is free (a pass may read ahead)
                ds.set_epoch(epoch)
                if epoch == 2:
                    os.unlink(warm)  # the path is free again: the next probe re-creates it
                    marks["freed"] = cache.stats()
                seen: list[int] = []
                for n, item in enumerate(ds):
                    seen.append(int(item["cls"]))
                    if n == N // 4 and epoch == 0:
                        ro.on()  # read-only mid-epoch
                    elif n == N // 4 and epoch == 1:
                        ro.replace_by_file()  # removed, and it cannot be re-created
                epochs.append(seen)
        s = cache.stats()
    finally:
        ro.off()
        cache.close()
    for seen in epochs:
        assert sorted(seen) == list(range(N))  # every sample exactly once, no crash
    out = _messages(caught, "taken out of the path")
    assert len(out) == 1 and str(warm) in out[0], [str(w.message) for w in caught]
    back = _messages(caught, "back in the path")
    assert len(back) == 1 and str(warm) in back[0], sorted((k, v) for k, v in s.items() if k.startswith("warm") and v)
    assert not _messages(caught, "cache counters not written")  # the tier's one warning says it
    assert s["warm_outs"] == 1 and s["warm_backs"] == 1
    assert marks["freed"]["warm_outs"] == 1 and marks["freed"].get("warm_backs", 0) == 0
    assert s["warm_fills"] > marks["freed"]["warm_fills"]  # filled again once back
    assert os.path.isdir(warm / "objects") and os.listdir(warm / "objects")


def test_a_node_local_tier_that_fails_is_passed_by_and_probed_back(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(6):
        (cold / f"o{i}.bin").write_bytes(bytes([i]) * 3000)
        urls.append(str(cold / f"o{i}.bin"))
    local = tmp_path / "local2"
    ro = ReadOnly(local)
    tel = Telemetry(window_s=3600)
    c = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                    local_tiers=[CacheTier(local, 1 << 20)], tier_retry_s=0, telemetry=tel)
    try:
        assert c.read(urls[0]) == bytes([0]) * 3000
        ro.on()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in (1, 2, 3):
                assert c.read(urls[i]) == bytes([i]) * 3000  # through to cold: local2 is out
            s = c.stats()
            window = tel.snapshot()
            ro.off()
            for i in (4, 5):
                assert c.read(urls[i]) == bytes([i]) * 3000
        st = c.stats()
    finally:
        ro.off()
        c.close()
        tel.close()
    assert len(_messages(caught, "taken out of the path")) == 1
    # the telemetry counts the failure that took the tier out; reads past it meet none
    assert window.tiers["node-local"].errors == 1
    assert len(_messages(caught, "back in the path")) == 1
    assert s["local2_outs"] == 1 and s.get("local2_backs", 0) == 0
    assert st["local2_backs"] == 1 and st["local2_fills"] > s.get("local2_fills", 0)


def test_local_path_while_the_warm_tier_is_out_is_a_named_error(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    (cold / "a.bin").write_bytes(b"a" * 2000)
    (cold / "b.bin").write_bytes(b"b" * 2000)
    warm = tmp_path / "warm"
    ro = ReadOnly(warm)
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, tier_retry_s=3600)
    try:
        assert c.read(str(cold / "a.bin")) == b"a" * 2000
        ro.on()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert c.pin_or_read(str(cold / "b.bin")) == b"b" * 2000  # bytes: read through
            with pytest.raises(StorageError, match=r"b\.bin.*out of the path"):
                c.local_path(str(cold / "b.bin"))
    finally:
        ro.off()
        c.close()


def test_tier_retry_s_is_checked():
    with pytest.raises(OptionError, match="tier_retry_s"):
        TieredCache(tier_retry_s=-1)
    with pytest.raises(OptionError, match="tier_retry_s"):
        TieredCache(tier_retry_s="soon")  # type: ignore[arg-type]


_WORKERS_SCRIPT = r"""
import os, shutil, subprocess, sys
from torch.utils.data import DataLoader
from datapipe.cache import TieredCache
from datapipe.loader import StreamingDataset
url, warm, n, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def read_only(path, on, top=False):
    if how == "chattr":
        subprocess.run(["chattr", *([] if top else ["-R"]), "+i" if on else "-i", path], check=True)
    else:
        for d, _dirs, _files in os.walk(path):
            os.chmod(d, 0o555 if on else 0o755)

# a warm tier too small for the dataset: every epoch fills it again
cache = TieredCache(warm_dir=warm, warm_bytes=150_000, tier_retry_s=0)
ds = StreamingDataset(url, cache=cache, window=2, seed=4, prefetch_bytes=1, concurrency=1)
loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
ok = True
for epoch in range(4):
    ds.set_epoch(epoch)
    seen = []
    for i, item in enumerate(loader):
        seen.append(int(item["cls"]))
        if epoch == 0 and i == n // 5:
            read_only(warm, True)  # read-only mid-epoch, through epoch 1
    ok = ok and sorted(seen) == list(range(n))
    if epoch == 1:  # removed: renamed away at once, then deleted; each worker's probe re-creates it
        if how == "chattr":
            read_only(warm, False, top=True)
        os.rename(warm, warm + ".gone")
        read_only(warm + ".gone", False)
        shutil.rmtree(warm + ".gone")
print("every sample exactly once:", ok)
del loader  # the workers exit: their last counters are written
st = cache.stats(node=True)
print("outs", st.get("warm_outs", 0), "backs", st.get("warm_backs", 0))
"""


def test_dataloader_workers_go_on_through_a_failing_warm_tier(ds_url, tmp_path):
    warm = tmp_path / "warm"
    how = "chattr" if os.geteuid() == 0 else "chmod"
    if how == "chattr":
        probe = tmp_path / "probe"
        probe.mkdir()
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i does not work here")
        subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        r = subprocess.run([sys.executable, "-c", _WORKERS_SCRIPT, ds_url, str(warm), str(N), how],
                           capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    finally:
        if how == "chattr" and warm.exists():
            subprocess.run(["chattr", "-R", "-i", str(warm)], capture_output=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every sample exactly once: True" in r.stdout, r.stdout + r.stderr[-3000:]
    outs = r.stderr.count("taken out of the path")
    backs = r.stderr.count("back in the path")
    # said once per process that met the failure (two workers), and its return once each
    assert 1 <= outs <= 2 and backs == outs, r.stderr[-3000:]
    assert "cache counters not written" not in r.stderr
    got = dict(zip(r.stdout.split()[-4::2], map(int, r.stdout.split()[-3::2])))
    assert got["outs"] == outs and got["backs"] == outs, r.stdout
