"""The background half of a checkpoint writer: for one staged save, every due tier's
chunks (checksums, optional zstd, writes on ``io_threads`` threads), the rank's part, the
commit where this process commits (manifest, ``latest``, retention), and the peer replica
of a node-local tier. It runs in a thread of the training process or, with
``CheckpointWriter(background="process")``, in a writer process of its own
(writer_process.py) that reads the staging buffer from shared memory; the code is the same.
A save reaches it as a :class:`PersistJob` and the writer's settings as a
:class:`PersistConfig`; each has its wire form (JSON, what a writer process is sent) here
and only here.

It sees the staged bytes only through ``view(start, end) -> memoryview`` (and, for the
peer link, ``tensor(end)``), so it never imports torch itself unless a replica is sent.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any

from ..checksum import Hasher
from ..errors import CheckpointError, StorageError
from ..storage import Store, join_url, open_store, storage_options_for
from .commit import (
    apply_retention,
    await_parts,
    scan_steps,
    sync_dirs,
    write_latest,
    write_manifest,
    write_parts_index,
)
from .format import (
    BLOCK_BYTES,
    MAX_PART_BYTES,
    PARTS_INDEX_MAX_BYTES,
    block_checksums,
    chunk_key,
    encode_doc,
    is_data_key,
    manifest_key,
    parse_attempt,
    part_key,
)
from .lease import Lease
from .replicate import PeerLink
from .tiers import Tier, TiersOut, own_dir, replica_dir

__all__ = ["IOThreads", "Persister", "PersistConfig", "PersistJob", "chunk_bytes_for", "lower_thread_priority",
           "replica_header"]


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


@dataclass(frozen=True)
class PersistConfig:
    """A writer's background as its constructor settled it: the tiers, who this rank is, the
    ids of its attempts (run_id.WriterIds) and how chunks are written."""

    tiers: list[Tier]
    rank: int
    world_size: int
    run_id: str
    ranks_per_node: int | None
    attempt_id: str  # the <run_id> of this writer's attempt names
    fresh_attempts: bool  # attempt_id was drawn for this writer (else it is the given run_id, which must be fresh)
    compression: str | None
    zstd_level: int
    io_threads: int
    nice: int  # how many levels below the caller the background threads run
    lease_ttl: float
    lease_wait: float

    def to_wire(self) -> dict[str, Any]:
        """The settings as a writer process is sent them (JSON: ``background.choose_background``
        runs no writer process for storage options that are not). Each tier carries the
        options that reach its store here, ``set_storage_options``' included: those are this
        process's, and the writer process opens the store with what it is sent."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tiers"}
        doc["tiers"] = [dict(asdict(t), storage_options=storage_options_for(t.url, t.storage_options))
                        for t in self.tiers]
        return doc

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> PersistConfig:
        return cls(**dict(doc, tiers=[Tier(**t) for t in doc["tiers"]]))


@dataclass
class PersistJob:
    """One staged save as the background sees it: no tensors, only the layout."""

    step: int
    attempt: str
    tree: Any
    specs: list[dict[str, Any]]  # the leaves' records of the part document
    total: int
    due: list[Tier]  # the tiers this save goes to, in the writer's order
    t_start: float  # time.monotonic() at save(): comparable across processes (CLOCK_MONOTONIC)
    order: int  # position of this save() call among the writer's calls
    chunk_bytes: int  # of this save's shared layout: chunk_bytes_for(total, ...)
    commit_timeout: float  # seconds rank 0 waits for every rank's part: the writer's at save()
    # (start, end) of a chunk of the staged bytes -> its raw checksum, shared by the tiers
    # (and the replica header) whose chunks cover the same range
    raw_checksums: dict[tuple[int, int], str] = field(default_factory=dict)
    # The node-local layout, when it differs from the shared one: the leaves' records with
    # this rank's copies of the values it holds with other ranks (staged after ``total``),
    # its byte count and chunk size. A node-local part must be whole on its own; a shared
    # tier stores each such value once, by its owner, so it writes only ``[0, total)``.
    local_specs: list[dict[str, Any]] | None = None
    local_total: int = 0
    local_chunk_bytes: int = 0
    # a writer process's replica, exchanged in the training process: (header, bytes), or why not
    received: tuple[dict[str, Any], memoryview] | None = None
    link_error: str | None = None

    def layout(self, node_local: bool) -> tuple[list[dict[str, Any]], int, int]:
        """``(specs, total, chunk_bytes)`` of this save's part in a node-local tier (and its
        peer replica) or in a shared one."""
        if node_local and self.local_specs is not None:
            return self.local_specs, self.local_total, self.local_chunk_bytes
        return self.specs, self.total, self.chunk_bytes

    def to_wire(self) -> dict[str, Any]:
        """The job as a writer process is sent it (JSON): the due tiers by URL, a received
        replica by its size (its bytes lie in the shared mapping named ``replica``)."""
        return {"step": self.step, "attempt": self.attempt, "tree": self.tree, "specs": self.specs,
                "total": self.total, "due": [t.url for t in self.due], "t_start": self.t_start,
                "order": self.order, "chunk_bytes": self.chunk_bytes, "commit_timeout": self.commit_timeout,
                "raw_checksums": [[a, b, ck] for (a, b), ck in self.raw_checksums.items()],
                "local": None if self.local_specs is None else {
                    "specs": self.local_specs, "total": self.local_total, "chunk_bytes": self.local_chunk_bytes},
                "received": None if self.received is None else {
                    "header": self.received[0], "bytes": len(self.received[1])},
                "link_error": self.link_error}

    @classmethod
    def from_wire(cls, msg: dict[str, Any], tiers: dict[str, Tier], replica: memoryview | None) -> PersistJob:
        """The job :meth:`to_wire` sent; ``tiers``: the writer's by URL; ``replica``: the
        shared mapping a received replica's bytes lie at the start of."""
        local = msg["local"]
        received = msg["received"]
        if received is not None and replica is None:
            raise CheckpointError(f"step {msg['step']}: a replica was sent without the memory that holds it")
        return cls(msg["step"], msg["attempt"], msg["tree"], msg["specs"], msg["total"],
                   [tiers[u] for u in msg["due"]], msg["t_start"], msg["order"], msg["chunk_bytes"],
                   float(msg["commit_timeout"]),
                   raw_checksums={(int(a), int(b)): str(ck) for a, b, ck in msg["raw_checksums"]},
                   local_specs=None if local is None else local["specs"],
                   local_total=0 if local is None else local["total"],
                   local_chunk_bytes=0 if local is None else local["chunk_bytes"],
                   received=None if received is None or replica is None else (
                       received["header"], replica[: received["bytes"]]),
                   link_error=msg["link_error"])


@dataclass
class _Target:
    """One store a tier's copy is written to, with the role this process plays there:
    a shared tier as (rank, world size) of the job, committed by rank 0; a node-local
    tier's own or replica folder as the one rank of a one-part checkpoint, committed by
    this process, with ``origin`` naming the job rank whose part it holds."""

    tier: Tier
    store: Store
    rank: int
    world_size: int
    lease: Lease | None
    origin: dict[str, int] | None = None
    max_step: int = -1
    # what the chunks are put through: their folder is synced once, after the last of them
    # (Store.sync_folder), not once per chunk
    chunk_store: Store = field(init=False)

    def __post_init__(self) -> None:
        self.chunk_store = self.store.deferring_folder_sync()

    @property
    def commits(self) -> bool:
        return self.rank == 0


def _checksum_in_slices(data: memoryview, piece: int = 1 << 20) -> str:
    """The checksum of ``data`` (the same digest as one call), hashed 1 MiB at a time:
    xxhash holds the GIL while it hashes, and a background thread at a lower priority
    must not hold it for long, or the training thread waits behind it."""
    h = Hasher()
    for i in range(0, len(data), piece):
        h.update(data[i : i + piece])
    return h.hexdigest()


def chunk_bytes_for(total: int, chunk_bytes: int, io_threads: int) -> int:
    """The chunk size of a save of ``total`` bytes: ``chunk_bytes``, or less when that
    would leave the ``io_threads`` unevenly loaded: a ``total / io_threads`` share rounded
    up to whole 1 MiB blocks (so a thread's share is at most one block over the even one;
    9 MiB over 4 threads is 3 chunks of 3 MiB). A 96 MiB part in 64 MiB chunks kept two of
    four threads idle and took 1.8x as long to write as 4 chunks of 24 MiB (0.305 s vs 0.170 s
    for 4 ranks, a microbenchmark on this machine)."""
    per_thread = -(-total // io_threads)
    return min(chunk_bytes, max(BLOCK_BYTES, -(-per_thread // BLOCK_BYTES) * BLOCK_BYTES))


def chunk_ranges(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of a part of ``total`` bytes: what is written, hashed
    and sent chunk by chunk (a chunk's raw checksum is known by its range)."""
    return [(a, min(a + chunk_bytes, total)) for a in range(0, total, chunk_bytes)]


def replica_header(job: PersistJob, rank: int, world_size: int,
                   staged: Callable[[int, int], memoryview]) -> dict[str, Any]:
    """The header a save's part is sent to the peer with (by a thread writer here, by a
    writer process's link thread in the training process): what the save is (its
    node-local layout: the replica is a copy of this rank's node-local part, whole on its
    own) and the raw checksum of every chunk, against which the receiver checks each chunk
    before writing it. Checksums missing from ``job.raw_checksums`` are computed (1 MiB
    per GIL hold) and kept there for this rank's own copy."""
    specs, total, chunk_bytes = job.layout(node_local=True)
    ranges = chunk_ranges(total, chunk_bytes)
    for r in ranges:
        if r not in job.raw_checksums:
            job.raw_checksums[r] = _checksum_in_slices(staged(*r))
    return {"step": job.step, "attempt": job.attempt, "rank": rank, "world_size": world_size,
            "total": total, "chunk_bytes": chunk_bytes, "tree": job.tree, "leaves": specs,
            "raw_checksums": [job.raw_checksums[r] for r in ranges]}


class IOThreads:
    """The threads a Persister writes chunks on: ``n`` of them with the calling thread
    among them, started at the first batch and kept until :meth:`close`. Threads started
    per save each waited for the scheduler and the GIL before the next could start: on a
    busy machine the fourth chunk of a save began 50-170 ms after the first. Own threads,
    not a pool: a pool refuses work once the interpreter starts to exit, and a flush at
    exit must still write."""

    def __init__(self, n: int, nice: int) -> None:
        self.n, self.nice = n, nice
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()

    def run(self, count: int, fn: Callable[[int], None]) -> None:
        """``fn(i)`` for each ``i`` in ``range(count)``, spread over the threads; returns when
        every call has returned, failed or not, and then raises the first error. After an
        error no new call starts."""
        indices = iter(range(count))
        lock = threading.Lock()
        errors: list[BaseException] = []
        helpers = max(0, min(self.n, count) - 1)  # none for an empty state (no chunks)
        left = [helpers]
        finished = threading.Event()

        def drain() -> None:
            while not errors:
                with lock:
                    i = next(indices, None)
                if i is None:
                    return
                try:
                    fn(i)
                except BaseException as e:
                    errors.append(e)

        def helper() -> None:
            try:
                drain()
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()

        if self._pid != os.getpid():  # a forked child: its parent's threads are not here
            self._work, self._threads, self._pid = queue.SimpleQueue(), [], os.getpid()
        while len(self._threads) < helpers:
            t = threading.Thread(target=self._serve, name="datapipe-ckpt-io", daemon=True)
            t.start()
            self._threads.append(t)
        for _ in range(helpers):
            self._work.put(helper)
        drain()
        if helpers:
            finished.wait()
        if errors:
            raise errors[0]

    def _serve(self) -> None:
        lower_thread_priority(self.nice)
        for job in iter(self._work.get, None):  # None: close() stops the thread
            job()

    def close(self) -> None:
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class Persister:
    """The stores of every tier (leases taken where this process commits) and the work of
    one save. ``saved_at[(step, n)]`` is the ``order`` of the save that made attempt
    ``n`` of ``step`` (retention keeps attempts of saves after the one it commits)."""

    def __init__(self, config: PersistConfig, link: PeerLink | None = None) -> None:
        tiers = config.tiers
        self.tiers, self.rank, self.world_size, self.run_id = tiers, config.rank, config.world_size, config.run_id
        self.attempt_id, self.fresh_attempts = config.attempt_id, config.fresh_attempts
        self.ranks_per_node = config.ranks_per_node
        self.compression, self.zstd_level = config.compression, config.zstd_level
        self.io_threads, self.nice = config.io_threads, config.nice
        self.saved_at: dict[tuple[int, int], int] = {}
        self._io = IOThreads(self.io_threads, self.nice)
        self.tiers_out = TiersOut()
        self._lease_args = (config.lease_ttl, config.lease_wait)  # to take a lease again (a tier back)
        self._tls = threading.local()
        self._targets: dict[str, list[_Target]] = {}
        # the peer link (thread writer with replicate=1): created by the writer before this
        # (its group is a collective, made before any rank can fail opening stores)
        self._link = link
        self.tiers_out.check_at_start(tiers)
        try:
            for t in tiers:
                if t is not tiers[0] and t.url in self.tiers_out.out:
                    continue  # opened by its probe, once it answers
                try:
                    self._targets[t.url] = self._open_targets(t, config.lease_ttl, config.lease_wait)
                except (CheckpointError, StorageError, OSError) as e:
                    if t is tiers[0]:
                        raise
                    self.tiers_out.out_at_start(t.url, f"{type(e).__name__}: {e}")
        except BaseException:
            self.release()
            raise
        self.store = self._targets[tiers[0].url][0].store

    def max_steps(self) -> dict[str, int]:
        """The highest complete step found in each store this process commits to, by its root."""
        return {tg.store.root: tg.max_step for ts in self._targets.values() for tg in ts if tg.commits}

    def roots(self, url: str) -> list[str]:
        return [tg.store.root for tg in self._targets.get(url, ())]

    def _open_targets(self, tier: Tier, lease_ttl: float, lease_wait: float) -> list[_Target]:
        """The stores of one tier, their leases taken, in the order a save writes them."""
        out: list[_Target] = []
        if not tier.node_local:
            store = open_store(tier.url, tier.storage_options)
            out.append(_Target(tier, store, self.rank, self.world_size, None))
        else:
            origin = {"rank": self.rank, "world_size": self.world_size}
            store = open_store(join_url(tier.url, own_dir(self.rank)), tier.storage_options)
            out.append(_Target(tier, store, 0, 1, None, origin))
            if tier.replicate:
                src = (self.rank - self.ranks_per_node) % self.world_size  # type: ignore[operator]
                store = open_store(join_url(tier.url, replica_dir(src)), tier.storage_options)
                out.append(_Target(tier, store, 0, 1, None, {"rank": src, "world_size": self.world_size}))
        try:
            for tg in out:
                if tg.commits:
                    tg.lease = Lease(tg.store, self.run_id, lease_ttl, lease_wait).acquire()
                    by_step = scan_steps(tg.store)
                    # the highest complete step already there: a save below it is loaded by nobody
                    tg.max_step = max((s for s, keys in by_step.items() if manifest_key(s) in keys), default=-1)
                    if not self.fresh_attempts:
                        self._refuse_used_run_id(tg.store, by_step)
        except BaseException:
            for tg in out:
                if tg.lease is not None:
                    tg.lease.release()
            raise
        return out

    def _refuse_used_run_id(self, store: Store, by_step: dict[int, list[str]]) -> None:
        """A run_id that is the attempt id itself (ranks without a process group to draw one
        with) names only this run's attempts: a folder of it left by an earlier run would be
        taken for this run's, a rank's part there for one of this save (rank 0 cannot tell
        them apart), so such a run_id is refused before anything is written."""
        for keys in by_step.values():
            for key in keys:
                pa = parse_attempt(key.split("/")[1]) if is_data_key(key) else None
                if pa is not None and pa[0] == self.attempt_id:
                    raise CheckpointError(
                        f"{store.url(key)}: run_id {self.run_id!r} was used by an earlier writer at {store.root}. "
                        "Ranks without torch.distributed agree only on the run_id they are given, so each run "
                        "needs a fresh one: pass a new run_id= (the same on every rank), or initialise "
                        "torch.distributed so that the ranks draw a fresh id together"
                    )

    def _refuse_used_attempt(self, tg: _Target, step: int, attempt: str) -> None:
        """Without a drawn attempt id, refuse to write into an attempt folder that already
        holds this rank's part: an earlier writer given the same run_id saved this step there
        (it may be a committed checkpoint, which our chunks would overwrite)."""
        key = part_key(step, attempt, tg.rank)
        if tg.store.exists(key):
            raise CheckpointError(
                f"step {step}: {tg.store.url(key)} exists already: an earlier writer given run_id "
                f"{self.run_id!r} saved this step there, and a save never writes over another one; nothing "
                "was written. Pass a fresh run_id= to each run (the same on every rank), or initialise "
                "torch.distributed so that the ranks draw a fresh id together"
            )

    def release(self) -> None:
        self._io.close()
        for targets in self._targets.values():
            for tg in targets:
                if tg.lease is not None:
                    tg.lease.release()
                    tg.lease = None

    def persist(self, job: PersistJob, view: Callable[[int, int], memoryview], tensor: Callable[[int], Any],
                m: dict[str, Any]) -> None:
        """Every due tier in order; a tier that fails does not stop the others. A tier that
        fails with a storage error while another commits the step is taken out of the path
        (``tiers.TiersOut``: warned once, probed before each later save, taken back when it
        answers); any other failure, or a step no due tier committed, raises naming each
        failed tier. Metrics of the first due tier written are the save's top-level ones
        (as for a single-URL writer); each tier's are in ``metrics["tiers"][url]``."""
        # saves are persisted in call order: every save made before this one is in saved_at
        # by now, and one made after it is not (retention's in_flight tells them apart)
        pa = parse_attempt(job.attempt)
        if pa is not None:
            self.saved_at[(job.step, pa[1])] = job.order
        m["tiers"] = {}
        errors: list[tuple[str, BaseException]] = []
        out: list[tuple[str, BaseException]] = []  # failed as a tier fails, or skipped: out of the path
        for tier in job.due:
            tm: dict[str, Any] = {}
            m["tiers"][tier.url] = tm
            skipped = self.tiers_out.skip(tier.url, partial(self._probe_tier, tier), job.step)
            if skipped is not None:
                tm["skipped"] = skipped
                out.append((tier.url, CheckpointError(skipped)))
                continue
            try:
                self._persist_tier(job, tier, tm, view, tensor)
            except BaseException as e:
                tm["error"] = f"{type(e).__name__}: {e}"
                if not self._tier_failure(tier, e):
                    errors.append((tier.url, e))
                    continue
                out.append((tier.url, e))
        written = [t.url for t in job.due if "durable_s" in m["tiers"][t.url]]
        if written:
            m.update({k: v for k, v in m["tiers"][written[0]].items() if k not in ("durable_s", "error", "replica")})
        for url, err in out:
            if "error" in m["tiers"][url]:
                self.tiers_out.failed(url, err, job.step, written)
        m["tiers_out"] = sorted(self.tiers_out.out)
        if not written or errors:  # no due tier has the step, or a failure that is not a tier's
            errors += out
        # save() to durable in every due tier (replicas included); retention not counted
        ends = [tm["durable_s"] for tm in m["tiers"].values() if "durable_s" in tm]
        ends += [tm["replica"]["durable_s"] for tm in m["tiers"].values() if "durable_s" in tm.get("replica", {})]
        m["total_s"] = max(ends, default=time.monotonic() - job.t_start)
        if len(errors) == 1 and len(job.due) == 1 and "skipped" not in m["tiers"][job.due[0].url]:
            raise errors[0][1]  # a writer of one tier: its own error
        if errors:
            raise CheckpointError(
                f"saving step {job.step} failed in {len(errors)} of {len(job.due)} tiers: "
                + "; ".join(f"{url}: {type(e).__name__}: {e}" for url, e in errors)
            ) from errors[0][1]

    def _tier_failure(self, tier: Tier, e: BaseException) -> bool:
        """Whether ``e`` says the tier itself failed (a storage error: unwritable, deleted,
        full; or its writer lease is lost), not the save (a rank that did not publish)."""
        if isinstance(e, (OSError, StorageError)):
            return True
        for tg in self._targets[tier.url]:
            if tg.lease is not None:
                try:
                    tg.lease.check("saving")
                except CheckpointError:
                    return True
        return False

    def _probe_tier(self, tier: Tier) -> str:
        """A tier out of the path, probed: in each of its stores a small object is written,
        read back and deleted (only that object: it is ours), and a writer lease whose file
        was deleted meanwhile (with its folder) is taken again; one another writer took
        over stays lost. Raises if any of it fails; returns what was done, for the message."""
        took = False
        if tier.url not in self._targets:  # out from the start: its stores opened, leases taken, now
            self._targets[tier.url] = self._open_targets(tier, *self._lease_args)
            took = True
        for tg in self._targets[tier.url]:
            key = f".datapipe-probe-{self.run_id}-{os.getpid()}-{os.urandom(4).hex()}"
            payload = os.urandom(64)
            tg.store.put(key, payload)
            try:
                if tg.store.get(key) != payload:
                    raise CheckpointError(f"{tg.store.url(key)}: a probe reads back different bytes")
            finally:
                tg.store.delete(key)
            if tg.lease is not None and tg.lease.deleted():  # never one another writer took over
                tg.lease.release()
                tg.lease = Lease(tg.store, self.run_id, *self._lease_args).acquire()
                took = True
            elif tg.lease is not None:
                tg.lease.check("taking the tier back")
        return "a probe written, read back and deleted" + ("; the writer lease taken again" if took else "")

    def _persist_tier(self, job: PersistJob, tier: Tier, tm: dict[str, Any],
                      staged: Callable[[int, int], memoryview], tensor: Callable[[int], Any]) -> None:
        own, *replica = self._targets[tier.url]
        received: tuple[dict[str, Any], memoryview] | None = None
        link_error: BaseException | None = None
        if replica and self._link is not None:
            # The peer waits for our bytes: exchange before writing our own copy.
            header = replica_header(job, self.rank, self.world_size, staged)
            t0 = time.perf_counter()
            try:
                received = self._link.exchange(header, tensor(header["total"]))
                tm["exchange_s"] = time.perf_counter() - t0
            except BaseException as e:
                link_error = e
        elif replica and job.link_error is not None:
            link_error = CheckpointError(job.link_error)
        elif replica and job.received is not None:
            received = job.received
        specs, total, chunk_bytes = job.layout(bool(tier.node_local))
        self._persist_to(own, job, job.step, job.attempt, staged, total, chunk_bytes, job.tree,
                         specs, job.raw_checksums, False, tm)
        tm["durable_s"] = time.monotonic() - job.t_start
        # This save's own copy is durable: a replica that failed (sent or received) is
        # reported as a warning and in metrics["tiers"][url]["replica_error"], not as a
        # failed save; the next save exchanges again.
        try:
            if link_error is not None:
                raise link_error
            if received is not None:
                self._persist_replica(job, replica[0], received, tm)
        except Exception as e:
            tm["replica_error"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"step {job.step}: the peer replica at {tier.url} was not written "
                          f"(rank {self.rank}): {tm['replica_error']}", stacklevel=1)

    def _persist_replica(self, job: PersistJob, rtg: _Target, received: tuple[dict[str, Any], memoryview],
                         tm: dict[str, Any]) -> None:
        """Check the part received from the source rank names this save, then write it."""
        hdr, data = received
        src = rtg.origin["rank"] if rtg.origin else -1
        if isinstance(hdr.get("no_data"), str):
            raise CheckpointError(f"rank {src} sent no replica of step {job.step}: {hdr['no_data']:.300}")
        ok = (hdr.get("step"), hdr.get("attempt"), hdr.get("rank"), hdr.get("world_size")) == (
            job.step, job.attempt, src, self.world_size)
        sent = hdr.get("raw_checksums")
        cb = hdr.get("chunk_bytes")
        if not (isinstance(cb, int) and cb > 0 and isinstance(sent, list) and len(sent) == -(-len(data) // cb)):
            raise CheckpointError(f"rank {self.rank}: the replica received from rank {src} for step {job.step} "
                                  "does not carry a checksum for each chunk: not written")
        if not ok or hdr.get("total") != len(data):
            raise CheckpointError(
                f"rank {self.rank}: the replica received from rank {src} is of step {hdr.get('step')!r:.40} "
                f"attempt {hdr.get('attempt')!r:.80} rank {hdr.get('rank')!r:.20}, not of this save "
                f"(step {job.step}, attempt {job.attempt}): the ranks are not saving the same steps"
            )
        rm: dict[str, Any] = {}
        ranges = chunk_ranges(len(data), cb)
        self._persist_to(rtg, job, job.step, job.attempt, lambda a, b: data[a:b], len(data),
                         cb, hdr["tree"], hdr["leaves"], dict(zip(ranges, sent)), True, rm)
        tm["replica"] = {"of_rank": src, "bytes": len(data), **rm}

    def _persist_to(self, tg: _Target, job: PersistJob, step: int, attempt: str, view: Any, total: int, cb: int,
                    tree: Any, specs: list[dict[str, Any]], known: dict[tuple[int, int], str], verify: bool,
                    m: dict[str, Any]) -> None:
        """Write one copy (chunks, part; commit if this process commits there) to one store.
        ``known``: raw checksums of chunks by their ``(start, end)``, already computed
        (reused), or, with ``verify``, those a peer sent (each chunk is hashed again and
        must match)."""
        t0 = time.perf_counter()
        if not self.fresh_attempts:
            self._refuse_used_attempt(tg, step, attempt)
        ranges = chunk_ranges(total, cb)
        chunks = self._write_chunks(tg, step, attempt, view, ranges, known, verify)
        # In a step of several parts the folders above a rank's chunk folder (the attempt's,
        # the step's, the root) are every rank's, made durable once by the rank that
        # commits: after its own chunks (the step's and the attempt's entries exist by then)
        # and the attempt folder again when every part is in it, before the manifest. The
        # other ranks sync their chunk folder only and publish their part without a folder
        # sync: 4 of the 6 directory fsyncs each did were the same ones (each a journal
        # commit and a device flush), on the path of every save.
        shared_folders = tg.world_size > 1
        if chunks:  # the chunks' folder (one for all of them), and above it where this rank syncs those
            tg.store.sync_folder(chunks[0]["key"], parents=tg.commits or not shared_folders)
        doc = {
            "step": step, "attempt": attempt, "rank": tg.rank,
            "world_size": tg.world_size, "compression": self.compression,
            "chunk_bytes": cb, "data_bytes": total,
            "stored_bytes": sum(c["stored_bytes"] for c in chunks),
            "chunks": chunks, "tree": tree, "leaves": specs,
        }
        pkey = part_key(step, attempt, tg.rank)
        body = encode_doc(doc, "part")
        if len(body) > MAX_PART_BYTES:
            raise CheckpointError(
                f"step {step}: the part document of rank {tg.rank} would be {len(body)} bytes, "
                f"more than readers accept ({MAX_PART_BYTES}); the state has too many leaves"
            )
        (tg.chunk_store if shared_folders else tg.store).put(pkey, body)
        if not chunks and (tg.commits or not shared_folders):
            sync_dirs(tg.store, pkey)  # an empty state: the part created the directories
        t1 = time.perf_counter()
        m.update(write_s=t1 - t0, write_gbps=total / (t1 - t0) / 1e9 if t1 > t0 else float("inf"),
                 stored_bytes=doc["stored_bytes"])
        if tg.commits:
            # A reader of every part (a load onto another world size) then makes one
            # request, not world_size; a one-part checkpoint needs no index.
            parts, docs = await_parts(tg.store, step, attempt, tg.world_size, job.commit_timeout,
                                      keep_docs=PARTS_INDEX_MAX_BYTES if tg.world_size > 1 else 0)
            index = None
            if docs is not None and tg.world_size > 1:
                try:  # its folder entry synced below, with the parts'
                    index = write_parts_index(tg.chunk_store, step, attempt, parts, docs)
                except (OSError, StorageError) as e:  # a copy for speed: the step commits without it
                    for p in parts:
                        p.pop("index_offset", None)
                    warnings.warn(f"step {step}: the parts index could not be written at {tg.store.root} "
                                  f"({type(e).__name__}: {e}); committing without it (a load onto another "
                                  "world size reads each part document)", stacklevel=1)
            del docs
            if shared_folders:  # every part's entry (and its chunk folder's) durable before the manifest
                tg.store.sync_folder(pkey, parents=False)
            tg.lease.check(f"committing step {step}")  # type: ignore[union-attr]
            write_manifest(tg.store, step, attempt, tg.world_size, parts, tg.origin, index)
            m["committed"] = True
            try:
                write_latest(tg.store, step, attempt)
            except Exception as e:
                # The manifest is the commit and readers scan manifests: the save succeeded.
                # Retention below keeps the step `latest` still names.
                m["latest_error"] = f"{type(e).__name__}: {e}"
                warnings.warn(f"step {step} is committed at {tg.store.root}, but updating `latest` "
                              f"failed ({type(e).__name__}: {e}); it names an older step until "
                              "a later save updates it", stacklevel=1)
        t2 = time.perf_counter()
        # total_s: until durable (rank 0: committed); retention is reported on its own
        done = time.monotonic() - job.t_start
        m.update(commit_s=t2 - t1, total_s=done, durable_s=done)
        if tg.commits:
            attempt_id = self.attempt_id

            def in_flight(s: int, a: str) -> bool:
                # An attempt of this writer that rank 0 had not saved before this one: another
                # rank, which may be ahead of rank 0, may still be writing it. Attempts rank 0
                # saved earlier are finished on every rank (each rank saves in call order and
                # every part of this step exists).
                pa = parse_attempt(a)
                return (pa is not None and pa[0] == attempt_id
                        and self.saved_at.get((s, pa[1]), job.order + 1) > job.order)

            try:
                tg.lease.check("deleting old checkpoints")  # type: ignore[union-attr]
                m["deleted_steps"] = apply_retention(tg.store, step, attempt, tg.tier.keep_last,
                                                     tg.tier.keep_every, in_flight)
            except Exception as e:
                raise CheckpointError(
                    f"step {step} is committed at {tg.store.root}, but deleting old checkpoints "
                    f"failed ({type(e).__name__}: {e}); they are retried after the next commit"
                ) from e
            m["retention_s"] = time.perf_counter() - t2

    def _write_chunks(self, tg: _Target, step: int, attempt: str, view: Any, ranges: list[tuple[int, int]],
                      known: dict[tuple[int, int], str], verify: bool) -> list[dict[str, Any]]:
        """Write the chunks on the ``io_threads`` threads. Returns only when every thread is
        done, failed or not: the staging buffer is reused only after that."""
        results: list[Any] = [None] * len(ranges)

        def write(i: int) -> None:
            results[i] = self._write_chunk(tg, step, attempt, view, i, *ranges[i], known, verify)

        self._io.run(len(ranges), write)
        return results

    def _write_chunk(self, tg: _Target, step: int, attempt: str, view: Any, index: int, start: int, end: int,
                     known: dict[tuple[int, int], str], verify: bool) -> dict[str, Any]:
        data = view(start, end)
        plain = self.compression != "zstd"  # stored as staged: its record lists block checksums
        key = chunk_key(step, attempt, tg.rank, index)
        raw_ck = known.get((start, end)) if not verify else None
        if plain and not verify and tg.chunk_store.local_path(key) is not None:
            # a local file: each block written as it is hashed (one read of the staged
            # bytes from memory, not two); a failure leaves nothing at the key
            whole = Hasher() if raw_ck is None else None
            with tg.chunk_store.open_writer(key) as f:
                written = block_checksums(data, whole=whole, sink=f.write)
            if whole is not None:
                raw_ck = known[(start, end)] = whole.hexdigest()  # reused as below
            return {"key": key, "offset": start, "bytes": end - start, "checksum": raw_ck,
                    "blocks": written, "stored_bytes": end - start}
        blocks: dict[str, Any] | None = None
        if raw_ck is None:
            if plain:  # one pass over the bytes: the blocks' checksums and the chunk's
                whole = Hasher()
                blocks = block_checksums(data, whole=whole)
                raw_ck = whole.hexdigest()
            else:
                raw_ck = _checksum_in_slices(data)
            if verify:
                if known.get((start, end)) != raw_ck:
                    raise CheckpointError(
                        f"step {step}: chunk {index} of the replica for {tg.store.root} does not match "
                        f"the checksum its rank sent ({known.get((start, end))!r:.40}, got {raw_ck}): not written"
                    )
            else:
                # the next tier reuses it (one thread per range: no race); a range is the
                # same bytes of the one staging buffer in the shared and node-local layouts
                known[(start, end)] = raw_ck
        rec: dict[str, Any] = {"key": key, "offset": start, "bytes": end - start}
        if not plain:
            cctx = getattr(self._tls, "cctx", None)
            if cctx is None:
                import zstandard

                cctx = self._tls.cctx = zstandard.ZstdCompressor(level=self.zstd_level)
            stored: Any = cctx.compress(data)
            rec.update(checksum=_checksum_in_slices(memoryview(stored)), raw_checksum=raw_ck)
        else:
            stored = data
            rec["checksum"] = raw_ck
            # range reads check only the blocks they touch (reshard.py)
            rec["blocks"] = blocks if blocks is not None else block_checksums(data)
        rec["stored_bytes"] = len(stored)
        tg.chunk_store.put(rec["key"], stored)
        return rec
