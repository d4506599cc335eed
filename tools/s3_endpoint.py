"""A local S3 endpoint on loopback: moto's threaded server, for tests, demos and benchmarks.

    with LocalS3() as s3:
        s3.create_bucket("data")
        datapipe.pack(src, "s3://data/ds", storage_options=s3.storage_options)

    with LocalS3(slowdown_rate=0.05, seed=1) as s3:   # 5% of object GETs answer 503 SlowDown
        ...
        s3.traffic()  # {"gets": {"bucket/key": n}, "bytes": {...}, "slowdowns": {...}, ...}

Every request passes through :class:`TrafficMeter`, a WSGI middleware around moto's app that
counts, per object key, the GETs answered (2xx), the body bytes they served, and the GETs it
refused with ``503 SlowDown`` (S3's answer to a prefix read too fast), injected at
``slowdown_rate`` with a seeded generator. Counters live in the process that runs the
server. Only 127.0.0.1 is ever bound or contacted. Credentials are dummies.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import unquote

__all__ = ["LocalS3", "TrafficMeter"]

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class TrafficMeter:
    """WSGI middleware counting object GETs and bytes per key, and refusing a seeded
    ``slowdown_rate`` share of object GETs with 503 SlowDown. An object request is a GET
    of ``/bucket/key`` (path-style, as s3fs and boto3 address a loopback endpoint)
    without a listing query."""

    def __init__(self, app: Callable[..., Iterable[bytes]], *, slowdown_rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= slowdown_rate < 1.0:
            raise ValueError(f"slowdown_rate must lie in [0, 1), got {slowdown_rate!r}")
        self.app = app
        self.slowdown_rate = float(slowdown_rate)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.gets: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.slowdowns: Counter[str] = Counter()
        self.other_requests = 0

    @staticmethod
    def object_key(environ: dict[str, Any]) -> str | None:
        """"bucket/key" of an object GET, else None (listings, bucket calls, HEAD, PUT)."""
        if environ.get("REQUEST_METHOD") != "GET":
            return None
        path = unquote(environ.get("PATH_INFO", "")).lstrip("/")
        query = environ.get("QUERY_STRING", "")
        if "/" not in path or path.endswith("/") or "list-type" in query or "uploads" in query:
            return None
        return path

    def _refuse(self) -> bool:
        if not self.slowdown_rate:
            return False
        with self._lock:
            return self._rng.random() < self.slowdown_rate

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        key = self.object_key(environ)
        if key is None:
            with self._lock:
                self.other_requests += 1
            return self.app(environ, start_response)
        if self._refuse():
            with self._lock:
                self.slowdowns[key] += 1
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(_SLOWDOWN)))])
            return [_SLOWDOWN]
        status: list[str] = []

        def record_status(code: str, headers: Any, *exc: Any) -> Any:
            status.append(code)
            return start_response(code, headers, *exc)

        body = self.app(environ, record_status)
        return _Counted(body, self, key, status)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"gets": dict(self.gets), "bytes": dict(self.bytes), "slowdowns": dict(self.slowdowns),
                    "total_gets": sum(self.gets.values()), "total_bytes": sum(self.bytes.values()),
                    "total_slowdowns": sum(self.slowdowns.values()), "other_requests": self.other_requests}

    def reset(self) -> None:
        with self._lock:
            self.gets.clear()
            self.bytes.clear()
            self.slowdowns.clear()
            self.other_requests = 0


class _Counted:
    """A response body counted as it is handed to the server: the GET (when answered 2xx)
    before its first byte, the bytes before they are sent, so a client that has read a
    body always finds it counted."""

    def __init__(self, body: Iterable[bytes], meter: TrafficMeter, key: str, status: list[str]) -> None:
        self.body, self.meter, self.key, self.status = body, meter, key, status
        self.counted = False

    def _count_get(self) -> None:
        if self.counted:
            return
        self.counted = True
        if self.status and self.status[0][:1] == "2":
            with self.meter._lock:
                self.meter.gets[self.key] += 1

    def __iter__(self) -> Iterator[bytes]:
        self._count_get()
        for part in self.body:
            with self.meter._lock:
                self.meter.bytes[self.key] += len(part)
            yield part

    def close(self) -> None:
        self._count_get()
        close = getattr(self.body, "close", None)
        if close is not None:
            close()


_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class LocalS3:
    """moto's S3 on 127.0.0.1, in a thread of this process, behind a :class:`TrafficMeter`
    (``slowdown_rate``: the share of object GETs refused with 503 SlowDown; ``seed``)."""

    def __init__(self, port: int = 0, *, slowdown_rate: float = 0.0, seed: int = 0) -> None:
        self._port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.slowdown_rate = slowdown_rate
        self.seed = seed
        self.meter: TrafficMeter | None = None
        self.endpoint_url = ""

    def start(self) -> LocalS3:
        import logging

        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        for k, v in _ENV.items():
            os.environ.setdefault(k, v)
        self.meter = TrafficMeter(DomainDispatcherApplication(create_backend_app),
                                  slowdown_rate=self.slowdown_rate, seed=self.seed)
        self._server = make_server("127.0.0.1", self._port, self.meter, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-s3", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def traffic(self) -> dict[str, Any]:
        """What the endpoint served since start (or :meth:`reset_traffic`): per "bucket/key"
        the answered GETs, body bytes and refused (503) GETs, and totals."""
        if self.meter is None:
            raise RuntimeError("LocalS3 is not running")
        return self.meter.snapshot()

    def reset_traffic(self) -> None:
        if self.meter is not None:
            self.meter.reset()

    def set_slowdown_rate(self, rate: float) -> None:
        """Change the share of object GETs refused with 503 from now on."""
        if self.meter is None:
            raise RuntimeError("LocalS3 is not running")
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"slowdown_rate must lie in [0, 1), got {rate!r}")
        self.meter.slowdown_rate = float(rate)

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this endpoint."""
        return {
            "key": _ENV["AWS_ACCESS_KEY_ID"],
            "secret": _ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point boto/s3fs in child processes at this endpoint."""
        return {**_ENV, "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ENDPOINT_URL_S3": self.endpoint_url}

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"
