"""The writer process: ``CheckpointWriter(background="process")`` runs the background half
of every save (persist.py: checksums, compression, writes, commits, retention) in a
process of its own, so it never takes the training process's GIL. Staging stays in the
training process and stays the only stall; the staging buffer is a memfd mapping shared
with the writer process (sent once per buffer, reused across saves).

The two processes talk over a socketpair in length-prefixed JSON frames (never pickle),
with the memfd passed as ancillary data (SCM_RIGHTS) when the buffer is new. The writer
process is started with ``subprocess`` (no fork of a training process, no multiprocessing
start method to agree on), takes the leases of the stores it commits to, and exits when
told to or when the training process's end of the socket closes (it died): leases on a
local disk die with it (flock); the save it was writing finishes or leaves an incomplete
step, as for a thread writer.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..errors import CheckpointError

__all__ = ["WriterProcess", "main"]

_PREFIX = struct.Struct("<Q")
MAX_FRAME = 1 << 31  # a part document is at most 256 MiB; a tree travels once per save


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    payload = json.dumps(obj, allow_nan=True).encode()
    prefix = _PREFIX.pack(len(payload))
    if fds:
        sent = socket.send_fds(sock, [prefix], fds)
        if sent < len(prefix):
            sock.sendall(prefix[sent:])
    else:
        sock.sendall(prefix)
    sock.sendall(payload)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the other end closed the writer socket")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    head, fds = b"", []
    while len(head) < _PREFIX.size:
        msg, got, _flags, _addr = socket.recv_fds(sock, _PREFIX.size - len(head), 4)
        if not msg:
            for fd in got:
                os.close(fd)
            raise EOFError("the other end closed the writer socket")
        head += msg
        fds += got
    (n,) = _PREFIX.unpack(head)
    if n > MAX_FRAME:
        raise CheckpointError(f"writer process protocol: a frame of {n} bytes")
    return json.loads(_recv_exactly(sock, n)), fds


def _tier_doc(t: Any) -> dict[str, Any]:
    d = asdict(t)
    try:
        json.dumps(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"Tier({t.url!r}): background='process' sends the tier to the writer process as JSON, and its "
            f"storage_options are not JSON ({e}); pass plain options or use background='thread'"
        ) from None
    return d


class WriterProcess:
    """The training process's end: start the writer process, send it jobs, hand each
    reply to ``on_done(order, metrics, error)`` from a reader thread (blocked in recv,
    it holds no GIL while it waits)."""

    def __init__(self, config: dict[str, Any], on_done: Callable[[int, dict[str, Any], str | None], None]) -> None:
        config = dict(config, tiers=[_tier_doc(t) for t in config["tiers"]])
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "datapipe.checkpoint.process", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours
        self._on_done = on_done
        self._send_lock = threading.Lock()
        self._sent_buffer: int | None = None  # id of the staging mapping the writer process has
        try:
            _send(ours, config)
            reply, _ = _recv(ours)
        except (EOFError, OSError) as e:
            ours.close()
            self.proc.kill()
            self.proc.wait()
            raise CheckpointError(f"the checkpoint writer process did not start ({e}; exit code "
                                  f"{self.proc.returncode})") from None
        if reply.get("op") != "ready":
            ours.close()
            self.proc.wait()
            raise CheckpointError(str(reply.get("error", reply)))
        self.max_steps: dict[str, int] = {k: int(v) for k, v in reply["max_steps"].items()}
        self.roots: dict[str, list[str]] = reply["roots"]
        self.pid = int(self.proc.pid)
        self.error: str | None = None
        self._reader = threading.Thread(target=self._read, name="datapipe-ckpt-replies", daemon=True)
        self._reader.start()

    def submit(self, job: dict[str, Any], buffer_id: int, buffer_fd: int, buffer_bytes: int) -> None:
        """Send one job; the staging mapping goes along the first time it is used."""
        if self.error is not None:
            raise CheckpointError(self.error)
        with self._send_lock:
            fds = None
            if buffer_id != self._sent_buffer:
                job = dict(job, buffer_bytes=buffer_bytes)
                fds = [buffer_fd]
            _send(self.sock, dict(job, op="job"), fds)
            self._sent_buffer = buffer_id

    def _read(self) -> None:
        while True:
            try:
                msg, fds = _recv(self.sock)
            except (EOFError, OSError):
                code = self.proc.wait()
                self.error = (f"the checkpoint writer process (pid {self.pid}) exited with code {code}; "
                              "the save in flight is not committed")
                self._on_done(-1, {}, self.error)
                return
            for fd in fds:
                os.close(fd)
            self._on_done(int(msg["order"]), msg.get("metrics") or {}, msg.get("error"))

    def close(self, timeout: float = 600.0) -> None:
        if self.proc.poll() is None:
            try:
                with self._send_lock:
                    _send(self.sock, {"op": "close"})
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        self.sock.close()


def main() -> None:
    """The writer process: config, then jobs until ``close`` or the socket closes."""
    from .persist import Persister, PersistJob
    from .tiers import Tier

    sock = socket.socket(fileno=int(sys.argv[1]))
    cfg, _ = _recv(sock)
    if cfg["nice"] > 0 and hasattr(os, "setpriority"):
        try:  # the whole process: the trainer keeps the cores when they are scarce
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + cfg["nice"]))
        except OSError:
            pass
    tiers = [Tier(**t) for t in cfg["tiers"]]
    try:
        p = Persister(tiers, cfg["rank"], cfg["world_size"], cfg["run_id"], cfg["ranks_per_node"],
                      compression=cfg["compression"], zstd_level=cfg["zstd_level"], chunk_bytes=cfg["chunk_bytes"],
                      io_threads=cfg["io_threads"], commit_timeout=cfg["commit_timeout"], nice=0,
                      lease_ttl=cfg["lease_ttl"], lease_wait=cfg["lease_wait"], link=False)
    except BaseException as e:
        _send(sock, {"op": "error", "error": f"{e}" if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"})
        return
    _send(sock, {"op": "ready", "max_steps": p.max_steps(), "roots": {t.url: p.roots(t.url) for t in tiers}})
    mapped: Any = None
    by_url = {t.url: t for t in tiers}

    def no_tensor(end: int) -> Any:
        raise CheckpointError("the writer process does not send replicas")

    try:
        while True:
            try:
                msg, fds = _recv(sock)
            except EOFError:
                return  # the training process is gone
            if msg["op"] == "close":
                return
            if fds:
                mapped = None  # the old mapping goes when nothing views it any more
                mapped = mmap.mmap(fds[0], max(1, msg["buffer_bytes"]), prot=mmap.PROT_READ)
                for fd in fds:
                    os.close(fd)
            buf = memoryview(mapped) if mapped is not None else memoryview(b"")

            def view(a: int, b: int, v: memoryview = buf) -> memoryview:
                return v[a:b]

            job = PersistJob(msg["step"], msg["attempt"], msg["tree"], msg["specs"], msg["total"],
                             [by_url[u] for u in msg["due"]], msg["t_start"], msg["order"])
            for step, n, order in msg["saved_at"]:
                p.saved_at[(step, n)] = order
            m: dict[str, Any] = {}
            error = None
            try:
                p.persist(job, view, no_tensor, m)
            except BaseException as e:
                error = str(e) if isinstance(e, CheckpointError) else (
                    f"saving step {job.step} failed ({type(e).__name__}: {e}); the previous complete "
                    "checkpoint is untouched")
            del buf, view
            _send(sock, {"order": job.order, "metrics": m, "error": error})
    finally:
        p.release()


if __name__ == "__main__":
    main()
