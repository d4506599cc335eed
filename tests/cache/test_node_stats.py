"""Node-wide cache counters: DataLoader workers' reads reach the main process's
``stats(node=True)`` through counter files in the warm directory."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from datapipe import ShardWriter, StreamingDataLoader, StreamingDataset, TieredCache
from datapipe.cache import clear_warm_dir, warm_dir_stats
from datapipe.cache.node_stats import COUNTER_KEYS

N = 300


class LoggingCache(TieredCache):
    """Records every read the loader makes, one line per call from any process (O_APPEND
    writes of one short line are atomic), so a test knows how many reads there were."""

    def __init__(self, *args, log: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def _note(self, url: str) -> None:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {url}\n".encode())
        finally:
            os.close(fd)

    def local_path(self, url, **kw):
        self._note(url)
        return super().local_path(url, **kw)

    def pin_or_read(self, url, **kw):
        self._note(url)
        return super().pin_or_read(url, **kw)

    def read(self, url, **kw):
        self._note(url)
        return super().read(url, **kw)


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("stats-ds") / "ds")
    with ShardWriter(url, max_samples=23) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "txt": f"t{i}" * (i % 7 + 1)})
    return url


def _reads(log: str) -> list[tuple[int, str]]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(int(a), b) for a, b in (line.split(" ", 1) for line in f.read().splitlines())]


def _epoch(cache, ds_url, loader_cls=StreamingDataLoader, **loader_kw):
    ds = StreamingDataset(ds_url, cache=cache, seed=3, batch_size=8)
    loader = loader_cls(ds, batch_size=8, num_workers=2, **loader_kw)
    ids = [int(x) for b in loader for x in b["cls"]]
    assert sorted(ids) == list(range(N))
    return loader


def _shard_sizes(urls) -> dict[str, int]:
    return {u: os.path.getsize(u.removeprefix("file://")) for u in urls}


def test_worker_reads_reach_node_stats_after_each_epoch(ds_url, tmp_path):
    log = str(tmp_path / "reads.log")
    warm = tmp_path / "warm"
    # A timer that never fires within the test: only the workers' exit hooks can write
    # their counters, which proves those run when DataLoader ends its workers (sentinel,
    # then join) at the end of an epoch.
    cache = LoggingCache(warm_dir=warm, warm_bytes=1 << 24, stats_interval_s=3600, log=log)
    _epoch(cache, ds_url)
    reads = _reads(log)
    pids = {pid for pid, _ in reads}
    shards = _shard_sizes({u for _, u in reads})
    assert len(shards) == -(-N // 23) and os.getpid() not in pids and len(pids) == 2

    mine = cache.stats()
    assert all(mine[k] == 0 for k in ("warm_hits", "warm_misses", "cold_reads", "cold_bytes"))
    node = cache.stats(node=True)
    assert node["cold_reads"] == len(shards)  # each shard fetched once per node
    assert node["cold_bytes"] == sum(shards.values())
    assert node["warm_fills"] == len(shards)
    assert node["warm_hits"] + node["warm_misses"] == len(reads)
    assert node["warm_misses"] >= len(shards)
    assert node["processes"] == 3  # two workers and this process
    assert node["wait_seconds"] >= 0.0 and isinstance(node["wait_seconds"], float)
    assert set(COUNTER_KEYS) <= set(node)

    # The CLI's view of the directory carries the same node-wide counters.
    on_disk = warm_dir_stats(warm)
    assert on_disk["processes"] == 3
    assert {k: on_disk["counters"][k] for k in COUNTER_KEYS} == {k: node[k] for k in COUNTER_KEYS}
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "cache", "stats", str(warm)],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["counters"]["cold_reads"] == len(shards)

    # A second epoch with new workers: all warm, nothing more from cold, counts add up.
    _epoch(cache, ds_url)
    reads2 = _reads(log)
    node2 = cache.stats(node=True)
    assert node2["cold_reads"] == len(shards) and node2["cold_bytes"] == sum(shards.values())
    assert node2["warm_hits"] - node["warm_hits"] == len(reads2) - len(reads)
    assert node2["warm_misses"] == node["warm_misses"]
    assert node2["processes"] == 5
    cache.close()


def test_live_workers_flush_on_the_timer(ds_url, tmp_path):
    log = str(tmp_path / "reads.log")
    cache = LoggingCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 24, stats_interval_s=0.1, log=log)
    # a plain DataLoader: StreamingDataLoader refuses persistent workers (they miss set_epoch)
    loader = _epoch(cache, ds_url, loader_cls=torch.utils.data.DataLoader, persistent_workers=True)
    workers = loader._iterator._workers  # kept alive between epochs: no exit hook has run
    assert all(w.is_alive() for w in workers)
    n_reads = len(_reads(log))
    deadline = time.monotonic() + 10
    while True:
        node = cache.stats(node=True)
        if node["warm_hits"] + node["warm_misses"] == n_reads or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(w.is_alive() for w in workers)
    assert node["warm_hits"] + node["warm_misses"] == n_reads
    assert node["cold_reads"] == -(-N // 23)
    del loader  # ends the persistent workers
    cache.close()


def _read_and_exit(warm: str, urls: list[str], how: str) -> None:
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, stats_interval_s=0.05 if how == "kill" else 3600)
    for u in urls:
        c.read(u)
    if how == "kill":
        deadline = time.monotonic() + 10  # the timer's write, not any hook, puts them on disk
        while c._state().counters.file._written != dict(c._state().stats) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        os._exit(0)  # no hook can run: nothing but the timer would have written


def _objects(tmp_path, n, size=1000):
    cold = tmp_path / "cold"
    cold.mkdir()
    urls = []
    for i in range(n):
        p = cold / f"obj-{i}.bin"
        p.write_bytes(os.urandom(size + i))
        urls.append(str(p))
    return urls


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_exited_processes_count_and_killed_ones_keep_what_they_wrote(tmp_path, method):
    urls = _objects(tmp_path, 3)
    warm = str(tmp_path / "warm")
    ctx = mp.get_context(method)
    for how in ("return", "kill") if method == "fork" else ("return",):
        p = ctx.Process(target=_read_and_exit, args=(warm, urls, how))
        p.start()
        p.join(30)
        assert p.exitcode == (0 if how == "return" else -signal.SIGKILL)
    node = warm_dir_stats(warm)
    runs = 2 if method == "fork" else 1
    assert node["processes"] == runs
    assert node["counters"]["cold_reads"] == 3  # the first child filled, the second hit
    assert node["counters"]["warm_hits"] == 3 * (runs - 1)
    assert node["counters"]["hot_misses"] == 3 * runs


def test_os_exit_without_hooks_loses_only_unflushed_counts(tmp_path):
    urls = _objects(tmp_path, 2)
    warm = str(tmp_path / "warm")
    p = mp.get_context("fork").Process(target=_read_and_exit, args=(warm, urls, "exit"))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert warm_dir_stats(warm)["counters"]["cold_reads"] == 0  # documented limit, not a crash


def test_clear_resets_node_counters(tmp_path):
    urls = _objects(tmp_path, 4)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, stats_interval_s=3600)
    for u in urls:
        c.read(u)
    assert c.stats(node=True)["cold_reads"] == 4  # writes this process's file
    assert any(n.endswith(".json") for n in os.listdir(warm / "stats"))
    assert clear_warm_dir(warm) == 4  # the cached objects; counter files are not counted
    assert not [n for n in os.listdir(warm / "stats") if n.endswith(".json")]
    assert warm_dir_stats(warm)["processes"] == 0
    assert warm_dir_stats(warm)["counters"]["cold_reads"] == 0
    c.read(urls[0])  # refilled from cold after the clear
    node = c.stats(node=True)
    assert (node["cold_reads"], node["warm_misses"], node["processes"]) == (1, 1, 1)
    assert c.stats()["cold_reads"] == 5  # this process's own counters are untouched
    c.close()
    c2 = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    c2.read(urls[0])
    node = c2.stats(node=True)
    assert (node["cold_reads"], node["warm_hits"], node["processes"]) == (1, 1, 2)
    c2.close()


def test_a_file_from_before_the_clear_is_ignored(tmp_path):
    urls = _objects(tmp_path, 1)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    c.read(urls[0])
    c.stats(node=True)
    (name,) = [n for n in os.listdir(warm / "stats") if n.endswith(".json")]
    stale = (warm / "stats" / name).read_text()
    clear_warm_dir(warm)
    # a writer that raced the clear publishes a file of the old generation afterwards
    (warm / "stats" / "other-1-1-abc.json").write_text(stale)
    assert warm_dir_stats(warm)["processes"] == 0
    assert warm_dir_stats(warm)["counters"]["cold_reads"] == 0
    c.close()


def test_without_a_warm_dir_node_stats_are_this_process(tmp_path):
    urls = _objects(tmp_path, 2)
    c = TieredCache(hot_bytes=1 << 20)
    for u in urls + urls:
        c.read(u)
    node, mine = c.stats(node=True), c.stats()
    assert node.pop("processes") == 1
    assert node == mine and mine["hot_hits"] == 2 and mine["cold_reads"] == 2
    c.close()


def test_bad_counter_files_and_an_unwritable_stats_dir(tmp_path):
    urls = _objects(tmp_path, 1)
    warm = tmp_path / "warm"
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20)
    c.read(urls[0])
    (warm / "stats" / "junk-1-1-x.json").write_text("{not json")
    (warm / "stats" / "other-2-2-y.json").write_text(json.dumps({"format": "something else"}))
    node = c.stats(node=True)
    assert node["unreadable_counter_files"] == 2 and node["processes"] == 1 and node["cold_reads"] == 1
    assert warm_dir_stats(warm)["counters"]["cold_reads"] == 1
    c.close()

    # stats/ is a file in a cache's folder: the cache still reads, warns once, and node
    # stats are its own (a folder made by a cache: one it did not make is refused)
    warm2 = tmp_path / "warm2"
    from datapipe.cache.warm import MARKER, _write_meta

    warm2.mkdir()
    _write_meta(str(warm2), 1 << 20, MARKER)
    (warm2 / "stats").write_text("in the way")
    c2 = TieredCache(warm_dir=warm2, warm_bytes=1 << 20)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert c2.read(urls[0]) == open(urls[0], "rb").read()
    assert any("node-wide stats will miss" in str(x.message) for x in w)
    node = c2.stats(node=True)
    assert node["processes"] == 1 and node["cold_reads"] == 1
    c2.close()

    with pytest.raises(ValueError, match="stats_interval_s"):
        TieredCache(warm_dir=warm, warm_bytes=1 << 20, stats_interval_s=0)


def _counter_files(warm) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(warm, "stats")) if not n.startswith("."))


def test_exited_processes_fold_into_one_summary_and_totals_stay_exact(tmp_path):
    """Non-persistent DataLoader workers are new processes every epoch: the stats directory
    must not gain a file per process forever, and the node totals must not move."""
    urls = _objects(tmp_path, 3)
    warm = str(tmp_path / "warm")
    c = TieredCache(warm_dir=warm, warm_bytes=1 << 20, stats_interval_s=3600)
    c.read(urls[0])
    ctx = mp.get_context("fork")
    for epoch, workers in enumerate((3, 2)):
        for _ in range(workers):
            p = ctx.Process(target=_read_and_exit, args=(warm, urls, "return"))
            p.start()
            p.join(30)
            assert p.exitcode == 0
        node = c.stats(node=True)
        runs = 1 + 3 + 2 * epoch  # this process and every worker so far
        assert node["processes"] == runs
        assert node["cold_reads"] == 3  # the first filled the warm tier, the rest hit it
        assert node["hot_misses"] == 1 + 3 * (runs - 1)
        assert node["warm_hits"] + node["warm_misses"] == 1 + 3 * (runs - 1)
        # this (live) process's file and one summary of the exited ones
        assert len(_counter_files(warm)) == 2, _counter_files(warm)
        assert warm_dir_stats(warm)["counters"]["hot_misses"] == node["hot_misses"]
    c.close()  # a closed cache's file is final: merged too, still counted once
    after = warm_dir_stats(warm)
    assert after["processes"] == 6 and after["counters"]["hot_misses"] == node["hot_misses"]
    assert _counter_files(warm) == ["exited.summary"]
    clear_warm_dir(warm)
    assert _counter_files(warm) == ["generation"] and warm_dir_stats(warm)["processes"] == 0
