"""Where a checkpoint writer's background work runs, chosen once at construction
(:func:`choose_background`), behind one small interface (:class:`Background`): threads of
the training process (:class:`ThreadBackground`: the Persister in a thread) or a writer
process of its own (:class:`ProcessBackground`: writer_process.py, with the peer exchange of
``replicate=1`` in a thread of the training process, whose gloo group it is).

Both take a staged save as ``submit(job, metrics, done)`` and persist saves in the order
they were submitted; ``done(error)`` is called once per save, from the background, after
``metrics`` holds the save's figures (``error`` None when it succeeded); ``close()`` waits
for what was submitted and releases the leases and memory the background holds.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import CheckpointError, CheckpointOptionError
from ..storage import Store, in_this_process, open_store, storage_options_for
from .persist import PersistConfig, Persister, PersistJob, lower_thread_priority, replica_header
from .replicate import PeerLink
from .staging import StagingBuffer
from .tiers import Tier
from .writer_process import SharedBytes, WriterProcess

__all__ = ["Background", "ThreadBackground", "ProcessBackground", "choose_background", "start_background"]

#: what a background calls when a save is done: its error, or None
Done = Callable[[BaseException | None], None]


class Background(Protocol):
    kind: str  # "thread" | "process": CheckpointWriter.background
    pid: int | None  # the writer process's, None for threads
    store: Store  # the first tier's store (this rank's folder if node-local)
    max_steps: dict[str, int]  # the highest complete step in each store this rank commits to, by root
    roots: dict[str, list[str]]  # tier URL -> the roots of the stores a save to it writes

    def submit(self, job: PersistJob, metrics: dict[str, Any], done: Done) -> None: ...

    def close(self, timeout: float) -> None: ...


def choose_background(background: str, tiers: list[Tier]) -> str:
    """Where a writer's background work runs: ``"auto"`` is a writer process wherever one
    can do the work (a memfd to share the staging buffer through; every tier a store
    another process can open, with storage options it can be sent as JSON), else threads
    of this process. ``"process"`` where one cannot is refused, naming the tier."""
    if background == "thread":
        return background
    why = None if hasattr(os, "memfd_create") else "this platform has no memfd to share the staging buffer through"
    for t in tiers:
        if why is not None:
            break
        if in_this_process(open_store(t.url, t.storage_options)):
            why = f"tier {t.url!r} lives in this process's memory, which a writer process cannot see"
        else:
            try:
                json.dumps(storage_options_for(t.url, t.storage_options))  # set_storage_options' too
            except (TypeError, ValueError) as e:
                why = f"the storage_options of tier {t.url!r} are not JSON ({e}), as a writer process is sent them"
    if why is None:
        return "process"
    if background == "process":
        raise CheckpointOptionError(f"background='process' is not possible here: {why}; use background='thread'")
    return "thread"


def start_background(kind: str, config: PersistConfig, staging: StagingBuffer, link: PeerLink | None) -> Background:
    """The background :func:`choose_background` chose; it takes the leases of the stores
    this rank commits to. ``link``: the peer link of ``replicate=1``, made by the writer
    before (a collective)."""
    if kind == "thread":
        return ThreadBackground(config, staging, link)
    return ProcessBackground(config, staging, link)


class ThreadBackground:
    """The Persister in a thread of this process, running ``config.nice`` levels below it."""

    kind: str = "thread"
    pid: int | None = None

    def __init__(self, config: PersistConfig, staging: StagingBuffer, link: PeerLink | None) -> None:
        self._persister = Persister(config, link)
        self.store = self._persister.store
        self.max_steps = self._persister.max_steps()
        self.roots = {t.url: self._persister.roots(t.url) for t in config.tiers}
        self._staging, self._nice, self._url = staging, config.nice, config.tiers[0].url
        self._queue: queue.Queue[tuple[PersistJob, dict[str, Any], Done] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="datapipe-ckpt-writer", daemon=True)
        self._thread.start()

    def submit(self, job: PersistJob, metrics: dict[str, Any], done: Done) -> None:
        self._queue.put((job, metrics, done))

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, metrics, done = item
            try:
                self._persister.persist(job, self._staging.view, self._staging.tensor, metrics)
            except BaseException as e:
                err = e
                if not isinstance(e, CheckpointError):
                    err = CheckpointError(
                        f"saving step {job.step} to {self._url} failed ({type(e).__name__}: {e}); "
                        "the previous complete checkpoint is untouched"
                    )
                    err.__cause__ = e
                done(err)
            else:
                done(None)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join()
        self._persister.release()


class ProcessBackground:
    """A writer process (writer_process.py) persists the saves, reading the staging buffer
    from shared memory. With a peer link, a thread here exchanges each save that a
    replicated tier is due for with the peer first (gloo waits without the GIL), receiving
    into shared memory the writer process maps, then sends the job on."""

    kind: str = "process"

    def __init__(self, config: PersistConfig, staging: StagingBuffer, link: PeerLink | None) -> None:
        self._staging = staging
        self._rank, self._world_size = config.rank, config.world_size
        self._in_flight: dict[int, tuple[dict[str, Any], Done]] = {}  # order -> the save's metrics, done
        self._replica: SharedBytes | None = None
        if link is not None:  # received parts go to shared memory the writer process maps
            self._replica = SharedBytes()
            link.receive_into(self._replica.ensure)
        try:
            self._process = WriterProcess(config, self._reply)
        except BaseException:
            if self._replica is not None:
                self._replica.close()
            raise
        self.pid: int | None = self._process.pid
        self.max_steps = dict(self._process.max_steps)
        self.roots = self._process.roots
        self.store = open_store(self.roots[config.tiers[0].url][0], config.tiers[0].storage_options)
        self._queue: queue.Queue[PersistJob | None] | None = None
        self._thread: threading.Thread | None = None
        if link is not None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run_link, args=(self._queue, link),
                                            name="datapipe-ckpt-link", daemon=True)
            self._thread.start()

    def submit(self, job: PersistJob, metrics: dict[str, Any], done: Done) -> None:
        self._in_flight[job.order] = (metrics, done)
        if self._queue is not None and any(t.replicate for t in job.due):
            self._queue.put(job)  # the link thread exchanges with the peer, then sends it
            return
        try:
            self._send(job)
        except BaseException:
            self._in_flight.pop(job.order, None)
            raise

    def _send(self, job: PersistJob) -> None:
        """Send the job with the shared mappings it reads (each sent once, when new)."""
        buffers = {"staging": _mapping(self._staging.buffer_id, self._staging.fd, self._staging.capacity)}
        if job.received is not None and self._replica is not None:
            rb = self._replica
            buffers["replica"] = _mapping(rb.buffer_id, rb.fd, rb.capacity)
        self._process.submit(job, buffers)

    def _run_link(self, jobs: queue.Queue[PersistJob | None], link: PeerLink) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            self._exchange_and_send(job, link)

    def _exchange_and_send(self, job: PersistJob, link: PeerLink) -> None:
        """Exchange the save with the peer (the received part is ``job.received``; a failed
        exchange is ``job.link_error``, a replica not written), then hand it to the writer
        process: its own copy is written either way."""
        metrics = self._in_flight[job.order][0]
        t0 = time.perf_counter()
        try:
            header = replica_header(job, self._rank, self._world_size, self._staging.view)
            job.received = link.exchange(header, self._staging.tensor(header["total"]))
            metrics["exchange_s"] = time.perf_counter() - t0
        except BaseException as e:
            job.link_error = str(e)
        try:
            self._send(job)
        except BaseException as e:
            self._reply(job.order, {}, f"handing step {job.step} to the writer process failed: {e}")

    def _reply(self, order: int, metrics: dict[str, Any], error: str | None) -> None:
        """A reply of the writer process (its reader thread): that save is done. ``order ==
        -1``: the process is gone; every save in flight fails."""
        if order == -1:
            saves = list(self._in_flight.values())
            self._in_flight.clear()
        else:
            one = self._in_flight.pop(order, None)
            saves = [] if one is None else [one]
        for m, done in saves:
            m.update(metrics)
            done(None if error is None else CheckpointError(error))

    def close(self, timeout: float) -> None:
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join()
        if self._replica is not None:
            self._replica.close()
        self._process.close(timeout)


def _mapping(buffer_id: int, fd: int | None, capacity: int) -> tuple[int, int, int]:
    """A shared buffer as the writer process is sent it: (id, memfd, bytes)."""
    if fd is None:
        raise CheckpointError("the checkpoint staging buffer has no shared memory for the writer process")
    return buffer_id, fd, capacity
