"""A Prometheus endpoint for a :class:`~datapipe.telemetry.Telemetry`, through
``prometheus_client`` (``pip install 'datapipe[metrics]'``).

    server = serve(telemetry, 9400)          # http://<host>:9400/metrics
    ...
    server.close()

Every scrape reads the recorder's totals (the process and its merged workers) at that
moment: nothing is kept twice. Names follow the Prometheus conventions: base units
(``_seconds``, ``_bytes``), ``_total`` on counters, histograms for durations, the tier as a
label, and every series labelled with the ``rank``:

- ``datapipe_steps_total``, ``datapipe_step_duration_seconds`` (histogram): step times;
- ``datapipe_data_wait_seconds_total``, ``datapipe_data_wait_duration_seconds``
  (histogram), ``datapipe_data_wait_ratio`` (gauge: the last window's share of time
  waiting for data);
- ``datapipe_compute_seconds_total``: the trainer's own work, when it records it;
- ``datapipe_tier_reads_total``, ``datapipe_tier_read_bytes_total``,
  ``datapipe_tier_read_duration_seconds`` (histogram), ``datapipe_cache_hits_total``,
  ``datapipe_cache_misses_total``, ``datapipe_tier_errors_total``, each with ``tier``;
- ``datapipe_cold_retries_total``, ``datapipe_cold_throttled_total``;
- ``datapipe_decode_seconds_total``, ``datapipe_decoded_samples_total``;
- ``datapipe_prefetch_depth`` (gauge).

Histogram buckets are 1, 2.5 and 5 of each decade from 1 us to 1000 s, a subset of the
recorder's own bounds, so each count is exact.
"""

from __future__ import annotations

import os
import socketserver
import threading
import weakref
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np

from ..errors import HealthError, MissingDependencyError, OptionError
from ..options import check_int, show
from ..telemetry import BUCKET_BOUNDS, TIERS, Telemetry
from ..topology import Topology
from .summary import Floats

__all__ = ["serve", "MetricsServer", "collect"]

#: the recorder's bucket indices a Prometheus histogram shows (1, 2.5, 5 per decade)
_SHOWN = [i for i, b in enumerate(BUCKET_BOUNDS) if float(f"{b:e}".split("e")[0]) in (1.0, 2.5, 5.0)]


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependencyError("a Prometheus endpoint (metrics_port=, datapipe.health.serve) needs the "
                                     "prometheus_client package: pip install 'datapipe[metrics]'") from None
    return prometheus_client


class _Threading(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds is no news
        pass


#: the endpoints serving in this process: a forked child (a DataLoader worker) closes its
#: copies of their sockets, else it would hold the port (and accept scrapes nobody answers)
#: after the endpoint closed
_SERVING: weakref.WeakSet[MetricsServer] = weakref.WeakSet()


def _close_in_child() -> None:
    for server in list(_SERVING):
        server._server.socket.close()
    _SERVING.clear()


os.register_at_fork(after_in_child=_close_in_child)


class MetricsServer:
    """A running endpoint: ``port`` (the one bound, when 0 was asked), ``url``, ``close()``."""

    def __init__(self, server: WSGIServer, addr: str) -> None:
        self._server = server
        _SERVING.add(self)
        self.port: int = server.server_port
        host = "127.0.0.1" if addr in ("", "0.0.0.0") else addr
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(target=server.serve_forever, name="datapipe-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(telemetry: Telemetry, port: int = 0, *, addr: str = "0.0.0.0", rank: int | None = None) -> MetricsServer:
    """Serve ``telemetry`` 's metrics at ``http://addr:port/metrics`` from a thread
    (``port=0``: any free port, see ``MetricsServer.port``). ``rank``: the ``rank`` label
    (default: the telemetry's, else the job's). :class:`MissingDependencyError` without
    ``prometheus_client``; :class:`HealthError` when the port cannot be bound."""
    if not isinstance(telemetry, Telemetry):
        raise OptionError(f"telemetry={show(telemetry)}: expected a datapipe.telemetry.Telemetry")
    port = check_int("port", port, min=0, max=65535, hint="0 for any free port")
    if not isinstance(addr, str):
        raise OptionError(f"addr={show(addr)}: expected an address to bind (a str, e.g. '0.0.0.0' or '127.0.0.1')")
    if rank is None:
        rank = telemetry.rank if telemetry.rank is not None else Topology.resolve(environment=True).rank
    label = check_int("rank", rank, min=0, max=1 << 40)
    client = _client()
    from prometheus_client.registry import Collector, CollectorRegistry

    class _Collector(Collector):
        def collect(self) -> Iterator[Any]:
            return collect(telemetry, label)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    try:
        server = make_server(addr, port, client.make_wsgi_app(registry), _Threading, handler_class=_Quiet)
    except OSError as e:
        raise HealthError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}; give another port (0: any "
                          "free one)") from None
    return MetricsServer(server, addr)


def collect(telemetry: Telemetry, rank: int) -> Iterator[Any]:
    """The metric families of ``telemetry`` now, labelled ``rank`` (prometheus_client's
    ``CounterMetricFamily``, ``GaugeMetricFamily``, ``HistogramMetricFamily``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    totals = telemetry.totals()
    r = str(rank)
    les = [floatToGoString(BUCKET_BOUNDS[i]) for i in _SHOWN] + ["+Inf"]  # type: ignore[no-untyped-call]

    def buckets(hist: Floats) -> list[tuple[str, float]]:
        cum = np.cumsum(hist)
        return list(zip(les, [float(cum[i]) for i in _SHOWN] + [float(cum[-1])]))

    def counter(name: str, doc: str, value: float) -> Any:
        m = CounterMetricFamily(name, doc, labels=["rank"])
        m.add_metric([r], value)
        return m

    def histogram(name: str, doc: str, hist: Floats, total: float) -> Any:
        m = HistogramMetricFamily(name, doc, labels=["rank"])
        m.add_metric([r], buckets(hist), total)
        return m

    n, s, hist = totals.timer("step")
    yield counter("datapipe_steps_total", "Steps (batches handed to the trainer) measured.", n)
    yield histogram("datapipe_step_duration_seconds", "Time between consecutive batches handed to the trainer.",
                    hist, s)
    n, s, hist = totals.timer("data_wait")
    yield counter("datapipe_data_wait_seconds_total", "Time the trainer waited for data in next().", s)
    yield histogram("datapipe_data_wait_duration_seconds", "Each wait of the trainer for a batch.", hist, s)
    last = telemetry.last
    if last is not None and last.data_wait_fraction is not None:
        g = GaugeMetricFamily("datapipe_data_wait_ratio", "Share of the last window spent waiting for data.",
                              labels=["rank"])
        g.add_metric([r], last.data_wait_fraction)
        yield g
    yield counter("datapipe_compute_seconds_total", "The trainer's own work, as it recorded it.",
                  totals.timer("compute")[1])
    families = {
        "reads": CounterMetricFamily("datapipe_tier_reads_total", "Reads served by each tier.",
                                     labels=["rank", "tier"]),
        "bytes": CounterMetricFamily("datapipe_tier_read_bytes_total", "Bytes served by each tier.",
                                     labels=["rank", "tier"]),
        "hits": CounterMetricFamily("datapipe_cache_hits_total", "Lookups that found their object in the tier.",
                                    labels=["rank", "tier"]),
        "misses": CounterMetricFamily("datapipe_cache_misses_total", "Lookups that missed in the tier.",
                                      labels=["rank", "tier"]),
        "errors": CounterMetricFamily("datapipe_tier_errors_total", "Reads or writes of the tier that failed.",
                                      labels=["rank", "tier"]),
    }
    latency = HistogramMetricFamily("datapipe_tier_read_duration_seconds", "Each read served by a tier.",
                                    labels=["rank", "tier"])
    for tier in TIERS:
        counts, hist = totals.tier(tier)
        for key, family in families.items():
            family.add_metric([r, tier], counts[key])
        latency.add_metric([r, tier], buckets(hist), counts["seconds"])
    yield from families.values()
    yield latency
    yield counter("datapipe_cold_retries_total", "Cold store requests retried after a failure.", totals.cold_retries)
    yield counter("datapipe_cold_throttled_total", "Cold store answers asking to slow down (503 SlowDown, 429).",
                  totals.cold_throttled)
    _calls, decode_s, samples = totals.decode
    yield counter("datapipe_decode_seconds_total", "Time spent decoding and mapping samples.", decode_s)
    yield counter("datapipe_decoded_samples_total", "Samples decoded and mapped.", samples)
    g = GaugeMetricFamily("datapipe_prefetch_depth", "What the loader has read ahead now.", labels=["rank"])
    g.add_metric([r], telemetry.depth_now())
    yield g
