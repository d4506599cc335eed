"""The loader's telemetry: StreamingDataLoader(telemetry=, metrics_path=, metrics_port=)
records the trainer's data wait and step time per batch, and its DataLoader workers' decode/map
time, prefetch depth and reads per tier reach the main process's windows through the
batches; stats() is the open window; metrics_path gets one JSON line per window; metrics_port
serves Prometheus (real prometheus_client over HTTP on 127.0.0.1). Real worker processes
(fork and spawn), real shards, a real TieredCache; slowdowns are sleeps in map= (ordering is
asserted, never a wall-clock threshold)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client import parser
from torch.utils.data import DataLoader

from datapipe import ShardWriter, StreamingDataLoader, StreamingDataset, TokenDataset
from datapipe.cache import TieredCache
from datapipe.errors import LoaderOptionError, MissingDependencyError
from datapipe.health import FileBoard, Publisher
from datapipe.storage import RetryPolicy
from datapipe.storage.faults import FaultInjectingStore
from datapipe.telemetry import SUMMARY_FORMAT, Telemetry
from tests.token_datasets import random_documents, write_tokens

N = 96
B = 8


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("tel") / "ds")
    with ShardWriter(url, max_samples=20) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "cls": str(i), "bin": bytes(1000 + i)})
    return url


class _Sleep:
    """A map= that sleeps (picklable for spawned workers): a deterministic slowdown of the
    data, ``seconds`` per sample at least."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, sample):
        if self.seconds:
            time.sleep(self.seconds)
        return sample


def _drain(loader):
    n = 0
    for _ in loader:
        n += 1
    return n


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_windows_count_the_batches_delivered_and_lines_parse(ds_url, tmp_path):
    path = tmp_path / "metrics.jsonl"
    tel = Telemetry(window_s=None, window_steps=3, metrics_path=path)
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2, telemetry=tel), batch_size=B, num_workers=2)
    delivered = _drain(loader) + _drain(loader)  # two passes of persistent workers
    tel.close()
    assert delivered == 2 * (N // B)
    docs = _lines(path)
    assert len(docs) >= 2 and all(d["format"] == SUMMARY_FORMAT for d in docs)
    assert [d["seq"] for d in docs] == list(range(1, len(docs) + 1))
    assert not any(d["final"] for d in docs[:-1])
    assert sum(d["waits"] for d in docs) == delivered  # one data wait per batch handed out
    assert sum(d["steps"] for d in docs) == delivered - 1  # the first batch starts the first step
    assert all(d["data_wait_s"] >= 0 and d["step_s"] >= 0 for d in docs)


def test_loader_made_telemetry_writes_its_final_window_on_close(ds_url, tmp_path):
    path = tmp_path / "m.jsonl"
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2), batch_size=B, metrics_path=path)
    assert loader.telemetry is not None and loader.stream.telemetry is loader.telemetry
    delivered = _drain(loader)
    assert not path.exists()  # a 10 s window has not closed yet
    loader.close()
    (doc,) = _lines(path)
    assert doc["final"] is True and doc["waits"] == delivered == N // B


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_time_reaches_the_main_window(ds_url, tmp_path, context):
    """decode/map runs only in the workers (a map= that sleeps 4 ms a sample), and the
    shards are read there: both show in the main process's window."""
    tel = Telemetry(window_s=None, export_interval_s=0)
    ds = StreamingDataset(ds_url, window=2, map=_Sleep(0.004), telemetry=tel)
    loader = StreamingDataLoader(ds, batch_size=B, num_workers=2, multiprocessing_context=context)
    delivered = _drain(loader)
    s = loader.stats()
    tel.close()
    assert delivered == N // B and s["waits"] == delivered
    assert s["decoded_samples"] > 0
    assert s["decode_s"] >= 0.004 * s["decoded_samples"]  # each sample slept that long, at least
    cold = s["tiers"]["cold"]  # no cache: the workers' fetches of the dataset's shards
    assert cold["reads"] > 0 and cold["bytes"] > 0 and cold["seconds"] > 0
    assert s["pid"] != 0 and tel.totals().decode[2] == s["decoded_samples"]


def test_a_caches_tiers_in_the_workers_reach_the_main_window(ds_url, tmp_path):
    tel = Telemetry(window_s=None, export_interval_s=0)
    # the memory tier: read through cache.read (a warm_dir's pinned copies are read by the loader)
    cache = TieredCache(hot_bytes=64 << 20)
    ds = StreamingDataset(ds_url, window=2, cache=cache)
    loader = StreamingDataLoader(ds, batch_size=B, num_workers=2, telemetry=tel)
    assert ds.telemetry is tel and cache.telemetry is tel  # the loader hands its recorder down
    _drain(loader)
    first = tel.close_window()
    _drain(loader)
    second = loader.stats()
    tel.close()
    assert first.tiers["cold"].reads > 0 and first.tiers["cold"].bytes > 0
    assert first.tiers["memory"].misses > 0
    assert first.cache_hit_ratio is not None
    # the second epoch reads what the first one left in the memory tier (the workers persist)
    assert second["tiers"]["memory"]["hits"] > 0 and second["tiers"]["memory"]["bytes"] > 0
    assert second["cache_hit_ratio"] > first.cache_hit_ratio


def test_a_warm_tiers_pinned_copies_count_as_warm_reads(ds_url, tmp_path):
    """With a warm_dir the loader pins each shard's warm copy and reads it itself: the
    cache counts the warm lookup (hit or miss), the loader the copy's bytes and seconds."""
    tel = Telemetry(window_s=None, export_interval_s=0)
    cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=64 << 20)
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2, cache=cache), batch_size=B, num_workers=2,
                                 telemetry=tel)
    _drain(loader)
    first = tel.close_window()
    _drain(loader)
    second = loader.stats()
    tel.close()
    assert first.tiers["cold"].reads > 0 and first.tiers["warm"].misses > 0
    warm = second["tiers"]["warm"]
    assert warm["hits"] > 0 and warm["reads"] > 0 and warm["bytes"] > 0 and warm["seconds"] > 0
    assert "cold" not in second["tiers"]  # every shard is in the warm tier by now


def test_retries_and_throttling_of_reads_without_a_cache_are_counted(ds_url):
    """Each shard's first read answers 503 SlowDown, its second a connection reset: the
    loader's own retries count both, the 503 as throttled too."""
    tel = Telemetry(window_s=None)
    ds = StreamingDataset(ds_url, window=2, telemetry=tel)
    ds.source.retry = RetryPolicy(base_delay_s=0.001, max_delay_s=0.01)
    for ix in ds.source.indexes:
        ix.store = FaultInjectingStore(ix.store, errors=1, resets=1)
    loader = StreamingDataLoader(ds, batch_size=B, num_workers=0)
    delivered = _drain(loader)
    s = loader.stats()
    tel.close()
    shards = len(ds.source.counts)
    assert delivered == N // B and s["tiers"]["cold"]["reads"] >= shards
    assert s["cold_throttled"] == shards and s["cold_retries"] == 2 * shards


def test_without_workers_the_same_figures_are_recorded(ds_url):
    tel = Telemetry(window_s=None)
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2, map=_Sleep(0.001), telemetry=tel),
                                 batch_size=B, num_workers=0)
    delivered = _drain(loader)
    s = loader.stats()
    tel.close()
    assert s["waits"] == delivered == N // B
    assert s["decoded_samples"] == N  # every sample decoded in this process, recorded by the pass's end
    assert s["tiers"]["cold"]["reads"] > 0


def _wait_when(url, map_s):
    tel = Telemetry(window_s=None)
    loader = StreamingDataLoader(StreamingDataset(url, window=2, map=_Sleep(map_s), telemetry=tel),
                                 batch_size=B, num_workers=1)
    _drain(loader)
    s = tel.close_window()
    tel.close()
    return s


def test_data_wait_is_larger_when_the_data_is_slowed(ds_url):
    fast = _wait_when(ds_url, 0.0)
    slow = _wait_when(ds_url, 0.01)  # 10 ms a sample in the worker: at least ~1 s over the pass
    assert fast.waits == slow.waits == N // B
    assert slow.data_wait_s > fast.data_wait_s
    assert slow.step_s > fast.step_s
    assert slow.decode_s > fast.decode_s


def test_stats_keys_and_their_kinds(ds_url):
    tel = Telemetry(window_s=None)
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2), batch_size=B, num_workers=1, telemetry=tel)
    _drain(loader)
    s = loader.stats()
    tel.close()
    documented = {"format", "version", "seq", "rank", "host", "pid", "time", "duration_s", "final", "steps",
                  "step_s", "step_mean_s", "step_p50_s", "step_p95_s", "waits", "data_wait_s", "data_wait_mean_s",
                  "data_wait_p50_s", "data_wait_p95_s", "data_wait_fraction", "waiting_now_s", "computes",
                  "compute_s", "compute_mean_s", "decode_s", "decoded_samples", "decode_per_sample_s",
                  "cold_retries", "cold_throttled", "prefetch_depth", "prefetch_depth_mean", "cache_hit_ratio",
                  "tiers"}
    assert set(s) == documented
    assert s["final"] is False and s["waits"] == N // B
    assert set(s["tiers"]["cold"]) == {"reads", "bytes", "seconds", "hits", "misses", "errors", "bytes_per_s",
                                       "latency_mean_s", "latency_p50_s", "latency_p95_s", "hit_ratio"}
    json.dumps(s, allow_nan=False)  # what a metrics line holds
    assert s["prefetch_depth_mean"] is not None and s["prefetch_depth_mean"] > 0  # bytes read ahead


def test_stats_without_telemetry_says_how_to_get_it(ds_url):
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2), batch_size=B)
    assert loader.telemetry is None
    with pytest.raises(LoaderOptionError, match="telemetry="):
        loader.stats()


def test_a_plain_dataloader_gets_only_what_runs_in_this_process(ds_url):
    """What the StreamingDataLoader docstring says of a plain torch DataLoader: without
    workers the pass records here; its workers' counts stay in their copies, and nothing
    times next() (the trainer can, with wait_begin/wait_end/step)."""
    tel = Telemetry(window_s=None)
    ds = StreamingDataset(ds_url, window=2, map=_Sleep(0.0), telemetry=tel)
    assert sum(1 for _ in DataLoader(ds, batch_size=B, num_workers=0)) == N // B
    here = tel.close_window()
    assert here.decoded_samples == N and here.waits == 0
    assert sum(1 for _ in DataLoader(ds, batch_size=B, num_workers=2)) == N // B
    workers = tel.close_window()
    tel.close()
    assert workers.decoded_samples == 0  # (the first pass's read ahead still fetches here)


def _scrape(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return {f.name: f for f in parser.text_string_to_metric_families(r.read().decode())}


def _value(family, name, **labels):
    return sum(s.value for s in family.samples if s.name == name and all(s.labels.get(k) == v
                                                                         for k, v in labels.items()))


def test_metrics_port_serves_prometheus_and_close_frees_it(ds_url):
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2, map=_Sleep(0.0)), batch_size=B, num_workers=2,
                                 metrics_port=0, metrics_addr="127.0.0.1")
    server = loader.metrics_server
    assert server is not None and server.url.startswith("http://127.0.0.1:")
    delivered = _drain(loader)
    fams = _scrape(server.url)
    loader.telemetry.close_window()  # the ratio gauge shows the last closed window
    again = _scrape(server.url)
    loader.close()
    assert _value(fams["datapipe_data_wait_duration_seconds"], "datapipe_data_wait_duration_seconds_count") \
        == delivered
    assert _value(fams["datapipe_steps"], "datapipe_steps_total") == delivered - 1
    assert _value(fams["datapipe_tier_reads"], "datapipe_tier_reads_total", tier="cold") > 0
    assert {s.labels["rank"] for f in fams.values() for s in f.samples} == {"0"}
    assert "datapipe_data_wait_ratio" in again
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_metrics_port_without_prometheus_client_names_the_extra(ds_url):
    probe = ("import sys; sys.modules['prometheus_client'] = None\n"
             "from datapipe import StreamingDataLoader, StreamingDataset\n"
             "from datapipe.errors import MissingDependencyError\n"
             f"ds = StreamingDataset({ds_url!r})\n"
             "try:\n    StreamingDataLoader(ds, batch_size=4, metrics_port=0, metrics_addr='127.0.0.1')\n"
             "except MissingDependencyError as e:\n    print('ok', e)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("ok"), out.stderr
    assert "datapipe[metrics]" in out.stdout and "metrics_port" in out.stdout
    assert issubclass(MissingDependencyError, ImportError)


def test_a_health_publisher_takes_the_loaders_windows(ds_url, tmp_path):
    loader = StreamingDataLoader(StreamingDataset(ds_url, window=2), batch_size=B, num_workers=1,
                                 telemetry=Telemetry(window_s=None, window_steps=4, rank=0))
    publisher = Publisher(loader.telemetry, FileBoard(str(tmp_path / "run")))
    delivered = _drain(loader)
    loader.telemetry.close()
    assert publisher.flush(60)
    publisher.close()
    (doc,) = FileBoard(str(tmp_path / "run")).read().docs
    assert doc["rank"] == 0 and doc["format"] == SUMMARY_FORMAT and doc["waits"] <= delivered


def test_token_loaders_get_data_wait_and_step_time(tmp_path):
    rng = np.random.default_rng(0)
    write_tokens(tmp_path / "tok", [random_documents(rng, 30), random_documents(rng, 25)])
    tel = Telemetry(window_s=None)
    loader = StreamingDataLoader(TokenDataset(str(tmp_path / "tok"), 16, seed=3, window=2, chunk_tokens=96),
                                 batch_size=4, num_workers=2, multiprocessing_context="fork", telemetry=tel)
    delivered = _drain(loader)
    s = loader.stats()
    tel.close()
    assert delivered > 0 and s["waits"] == delivered and s["steps"] == delivered - 1


def test_bad_telemetry_arguments_are_named(ds_url, tmp_path):
    ds = StreamingDataset(ds_url)
    with pytest.raises(LoaderOptionError, match="telemetry='yes'"):
        StreamingDataLoader(ds, batch_size=4, telemetry="yes")
    with pytest.raises(LoaderOptionError, match="telemetry="):
        StreamingDataset(ds_url, telemetry=3)
    with pytest.raises(LoaderOptionError, match="metrics_port"):
        StreamingDataLoader(ds, batch_size=4, metrics_port=70000)
    with pytest.raises(LoaderOptionError, match="metrics_addr"):
        StreamingDataLoader(ds, batch_size=4, metrics_port=0, metrics_addr=0)
    with pytest.raises(LoaderOptionError, match="metrics_path"):
        StreamingDataLoader(ds, batch_size=4, metrics_path=3)
    mine, other = Telemetry(window_s=None), Telemetry(window_s=None, metrics_path=tmp_path / "a.jsonl")
    try:
        with pytest.raises(LoaderOptionError, match="another Telemetry"):
            StreamingDataLoader(StreamingDataset(ds_url, telemetry=mine), batch_size=4, telemetry=other)
        with pytest.raises(LoaderOptionError, match=r"a\.jsonl"):
            StreamingDataLoader(StreamingDataset(ds_url), batch_size=4, telemetry=other,
                                metrics_path=tmp_path / "b.jsonl")
    finally:
        mine.close()
        other.close()
