"""CheckpointWriter: the training loop pays for one copy into host memory, a background
thread does the rest (chunks, checksums, optional zstd, the rank part, the commit
manifest, ``latest``, retention).

One save is in flight at a time: the staging buffer holds exactly one state, so a save
while the previous one still writes waits for it (or is skipped, if asked) and reports
the wait. A failure in the background is kept and raised at the next ``save()``,
``wait()`` or ``close()``; it is never only logged.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

from ..checksum import Hasher
from ..errors import CheckpointError, TopologyError
from ..storage import open_store
from ..topology import Topology
from .commit import (
    apply_retention,
    await_parts,
    scan_steps,
    sync_dirs,
    write_latest,
    write_manifest,
)
from .flatten import Leaf, flatten
from .format import (
    MAX_CHUNK_BYTES,
    MAX_PART_BYTES,
    chunk_checksums,
    chunk_key,
    encode_doc,
    manifest_key,
    parse_attempt,
    part_key,
)
from .lease import Lease
from .run_id import agree_run_id
from .staging import StagingBuffer

__all__ = ["CheckpointWriter", "SaveHandle"]


def lower_thread_priority(increment: int = 10) -> None:
    """Raise the nice value of the calling thread only (Linux treats a thread id as a
    process id here), so that the training threads win the cores from checkpoint I/O."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:
        pass  # not permitted or not supported: the thread runs at normal priority, which is only slower

class SaveHandle:
    """The future of one save. ``metrics`` fills in as the save progresses: ``stall_s``,
    ``waited_s``, ``staging_s``, ``staging_gbps``, ``bytes``, ``staging_allocated`` (this
    save took a new host buffer instead of reusing the last one) at return; ``write_s``,
    ``write_gbps``, ``stored_bytes``, ``commit_s``, ``total_s`` (save() to durable; on
    rank 0 to committed) once done, and on rank 0 ``committed``, ``deleted_steps``,
    ``retention_s``."""

    def __init__(self, step: int, on_report: Any = None) -> None:
        self.step = step
        self.skipped = False
        self.metrics: dict[str, Any] = {"step": step, "skipped": False}
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._on_report = on_report

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error of a failed save (None if it succeeded); waits up to ``timeout``."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout} s")
        if self._exc is not None and self._on_report is not None:
            self._on_report(self)
        return self._exc

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the save is durable (on rank 0: committed); return its metrics or
        raise its error."""
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.metrics

    def _finish(self, exc: BaseException | None = None) -> None:
        self._exc = exc
        self._event.set()

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "running")
        return f"SaveHandle(step={self.step}, {state})"


@dataclass
class _Job:
    step: int
    attempt: str
    tree: Any
    leaves: list[Leaf]
    offsets: list[int]
    total: int
    handle: SaveHandle
    t_start: float
    order: int  # position of this save() call among the writer's calls


def _checksum_in_slices(data: memoryview, piece: int = 1 << 20) -> str:
    """The checksum of ``data`` (the same digest as one call), hashed 1 MiB at a time:
    xxhash holds the GIL while it hashes, and a background thread at a lower priority
    must not hold it for long, or the training thread waits behind it."""
    h = Hasher()
    for i in range(0, len(data), piece):
        h.update(data[i : i + piece])
    return h.hexdigest()


def _close_at_exit(ref: Any) -> None:
    w = ref()
    # Not in a forked child (a DataLoader worker): the writer thread and the lease are the
    # parent's, and a save in flight at the fork never finishes there.
    if w is not None and not w._closed and w._pid == os.getpid():
        try:
            w.close()
        except Exception as e:  # the interpreter is exiting: say it, do not hide it
            print(f"datapipe: checkpoint writer for {w.url} failed at exit: {e}", file=sys.stderr)


class CheckpointWriter:
    """Nonblocking checkpoints to a local directory or any fsspec URL.

    ``keep_last`` complete checkpoints are kept, plus every step divisible by
    ``keep_every``; ``compression`` is None or ``"zstd"`` (per chunk); ``if_busy`` is
    ``"wait"`` or ``"skip"`` for a save that finds the previous one still writing.
    ``rank``/``world_size`` default to torch.distributed's when it is initialized.
    Background threads run ``nice`` levels below the caller (0: same priority), so that
    on a busy host the training threads keep the cores and the checkpoint waits.
    """

    def __init__(self, url: str, *, keep_last: int = 3, keep_every: int | None = None,
                 compression: str | None = None, max_staging_bytes: int | None = None,
                 storage_options: dict[str, Any] | None = None, rank: int | None = None,
                 world_size: int | None = None, run_id: str | None = None,
                 chunk_bytes: int = 64 << 20, io_threads: int = 4, if_busy: str = "wait",
                 commit_timeout: float = 600.0, zstd_level: int = 3, nice: int = 10,
                 lease_ttl: float = 60.0, lease_wait: float = 0.0) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointError(
                f"keep_last must be an int >= 1 (the last good checkpoint is always kept), got {keep_last!r}"
            )
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise CheckpointError(f"keep_every must be None or an int >= 1, got {keep_every!r}")
        if compression not in (None, "zstd"):
            raise CheckpointError(f"compression must be None or 'zstd', got {compression!r}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise CheckpointError(f"chunk_bytes must be an int in [4096, 2**32], got {chunk_bytes!r}")
        if not isinstance(io_threads, int) or io_threads < 1:
            raise CheckpointError(f"io_threads must be an int >= 1, got {io_threads!r}")
        if if_busy not in ("wait", "skip"):
            raise CheckpointError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        self.url = url
        self.store = open_store(url, storage_options)
        try:
            self.rank, self.world_size = Topology.resolve(rank, world_size, environment=False)
        except TopologyError as e:
            raise CheckpointError(f"CheckpointWriter({url!r}): {e}") from None
        self.run_id = agree_run_id(self.world_size, run_id)
        self._saved_at: dict[tuple[int, int], int] = {}  # (step, n) of each attempt -> its save's number
        self._calls = 0
        self._pid = os.getpid()
        self._api_lock = threading.Lock()  # one thread at a time in save/prepare/close
        self.keep_last, self.keep_every = keep_last, keep_every
        self.compression, self.zstd_level = compression, zstd_level
        self.chunk_bytes, self.if_busy, self.commit_timeout = chunk_bytes, if_busy, commit_timeout
        self._staging = StagingBuffer(max_staging_bytes)
        self._attempts: dict[int, int] = {}
        self._current: SaveHandle | None = None
        self._failed: SaveHandle | None = None  # a failed save nobody has been told about yet
        self._prepare_thread: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self._closed = False
        self._tls = threading.local()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.io_threads, self.nice = io_threads, nice
        # One writer per URL: rank 0 (the one that commits and deletes) holds the lease.
        self._lease = Lease(self.store, self.run_id, lease_ttl, lease_wait).acquire() if self.rank == 0 else None
        try:
            # the highest complete step already there: a save below it is loaded by nobody
            self._max_step = max((s for s, keys in scan_steps(self.store).items()
                                  if manifest_key(s) in keys), default=-1) if self.rank == 0 else -1
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self._thread = threading.Thread(target=self._run, name="datapipe-ckpt-writer", daemon=True)
        self._thread.start()
        # Flush at exit before daemon threads stop: threading's exit hooks run before
        # atexit's, while the writer thread still runs (the hook concurrent.futures uses).
        getattr(threading, "_register_atexit", atexit.register)(_close_at_exit, weakref.ref(self))

    # -- training side -------------------------------------------------------------------
    def _enter(self, what: str) -> None:
        if not self._api_lock.acquire(blocking=False):
            raise CheckpointError(
                f"CheckpointWriter({self.url!r}).{what}() called while another thread is inside "
                "save/prepare/close of the same writer: a writer has one staging buffer and saves "
                "from one thread; use one writer per thread and URL, or serialise the calls"
            )

    def prepare(self, state_or_layout: Any, *, block: bool = False) -> None:
        """Allocate and touch the staging buffer for a state (real or ``meta`` tensors
        give the same layout) in a background thread, so the first save only copies."""
        self._enter("prepare")
        try:
            self._prepare(state_or_layout, block)
        finally:
            self._api_lock.release()

    def _prepare(self, state_or_layout: Any, block: bool) -> None:
        self._check_open()
        _tree, leaves = flatten(state_or_layout, allow_meta=True, rank=self.rank)
        self._join_prepare()
        prev = self._current

        def work() -> None:
            try:
                if prev is not None:
                    prev._event.wait()  # never reallocate under a save being written
                self._staging.prepare(leaves)
            except BaseException as e:
                self._prepare_error = e

        self._prepare_thread = threading.Thread(target=work, name="datapipe-ckpt-prepare", daemon=True)
        self._prepare_thread.start()
        if block:
            self._join_prepare()

    def save(self, step: int, state: Any, *, if_busy: str | None = None) -> SaveHandle:
        """Copy ``state`` into host staging and return; the rest happens in the background.

        If an earlier save failed and its error was not yet seen (through its handle), this
        call raises that error and saves nothing; the next call saves again. One thread
        saves at a time: a call while another thread is inside save() raises
        :class:`CheckpointError` (sharing the staging buffer would mix the two states)."""
        self._enter("save")
        try:
            return self._save(step, state, if_busy)
        finally:
            self._api_lock.release()

    def _save(self, step: int, state: Any, if_busy: str | None) -> SaveHandle:
        t0 = time.perf_counter()
        self._check_open()
        self._raise_failed()
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
            raise CheckpointError(f"step must be an int in [0, 10**12), got {step!r}")
        mode = if_busy or self.if_busy
        if mode not in ("wait", "skip"):
            raise CheckpointError(f"if_busy must be 'wait' or 'skip', got {mode!r}")
        tree, leaves = flatten(state, rank=self.rank)  # unsupported objects fail here, before any write
        if step < self._max_step:
            warnings.warn(
                f"saving step {step} to {self.url}, below step {self._max_step} saved there before: "
                f"load_checkpoint() loads the highest complete step ({self._max_step}), not this one. "
                "Delete the higher steps, or save to a new URL, if training restarted from an earlier step",
                stacklevel=3,
            )
        self._max_step = max(self._max_step, step)
        waited = 0.0
        prev = self._current
        if prev is not None and not prev.done():
            if mode == "skip":
                h = SaveHandle(step, self._reported)
                h.skipped = True
                h.metrics.update(skipped=True, stall_s=time.perf_counter() - t0, waited_s=0.0)
                h._finish()
                return h
            tw = time.perf_counter()
            prev._event.wait()
            waited = time.perf_counter() - tw
            self._raise_failed()
        self._join_prepare()
        ts = time.perf_counter()
        allocations = self._staging.allocations
        self._staging.stage(leaves)
        staging_s = time.perf_counter() - ts
        total = self._staging.total
        n = self._attempts.get(step, 0)
        self._attempts[step] = n + 1
        self._calls += 1
        self._saved_at[(step, n)] = self._calls
        h = SaveHandle(step, self._reported)
        h.metrics.update(bytes=total, waited_s=waited, staging_s=staging_s,
                         staging_allocated=self._staging.allocations > allocations,
                         staging_gbps=total / staging_s / 1e9 if staging_s > 0 else float("inf"))
        self._current = h
        self._queue.put(_Job(step, f"{self.run_id}-{n}", tree, leaves, list(self._staging.offsets),
                             total, h, t0, self._calls))
        h.metrics["stall_s"] = time.perf_counter() - t0
        return h

    def wait(self) -> None:
        """Block until the last save is done; raise any unreported background error."""
        if self._current is not None:
            self._current._event.wait()
        self._raise_failed()

    flush = wait

    def close(self) -> None:
        """Flush the last save, stop the background thread, release the URL's lease,
        raise any unreported error."""
        self._enter("close")
        try:
            if self._closed:
                return
            try:
                self._join_prepare()
            finally:
                if self._current is not None:
                    self._current._event.wait()
                self._closed = True
                self._queue.put(None)
                self._thread.join()
                if self._lease is not None:
                    self._lease.release()
            self._raise_failed()
        finally:
            self._api_lock.release()

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory the staging buffer holds now (0 before the first save or
        prepare)."""
        return self._staging.capacity

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error is already on its way out: do not replace it with ours
            self.close()
        except Exception as e:
            warnings.warn(f"closing the checkpoint writer for {self.url}: {e}", stacklevel=2)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint writer for {self.url} is closed")

    def _reported(self, handle: SaveHandle) -> None:
        if self._failed is handle:
            self._failed = None

    def _raise_failed(self) -> None:
        h = self._failed
        if h is not None:
            self._failed = None
            raise h._exc  # type: ignore[misc]

    def _join_prepare(self) -> None:
        t = self._prepare_thread
        if t is not None:
            t.join()
            self._prepare_thread = None
            err, self._prepare_error = self._prepare_error, None
            if err is not None:
                raise err

    # -- background side -----------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority(self.nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._persist(job)
            except BaseException as e:
                err = e
                if not isinstance(e, CheckpointError):
                    err = CheckpointError(
                        f"saving step {job.step} to {self.url} failed ({type(e).__name__}: {e}); "
                        "the previous complete checkpoint is untouched"
                    )
                    err.__cause__ = e
                self._failed = job.handle  # before the event, so a waiter sees it
                job.handle._finish(err)
            else:
                job.handle._finish()
            finally:
                job.leaves = []  # drop references to the caller's tensors

    def _persist(self, job: _Job) -> None:
        t0 = time.perf_counter()
        cb = self.chunk_bytes
        chunks = self._write_chunks(job, [(a, min(a + cb, job.total)) for a in range(0, job.total, cb)])
        if chunks:
            sync_dirs(self.store, chunks[0]["key"])
        doc = {
            "step": job.step, "attempt": job.attempt, "rank": self.rank,
            "world_size": self.world_size, "compression": self.compression,
            "chunk_bytes": cb, "data_bytes": job.total,
            "stored_bytes": sum(c["stored_bytes"] for c in chunks),
            "chunks": chunks, "tree": job.tree,
            "leaves": [leaf.spec(off) for leaf, off in zip(job.leaves, job.offsets)],
        }
        pkey = part_key(job.step, job.attempt, self.rank)
        body = encode_doc(doc, "part")
        if len(body) > MAX_PART_BYTES:
            raise CheckpointError(
                f"step {job.step}: the part document of rank {self.rank} would be {len(body)} bytes, "
                f"more than readers accept ({MAX_PART_BYTES}); the state has too many leaves"
            )
        self.store.put(pkey, body)
        if not chunks:
            sync_dirs(self.store, pkey)  # an empty state: the part created the directories
        t1 = time.perf_counter()
        m = job.handle.metrics
        m.update(write_s=t1 - t0, write_gbps=job.total / (t1 - t0) / 1e9 if t1 > t0 else float("inf"),
                 stored_bytes=doc["stored_bytes"])
        if self.rank == 0:
            parts = await_parts(self.store, job.step, job.attempt, self.world_size, self.commit_timeout)
            self._lease.check(f"committing step {job.step}")  # type: ignore[union-attr]
            write_manifest(self.store, job.step, job.attempt, self.world_size, parts)
            m["committed"] = True
            try:
                write_latest(self.store, job.step, job.attempt)
            except Exception as e:
                # The manifest is the commit and readers scan manifests: the save succeeded.
                # Retention below keeps the step `latest` still names.
                m["latest_error"] = f"{type(e).__name__}: {e}"
                warnings.warn(f"step {job.step} is committed at {self.url}, but updating `latest` "
                              f"failed ({type(e).__name__}: {e}); it names an older step until "
                              "a later save updates it", stacklevel=1)
        t2 = time.perf_counter()
        # total_s: until durable (rank 0: committed); retention is reported on its own
        m.update(commit_s=t2 - t1, total_s=t2 - job.t_start)
        if self.rank == 0:
            run_id = self.run_id

            def in_flight(step: int, attempt: str) -> bool:
                # An attempt of this job that rank 0 had not saved before this one: another
                # rank, which may be ahead of rank 0, may still be writing it. Attempts rank 0
                # saved earlier are finished on every rank (each rank saves in call order and
                # every part of this step exists).
                pa = parse_attempt(attempt)
                return (pa is not None and pa[0] == run_id
                        and self._saved_at.get((step, pa[1]), job.order + 1) > job.order)

            try:
                self._lease.check("deleting old checkpoints")  # type: ignore[union-attr]
                m["deleted_steps"] = apply_retention(self.store, job.step, job.attempt,
                                                     self.keep_last, self.keep_every, in_flight)
            except Exception as e:
                raise CheckpointError(
                    f"step {job.step} is committed at {self.url}, but deleting old checkpoints "
                    f"failed ({type(e).__name__}: {e}); they are retried after the next commit"
                ) from e
            m["retention_s"] = time.perf_counter() - t2

    def _write_chunks(self, job: _Job, ranges: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """Write the chunks on ``io_threads`` threads of this save. Own threads, not a pool:
        a pool refuses work once the interpreter starts to exit, and a flush at exit must
        still write. Returns only when every thread is done, failed or not: the staging
        buffer is reused only after that."""
        results: list[Any] = [None] * len(ranges)
        errors: list[BaseException] = []
        next_index = iter(range(len(ranges)))
        lock = threading.Lock()

        def worker() -> None:
            lower_thread_priority(self.nice)
            while not errors:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                try:
                    results[i] = self._write_chunk(job, i, *ranges[i])
                except BaseException as e:
                    errors.append(e)

        threads = [threading.Thread(target=worker, name="datapipe-ckpt-io", daemon=True)
                   for _ in range(min(self.io_threads, len(ranges)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def _write_chunk(self, job: _Job, index: int, start: int, end: int) -> dict[str, Any]:
        data = self._staging.view(start, end)
        raw_ck, blocks = chunk_checksums(data)
        rec: dict[str, Any] = {"key": chunk_key(job.step, job.attempt, self.rank, index),
                               "offset": start, "bytes": end - start}
        if self.compression == "zstd":
            cctx = getattr(self._tls, "cctx", None)
            if cctx is None:
                import zstandard

                cctx = self._tls.cctx = zstandard.ZstdCompressor(level=self.zstd_level)
            stored: Any = cctx.compress(data)
            rec.update(checksum=_checksum_in_slices(memoryview(stored)), raw_checksum=raw_ck)
        else:
            stored = data
            rec["checksum"] = raw_ck
            rec["blocks"] = blocks  # range reads check only the blocks they touch (reshard.py)
        rec["stored_bytes"] = len(stored)
        self.store.put(rec["key"], stored)
        return rec
