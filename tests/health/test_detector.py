"""datapipe.health.detect: stragglers named with their cause, stale/idle/missing ranks,
sub-groups, hostile documents; and, end to end, real rank processes publishing through a
FileBoard and through torch.distributed's TCPStore (gloo), one slowed in its node-local
reads and one in compute, named within two windows."""

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import DatapipeError, HealthError, OptionError
from datapipe.health import FileBoard, Publisher, StoreBoard, SummaryTable, detect, parse_summary
from datapipe.telemetry import Telemetry, TierSummary, WindowSummary
from tests.ranks import free_port, spawn_ranks

NOW = 1_000_000.0


def tier(bps, nbytes=100 << 20):
    return TierSummary(reads=10, bytes=nbytes, seconds=nbytes / bps, hits=10, misses=0, errors=0, bytes_per_s=bps,
                       latency_mean_s=None, latency_p50_s=None, latency_p95_s=None, hit_ratio=1.0)


def summary(rank, *, step=0.100, wait=0.002, steps=50, compute=None, tiers=None, hit_ratio=0.98, throttled=0,
            retries=0, decode=1e-5, age=1.0, waiting_now=0.0, seq=2):
    return WindowSummary(
        seq=seq, rank=rank, host=f"node{rank // 2}", pid=100 + rank, time=NOW - age, duration_s=10.0, final=False,
        steps=steps, step_s=step * steps, step_mean_s=step if steps else None, step_p50_s=step if steps else None,
        step_p95_s=step if steps else None, waits=steps, data_wait_s=wait * steps,
        data_wait_mean_s=wait if steps else None, data_wait_p50_s=None, data_wait_p95_s=None,
        data_wait_fraction=wait * steps / 10.0, waiting_now_s=waiting_now, computes=steps if compute else 0,
        compute_s=(compute or 0) * steps, compute_mean_s=compute, decode_s=decode * 1000, decoded_samples=1000,
        decode_per_sample_s=decode, cold_retries=retries, cold_throttled=throttled, prefetch_depth=4,
        prefetch_depth_mean=4.0, cache_hit_ratio=hit_ratio,
        tiers=tiers if tiers is not None else {"node-local": tier(1.8e9), "cold": tier(2e8)})


def test_a_rank_slow_in_its_node_local_reads_is_named_data_with_the_tier():
    docs = [summary(r) for r in range(8)]
    docs[5] = summary(5, step=0.150, wait=0.052, tiers={"node-local": tier(40e6), "cold": tier(2e8)})
    report = detect(docs, now=NOW)
    (f,) = report.stragglers
    assert (f.rank, f.kind, f.host) == (5, "data", "node2")
    assert f.message.startswith("data: node-local tier reads 40 MB/s against a median of 1.8 GB/s")
    assert "waits 52 ms per step for data, median 2 ms" in f.message
    assert report.compared == 8 and not report.others and not report.ok
    assert str(f).startswith("rank 5 (node2): data: node-local tier")


def test_a_rank_slow_in_compute_is_named_compute():
    docs = [summary(r) for r in range(8)]
    docs[2] = summary(2, step=0.160)
    (f,) = detect(docs, now=NOW).stragglers
    assert (f.rank, f.kind) == (2, "compute")
    assert f.message == "compute: data wait normal (2 ms per step), step time 1.6x the median (160 ms against 100 ms)"
    assert f.ratio == pytest.approx(1.6)


def test_in_synchronous_training_the_recorded_compute_time_names_the_slow_rank():
    # every rank's step lasts as long as the slowest's; only its own compute time differs
    docs = [summary(r, step=0.2, compute=0.09) for r in range(6)]
    docs[4] = summary(4, step=0.2, compute=0.19)
    (f,) = detect(docs, now=NOW).stragglers
    assert (f.rank, f.kind) == (4, "compute") and "compute time 2.1x the median" in f.message


def test_k_sets_how_far_from_the_median_a_straggler_is():
    docs = [summary(r) for r in range(5)] + [summary(5, step=0.130)]
    assert detect(docs, now=NOW).ok
    assert detect(docs, now=NOW, k=1.2).named("compute") == [5]


@pytest.mark.parametrize("change, cause", [
    ({"hit_ratio": 0.40}, "cache hit ratio 40% against a median of 98%"),
    ({"throttled": 57}, "the cold store throttled 57 of its requests (503/429) against a median of 0"),
    ({"retries": 12}, "12 cold requests retried against a median of 0"),
    ({"decode": 5e-5}, "decode/map takes 50 us per sample against a median of 10 us"),
    ({}, "waits for data with no tier, cache or decode figure standing out"),
])
def test_the_cause_of_a_data_straggler(change, cause):
    docs = [summary(r) for r in range(6)]
    docs[1] = summary(1, wait=0.040, step=0.14, **change)
    (f,) = detect(docs, now=NOW).stragglers
    assert f.kind == "data" and f.message.startswith(f"data: {cause}")


def test_a_small_wait_is_not_named_even_if_many_times_the_median():
    docs = [summary(r, wait=0.0001) for r in range(6)]
    docs[3] = summary(3, wait=0.001)  # 10x the median wait, but 1% of a step
    assert detect(docs, now=NOW).ok
    assert detect(docs, now=NOW, min_share=0.005).named("data") == [3]


def test_a_rank_that_stopped_publishing_is_stale_and_not_compared():
    docs = [summary(r) for r in range(6)]
    docs[0] = summary(0, step=0.5, wait=0.4, age=120.0)  # the last thing it said before it died
    report = detect(docs, now=NOW)
    assert report.stragglers == () and report.named("stale") == [0]
    (f,) = report.others
    assert f.message.startswith("stale: its last summary (window 2) is 120 s old, older than 30 s")
    assert report.compared == 5
    assert detect(docs, now=NOW, stale_s=500).named("data") == [0]


def test_a_rank_stuck_waiting_for_data_is_named_data_not_stale():
    docs = [summary(r) for r in range(6)]
    docs[2] = summary(2, steps=0, wait=0.0, waiting_now=9.5)  # no batch at all this window
    (f,) = detect(docs, now=NOW).stragglers
    assert (f.rank, f.kind) == (2, "data") and "waits 9.5 s per step" in f.message


def test_idle_and_missing_ranks_and_sub_groups():
    docs = [summary(r) for r in range(8)]
    docs[6] = summary(6, steps=0, wait=0.0)
    docs[3] = summary(3, step=0.3)
    report = detect(docs, now=NOW)
    assert report.named("idle") == [6] and report.named("compute") == [3]
    sub = detect(docs, now=NOW, ranks=[0, 1, 2, 9])  # a sub-group: only its ranks are compared
    assert sub.compared == 3 and sub.stragglers == () and sub.named("missing") == [9]
    assert detect(docs, now=NOW, ranks=[2, 3, 4, 5]).named("compute") == [3]


def test_the_newest_summary_of_a_rank_is_the_one_compared():
    docs = [summary(r) for r in range(5)]
    docs.append(replace(summary(1, step=0.4), time=NOW - 5.0))  # older than rank 1's other summary
    assert detect(docs, now=NOW).ok
    docs.append(replace(summary(1, step=0.4), time=NOW - 0.5))
    assert detect(docs, now=NOW).named("compute") == [1]


def test_two_ranks_name_nobody_and_an_empty_board_compares_nothing():
    assert detect([summary(0), summary(1, step=0.3)], now=NOW).stragglers == ()
    report = detect([], now=NOW)
    assert report.compared == 0 and report.ok and "no rank to compare" in report.format()


def test_the_report_as_text_and_json():
    docs = [summary(r) for r in range(4)] + [summary(4, step=0.5)]
    report = detect(docs, now=NOW)
    text = report.format()
    assert "5 rank(s) compared: median step 100 ms" in text and "straggler rank 4 (node2): compute:" in text
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["stragglers"][0]["rank"] == 4 and doc["compared"] == 5


@pytest.mark.parametrize("kwargs", [{"k": 1}, {"k": 0.5}, {"k": float("nan")}, {"min_share": -1}, {"stale_s": 0},
                                    {"now": "now"}])
def test_bad_arguments_are_option_errors(kwargs):
    with pytest.raises(OptionError, match=next(iter(kwargs))):
        detect([summary(0)], **kwargs)


def test_documents_with_bad_numbers_are_unreadable_and_named():
    good = [summary(r).to_dict() for r in range(4)]
    bad = [
        {**summary(4).to_dict(), "steps": "many"},
        {**summary(5).to_dict(), "data_wait_s": -1},
        {**summary(6).to_dict(), "step_s": True},
        {**summary(7).to_dict(), "rank": -3},
        {**summary(8).to_dict(), "tiers": {"warm": {"bytes": 5, "bytes_per_s": -1.0}}},
        {**summary(11).to_dict(), "tiers": {"warm": {"bytes_per_s": "fast"}}},
        {**summary(12).to_dict(), "tiers": ["warm"]},
        {**summary(9).to_dict(), "time": float("inf")},
        ["not", "a", "dict"],
        {**summary(10).to_dict(), "cache_hit_ratio": float("-inf")},
    ]
    report = detect(good + bad, now=NOW)
    kinds = {f.kind for f in report.others}
    assert kinds == {"unreadable"} and len(report.others) == len(bad)
    reasons = [f.message for f in report.others]
    assert any("steps 'many' is not a number" in m for m in reasons)
    assert any("data_wait_s -1 is negative" in m for m in reasons)
    assert any("step_s True is not a number" in m for m in reasons)
    assert any("tiers is not an object of tier objects" in m for m in reasons)
    assert report.compared == 4


def test_parse_summary_checks_what_it_reads():
    doc = summary(3).to_dict()
    assert parse_summary(json.dumps(doc).encode(), "x")["rank"] == 3
    for data, why in [(b"{", "not JSON"), (b"[1]", "not a window summary object"),
                      (json.dumps({**doc, "format": "other"}).encode(), "format"),
                      (json.dumps({**doc, "version": 99}).encode(), "version 99"),
                      (json.dumps({**doc, "rank": "3"}).encode(), "rank"),
                      (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
                      (b" " * (2 << 20), "more than a window summary may be")]:
        with pytest.raises(HealthError, match=why):
            parse_summary(data, "board/rank-3.json")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=20)


@settings(max_examples=150)
@given(st.lists(st.dictionaries(st.sampled_from([*sorted(summary(0).to_dict()), "x"]), json_values, max_size=12),
                max_size=6), st.lists(st.integers(0, 12), max_size=6))
def test_hostile_documents_never_crash_the_detector(docs, overrides):
    base = [summary(r).to_dict() for r in range(3)]
    mixed = base + [{**summary(3 + i).to_dict(), **d} for i, d in enumerate(docs)] + docs
    report = detect(mixed, now=NOW, ranks=overrides or None)
    assert report.compared + len(report.others) >= 0
    for f in (*report.stragglers, *report.others):
        assert isinstance(f.message, str) and f.message


@settings(max_examples=200)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_hostile_bytes_are_health_errors(data):
    try:
        doc = parse_summary(data, "rank-000001.json")
    except HealthError:
        return
    assert isinstance(doc, dict)
    SummaryTable.from_summaries([doc])


# -- real ranks ------------------------------------------------------------------------------

WINDOW_STEPS = 6
SLOW_DATA, SLOW_COMPUTE = 1, 3
RANKS = 5


def _train(rank, data_file, tel, slow_data_s, compute_s, step_hook=None):
    """A rank's loop: read the next chunk of its node-local file (the data, slowed on one
    rank by sleeps inside the read), then compute (a sleep, longer on one rank), until two
    windows have been closed."""
    chunk = 256 << 10
    with open(data_file, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while tel.windows < 2:
            t0 = tel.wait_begin()
            r0 = time.perf_counter()
            data = os.pread(f.fileno(), chunk, pos)
            if slow_data_s:
                time.sleep(slow_data_s)  # a throttled local disk
            tel.read("node-local", len(data), time.perf_counter() - r0)
            tel.hit("node-local")
            pos = (pos + chunk) % (size - chunk)
            tel.wait_end(t0)
            c0 = time.perf_counter()
            time.sleep(compute_s)
            tel.compute(time.perf_counter() - c0)
            if step_hook is not None:
                step_hook()
            tel.step()


def _data_file(tmp_path):
    path = tmp_path / "node-local.bin"
    path.write_bytes(os.urandom(4 << 20))
    return str(path)


def _file_rank(rank, run_dir, data_file):
    tel = Telemetry(window_s=None, window_steps=WINDOW_STEPS, rank=rank)
    board = FileBoard(run_dir)
    pub = Publisher(tel, board)
    _train(rank, data_file, tel, 0.06 if rank == SLOW_DATA else 0.0, 0.08 if rank == SLOW_COMPUTE else 0.02)
    if not pub.flush(60):
        raise AssertionError(f"rank {rank} could not publish")
    pub.close()  # the final (partial) window below is not published
    tel.close()
    board.close()
    if pub.errors:
        raise AssertionError(f"rank {rank}: {pub.errors} publish errors")


def test_ranks_publishing_to_a_file_board_are_named_with_their_cause(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    spawn_ranks(_file_rank, (run_dir, _data_file(tmp_path)), RANKS)
    read = FileBoard(run_dir).read()
    assert sorted(d["rank"] for d in read.docs) == list(range(RANKS)) and not read.unreadable
    assert all(d["seq"] == 2 for d in read.docs)  # named from the second window
    assert not any(n.startswith(".tmp-") for n in os.listdir(os.path.join(run_dir, "health")))
    # the ranks do not synchronise: a slow rank's step time is its own. The slowed ranks are
    # 3-4x the others: k and min_share leave room for a loaded machine's hiccups
    report = detect(read, k=2.0, min_share=0.2)
    named = {f.rank: f for f in report.stragglers}
    assert set(named) == {SLOW_DATA, SLOW_COMPUTE}, report.format()
    assert named[SLOW_DATA].kind == "data" and "data: node-local tier reads" in named[SLOW_DATA].message
    assert named[SLOW_COMPUTE].kind == "compute"
    assert not report.others
    # the same from outside the job, through the command line
    margins = ["-k", "2", "--min-share", "0.2"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "status", run_dir, *margins], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 1, out.stderr
    assert f"straggler rank {SLOW_DATA} (" in out.stdout and "data: node-local tier reads" in out.stdout
    assert f"straggler rank {SLOW_COMPUTE} (" in out.stdout and "compute: data wait normal" in out.stdout
    js = subprocess.run([sys.executable, "-m", "datapipe.cli", "status", run_dir, "--json", "--ranks", "0,2,4",
                         *margins], capture_output=True, text=True, env=env)
    assert js.returncode == 0, js.stdout + js.stderr  # the sub-group of the normal ranks: nobody named
    assert json.loads(js.stdout)["compared"] == 3


def _store_rank(rank, port, data_file, out_dir):
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, RANKS, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    try:
        tel = Telemetry(window_s=None, window_steps=WINDOW_STEPS, rank=rank)
        pub = Publisher(tel, StoreBoard(store, group="train"))
        grad = torch.ones(1024)

        def all_reduce():  # synchronous training: every step waits for the slowest rank
            dist.all_reduce(grad)

        _train(rank, data_file, tel, 0.06 if rank == SLOW_DATA else 0.0, 0.08 if rank == SLOW_COMPUTE else 0.02,
               all_reduce)
        if not pub.flush(60):
            raise AssertionError(f"rank {rank} could not publish")
        pub.close()
        tel.close()
        dist.barrier()  # the test's own collective: every rank has published its second window
        if rank == 0:  # the detector, run on a rank, reading the store without waiting on anyone
            read = StoreBoard(store, group="train", world_size=RANKS).read()
            report = detect(read, k=2.0, min_share=0.2)
            sub = detect(StoreBoard(store, group="train").read(ranks=[0, 2, 3, 4]), ranks=[0, 2, 3, 4], k=2.0,
                         min_share=0.2)
            with open(os.path.join(out_dir, "report.json"), "w") as f:
                json.dump({"all": report.to_dict(), "sub": sub.to_dict(),
                           "seqs": sorted(d["seq"] for d in read.docs)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_publishing_to_the_jobs_tcpstore_are_named_with_their_cause(tmp_path):
    spawn_ranks(_store_rank, (free_port(), _data_file(tmp_path), str(tmp_path)), RANKS)
    result = json.loads((tmp_path / "report.json").read_text())
    assert result["seqs"] == [2] * RANKS
    named = {f["rank"]: f for f in result["all"]["stragglers"]}
    assert set(named) == {SLOW_DATA, SLOW_COMPUTE}, result
    assert named[SLOW_DATA]["kind"] == "data" and "node-local tier reads" in named[SLOW_DATA]["message"]
    # the ranks synchronise every step: their step times are alike, their compute times are not
    assert named[SLOW_COMPUTE]["kind"] == "compute" and "compute time" in named[SLOW_COMPUTE]["message"]
    assert result["all"]["others"] == []
    sub = result["sub"]  # a sub-group without the data straggler
    assert sub["compared"] == 4 and [f["rank"] for f in sub["stragglers"]] == [SLOW_COMPUTE]


def test_summaries_of_real_recorders_round_trip_through_the_table():
    tel = Telemetry(window_s=None, rank=7)
    tel.read("warm", 1 << 20, 0.001)
    tel.data_wait(0.5)
    s = tel.close_window()
    table = SummaryTable.from_summaries([s, s.to_dict()])
    assert table.ranks.tolist() == [7] and not table.unreadable
    assert math.isclose(table.wait_s[0], 0.5)
    assert isinstance(HealthError("x"), DatapipeError)
