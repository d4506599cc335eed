"""CheckpointWriter: the training loop pays for one copy into host memory, a background
thread or a writer process (background.py, chosen once) does the rest (persist.py: chunks,
checksums, optional zstd, the rank part, the commit manifest, ``latest``, retention) for
every tier due at that step (tiers.py; ``url=`` is the shorthand for one tier), including
the peer replica of a node-local tier (replicate.py).

One save is in flight at a time: the staging buffer holds exactly one state, so a save
while the previous one still writes waits for it (or is skipped, if asked) and reports
the wait. A failure in the background is kept and raised at the next ``save()``,
``wait()`` or ``close()``; it is never only logged.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from ..errors import CheckpointError, CheckpointOptionError, TopologyError
from ..topology import Topology
from .background import choose_background, start_background
from .flatten import flatten
from .format import MAX_CHUNK_BYTES
from .leaf import Leaf
from .persist import PersistConfig, PersistJob, chunk_bytes_for
from .run_id import agree_writer_ids
from .staging import StagingBuffer
from .tiers import Tier, resolve_ranks_per_node, writer_tiers

__all__ = ["CheckpointWriter", "SaveHandle"]


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


def _copies(leaves: list[Leaf]) -> list[Leaf]:
    """This rank's copies of the values it holds but another rank stores for the shared
    tiers (``Leaf.copy``), in state order: what a node-local part holds on top."""
    return [leaf.copy for leaf in leaves if leaf.copy is not None]


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
    """Nonblocking checkpoints to a local directory or any fsspec URL, or to several tiers.

    ``CheckpointWriter(url, keep_last=3, keep_every=None, storage_options=None)`` writes
    every save to one URL: it is the shorthand of ``CheckpointWriter(tiers=[Tier(url,
    keep_last=3, keep_every=None, storage_options=None)])`` (those three arguments are
    refused beside ``tiers=``). ``CheckpointWriter(tiers=[Tier(...), ...])`` writes a save
    of step ``s`` to each tier with ``s % tier.every == 0``, from one staging copy; a save
    that no tier is due for returns at once and copies nothing (``handle.skipped``,
    ``metrics["due_tiers"] == []``). A node-local tier with ``replicate=1`` also sends this
    rank's part to its peer ``(rank + ranks_per_node) % world_size`` over a gloo group of
    the writer's own and keeps the part of ``(rank - ranks_per_node) % world_size``
    (``ranks_per_node``: given, else ``LOCAL_WORLD_SIZE``); every rank must then save the
    same steps, so ``if_busy="skip"`` is refused, and the process group must stay
    initialised while the writer is open.

    ``background="auto"`` (default) runs the background work (checksums, compression,
    writes, commit, retention) in a writer process of its own, which reads the staging
    buffer from shared memory (a memfd, reused across saves; registered as pinned memory
    where the state is on a CUDA device), so it never takes this process's GIL and a
    Python-heavy training loop cannot starve it (writer_process.py). Where no writer
    process can do the work (a ``memory://`` tier, storage options that are not JSON, no
    memfd) it runs in threads of this process; ``background="thread"`` asks for threads,
    and ``background="process"`` refuses to fall back. ``self.background`` says which ran.
    Warnings of the writer process (a ``latest`` pointer that could not be updated, a tier
    skipped) are raised again in this process as the save they belong to finishes. With
    ``replicate=1`` the peer exchange stays in a thread of this process that waits in
    gloo without the GIL.

    ``compression`` is None or ``"zstd"`` (per chunk); ``if_busy`` is ``"wait"`` or
    ``"skip"`` for a save that finds the previous one still writing. ``rank``/``world_size``
    default to torch.distributed's when it is initialized. ``run_id`` (default: drawn)
    names the run in the lease; the attempt folders of this writer's saves are named by an
    id its ranks draw together at construction (one broadcast over torch.distributed), so
    a later run given the same ``run_id`` never writes into them (run_id.py).

    The background work (the writer process, or the threads) runs ``nice`` levels below the
    caller (0: same priority): 7 by default, where on this project's 2-core machine with
    both cores busy a save still became durable within 2x of its time beside an idle
    trainer while the training step stayed within 1.1x (10 missed the first, 0 the second;
    ``bench_checkpoint --tiers``).
    """

    def __init__(self, url: str | None = None, *, keep_last: int | None = None, keep_every: int | None = None,
                 compression: str | None = None, max_staging_bytes: int | None = None,
                 storage_options: dict[str, Any] | None = None, rank: int | None = None,
                 world_size: int | None = None, run_id: str | None = None,
                 chunk_bytes: int = 64 << 20, io_threads: int = 4, if_busy: str = "wait",
                 commit_timeout: float = 600.0, zstd_level: int = 3, nice: int = 7,
                 lease_ttl: float = 60.0, lease_wait: float = 0.0, tiers: list[Tier] | None = None,
                 ranks_per_node: int | None = None, background: str = "auto") -> None:
        if compression not in (None, "zstd"):
            raise CheckpointOptionError(f"compression must be None or 'zstd', got {compression!r}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise CheckpointOptionError(f"chunk_bytes must be an int in [4096, 2**32], got {chunk_bytes!r}")
        if not isinstance(io_threads, int) or io_threads < 1:
            raise CheckpointOptionError(f"io_threads must be an int >= 1, got {io_threads!r}")
        if if_busy not in ("wait", "skip"):
            raise CheckpointOptionError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        if background not in ("auto", "thread", "process"):
            raise CheckpointOptionError(f"background must be 'auto', 'thread' or 'process', got {background!r}")
        tiers = writer_tiers(url, tiers, keep_last=keep_last, keep_every=keep_every, storage_options=storage_options)
        self.tiers: list[Tier] = tiers
        self.url = tiers[0].url
        # the first tier's retention (with url=, its only one)
        self.keep_last, self.keep_every = tiers[0].keep_last, tiers[0].keep_every
        background = choose_background(background, tiers)
        try:
            self.rank, self.world_size = Topology.resolve(rank, world_size, environment=False)
        except TopologyError as e:
            raise CheckpointOptionError(f"CheckpointWriter({self.url!r}): {e}") from None
        replicated = [t for t in tiers if t.replicate]
        if replicated and if_busy != "wait":
            raise CheckpointOptionError(
                "if_busy must be 'wait' with replicate=1: every rank sends its part to its peer at the "
                "same steps, and a rank that skipped a save would leave its peer waiting"
            )
        self.ranks_per_node = (resolve_ranks_per_node(ranks_per_node, self.world_size, f"Tier({replicated[0].url!r})")
                               if replicated else ranks_per_node)
        ids = agree_writer_ids(self.rank, self.world_size, run_id)
        self.run_id = ids.run_id
        # The peer link's gloo group is a collective: create it right after the ids, the
        # other collective, before anything that can fail on one rank only (leases, stores,
        # the writer process); a rank failing there cannot leave the others in new_group.
        self._link: Any = None  # the peer link with replicate=1 (replicate.PeerLink)
        if replicated:
            from .replicate import PeerLink

            self._link = PeerLink(self.rank, self.world_size, self.ranks_per_node,  # type: ignore[arg-type]
                                  commit_timeout)
        config = PersistConfig(
            tiers=tiers, rank=self.rank, world_size=self.world_size, run_id=self.run_id,
            ranks_per_node=self.ranks_per_node, attempt_id=ids.attempt_id, fresh_attempts=ids.fresh,
            compression=compression, zstd_level=zstd_level, io_threads=io_threads, nice=nice,
            lease_ttl=lease_ttl, lease_wait=lease_wait)
        try:
            self._start(config, background, max_staging_bytes, chunk_bytes, if_busy, commit_timeout)
        except BaseException:
            if self._link is not None:
                self._link.close()
            raise

    def _start(self, config: PersistConfig, background: str, max_staging_bytes: Any, chunk_bytes: int,
               if_busy: str, commit_timeout: float) -> None:
        """The constructor after the collectives: staging, then the background, which takes
        the stores and leases (whoever commits to a store, rank 0 of a shared tier and every
        rank in its node-local folders, holds its lease in the process that does the work)."""
        self._attempt_id = config.attempt_id  # the <run_id> of this writer's attempt folders (run_id.py)
        self._calls = 0
        self._pid = os.getpid()
        self._api_lock = threading.Lock()  # one thread at a time in save/prepare/close
        self.compression, self.zstd_level = config.compression, config.zstd_level
        self.chunk_bytes, self.if_busy = chunk_bytes, if_busy
        self.io_threads, self.nice = config.io_threads, config.nice
        self._commit_timeout = float(commit_timeout)
        self._staging = StagingBuffer(max_staging_bytes, shared=background == "process")
        self._attempts: dict[int, int] = {}
        self._current: SaveHandle | None = None
        self._failed: SaveHandle | None = None  # a failed save nobody has been told about yet
        self._prepare_thread: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self._closed = False
        self._replicated = self._link is not None
        self._background = start_background(background, config, self._staging, self._link)
        self.background = self._background.kind
        self.store = self._background.store  # the first tier's store (this rank's folder if node-local)
        self._max_steps = dict(self._background.max_steps)
        self._roots = self._background.roots
        # Flush at exit before daemon threads stop: threading's exit hooks run before
        # atexit's, while the writer thread still runs (the hook concurrent.futures uses).
        getattr(threading, "_register_atexit", atexit.register)(_close_at_exit, weakref.ref(self))

    # -- training side -------------------------------------------------------------------
    @property
    def commit_timeout(self) -> float:
        """Seconds rank 0 waits for every rank's part before it gives a save up (each save
        takes the value it has at its ``save()``)."""
        return self._commit_timeout

    @commit_timeout.setter
    def commit_timeout(self, seconds: float) -> None:
        self._commit_timeout = float(seconds)

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
        if any(t.node_local for t in self.tiers):  # room for a node-local save's copies too
            leaves += _copies(leaves)
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

        A step that no tier is due for returns a finished handle at once (``skipped``,
        ``metrics["due_tiers"] == []``) without looking at the state. If an earlier save
        failed and its error was not yet seen (through its handle), this call raises that
        error and saves nothing; the next call saves again (with replicate=1 the save
        happens, its peer waits for it, and the error is raised after it is queued). One thread saves at a time: a
        call while another thread is inside save() raises :class:`CheckpointError`
        (sharing the staging buffer would mix the two states)."""
        self._enter("save")
        try:
            return self._save(step, state, if_busy)
        finally:
            self._api_lock.release()

    def _save(self, step: int, state: Any, if_busy: str | None) -> SaveHandle:
        t0 = time.perf_counter()
        self._check_open()
        if not self._replicated:
            self._raise_failed()
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
            raise CheckpointOptionError(f"step must be an int in [0, 10**12), got {step!r}")
        mode = if_busy or self.if_busy
        if mode not in ("wait", "skip"):
            raise CheckpointOptionError(f"if_busy must be 'wait' or 'skip', got {mode!r}")
        if mode == "skip" and self._replicated:
            raise CheckpointOptionError(
                "if_busy='skip' is refused with replicate=1: every rank must save the same steps")
        due = [t for t in self.tiers if t.due(step)]
        if not due:  # nothing to write: no flatten, no copy, no wait
            self._raise_failed()  # no rank exchanges at a step no tier is due for
            h = SaveHandle(step, self._reported)
            h.skipped = True
            h.metrics.update(skipped=True, due_tiers=[], stall_s=time.perf_counter() - t0, waited_s=0.0)
            h._finish()
            return h
        tree, leaves = flatten(state, rank=self.rank)  # unsupported objects fail here, before any write
        for t in due:
            for root in self._roots[t.url]:
                top = self._max_steps.get(root, -1)
                if step < top:
                    warnings.warn(
                        f"saving step {step} to {root}, below step {top} saved there before: "
                        f"load_checkpoint() loads the highest complete step ({top}), not this one. "
                        "Delete the higher steps, or save to a new URL, if training restarted from an earlier step",
                        stacklevel=3,
                    )
                self._max_steps[root] = max(top, step)
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
            if not self._replicated:
                self._raise_failed()
        self._join_prepare()
        ts = time.perf_counter()
        allocations = self._staging.allocations
        # A node-local part must be whole on its own: when a node-local tier is due, this
        # rank also stages its copies of the values it holds with other ranks (whose bytes
        # their owner stages for the shared tiers), after the shared layout, so that the
        # shared tiers still write [0, shared total) exactly as without them.
        copies = _copies(leaves) if any(t.node_local for t in due) else []
        self._staging.stage(leaves + copies)
        staging_s = time.perf_counter() - ts
        total = self._staging.total
        specs = [leaf.spec(off) for leaf, off in zip(leaves, self._staging.offsets)]
        shared_total = total
        local_specs = None
        if copies:
            # the copies come after the shared layout, whose end is its last leaf's
            shared_total = self._staging.offsets[len(leaves) - 1] + leaves[-1].nbytes if leaves else 0
            local_specs = list(specs)
            at = iter(self._staging.offsets[len(leaves):])
            for i, leaf in enumerate(leaves):
                if leaf.copy is not None:
                    local_specs[i] = leaf.copy.spec(next(at))
        n = self._attempts.get(step, 0)
        self._attempts[step] = n + 1
        self._calls += 1
        h = SaveHandle(step, self._reported)
        h.metrics.update(bytes=total, waited_s=waited, staging_s=staging_s, due_tiers=[t.url for t in due],
                         staging_allocated=self._staging.allocations > allocations,
                         staging_gbps=total / staging_s / 1e9 if staging_s > 0 else float("inf"))
        self._current = h
        job = PersistJob(step, f"{self._attempt_id}-{n}", tree, specs, shared_total, due,
                         time.monotonic() - (time.perf_counter() - t0), self._calls,
                         chunk_bytes_for(shared_total, self.chunk_bytes, self.io_threads), self._commit_timeout)
        if local_specs is not None:
            job.local_specs, job.local_total = local_specs, total
            job.local_chunk_bytes = chunk_bytes_for(total, self.chunk_bytes, self.io_threads)
        del leaves, copies  # no reference to the caller's tensors beyond this call
        try:
            self._background.submit(job, h.metrics, functools.partial(self._done, h))
        except BaseException:
            self._current = None
            raise
        h.metrics["stall_s"] = time.perf_counter() - t0
        if self._replicated and self._failed is not h:
            # With replicate=1 an earlier failure is raised only now, after this save was
            # queued: its peer waits for this save's exchange, and skipping it would break
            # the peer's link (and so on around the ring).
            self._raise_failed()
        return h

    def _done(self, handle: SaveHandle, error: BaseException | None) -> None:
        """The background finished ``handle``'s save (its thread, or the writer process's
        reply thread)."""
        if error is not None:
            self._failed = handle  # before the event, so a waiter sees it
        handle._finish(error)

    def wait(self) -> None:
        """Block until the last save is done; raise any unreported background error."""
        if self._current is not None:
            self._current._event.wait()
        self._raise_failed()

    flush = wait

    def close(self) -> None:
        """Flush the last save, stop the background thread, release the leases, raise any
        unreported error."""
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
                self._background.close(self.commit_timeout)
                if self._link is not None:
                    self._link.close()  # after the threads that use it are done
                self._staging.close()
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
