"""Costs of the health layer: telemetry records against a batch's time at 16 KiB samples,
the publish step per window, and the straggler detector over 10^5 ranks' summaries.

    python -m benchmarks.bench_health [--ranks 100000] [--samples 8192] [--out result.json]

Printed (JSON):

- ``records``: ns per call of each recorder method (a tight loop on one thread), beside
  ``floor_ns``: an empty method call of a plain object measured in the same run, the least
  any Python-level record can cost on this machine.
- ``batch``: a real in-process pass of ``StreamingDataset(batched=True)`` over a corpus of
  16 KiB samples (``--samples``, packed here, read from the page cache), 256 per batch:
  seconds per batch without telemetry (the pass's time, its reads included, over its
  batches; the best of 5);
  the telemetry calls the loader will make per batch (``wait_begin``/``wait_end``,
  ``step``, ``decode``, ``prefetch_depth``; a worker's ``export`` and the main process's
  ``merge`` at most every 100 ms; one ``read`` + ``hit`` per shard), their cost per batch
  measured on their own, and that cost as a share of the batch (the target: at most 1%);
  beside them the floor, ``read_floor_batch_s``: the pass's shard files read once from
  the page cache on one thread, per batch.
  The same pass with the calls wrapped around ``next()`` is reported too; its difference
  is within the pass's own noise (``pass_noise_pct``).
- ``window``: closing a window (summing four threads' counters, summarising) and writing
  its JSON line, on the window thread.
- ``publish``: one window summary published, the board's call as the publisher's thread
  makes it (target: at most 1 ms per window per rank): a ``FileBoard`` on local disk, a
  ``StoreBoard`` over a ``TCPStore`` on 127.0.0.1; and the hand-over the window thread
  makes (``Publisher.offer``).
- ``detector``: ``detect`` over ``--ranks`` synthetic summaries (documents as a board
  holds them), 0.1% of them slowed (half in a tier, half in compute), including the
  documents' conversion to columns (target: at most 1 s); checked to name exactly the
  slowed ranks with the right cause. Wall and CPU seconds of this process (on a shared
  machine the wall time includes other processes' turns: ``load_average`` is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import timeit
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.output import print_json  # noqa: E402
from datapipe.health import FileBoard, Publisher, StoreBoard, detect  # noqa: E402
from datapipe.health.summary import SummaryTable  # noqa: E402
from datapipe.telemetry import Telemetry, TierSummary, WindowSummary  # noqa: E402

SAMPLE_BYTES = 16 << 10
BATCH = 256


class _Plain:
    def f(self, a: Any, b: Any) -> None:
        pass


def _ns(stmt: str, env: dict[str, Any], n: int = 200_000) -> float:
    best = min(timeit.repeat(stmt, globals=env, number=n, repeat=5))
    return best / n * 1e9


def bench_records() -> dict[str, float]:
    tel = Telemetry(window_s=None)
    env = {"tel": tel, "p": _Plain()}
    t0 = tel.wait_begin()
    env["t0"] = t0
    out = {"floor_ns": _ns("p.f(1, 2)", env)}
    for name, stmt in [("read", "tel.read('warm', 16384, 1e-5)"), ("hit", "tel.hit('warm')"),
                       ("data_wait", "tel.data_wait(1e-4)"), ("wait_begin_end", "tel.wait_end(tel.wait_begin())"),
                       ("step", "tel.step()"), ("compute", "tel.compute(1e-3)"), ("decode", "tel.decode(1e-3, 256)"),
                       ("prefetch_depth", "tel.prefetch_depth(4)"), ("throttled", "tel.throttled()")]:
        out[f"{name}_ns"] = _ns(stmt, env)
    worker = Telemetry(window_s=None)
    worker.read("warm", 1, 1e-5)
    env["worker"], env["blob"] = worker, worker.export(force=True)
    out["export_us"] = _ns("worker.export(force=True)", env, 2000) / 1e3
    out["merge_us"] = _ns("tel.merge(blob)", env, 2000) / 1e3
    return out


def _corpus(workdir: str, samples: int) -> str:
    import datapipe

    dest = os.path.join(workdir, "ds")
    if os.path.exists(os.path.join(dest, "manifest.json")):
        return dest
    src = os.path.join(workdir, "src")
    rng = np.random.default_rng(0)
    for i in range(samples):
        d = os.path.join(src, f"{i // 1000:03d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"s{i:07d}.bin"), "wb") as f:
            f.write(rng.bytes(SAMPLE_BYTES))
    datapipe.pack(src, dest, shard_bytes=32 << 20, progress=False)
    return dest


def _pass(dataset_url: str, tel: Telemetry | None) -> float:
    """One epoch of batches in this process, its shards read from the page cache by the
    dataset's prefetcher as it goes; seconds per batch (the pass's time over its batches)."""
    from datapipe import StreamingDataset

    ds = StreamingDataset(dataset_url, batch_size=BATCH, batched=True, seed=1)
    n, t0 = 0, time.perf_counter()
    it = iter(ds)
    while True:
        if tel is not None:
            w = tel.wait_begin()
        try:
            batch = next(it)
        except StopIteration:
            break
        if tel is not None:
            tel.wait_end(w)
            tel.decode(1e-4, BATCH)
            tel.prefetch_depth(3)
            tel.step()
        del batch
        n += 1
    return (time.perf_counter() - t0) / n


def bench_batch(workdir: str, samples: int, records: dict[str, float]) -> dict[str, Any]:
    url = _corpus(workdir, samples)
    _pass(url, None)  # the page cache and the buffer pool warmed
    tel = Telemetry(window_s=None)
    plain, wrapped = [], []
    for _ in range(5):  # alternated, so that a busy moment of the machine falls on both
        plain.append(_pass(url, None))
        wrapped.append(_pass(url, tel))
    batch_s = min(plain)
    # the floor: every shard file read once from the page cache, per batch of the pass
    shards = [os.path.join(dp, f) for dp, _, fs in os.walk(url) for f in fs if f.endswith(".tar")]
    batches = -(-samples // BATCH)
    floors = []
    for _ in range(3):
        t0 = time.perf_counter()
        for path in shards:
            with open(path, "rb", buffering=0) as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(buf)
        floors.append((time.perf_counter() - t0) / batches)
    samples_per_shard = (32 << 20) // SAMPLE_BYTES
    # what the loader records per batch: the trainer's wait and step, the batch's decode and
    # prefetch depth, one cache read and hit per shard (amortised), a worker's export and
    # the main process's merge at most every 100 ms (at most one per batch)
    per_batch_ns = (records["wait_begin_end_ns"] + records["step_ns"] + records["decode_ns"]
                    + records["prefetch_depth_ns"]
                    + (records["read_ns"] + records["hit_ns"]) * BATCH / samples_per_shard
                    + min(1.0, batch_s / 0.1) * (records["export_us"] + records["merge_us"]) * 1e3)
    return {"samples": samples, "sample_bytes": SAMPLE_BYTES, "batch_size": BATCH, "batch_s": batch_s,
            "batch_MB_s": BATCH * SAMPLE_BYTES / batch_s / 1e6, "read_floor_batch_s": min(floors),
            "telemetry_per_batch_us": per_batch_ns / 1e3, "overhead_pct": per_batch_ns / 1e9 / batch_s * 100,
            "overhead_of_floor_pct": per_batch_ns / 1e9 / min(floors) * 100,
            "target_pct": 1.0, "batch_s_with_telemetry": min(wrapped),
            "pass_noise_pct": (max(plain) - min(plain)) / min(plain) * 100}


def bench_window(tmp: str) -> dict[str, float]:
    tel = Telemetry(window_s=None, metrics_path=os.path.join(tmp, "m.jsonl"))
    go = threading.Barrier(5)
    stop = threading.Event()

    def work() -> None:  # four threads with counters of their own
        tel.read("warm", 16384, 1e-5)
        go.wait()
        stop.wait()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    go.wait()
    times = []
    for _ in range(200):
        tel.data_wait(1e-3)
        t0 = time.perf_counter()
        tel.close_window()
        times.append(time.perf_counter() - t0)
    stop.set()
    for t in threads:
        t.join()
    return {"close_window_us_median": statistics.median(times) * 1e6, "close_window_us_max": max(times) * 1e6}


def _doc(rank: int, rng: np.random.Generator, now: float, slow: str | None = None) -> dict[str, Any]:
    step = 0.1 * (1 + 0.05 * rng.standard_normal())
    wait = 0.002 * (1 + 0.2 * rng.random())
    local_bps = 1.8e9 * (1 + 0.1 * rng.standard_normal())
    if slow == "data":
        local_bps, wait, step = 40e6, 0.06, step + 0.06
    elif slow == "compute":
        step *= 2
    tiers = {"memory": _tier(12e9), "node-local": _tier(local_bps), "cold": _tier(3e8)}
    return WindowSummary(
        seq=12, rank=rank, host=f"node{rank // 8}", pid=1000 + rank, time=now - 2, duration_s=10.0, final=False,
        steps=100, step_s=step * 100, step_mean_s=step, step_p50_s=step, step_p95_s=step * 1.2, waits=100,
        data_wait_s=wait * 100, data_wait_mean_s=wait, data_wait_p50_s=wait, data_wait_p95_s=wait * 2,
        data_wait_fraction=wait / step, waiting_now_s=0.0, computes=0, compute_s=0.0, compute_mean_s=None,
        decode_s=0.1, decoded_samples=25600, decode_per_sample_s=0.1 / 25600, cold_retries=0, cold_throttled=0,
        prefetch_depth=3.0, prefetch_depth_mean=3.0,
        cache_hit_ratio=0.97, tiers=tiers).to_dict()


def _tier(bps: float) -> TierSummary:
    nbytes = 256 << 20
    return TierSummary(reads=64, bytes=nbytes, seconds=nbytes / bps, hits=64, misses=2, errors=0, bytes_per_s=bps,
                       latency_mean_s=nbytes / bps / 64, latency_p50_s=None, latency_p95_s=None, hit_ratio=0.97)


def bench_detector(ranks: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    now = time.time()
    n_slow = max(2, ranks // 1000)
    slow = {int(r): ("data" if i % 2 == 0 else "compute")
            for i, r in enumerate(rng.choice(ranks, size=n_slow, replace=False))}
    docs = [_doc(r, rng, now, slow.get(r)) for r in range(ranks)]
    c0, t0 = time.process_time(), time.perf_counter()
    table = SummaryTable.from_summaries(docs)
    c1, t1 = time.process_time(), time.perf_counter()
    report = detect(table, now=now)
    c2, t2 = time.process_time(), time.perf_counter()
    walls, cpus = [], []
    for _ in range(3):
        c, w = time.process_time(), time.perf_counter()
        detect(docs, now=now)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    named = {f.rank: f.kind for f in report.stragglers}
    return {"ranks": ranks, "slowed": n_slow, "detect_s": min(walls), "detect_cpu_s": min(cpus),
            "columns_s": t1 - t0, "columns_cpu_s": c1 - c0, "compare_s": t2 - t1, "compare_cpu_s": c2 - c1,
            "target_s": 1.0, "named_exactly_the_slowed": named == slow,
            "data_cause_names_the_tier": all("node-local tier reads" in f.message
                                             for f in report.stragglers if f.kind == "data")}


def bench_publish(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    tel = Telemetry(window_s=None, rank=0)
    tel.read("warm", 16384, 1e-4)
    tel.data_wait(1e-3)
    summary = tel.close_window()
    doc = summary.to_dict()
    out: dict[str, Any] = {"summary_bytes": len(str(doc))}
    board = FileBoard(tmp)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        board.publish(0, doc)
        times.append(time.perf_counter() - t0)
    out["file_board_ms_median"] = statistics.median(times) * 1e3
    out["file_board_ms_p95"] = float(np.percentile(times, 95)) * 1e3
    from tests.ranks import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=30))
    sboard = StoreBoard(client)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        sboard.publish(0, doc)
        times.append(time.perf_counter() - t0)
    out["tcpstore_board_ms_median"] = statistics.median(times) * 1e3
    out["tcpstore_board_ms_p95"] = float(np.percentile(times, 95)) * 1e3
    out["target_ms"] = 1.0
    pub = Publisher(tel, sboard)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        pub.offer(summary)
        times.append(time.perf_counter() - t0)
    pub.close()
    out["publisher_offer_us_median"] = statistics.median(times) * 1e6
    del master
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=100_000, help="simulated ranks for the detector (default 10^5)")
    ap.add_argument("--samples", type=int, default=8192, help="16 KiB samples in the loader pass (default 8192)")
    ap.add_argument("--workdir", default=None, help="where the corpus is packed (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = a.workdir or tmp
        records = bench_records()
        result = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "records": records,
                  "batch": bench_batch(workdir, a.samples, records), "window": bench_window(tmp),
                  "publish": bench_publish(os.path.join(tmp, "board")), "detector": bench_detector(a.ranks)}
    print_json(result, a.out)


if __name__ == "__main__":
    main()
