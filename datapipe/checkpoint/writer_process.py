"""The writer process: ``CheckpointWriter(background="process")`` runs the background half
of every save (persist.py: checksums, compression, writes, commits, retention) in a
process of its own, so it never takes the training process's GIL. Staging stays in the
training process and stays the only stall; the staging buffer is a memfd mapping shared
with the writer process (sent once per buffer, reused across saves).

The two processes talk over a socketpair in length-prefixed JSON frames (never pickle):
the writer's settings once (``PersistConfig.to_wire``), then each save
(``PersistJob.to_wire``), with the memfd passed as ancillary data (SCM_RIGHTS) when the
buffer is new. The writer
process is started with ``subprocess`` (no fork of a training process, no multiprocessing
start method to agree on), takes the leases of the stores it commits to, and exits when
told to or when the training process's end of the socket closes (it died): leases on a
local disk die with it (flock); the save it was writing finishes or leaves an incomplete
step, as for a thread writer.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError
from .persist import PersistConfig, Persister, PersistJob
from .staging import memfd_tensor

__all__ = ["WriterProcess", "SharedBytes", "main"]

_MODULE = "datapipe.checkpoint.writer_process"  # what the writer process runs (python -m)
_PREFIX = struct.Struct("<Q")
#: warning categories the writer process reports by name (any other is a UserWarning)
_WARNINGS: dict[str, type[Warning]] = {c.__name__: c for c in (UserWarning, RuntimeWarning, ResourceWarning)}
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


class SharedBytes:
    """A byte buffer in a memfd mapping, reused and regrown only for more bytes: where the
    training process receives a peer's part for the writer process to persist."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.buffer_id = 0
        self.capacity = 0
        self._tensor: Any = None

    def ensure(self, n: int) -> Any:
        """A torch uint8 tensor over the first ``n`` bytes (a larger buffer if needed)."""
        if self._tensor is None or self.capacity < n:
            self._tensor = None
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            self.fd, self._tensor = memfd_tensor("datapipe-ckpt-replica", n)
            self.capacity = max(n, 1)
            self.buffer_id += 1
        return self._tensor[:n]

    def close(self) -> None:
        self._tensor = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class WriterProcess:
    """The training process's end: start the writer process, send it jobs, hand each
    reply to ``on_done(order, metrics, error)`` from a reader thread (blocked in recv,
    it holds no GIL while it waits)."""

    def __init__(self, config: PersistConfig, on_done: Callable[[int, dict[str, Any], str | None], None]) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", _MODULE, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL)  # holds no pipe of the trainer's
        finally:
            theirs.close()
        self.sock = ours
        self._on_done = on_done
        self._send_lock = threading.Lock()
        self._sent: dict[str, int] = {}  # name -> id of the mapping the writer process has
        try:
            _send(ours, config.to_wire())
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

    def submit(self, job: PersistJob, buffers: dict[str, tuple[int, int, int]]) -> None:
        """Send one job; ``buffers``: name -> (id, fd, bytes) of the shared mappings it
        reads (``staging``, ``replica``), each sent along the first time it is used."""
        if self.error is not None:
            raise CheckpointError(self.error)
        with self._send_lock:
            new = {name: b for name, b in buffers.items() if self._sent.get(name) != b[0]}
            msg = dict(job.to_wire(), op="job", mappings=[[name, b[2]] for name, b in new.items()])
            _send(self.sock, msg, [b[1] for b in new.values()] or None)
            for name, b in new.items():
                self._sent[name] = b[0]

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
            error = msg.get("error")
            for category, text in msg.get("warnings") or []:
                # raised here, under this process's filters, before the save is seen done
                try:
                    warnings.warn(str(text), _WARNINGS.get(category, UserWarning), stacklevel=1)
                except Exception as e:  # a filter made it an error: the save's, as in a writer thread
                    error = error or (f"a warning of the checkpoint writer process is an error under this "
                                      f"process's warning filters ({type(e).__name__}: {e})")
            self._on_done(int(msg["order"]), msg.get("metrics") or {}, error)

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


def _die_with_trainer(sock: socket.socket) -> None:
    """End this process the moment the training process's end of the socket closes, also
    in the middle of a save (which then stays an incomplete step, as with a writer thread
    killed with its process): a writer left running for a dead trainer would hold the
    store's lease against the job restarted in its place. A thread waits for the hang-up
    alone (POLLRDHUP: frames arriving do not wake it), and checks the parent every half
    second: a process forked from the trainer after the writer started (a fork Pool, a
    DataLoader worker) holds the trainer's end too, so no hang-up comes while it lives.
    Where there is no POLLRDHUP it checks the parent alone."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    parent = os.getppid()

    def watch() -> None:
        if rdhup:
            poller = select.poll()
            poller.register(sock.fileno(), rdhup)
            while not poller.poll(500) and os.getppid() == parent:
                pass
        else:
            while os.getppid() == parent:
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="datapipe-ckpt-watchdog", daemon=True).start()


def main() -> None:
    """The writer process: config, then jobs until ``close`` or the socket closes."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    _die_with_trainer(sock)
    doc, _ = _recv(sock)
    config = PersistConfig.from_wire(doc)
    if config.nice > 0 and hasattr(os, "setpriority"):
        try:  # the whole process: the trainer keeps the cores when they are scarce
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + config.nice))
        except OSError:
            pass
    tiers = config.tiers
    try:
        p = Persister(dataclasses.replace(config, nice=0))  # the process is niced already
    except BaseException as e:
        _send(sock, {"op": "error", "error": f"{e}" if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"})
        return
    _send(sock, {"op": "ready", "max_steps": p.max_steps(), "roots": {t.url: p.roots(t.url) for t in tiers}})
    mapped: dict[str, Any] = {}
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
            for (name, size), fd in zip(msg["mappings"], fds):
                mapped.pop(name, None)  # the old mapping goes when nothing views it any more
                mapped[name] = mmap.mmap(fd, max(1, size), prot=mmap.PROT_READ)
            for fd in fds:
                os.close(fd)
            buf = memoryview(mapped["staging"]) if "staging" in mapped else memoryview(b"")

            def view(a: int, b: int, v: memoryview = buf) -> memoryview:
                return v[a:b]

            received = memoryview(mapped["replica"]) if msg["received"] is not None and "replica" in mapped else None
            m: dict[str, Any] = {}
            error = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # the training process's filters decide
                try:
                    p.persist(PersistJob.from_wire(msg, by_url, received), view, no_tensor, m)
                except BaseException as e:
                    error = str(e) if isinstance(e, CheckpointError) else (
                        f"saving step {msg['step']} failed ({type(e).__name__}: {e}); the previous complete "
                        "checkpoint is untouched")
            del buf, view, received  # no view of a mapping outlives its job
            said = [[w.category.__name__, str(w.message)] for w in caught]
            _send(sock, {"order": msg["order"], "metrics": m, "error": error, "warnings": said})
    finally:
        p.release()


if __name__ == "__main__":
    main()
