"""Faults on the wire: a loopback HTTP proxy in front of moto answers 503 SlowDown, cuts
bodies short, resets connections and stalls mid-body, and a server that accepts and never
answers, so the real s3fs/aiobotocore stack meets them."""

import http.client
import os
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from datapipe.cache import TieredCache
from datapipe.checksum import checksum
from datapipe.errors import RemoteError
from datapipe.storage import RetryPolicy, open_store

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class FaultProxy:
    """Forwards to ``upstream``; GETs of object keys suffer ``plan[n]`` on their n-th try."""

    def __init__(self, upstream: str, plan: list[str]) -> None:
        host, port = upstream.split("//", 1)[1].split(":")
        self.plan = plan
        self.tries: Counter = Counter()
        self.injected: Counter = Counter()
        self.released = threading.Event()  # stalled answers wait for this
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                fault = None
                if self.command == "GET" and "?" not in self.path and self.path.count("/") >= 2:
                    with proxy.lock:
                        i = proxy.tries[self.path]
                        proxy.tries[self.path] += 1
                    fault = proxy.plan[i] if i < len(proxy.plan) else None
                    if fault:
                        proxy.injected[fault] += 1
                if fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.close_connection = True
                    self.connection.close()
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                head = self.command == "HEAD"  # a HEAD keeps the object's own length
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "stall" and self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2])  # then nothing more, for good
                    self.wfile.flush()
                    proxy.released.wait()
                    self.close_connection = True
                    return
                if fault == "truncate" and self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


class SilentServer:
    """Accepts connections on 127.0.0.1 and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


def _bounded(fn, limit_s: float = 40.0):
    """Run ``fn`` in a thread; the test fails (instead of hanging) if it is not done within
    ``limit_s``. Returns what it returned or raised."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still waiting after {limit_s} s: a cold request is unbounded"
    return out


@pytest.mark.parametrize("plan", [["truncate"], ["reset"], ["503", "truncate", "reset"]])
def test_wire_faults_are_recovered(tmp_path, s3, s3_server, plan):
    root, opts = s3
    store = open_store(root, opts)
    blobs = {}
    for i in range(1):
        data = os.urandom(300_000)
        store.put(f"w/s{i}.tar", data)
        blobs[f"{root}/w/s{i}.tar"] = data
    with FaultProxy(s3_server.endpoint_url, plan) as proxy:
        popts = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url}}
        cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=4 << 20, storage_options=popts,
                            retry=RetryPolicy(attempts=5, base_delay_s=0.01, max_delay_s=0.05))
        for url, data in blobs.items():
            assert cache.read(url, checksum=checksum(data)) == data
        assert sum(proxy.injected.values()) == len(plan) * len(blobs)
        assert cache.stats()["cold_reads"] == len(blobs)
        cache.close()


def _via(opts, url, **extra):
    return {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": url}, **extra}


def test_one_retry_layer_each_attempt_is_one_request(tmp_path, s3, s3_server):
    """s3fs and botocore retry a 503 on their own (10 GETs per call with the stock
    settings); the cache turns them down, so each of our retries is one GET, and
    ``attempts`` is the number of failed GETs sent (here bodies cut short; 503s are
    throttling, waited out within the deadline without using up attempts:
    tests/cache/test_throttling.py)."""
    root, opts = s3
    data = os.urandom(100_000)
    open_store(root, opts).put("x/s.tar", data)
    policy = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.02)
    with FaultProxy(s3_server.endpoint_url, ["503"] * 2) as proxy:
        cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                            storage_options=_via(opts, proxy.url), retry=policy)
        assert cache.read(f"{root}/x/s.tar") == data
        assert proxy.injected["503"] == 2 and sum(proxy.tries.values()) == 3
        assert cache.stats()["cold_retries"] == 2
        cache.close()
    with FaultProxy(s3_server.endpoint_url, ["truncate"] * 1000) as proxy:
        cache = TieredCache(storage_options=_via(opts, proxy.url), retry=policy)
        with pytest.raises(RemoteError, match=r"x/s\.tar.*3 attempts.*payload is not completed"):
            cache.read(f"{root}/x/s.tar")
        assert sum(proxy.tries.values()) == 3
        cache.close()


def test_a_total_deadline_ends_the_retries(tmp_path, s3, s3_server):
    root, opts = s3
    open_store(root, opts).put("x/s.tar", b"z" * 1000)
    policy = RetryPolicy(attempts=1000, base_delay_s=0.05, max_delay_s=0.05, deadline_s=0.5)
    with FaultProxy(s3_server.endpoint_url, ["503"] * 100_000) as proxy:
        cache = TieredCache(storage_options=_via(opts, proxy.url), retry=policy)
        out = _bounded(lambda: cache.read(f"{root}/x/s.tar"))
        assert isinstance(out.get("error"), RemoteError), out
        assert "deadline of 0.5 s" in str(out["error"])
        assert sum(proxy.tries.values()) < 1000  # GETs; under load the HEAD may use it all
        cache.close()


@pytest.mark.parametrize("what", ["read", "read_range", "local_path"])
def test_a_server_that_never_answers_fails_within_the_timeouts(tmp_path, s3, what):
    """The size probe (HEAD) and the reads alike give up after attempts x timeout."""
    root, opts = s3
    with SilentServer() as silent:
        policy = RetryPolicy(attempts=2, base_delay_s=0.01, attempt_timeout_s=0.5)
        cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                            storage_options=_via(opts, silent.url), retry=policy)
        url = f"{root}/x/s.tar"
        call = {"read": lambda: cache.read(url), "read_range": lambda: cache.read_range(url, 0, 10),
                "local_path": lambda: cache.local_path(url)}[what]
        out = _bounded(call)
        assert isinstance(out.get("error"), RemoteError), out
        assert "within 0.5 s" in str(out["error"]) and url in str(out["error"])
        cache.close()


def test_parts_stalled_mid_body_are_abandoned_and_retried(tmp_path, s3, s3_server):
    root, opts = s3
    data = os.urandom(256 << 10)
    open_store(root, opts).put("x/s.tar", data)
    policy = RetryPolicy(attempts=4, base_delay_s=0.01, attempt_timeout_s=1.0,
                         part_bytes=64 << 10, max_parts=4)
    with FaultProxy(s3_server.endpoint_url, ["stall"]) as proxy:
        cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20,
                            storage_options=_via(opts, proxy.url), retry=policy)
        # one attempt is abandoned after 1 s; the stock stack waits out its socket timeout
        out = _bounded(lambda: cache.read(f"{root}/x/s.tar", checksum=checksum(data)), limit_s=10)
        assert out.get("value") == data, out.get("error")
        assert proxy.injected["stall"] == 1
        assert cache.stats()["cold_retries"] >= 1
        cache.close()
