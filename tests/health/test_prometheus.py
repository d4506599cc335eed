"""datapipe.health.serve: the real HTTP endpoint on 127.0.0.1, scraped with urllib and
parsed with prometheus_client's own text-format parser."""

import re
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import parser

from datapipe.errors import HealthError, MissingDependencyError, OptionError
from datapipe.health import serve
from datapipe.telemetry import TIERS, Telemetry


def _scrape(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        return r.read().decode()


def _families(text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(family, name, **labels):
    (v,) = [s.value for s in family.samples if s.name == name and all(s.labels.get(k) == x for k, x in labels.items())]
    return v


def test_scraped_metrics_follow_the_conventions_and_hold_the_counts():
    tel = Telemetry(window_s=None, rank=3)
    for _ in range(10):
        tel.data_wait(0.004)
        tel.read("warm", 16384, 0.0002)
        tel.hit("warm")
        tel.miss("memory")
        tel.step()
    tel.read("cold", 1 << 20, 0.3)
    tel.error("cold")
    tel.cold_retry(2)
    tel.throttled(5)
    tel.decode(0.01, 100)
    tel.compute(0.25)
    tel.prefetch_depth(6)
    tel.close_window()
    with serve(tel, 0, addr="127.0.0.1") as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        fams = _families(_scrape(server.url))
        tel.read("warm", 16384, 0.0002)  # a later scrape reads the counts of that moment
        again = _families(_scrape(server.url))
    names = set(fams)
    assert {"datapipe_steps", "datapipe_step_duration_seconds", "datapipe_data_wait_seconds",
            "datapipe_data_wait_duration_seconds", "datapipe_data_wait_ratio", "datapipe_compute_seconds",
            "datapipe_tier_reads", "datapipe_tier_read_bytes", "datapipe_tier_read_duration_seconds",
            "datapipe_cache_hits", "datapipe_cache_misses", "datapipe_tier_errors", "datapipe_cold_retries",
            "datapipe_cold_throttled", "datapipe_decode_seconds", "datapipe_decoded_samples",
            "datapipe_prefetch_depth"} <= names
    for f in fams.values():
        assert re.fullmatch(r"datapipe_[a-z_]+", f.name)
        for s in f.samples:
            assert s.labels["rank"] == "3"
            if f.type == "counter":
                assert s.name.endswith("_total") or s.name.endswith("_created")
        if f.type == "histogram" or f.name.endswith("_seconds"):
            assert "seconds" in f.name  # durations in base units
    assert _value(fams["datapipe_data_wait_seconds"], "datapipe_data_wait_seconds_total") == pytest.approx(0.04)
    assert _value(fams["datapipe_steps"], "datapipe_steps_total") == 9
    rb = fams["datapipe_tier_read_bytes"]
    assert _value(rb, "datapipe_tier_read_bytes_total", tier="warm") == 10 * 16384
    assert _value(rb, "datapipe_tier_read_bytes_total", tier="cold") == 1 << 20
    assert {s.labels["tier"] for s in rb.samples} == set(TIERS)
    assert _value(fams["datapipe_cache_hits"], "datapipe_cache_hits_total", tier="warm") == 10
    assert _value(fams["datapipe_cache_misses"], "datapipe_cache_misses_total", tier="memory") == 10
    assert _value(fams["datapipe_tier_errors"], "datapipe_tier_errors_total", tier="cold") == 1
    assert _value(fams["datapipe_cold_retries"], "datapipe_cold_retries_total") == 2
    assert _value(fams["datapipe_cold_throttled"], "datapipe_cold_throttled_total") == 5
    assert _value(fams["datapipe_decoded_samples"], "datapipe_decoded_samples_total") == 100
    assert _value(fams["datapipe_prefetch_depth"], "datapipe_prefetch_depth") == 6
    assert 0 < _value(fams["datapipe_data_wait_ratio"], "datapipe_data_wait_ratio") <= 1
    # histograms: cumulative buckets ending in +Inf = count, sum = the seconds recorded
    lat = fams["datapipe_tier_read_duration_seconds"]
    buckets = [(float(s.labels["le"]), s.value) for s in lat.samples
               if s.name.endswith("_bucket") and s.labels["tier"] == "warm"]
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert buckets[-1] == (float("inf"), 10)
    assert dict(buckets)[0.00025] == 10 and dict(buckets)[0.0001] == 0  # 0.2 ms lies in (0.1, 0.25] ms
    assert _value(lat, "datapipe_tier_read_duration_seconds_count", tier="warm") == 10
    assert _value(lat, "datapipe_tier_read_duration_seconds_sum", tier="warm") == pytest.approx(0.002)
    wait = fams["datapipe_data_wait_duration_seconds"]
    assert {float(s.labels["le"]) for s in wait.samples if s.name.endswith("_bucket")} >= {1e-6, 2.5e-3, 5.0, 1000.0}
    rb2 = again["datapipe_tier_read_bytes"]
    assert _value(rb2, "datapipe_tier_read_bytes_total", tier="warm") == 11 * 16384


def test_the_port_is_freed_on_close_and_a_busy_port_is_a_health_error():
    tel = Telemetry(window_s=None, rank=0)
    server = serve(tel, 0, addr="127.0.0.1")
    port = server.port
    with pytest.raises(HealthError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
        serve(tel, port, addr="127.0.0.1")
    server.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again


def test_bad_arguments():
    tel = Telemetry(window_s=None, rank=0)
    with pytest.raises(OptionError, match="port="):
        serve(tel, 70000)
    with pytest.raises(OptionError, match="telemetry="):
        serve("tel", 0)


def test_without_prometheus_client_the_error_says_what_to_install():
    probe = ("import sys; sys.modules['prometheus_client'] = None\n"
             "from datapipe.health import serve\nfrom datapipe.telemetry import Telemetry\n"
             "from datapipe.errors import MissingDependencyError\n"
             "try:\n    serve(Telemetry(window_s=None, rank=0), 0, addr='127.0.0.1')\n"
             "except MissingDependencyError as e:\n    print('ok', e)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ok") and "pip install 'datapipe[metrics]'" in out
    assert issubclass(MissingDependencyError, ImportError)
