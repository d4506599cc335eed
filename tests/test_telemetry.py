"""datapipe.telemetry: windows, per-thread counters, worker processes (real DataLoader
workers, fork and forkserver), JSON lines from several processes, hostile exports."""

import itertools
import json
import math
import multiprocessing
import os
import pickle
import struct
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from datapipe.errors import DatapipeError, HealthError, OptionError
from datapipe.telemetry import BUCKET_BOUNDS, SUMMARY_FORMAT, TIERS, Telemetry, quantile


def _until(predicate, what, limit_s=60.0):
    """Wait for ``predicate`` (a background thread's work), failing after ``limit_s``: a
    bound against a hang, not a timing assertion."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


def test_a_window_sums_what_was_recorded():
    tel = Telemetry(window_s=None, rank=3)
    for _ in range(10):
        tel.data_wait(0.010)
        tel.read("node-local", 1 << 20, 0.002)
        tel.hit("node-local")
        tel.miss("memory")
        tel.compute(0.05)
    tel.read("cold", 4 << 20, 0.2)
    tel.miss("node-local")
    tel.decode(0.004, 64)
    tel.decode(0.004, 64)
    tel.cold_retry()
    tel.throttled(3)
    tel.error("cold")
    tel.prefetch_depth(4)
    tel.prefetch_depth(2)
    s = tel.close_window()
    assert (s.seq, s.rank, s.waits, s.computes) == (1, 3, 10, 10)
    assert s.data_wait_s == pytest.approx(0.1) and s.data_wait_mean_s == pytest.approx(0.01)
    assert s.compute_s == pytest.approx(0.5)
    # quantiles come from the histogram: within its bucket (10**0.1) of the value
    assert 0.01 / 10 ** 0.1 <= s.data_wait_p50_s <= 0.01 * 10 ** 0.1
    local = s.tiers["node-local"]
    assert (local.reads, local.bytes, local.hits, local.misses) == (10, 10 << 20, 10, 1)
    assert local.bytes_per_s == pytest.approx((10 << 20) / 0.02)
    assert local.latency_mean_s == pytest.approx(0.002)
    assert local.hit_ratio == pytest.approx(10 / 11)
    assert s.tiers["cold"].errors == 1 and s.tiers["memory"].misses == 10
    assert set(s.tiers) == {"node-local", "cold", "memory"}  # tiers not touched are left out
    assert s.cache_hit_ratio == pytest.approx(10 / 11)  # 10 reads served by a cache tier, 1 by cold
    assert (s.decoded_samples, s.cold_retries, s.cold_throttled) == (128, 1, 3)
    assert s.decode_per_sample_s == pytest.approx(0.008 / 128)
    assert s.prefetch_depth == 2 and s.prefetch_depth_mean == pytest.approx(3)
    doc = s.to_dict()
    assert doc["format"] == SUMMARY_FORMAT and json.loads(json.dumps(doc)) == doc

    tel.data_wait(0.5)
    s2 = tel.close_window()  # the next window holds only what came after
    assert (s2.seq, s2.waits, s2.tiers) == (2, 1, {})
    assert s2.data_wait_s == pytest.approx(0.5)
    assert tel.last is s2 and tel.windows == 2
    tel.close()


def test_snapshot_is_the_open_window_and_does_not_close_it():
    tel = Telemetry(window_s=None)
    tel.data_wait(0.25)
    a = tel.snapshot()
    tel.data_wait(0.25)
    b = tel.snapshot()
    assert a.data_wait_s == pytest.approx(0.25) and b.data_wait_s == pytest.approx(0.5)
    assert tel.windows == 0 and tel.last is None
    assert tel.close_window().data_wait_s == pytest.approx(0.5)


def test_step_marks_count_the_time_between_them():
    tel = Telemetry(window_s=None)
    for _ in range(6):
        tel.step()
        time.sleep(0.002)
    s = tel.close_window()
    assert s.steps == 5  # five intervals between six marks
    assert s.step_mean_s > 0 and s.step_p50_s > 0 and s.step_p95_s >= s.step_p50_s


def test_an_open_wait_shows_in_the_window():
    tel = Telemetry(window_s=None)
    t0 = tel.wait_begin()
    time.sleep(0.01)
    assert tel.snapshot().waiting_now_s > 0
    tel.wait_end(t0)
    s = tel.close_window()
    assert s.waiting_now_s == 0 and s.waits == 1 and s.data_wait_s > 0


def test_threads_record_without_locks_and_every_count_lands():
    tel = Telemetry(window_s=None)
    n, threads = 20_000, 4
    go = threading.Barrier(threads)

    def work(tier):
        go.wait()
        for _ in range(n):
            tel.read(tier, 16384, 1e-5)
            tel.hit(tier)

    ts = [threading.Thread(target=work, args=(TIERS[i % len(TIERS)],)) for i in range(threads)]
    for t in ts:
        t.start()
    snapshots = []
    while any(t.is_alive() for t in ts):  # windows read while the threads write
        snapshots.append(tel.snapshot())
    for t in ts:
        t.join()
    total = tel.totals()
    reads = sum(total.tier(name)[0]["reads"] for name in TIERS)
    assert reads == n * threads  # the threads have ended: their counters were folded in, none lost
    assert sum(total.tier(name)[0]["bytes"] for name in TIERS) == n * threads * 16384
    s = tel.close_window()
    assert sum(t.reads for t in s.tiers.values()) == n * threads
    assert all(sum(t.reads for t in snap.tiers.values()) <= n * threads for snap in snapshots)


def test_windows_close_by_steps_on_the_window_thread():
    tel = Telemetry(window_s=None, window_steps=5)
    got = []
    tel.on_window(got.append)
    for _ in range(5):
        tel.step()
    _until(lambda: tel.windows >= 1, "the first window")
    for _ in range(5):
        tel.step()
    _until(lambda: tel.windows >= 2, "the second window")
    assert [s.seq for s in got] == [1, 2]
    assert sum(s.steps for s in got) + tel.snapshot().steps == 9
    tel.close()


def test_windows_close_by_time_and_land_in_metrics_path(tmp_path):
    path = tmp_path / "m.jsonl"
    tel = Telemetry(window_s=0.05, metrics_path=path, rank=1)
    tel.data_wait(0.125)
    _until(lambda: tel.windows >= 3, "three windows")
    tel.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) >= 3 and [d["seq"] for d in lines] == list(range(1, len(lines) + 1))
    assert sum(d["data_wait_s"] for d in lines) == pytest.approx(0.125)
    assert all(d["rank"] == 1 and d["format"] == SUMMARY_FORMAT for d in lines)


def test_close_writes_the_last_window_once(tmp_path):
    path = tmp_path / "m.jsonl"
    tel = Telemetry(window_s=None, metrics_path=path)
    tel.data_wait(1.0)
    tel.close()
    tel.close()
    (doc,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert doc["final"] is True and doc["data_wait_s"] == 1.0
    empty = Telemetry(window_s=None, metrics_path=tmp_path / "e.jsonl")
    empty.close()
    assert not (tmp_path / "e.jsonl").exists()  # nothing recorded: no window


def test_an_abandoned_recorder_ends_its_thread():
    tel = Telemetry(window_s=0.01)
    thread = tel._thread
    del tel
    _until(lambda: not thread.is_alive(), "the window thread of a collected recorder to end")


def test_a_failing_callback_warns_once_and_windows_go_on():
    tel = Telemetry(window_s=None)

    def broken(summary):
        raise KeyError("board gone")

    tel.on_window(broken)
    with pytest.warns(RuntimeWarning, match="window callback failed"):
        tel.close_window()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tel.close_window()  # no second warning
    tel.remove_callback(broken)
    assert tel.windows == 2


def test_metrics_path_that_cannot_be_written_warns_and_windows_go_on(tmp_path):
    tel = Telemetry(window_s=None, metrics_path=tmp_path / "no" / "such" / "dir" / "m.jsonl")
    with pytest.warns(RuntimeWarning, match="cannot append to metrics_path"):
        tel.close_window()
    assert tel.windows == 1


def _append_windows(path, rank, n):
    tel = Telemetry(window_s=None, metrics_path=path, rank=rank)
    for i in range(n):
        tel.read("warm", 100 + i, 0.001)
        tel.hit("warm")
        tel.close_window()


def test_processes_appending_to_one_metrics_file_never_interleave_lines(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=_append_windows, args=(path, r, 200)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    docs = [json.loads(line) for line in open(path)]  # a torn line would not parse
    assert len(docs) == 800
    for r in range(4):
        mine = [d for d in docs if d["rank"] == r]
        assert [d["seq"] for d in mine] == list(range(1, 201))
        assert [d["tiers"]["warm"]["bytes"] for d in mine] == [100 + i for i in range(200)]


class _Recording(IterableDataset):
    """Each worker records into its copy of the loader's recorder, as the dataset will."""

    def __init__(self, tel, n):
        self.tel = tel
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for i in range(self.n):
            if info is not None and i % info.num_workers != wid:
                continue
            self.tel.read("warm", 1000 + wid, 0.001)
            self.tel.hit("warm")
            self.tel.decode(0.002, 8)
            self.tel.prefetch_depth(wid + 1)
            yield i


class _Collate:
    """In the worker: the batch carries the worker's counts since its last export."""

    def __init__(self, tel):
        self.tel = tel

    def __call__(self, items):
        return torch.tensor(items), self.tel.export(force=True)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_worker_counts_reach_the_main_process_through_batches(method):
    tel = Telemetry(window_s=None)
    tel.read("memory", 5, 1e-6)  # the main process's own: a forked worker must not count it again
    n = 60
    loader = DataLoader(_Recording(tel, n), batch_size=4, num_workers=2, collate_fn=_Collate(tel),
                        multiprocessing_context=method)
    seen = 0
    for batch, delta in loader:
        seen += len(batch)
        tel.merge(delta)
    assert seen == n
    s = tel.close_window()
    warm = s.tiers["warm"]
    assert warm.reads == n and warm.hits == n
    assert warm.bytes == 1000 * 30 + 1001 * 30  # worker 0 and worker 1 read half each
    assert s.decoded_samples == 8 * n and s.tiers["memory"].reads == 1
    assert s.prefetch_depth == 1 + 2  # each worker's last depth, summed


def test_a_forked_child_counts_from_zero():
    tel = Telemetry(window_s=None)
    tel.data_wait(7.0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its export holds only its own wait
        try:
            os.close(r)
            tel.data_wait(1.0)
            os.write(w, tel.export(force=True))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    tel.merge(data)
    assert tel.close_window().data_wait_s == pytest.approx(8.0)


def test_a_pickled_recorder_is_a_worker_copy(tmp_path):
    tel = Telemetry(window_s=5, window_steps=7, metrics_path=tmp_path / "m.jsonl", rank=2)
    tel.data_wait(1.0)
    copy = pickle.loads(pickle.dumps(tel))
    assert copy.worker and copy._thread is None and copy.metrics_path is None
    assert (copy.window_s, copy.window_steps, copy.rank) == (5, 7, 2)
    assert copy.snapshot().data_wait_s == 0
    copy.data_wait(0.5)
    tel.merge(copy.export(force=True))
    assert tel.snapshot().data_wait_s == pytest.approx(1.5)
    tel.close()


def test_export_is_throttled_unless_forced():
    tel = Telemetry(window_s=None, export_interval_s=3600)
    tel.data_wait(0.1)
    first = tel.export()
    assert first is not None and tel.export() is None
    tel.data_wait(0.2)
    second = tel.export(force=True)
    main = Telemetry(window_s=None)
    main.merge(first)
    main.merge(second)
    assert main.snapshot().data_wait_s == pytest.approx(0.3)  # deltas: nothing counted twice


def test_merge_refuses_what_is_not_an_export():
    tel = Telemetry(window_s=None)
    good = Telemetry(window_s=None).export(force=True)
    for bad in (b"", b"x" * len(good), good[:-8], good + b"\0", "text", None, 3):
        with pytest.raises(HealthError, match=r"Telemetry\.merge"):
            tel.merge(bad)
    header = struct.calcsize("<4sIqd")
    negative = good[:header] + np.full((len(good) - header) // 8, -1.0).tobytes()
    with pytest.raises(HealthError, match="negative or not finite"):
        tel.merge(negative)
    nan = good[:header] + np.full((len(good) - header) // 8, np.nan).tobytes()
    with pytest.raises(HealthError):
        tel.merge(nan)
    assert tel.snapshot().waits == 0  # nothing of the refused ones was added


@settings(max_examples=300)
@given(st.data())
def test_damaged_exports_are_refused_or_stay_sane(data):
    tel = Telemetry(window_s=None)
    src = Telemetry(window_s=None)
    src.read("warm", 123, 0.5)
    blob = bytearray(src.export(force=True))
    for _ in range(data.draw(st.integers(0, 8))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    try:
        tel.merge(bytes(blob))
    except HealthError:
        return
    s = tel.snapshot()  # accepted: every figure is still finite and not negative
    for t in s.tiers.values():
        assert t.reads >= 0 and t.bytes >= 0 and math.isfinite(t.seconds) and t.seconds >= 0


@pytest.mark.parametrize("call", [
    lambda t: t.read("disk", 1, 0.1), lambda t: t.read(["warm"], 1, 0.1), lambda t: t.read("warm", -1, 0.1),
    lambda t: t.read("warm", 1, float("nan")), lambda t: t.read("warm", "1", 0.1), lambda t: t.hit("hot"),
    lambda t: t.miss(None), lambda t: t.error(1), lambda t: t.data_wait(-0.1), lambda t: t.data_wait("1"),
    lambda t: t.data_wait(float("inf")), lambda t: t.compute(float("nan")), lambda t: t.decode(-1.0),
    lambda t: t.decode(0.1, -3), lambda t: t.cold_retry(-1), lambda t: t.throttled("2"),
    lambda t: t.prefetch_depth(-1), lambda t: t.prefetch_depth(None),
])
def test_bad_records_are_option_errors_and_count_nothing(call):
    tel = Telemetry(window_s=None)
    with pytest.raises(OptionError, match="Telemetry\\.") as e:
        call(tel)
    assert isinstance(e.value, DatapipeError) and isinstance(e.value, ValueError)
    s = tel.close_window()
    assert (s.tiers, s.waits, s.computes, s.decoded_samples, s.cold_retries, s.cold_throttled) == ({}, 0, 0, 0, 0, 0)
    assert s.prefetch_depth_mean is None


def test_a_bad_tier_is_named_with_the_tiers_allowed():
    with pytest.raises(OptionError, match="'disk' is not a tier: one of memory, warm, node-local, shared, cold"):
        Telemetry(window_s=None).read("disk", 1, 0.1)


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"window_s": -1}, {"window_s": float("nan")},
                                    {"window_steps": 0}, {"window_steps": 1.5}, {"rank": -1}, {"rank": "0"},
                                    {"metrics_path": ""}, {"export_interval_s": -1}])
def test_bad_arguments_name_the_argument(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(OptionError, match=name):
        Telemetry(**kwargs)


def test_quantiles_from_the_histogram():
    hist = np.zeros(len(BUCKET_BOUNDS) + 1)
    assert quantile(hist, 0.5) is None
    i = BUCKET_BOUNDS.index(1e-3)
    hist[i] = 100  # a hundred values in (7.9e-4, 1e-3]
    assert 7.9e-4 <= quantile(hist, 0.5) <= 1e-3
    hist[-1] = 1000  # most above the last bound
    assert quantile(hist, 0.95) == BUCKET_BOUNDS[-1]
    assert all(a < b for a, b in itertools.pairwise(BUCKET_BOUNDS))
    assert {1e-6, 2.5e-6, 5e-6, 1.0, 2.5, 5.0, 1000.0} <= set(BUCKET_BOUNDS)
