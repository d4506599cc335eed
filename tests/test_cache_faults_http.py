"""Faults on the wire: a loopback HTTP proxy in front of moto answers 503 SlowDown, cuts
bodies short and resets connections, so the real s3fs/aiobotocore stack meets them."""

import http.client
import os
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from datapipe.checksum import checksum
from datapipe.storage import RetryPolicy, TieredCache, open_store

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
                    with threading.Lock():
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
        self.server.shutdown()
        self.server.server_close()


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


def test_datapipe_retries_once_the_lower_stack_gives_up(tmp_path, s3, s3_server):
    """botocore told not to retry; s3fs still retries a 503 on its own (10 GETs with this
    s3fs), then raises; datapipe's next attempt gets through."""
    root, opts = s3
    data = os.urandom(100_000)
    open_store(root, opts).put("x/s.tar", data)
    with FaultProxy(s3_server.endpoint_url, ["503"] * 10) as proxy:
        popts = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url},
                 "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
        cache = TieredCache(warm_dir=tmp_path / "warm", warm_bytes=1 << 20, storage_options=popts,
                            retry=RetryPolicy(attempts=3, base_delay_s=0.01))
        assert cache.read(f"{root}/x/s.tar") == data
        assert proxy.injected["503"] == 10
        assert cache.stats()["cold_retries"] >= 1
        cache.close()
