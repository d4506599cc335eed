"""Restore from the best place: the newest step that every rank can load, each rank's part
from its own node-local tier, else from its peer's replica, else from a shared (remote)
tier, every byte verified against the manifest checksums before it is used.

How the ranks agree (one collective round per attempt, over a gloo group made for the
restore): each rank lists the complete steps it holds (its own folder and the replica it
keeps in each node-local tier; rank 0 also the shared tiers) and the lists are gathered
on every rank, so every rank computes the same plan. A rank whose part comes from the
peer replica gets it from the rank that holds it: the holder sends the stored files
(manifest, part, chunks) as they are, each chunk as soon as it is read; the receiver takes
each chunk straight into the state's buffer and verifies everything exactly as a load
from storage does. A copy that fails (missing, incomplete, corrupt) is
named in a warning on every rank and never tried again; the plan is made again without
it. Each round removes at least one copy from a finite set, so a restore ends: with a
state, or with :class:`NoCheckpointError` naming what was skipped (the endless restart
loop of a ``latest`` pointing at a partial folder plus a corrupt replica cannot happen:
``latest`` is never read).

Onto another world size (``reshard=True``): every rank lists every own and replica folder
of its node's tiers, so the parts of ranks that left are found where the remaining nodes
keep them; the saved ranks' parts are read as one step by overlap (``SavedStep(joined=)``,
reshard.py), each from where this rank can read it, else sent, as stored, by a rank that
holds it (only the parts the rank's ``into`` boxes overlap). The same agreement rounds
skip failing copies.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointOptionError,
    NoCheckpointError,
    StorageError,
    UnsupportedStateError,
)
from ..storage import MemoryStore, Store, join_url, open_store
from ..topology import Topology
from .commit import scan_steps
from .format import MAX_CHUNK_BYTES, MAX_PART_BYTES, manifest_key, part_key
from .read import read_step
from .step import check_chunk, check_part, part_state, probe_chunk, read_doc, read_manifest, read_part
from .tiers import Tier, check_tiers, own_dir, peer_of, replica_dir, resolve_ranks_per_node, source_of

__all__ = ["RestoreResult", "restore_checkpoint", "LOCAL", "PEER_REPLICA", "REMOTE"]

LOCAL, PEER_REPLICA, REMOTE = "local", "peer replica", "remote"
_PREFERENCE = {LOCAL: 0, PEER_REPLICA: 1, REMOTE: 2}


@dataclass
class RestoreResult:
    """What :func:`restore_checkpoint` loaded: this rank's ``state`` of ``step``, where it
    came from (``source``: ``"local"``, ``"peer replica"`` or ``"remote"``; ``url``: the
    folder it was read from, on the holder's node for a replica), every rank's source in
    rank order (``sources``), the copies skipped on the way (``skipped``), the seconds this
    rank spent reading and verifying its part (``read_s``) and the bytes it restored."""

    state: Any
    step: int
    source: str
    url: str
    sources: list[str]
    skipped: list[str] = field(default_factory=list)
    read_s: float = 0.0
    bytes: int = 0
    seconds: float = 0.0  # the whole restore, agreement rounds included
    saved_world_size: int = 0  # the world size that saved ``step``
    resharded: bool = False  # saved by another world size, read onto this one by overlap


# What the fill of `into` raises about `into` itself (a box, dtype or key the step does not
# have, a DTensor it cannot place), before it reads any byte for it: no copy's fault.
_INTO_ERRORS = (CheckpointOptionError, UnsupportedStateError)

# A copy: (source kind, tier index, job rank whose part it is). Its step/attempt is the plan's.
_Copy = tuple[str, int, int]


def _commit_time(doc: dict[str, Any]) -> float | None:
    """A verified manifest's ``created_unix`` (its commit time), or None where it has none
    that is a finite number of seconds: the order of two saves of one step."""
    t = doc.get("created_unix")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not -(2.0**53) < t < 2.0**53:
        return None
    return float(t) if math.isfinite(t) else None


def _complete(store: Store, origin: tuple[int, int | None] | None, world_size: int | None,
              skipped: list[str]) -> list[list[Any]]:
    """``[[step, attempt, commit time, saved world size], ...]`` of the steps in ``store``
    whose manifest verifies (and, in a node-local folder, names the expected job rank and
    world size). A world size of None: any (a restore that reshards)."""
    # Any failure here is a note, never raised: this runs before the ranks first agree,
    # and a rank that raised would leave the others waiting out their timeout.
    out: list[list[Any]] = []
    try:
        by_step = scan_steps(store)
    except Exception as e:
        skipped.append(f"{store.root}: cannot list ({type(e).__name__}: {e})")
        return out
    for s, keys in sorted(by_step.items(), reverse=True):
        if manifest_key(s) not in keys:
            continue  # never committed: a killed save; loaders skip it without a word
        try:
            doc = read_manifest(store, s)
        except (CheckpointError, StorageError) as e:
            skipped.append(f"{store.url(manifest_key(s))}: {e}")
            continue
        except Exception as e:
            skipped.append(f"{store.url(manifest_key(s))}: {type(e).__name__}: {e}")
            continue
        if origin is not None:
            got = doc.get("origin")
            ows = got.get("world_size") if isinstance(got, dict) else None
            if not (isinstance(got, dict) and got.get("rank") == origin[0] and doc["world_size"] == 1
                    and isinstance(ows, int) and not isinstance(ows, bool) and origin[0] < ows <= 1 << 20
                    and (origin[1] is None or ows == origin[1])):
                skipped.append(f"{store.url(manifest_key(s))}: holds the part of {got!r:.80}, "
                               f"not of rank {origin[0]} of {origin[1] or 'any world size'}")
                continue
            out.append([s, doc["attempt"], _commit_time(doc), ows])
            continue
        if world_size is not None and doc["world_size"] != world_size:
            skipped.append(f"{store.url(manifest_key(s))}: saved by {doc['world_size']} ranks, "
                           f"this job has {world_size}")
            continue
        out.append([s, doc["attempt"], _commit_time(doc), doc["world_size"]])
    return out


class _Group:
    """The collective side of a restore: a gloo group of its own, or one process."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.group: Any = None
        if world_size > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def close(self) -> None:
        """Destroy the gloo group (its sockets and threads)."""
        if self.group is not None:
            import torch.distributed as dist

            group, self.group = self.group, None
            dist.destroy_process_group(group)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-able), in rank order. JSON, not pickle: a peer's
        message is data."""
        if self.world_size == 1:
            return [obj]
        import torch
        import torch.distributed as dist

        data = json.dumps(obj).encode()
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        try:
            dist.all_gather(sizes, n, group=self.group)
            top = max(int(s) for s in sizes)
            mine = torch.zeros(top, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
            bufs = [torch.empty(top, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(bufs, mine, group=self.group)
        except RuntimeError as e:  # gloo's word: a rank stopped, or did not come within the timeout
            raise CheckpointError(
                f"restore: rank {self.rank} of {self.world_size}: the ranks' exchange failed (a rank stopped, "
                f"or did not reach it within timeout_s={self.timeout_s} s): {e}; see the other ranks' "
                "errors") from e
        return [json.loads(bytes(b[: int(s)].numpy())) for b, s in zip(bufs, sizes)]


def _replica_docs(store: Store, step: int, attempt: str) -> tuple[list[tuple[str, bytes]], list[dict[str, Any]]]:
    """The stored manifest and part of a one-part checkpoint in a replica folder, as they
    are, and its chunk records, each chunk's size probed. The documents are checked here
    first, so a holder never reads or sends more than the part's chunks hold; the
    receiving rank checks everything again."""
    doc = read_manifest(store, step)
    if doc["attempt"] != attempt:
        raise CheckpointError(f"{store.url(manifest_key(step))}: attempt {doc['attempt']}, not {attempt}")
    mdata = store.get(manifest_key(step))
    entry = doc["parts"][0]
    pdata, part = read_doc(store, entry["key"], "part", MAX_PART_BYTES)
    where = f"replica of step {step} at {store.root}"
    check_part(part, entry, step, attempt, 0, 1, where)
    for c in part["chunks"]:
        probe_chunk(store, c, part.get("compression") == "zstd", where)
    return [(manifest_key(step), mdata), (entry["key"], pdata)], part["chunks"]


def _send_replica(group: _Group, dst: int, store: Store, step: int, attempt: str,
                  tag: int = 0) -> tuple[list[Any], str | None]:
    """Start sending a replica to ``dst``, pipelined: sizes and a JSON header naming each
    file (or the reason there is none), the manifest and the part as stored, then each
    chunk as it is read, its send started before the next is read (the receiver takes
    the first chunk while this rank reads the rest; no send waits on a receive, so two
    ranks sending each other replicas cannot block). Returns the sends and what went wrong
    here after the header went out, if anything: from then on every chunk announced is
    still sent, a chunk that could not be read (or allocated) as zeros of its size from a
    read-only map of the zero page, so the receiver's checksum refuses it and neither
    side waits for what never comes."""
    import torch
    import torch.distributed as dist

    docs: list[tuple[str, bytes]] = []
    chunks: list[dict[str, Any]] = []
    error = None
    try:
        docs, chunks = _replica_docs(store, step, attempt)
    except Exception as e:  # any failure is sent: the rank that needs the files waits for them
        error = f"{store.root}: {type(e).__name__}: {e}"
    files = [[k, len(b)] for k, b in docs] + [[c["key"], c["stored_bytes"]] for c in chunks]
    header = json.dumps({"files": files, "error": error}).encode()
    sizes = torch.tensor([len(header), sum(n for _k, n in files)], dtype=torch.int64)
    reqs = [dist.isend(sizes, dst, group=group.group, tag=tag),
            dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group.group, tag=tag)]
    failed: str | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": gloo only reads what it sends
        for _k, b in docs:
            reqs.append(dist.isend(torch.frombuffer(b, dtype=torch.uint8), dst, group=group.group, tag=tag))
        for c in chunks:
            n = c["stored_bytes"]
            buf = None
            if failed is None:
                try:
                    buf = torch.empty(n, dtype=torch.uint8)
                    if store.readinto(c["key"], buf.numpy().data) != n:
                        raise CheckpointError(f"{store.url(c['key'])} is shorter than its {n} bytes")
                except Exception as e:
                    failed, buf = f"{store.url(c['key'])}: {type(e).__name__}: {e}", None
            if buf is None:
                buf = torch.frombuffer(mmap.mmap(-1, n, prot=mmap.PROT_READ), dtype=torch.uint8)
            reqs.append(dist.isend(buf, dst, group=group.group, tag=tag))
    return reqs, failed


def _recv_replica(group: _Group, src: int, rank: int, world: int, step: int, attempt: str,
                  where: str, map_location: Any) -> tuple[Any, int]:
    """Receive the replica of this rank's part from ``src`` (see :func:`_send_replica`):
    (its state, its data bytes), everything checked exactly as a load from storage is: manifest and
    part first, then each chunk received straight into the state's buffer and checked
    against its checksum while the next arrives. On any failure the rest of what ``src``
    announced is still received (its sends complete) and then the error is raised."""
    import torch
    import torch.distributed as dist

    header, files = _recv_header(group, src, 0, "a replica")
    got = 0  # files received so far
    pending: list[Any] = []  # the chunks' receives, once posted
    waited = 0  # of them

    def recv_bytes(n: int) -> bytes:
        nonlocal got
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            dist.recv(buf, src, group=group.group)
        got += 1
        return buf.numpy().tobytes()

    try:  # from here on, what src announced is received to the end (below)
        if any(n > MAX_CHUNK_BYTES + (1 << 20) for _k, n in files):
            raise CheckpointError(f"rank {src} sent a file list of sizes that are not a replica's "
                                  f"({[n for _k, n in files][:8]})")
        if header.get("error") is not None:
            raise CheckpointError(str(header["error"]))
        mkey, pkey = manifest_key(step), part_key(step, attempt, 0)
        if [k for k, _n in files[:2]] != [mkey, pkey] or any(n > MAX_PART_BYTES for _k, n in files[:2]):
            raise CheckpointError(f"rank {src} sent {[k for k, _n in files[:2]]!r:.200}, not {mkey} and {pkey}")
        mem = MemoryStore(f"replica-of-rank-{rank}://")
        for key, n in files[:2]:
            mem.put(key, recv_bytes(n))
        _check_attempt(mem, step, attempt)
        _check_origin(mem, step, rank, world)
        doc = read_manifest(mem, step)
        if doc["world_size"] != 1:
            raise CheckpointError(f"rank {src} sent a checkpoint of {doc['world_size']} parts as a replica")
        part = read_part(mem, doc, 0, where)
        chunks = part["chunks"]
        if [(c["key"], c["stored_bytes"]) for c in chunks] != files[2:]:
            raise CheckpointError(f"rank {src} announced chunks that are not the ones its part names")
        compressed = part.get("compression") == "zstd"
        data = torch.empty(part["data_bytes"], dtype=torch.uint8)
        view = data.numpy().data
        # every receive posted at once: chunk i is checked while the next ones arrive
        bufs = [torch.empty(c["stored_bytes"], dtype=torch.uint8) if compressed
                else data[c["offset"]: c["offset"] + c["bytes"]] for c in chunks]
        pending = [dist.irecv(b, src, group=group.group) for b in bufs]
        for c, b, q in zip(chunks, bufs, pending):
            waited += 1  # before the wait: one that raised is not waited again
            q.wait()
            check_chunk(c, view[c["offset"]: c["offset"] + c["bytes"]], b.numpy() if compressed else None,
                         f"{c['key']} (from rank {src})", where)
        return part_state(part, data, where, map_location), int(part["data_bytes"])
    except BaseException:
        try:  # take the rest of what src sends, so that its sends complete
            for q in pending[waited:]:  # each once: a second wait on a gloo receive waits for another
                q.wait()
            _drain(group, src, [] if pending else [n for _k, n in files[got:]])
        except Exception:  # the connection itself failed: nothing more will come
            pass
        raise


def _recv_files(group: _Group, src: int, tag: int, into: MemoryStore) -> None:
    """Receive into ``into`` the files of a one-part checkpoint that ``src`` sends with
    :func:`_send_replica` (manifest, part, chunks: as stored, each checked later by the step
    reader, as a load from storage checks them). What ``src`` announced is received to the
    end even when it sent an error, or a file list refused here (its sends complete), then
    the error is raised; only a header that cannot be read, or whose sizes do not add up to
    what ``src`` announced, leaves the rest unreceived (then nothing says what to take)."""
    import torch
    import torch.distributed as dist

    header, files = _recv_header(group, src, tag, "a part")
    if any(n > MAX_CHUNK_BYTES + (1 << 20) for _k, n in files):
        # announced all the same: take them (no more memory than accepting them would
        # hold), so that the sender's sends complete, and refuse them after
        why = _drain(group, src, [n for _k, n in files], tag)
        raise CheckpointError(f"rank {src} sent a file list of sizes that are not a part's "
                              f"({[n for _k, n in files][:8]}){why}")
    for key, n in files:  # announced: every one is sent, readable or not (zeros then)
        buf = torch.empty(n, dtype=torch.uint8)
        dist.recv(buf, src, group=group.group, tag=tag)
        into.put(key, buf.numpy().tobytes())
    if header.get("error") is not None:
        raise CheckpointError(str(header["error"]))


def _recv_header(group: _Group, src: int, tag: int, what: str) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """The header :func:`_send_replica` sends first: (the header, its file list), its sizes
    checked (a header of bounded size; positive file sizes adding up to the data announced).
    A header that fails this leaves the rest unreceived: nothing then says what to take."""
    import torch
    import torch.distributed as dist

    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src, group=group.group, tag=tag)
    nh, nb = int(sizes[0]), int(sizes[1])
    if not (0 < nh <= MAX_PART_BYTES and 0 <= nb <= 1 << 44):
        raise CheckpointError(f"rank {src} announced {nh} header and {nb} data bytes for {what}")
    h = torch.empty(nh, dtype=torch.uint8)
    dist.recv(h, src, group=group.group, tag=tag)
    try:
        header = json.loads(bytes(h.numpy()))
        files = [(str(k), int(n)) for k, n in header["files"]]
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"rank {src} sent a malformed header for {what}: {e}") from None
    if any(n <= 0 for _k, n in files) or sum(n for _k, n in files) != nb:
        raise CheckpointError(f"rank {src} sent a file list of sizes that are not all positive or do not "
                              f"add up to {nb} bytes")
    return header, files


def _drain(group: _Group, src: int, sizes: list[int], tag: int = 0) -> str:
    """Receive and drop the files of ``sizes`` that ``src`` announced, so that its sends
    complete: one scratch buffer, of the largest, and only while that is at most twice a
    file a part may hold (a sender a little off, e.g. another datapipe); past that nothing
    is received (memory stays bounded) and the sender's sends wait out its timeout. Returns
    what the caller's error adds about it."""
    import torch
    import torch.distributed as dist

    top = max(sizes, default=0)
    if top > 2 * (MAX_CHUNK_BYTES + (1 << 20)):
        return (f"; not received (a file of {top} bytes is more than twice a part's largest): rank {src}'s sends "
                "wait out the group's timeout")
    scratch = torch.empty(top, dtype=torch.uint8)
    for n in sizes:
        if n:
            dist.recv(scratch[:n], src, group=group.group, tag=tag)
    return ""


def _check_attempt(store: Store, step: int, attempt: str) -> None:
    doc = read_manifest(store, step)
    if doc["attempt"] != attempt:
        raise CheckpointError(f"{store.url(manifest_key(step))}: attempt {doc['attempt']}, not {attempt}: "
                              "another save of this step replaced it")


def restore_checkpoint(tiers: list[Tier], *, rank: int | None = None, world_size: int | None = None,
                       ranks_per_node: int | None = None, map_location: Any = None,
                       timeout_s: float = 600.0, reshard: bool = False, into: Any = None) -> RestoreResult:
    """Load this rank's part of the newest step every rank can load from ``tiers`` (the
    writer's list; node-local tier URLs are this node's). With more than one rank every
    rank must call it at once (torch.distributed initialised): the ranks agree on the step
    and trade peer replicas over a gloo group of its own (``timeout_s`` per collective,
    destroyed at the end). A copy that fails to load on any rank, for any reason, is
    skipped on every rank with a warning naming it. See the module docstring.

    ``reshard=True``: the newest step saved by any world size, onto this one (a job that
    shrank after a node was lost, or grew). The parts of ranks that left are found in
    every folder of the node-local tiers (their own, or the peer replicas the remaining
    nodes keep), else in a shared tier; a part no rank of a node can read is sent by a rank
    that holds it. ``into=`` (this rank's state on this world: DTensors on the new mesh,
    ``LocalShard``s, tensors, as ``load_checkpoint(into=)`` takes) is filled in place by
    overlap, and only the parts it overlaps are read or sent; the other values come from
    the checkpoint. Without ``into=`` every rank gets the saved state of its rank (rank 0's
    on a rank the save did not have) with each global tensor whole. ``into=`` without
    ``reshard`` restores only steps saved by this world size, the same way. An ``into=``
    that does not fit the newest step (a key it lacks, another dtype or global shape, a
    box outside it) is a :class:`CheckpointOptionError` on every rank, naming the key: no
    older step whose shapes fit is restored in its place, and no copy is skipped."""
    t_start = time.perf_counter()
    tiers = check_tiers(tiers)
    if not isinstance(reshard, bool):
        raise CheckpointOptionError(f"restore_checkpoint: reshard must be True or False, got {reshard!r:.80}")
    try:
        rank, world = Topology.resolve(rank, world_size, environment=False)
    except Exception as e:
        raise CheckpointOptionError(f"restore_checkpoint: {e}") from None
    live = Topology.distributed()
    if world > 1 and (live is None or live != (rank, world)):
        raise CheckpointError(
            f"restoring rank {rank} of {world} from tiers needs every rank at once over torch.distributed "
            f"(initialised: {live}); to read one rank's part of a shared tier use load_checkpoint(url, rank=)"
        )
    if reshard or into is not None:
        return _restore_any_world(tiers, rank, world, into, reshard, map_location, timeout_s, t_start)
    rpn = (resolve_ranks_per_node(ranks_per_node, world, f"Tier({tiers[0].url!r})")
           if any(t.replicate for t in tiers) else None)
    own: dict[int, Store] = {}
    held: dict[int, Store] = {}
    shared: dict[int, Store] = {}
    for i, t in enumerate(tiers):
        if t.node_local:
            own[i] = open_store(join_url(t.url, own_dir(rank)), t.storage_options)
            if t.replicate and rpn is not None:
                held[i] = open_store(join_url(t.url, replica_dir(source_of(rank, world, rpn))), t.storage_options)
        else:
            shared[i] = open_store(t.url, t.storage_options)
    skipped: list[str] = []
    mine = {
        "own": {str(i): _complete(s, (rank, world), world, skipped) for i, s in own.items()},
        "held": {str(i): _complete(s, (source_of(rank, world, rpn), world), world, skipped)  # type: ignore[arg-type]
                 for i, s in held.items()},
        "shared": ({str(i): _complete(s, None, world, skipped) for i, s in shared.items()} if rank == 0 else {}),
        "skipped": skipped,
    }
    group = _Group(rank, world, timeout_s)
    try:
        return _restore(group, tiers, mine, rank, world, rpn, own, held, shared, map_location, t_start)
    finally:
        group.close()


def _restore(group: _Group, tiers: list[Tier], mine: dict[str, Any], rank: int, world: int,
             rpn: int | None, own: dict[int, Store], held: dict[int, Store], shared: dict[int, Store],
             map_location: Any, t_start: float) -> RestoreResult:
    """restore_checkpoint's collective part, over ``group``."""
    infos = group.all_gather_json(mine)
    # every rank warns of every rank's skipped copies, in the same order: a warning
    # turned into an error then stops all ranks at this point, never one while the
    # others wait for it in the next collective
    notes = [s for info in infos for s in info["skipped"]]
    for note in notes:
        warnings.warn(f"restore: skipping {note}", stacklevel=2)

    # (kind, tier, rank) -> set of (step, attempt) it holds
    have: dict[_Copy, set[tuple[int, str]]] = {}
    # (step, attempt) -> the latest commit time of its manifests (one save, several copies)
    when: dict[tuple[int, str], float] = {}

    def saves(steps: list[list[Any]]) -> set[tuple[int, str]]:
        for s, a, t, _w in steps:
            if t is not None:
                when[(int(s), str(a))] = max(float(t), when.get((int(s), str(a)), float(t)))
        return {(int(s), str(a)) for s, a, _t, _w in steps}

    for r, info in enumerate(infos):
        for i, steps in info["own"].items():
            have[(LOCAL, int(i), r)] = saves(steps)
        if rpn is not None:
            for i, steps in info["held"].items():
                have[(PEER_REPLICA, int(i), source_of(r, world, rpn))] = saves(steps)
    for i, steps in infos[0]["shared"].items():
        shared_steps = saves(steps)
        for r in range(world):
            have[(REMOTE, int(i), r)] = shared_steps
    bad: set[tuple[str, int, int, int, str]] = set()

    def newest(sa: tuple[int, str]) -> tuple[int, bool, float]:
        # The highest step; of two saves of one step (a run that saved it again after a
        # restart, into another tier), the one committed last: the other is older state.
        # A manifest without a commit time (edited) ranks below one with.
        t = when.get(sa)
        return (sa[0], t is not None, 0.0 if t is None else t)

    # (ties, refused below, in one order on every rank)
    candidates = sorted({sa for v in have.values() for sa in v}, key=lambda sa: (newest(sa), sa[1]), reverse=True)

    def source(r: int, s: int, a: str) -> _Copy | None:
        best = [c for c, v in have.items() if c[2] == r and (s, a) in v and (c[0], c[1], r, s, a) not in bad]
        return min(best, key=lambda c: (_PREFERENCE[c[0]], c[1])) if best else None

    while True:
        plan = None
        for s, a in candidates:
            if plan is not None and newest((s, a)) != newest((plan[0], plan[1])):
                break
            srcs = [source(r, s, a) for r in range(world)]
            if all(c is not None for c in srcs):
                if plan is not None:
                    # every rank computes this from the same gathered lists: all refuse alike
                    raise CheckpointError(
                        f"restore: step {s} was saved twice, as attempts {a} and {plan[1]}, and their manifests "
                        f"in tiers {[t.url for t in tiers]} do not say which is newer (the same commit time, "
                        "or none); delete the older one's step folder from the tier that holds it"
                    )
                plan = (s, a, srcs)
        if plan is None:
            raise NoCheckpointError(
                f"no step is complete and verified for all {world} ranks in tiers "
                f"{[t.url for t in tiers]} (steps seen: {sorted({s for s, _a in candidates})}; "
                f"skipped: {'; '.join(notes) or 'none'})"
            )
        s, a, srcs = plan
        failure: str | None = None
        state: Any = None
        read_s = 0.0
        nbytes = 0
        reqs: list[Any] = []
        holder_error: str | None = None
        # 1. as a holder: read the replicas of the ranks that need them and start sending
        if rpn is not None:
            src_rank = source_of(rank, world, rpn)
            c = srcs[src_rank]
            if c is not None and c[0] == PEER_REPLICA:
                reqs, holder_error = _send_replica(group, src_rank, held[c[1]], s, a)
        # 2. this rank's own part
        mine_c = srcs[rank]
        if mine_c is None:  # unreachable: a plan holds a source for every rank
            raise CheckpointError(f"restore plan for step {s} has no source for rank {rank}")
        kind, ti = mine_c[0], mine_c[1]
        if kind != PEER_REPLICA:
            # the rank that needs what this one sends waits for it, and the restore waits for
            # the slowest rank: the replica goes first, then this rank's own part. (A rank
            # that itself waits for a replica does not wait here: two ranks holding each
            # other's replicas would each wait for a receive the other has not posted.)
            _wait_sends(reqs, rank, s, group.timeout_s)
            reqs = []  # each waited once
        where = ""
        t0 = time.perf_counter()
        try:
            if kind == LOCAL:
                where = own[ti].root
                _check_attempt(own[ti], s, a)
                state = read_step(own[ti], s, 0, map_location)
                nbytes = _manifest_bytes(own[ti], s)
            elif kind == REMOTE:
                where = shared[ti].root
                _check_attempt(shared[ti], s, a)
                state = read_step(shared[ti], s, rank, map_location)
                nbytes = _manifest_bytes(shared[ti], s, rank)
            else:
                holder = peer_of(rank, world, rpn)  # type: ignore[arg-type]
                where = f"{join_url(tiers[ti].url, replica_dir(rank))} on rank {holder}"
                state, nbytes = _recv_replica(group, holder, rank, world, s, a, where, map_location)
        except Exception as e:  # any failure is agreed on below: a rank that raised here would hang the others
            failure = f"{kind} copy of rank {rank}'s part of step {s} at {where}: {type(e).__name__}: {e}"
        read_s = time.perf_counter() - t0
        _wait_sends(reqs, rank, s, group.timeout_s)
        # 3. agree: a copy that failed anywhere is skipped everywhere; a holder's failure to
        # read what it sent is named on every rank alike (a warning turned into an error
        # then stops every rank at once, never one while the others wait for it)
        agreed = group.all_gather_json([failure, holder_error])
        results = [f for f, _h in agreed]
        for r, (_f, h) in enumerate(agreed):
            if h is not None:
                warnings.warn(f"restore: rank {r} sending a peer replica of step {s}: {h}", stacklevel=2)
        failed = [(r, f) for r, f in enumerate(results) if f is not None]
        if not failed:
            return RestoreResult(state, s, kind, where, [c[0] for c in srcs if c is not None], notes,
                                 read_s, nbytes, time.perf_counter() - t_start, saved_world_size=world)
        for r, f in failed:
            cr = srcs[r]
            if cr is not None:
                bad.add((cr[0], cr[1], r, s, a))
            notes.append(f)
            warnings.warn(f"restore: skipping the {f}", stacklevel=2)


def _check_origin(store: Store, step: int, rank: int, world: int) -> None:
    doc = read_manifest(store, step)
    got = doc.get("origin")
    if not (isinstance(got, dict) and (got.get("rank"), got.get("world_size")) == (rank, world)):
        raise CheckpointError(f"the replica names origin {got!r:.80}, not rank {rank} of {world}")


def _manifest_bytes(store: Store, step: int, rank: int = 0) -> int:
    return int(read_manifest(store, step)["parts"][rank]["data_bytes"])


# -- restoring onto another world size ---------------------------------------------------------

_FOLDER = re.compile(r"(?:rank|replica-of-rank)-(\d{5})")

# A copy of one saved rank's part: (kind, tier index, saved rank, the rank that reads it
# from its node: -1 for a shared tier, which every rank reads).
_PartCopy = tuple[str, int, int, int]


def _node_folders(store: Store, skipped: list[str]) -> list[tuple[int, str, str]]:
    """``(saved rank, kind, folder)`` of each own and replica folder in a node-local tier
    (docs/CHECKPOINT_FORMAT.md, "Tiers"); other names are not the tier's and are left alone."""
    try:
        keys = store.list("")
    except Exception as e:
        skipped.append(f"{store.root}: cannot list ({type(e).__name__}: {e})")
        return []
    out = []
    for name in sorted({k.split("/", 1)[0] for k in keys if "/" in k}):
        m = _FOLDER.fullmatch(name)
        if m is None:
            continue
        r = int(m.group(1))
        if name == own_dir(r):
            out.append((r, LOCAL, name))
        elif name == replica_dir(r):
            out.append((r, PEER_REPLICA, name))
    return out


def _restore_any_world(tiers: list[Tier], rank: int, world: int, into: Any, reshard: bool, map_location: Any,
                       timeout_s: float, t_start: float) -> RestoreResult:
    """restore_checkpoint(reshard=True or into=): the newest step whose every saved rank's
    part some rank can reach, saved by any world size (``reshard``) or by this one, read
    onto this world by overlap (reshard.py). Every rank lists every folder of its node's
    tiers (its own and the replicas it keeps are not the only ones once the world changed),
    and rank 0 the shared tiers. A part is read where this rank can read it (a folder of its
    node, a shared tier); else it is sent, as stored, by a rank that holds it, and checked
    here as if read from storage. Only the parts whose pieces overlap ``into`` are sent
    (without ``into``, every part: each global tensor comes back whole)."""
    skipped: list[str] = []
    folders: dict[tuple[int, str, int], Store] = {}  # (tier, kind, saved rank) -> its folder on this node
    local: list[list[Any]] = []
    shared: dict[int, Store] = {}
    remote: list[list[Any]] = []
    for i, t in enumerate(tiers):
        if t.node_local:
            for r, kind, name in _node_folders(open_store(t.url, t.storage_options), skipped):
                folders[(i, kind, r)] = st = open_store(join_url(t.url, name), t.storage_options)
                local += [[i, kind, r, *e] for e in _complete(st, (r, None), None, skipped)]
        else:
            shared[i] = open_store(t.url, t.storage_options)
            if rank == 0:
                remote += [[i, *e] for e in _complete(shared[i], None, None, skipped)]
    group = _Group(rank, world, timeout_s)
    try:
        infos = group.all_gather_json({"local": local, "remote": remote, "skipped": skipped})
        return _plan_and_read(group, tiers, infos, folders, shared, rank, world, into, reshard, map_location,
                              t_start)
    finally:
        group.close()


def _plan_and_read(group: _Group, tiers: list[Tier], infos: list[dict[str, Any]],
                   folders: dict[tuple[int, str, int], Store], shared: dict[int, Store], rank: int, world: int,
                   into: Any, reshard: bool, map_location: Any, t_start: float) -> RestoreResult:
    from .reshard import fill_into, parts_overlapping, whole_state
    from .step import SavedStep

    notes = list(dict.fromkeys(n for info in infos for n in info["skipped"]))  # a node's ranks list alike
    for note in notes:
        warnings.warn(f"restore: skipping {note}", stacklevel=3)
    have: dict[_PartCopy, set[tuple[int, str]]] = {}
    when: dict[tuple[int, str], float] = {}
    world_of: dict[tuple[int, str], set[int]] = {}

    def add(c: _PartCopy, s: int, a: str, t: Any, n: int) -> None:
        have.setdefault(c, set()).add((s, a))
        world_of.setdefault((s, a), set()).add(n)
        if t is not None:
            when[(s, a)] = max(float(t), when.get((s, a), float(t)))

    for q, info in enumerate(infos):
        for i, kind, r, s, a, t, n in info["local"]:
            add((str(kind), int(i), int(r), q), int(s), str(a), t, int(n))
    for i, s, a, t, n in infos[0]["remote"]:
        for r in range(int(n)):
            add((REMOTE, int(i), r, -1), int(s), str(a), t, int(n))

    def newest(sa: tuple[int, str]) -> tuple[int, bool, float]:
        t = when.get(sa)
        return (sa[0], t is not None, 0.0 if t is None else t)

    bad: set[tuple[_PartCopy, int, str]] = set()
    # one save has one world size: its copies disagreeing on it cannot all be its own
    candidates = sorted((sa for sa, ws in world_of.items() if len(ws) == 1 and (reshard or ws == {world})),
                        key=lambda sa: (newest(sa), sa[1]), reverse=True)

    def usable(s: int, a: str, r: int) -> list[_PartCopy]:
        return [c for c, v in have.items() if c[2] == r and (s, a) in v and (c, s, a) not in bad]

    def readable(cs: list[_PartCopy], q: int) -> _PartCopy | None:
        """The copy rank ``q`` reads itself: its node's own folder, a replica there, a shared tier."""
        mine = [c for c in cs if c[3] in (q, -1)]
        return min(mine, key=lambda c: (_PREFERENCE[c[0]], c[1])) if mine else None

    def provider(cs: list[_PartCopy]) -> _PartCopy | None:
        """The copy on a node that is sent to the ranks that cannot read the part: the lowest
        holder's (of a node-local copy; then each rank reads a shared tier itself)."""
        held = [c for c in cs if c[3] >= 0]
        return min(held, key=lambda c: (c[3], _PREFERENCE[c[0]], c[1])) if held else None

    while True:
        plan = None
        for s, a in candidates:
            if plan is not None and newest((s, a)) != newest((plan[0], plan[1])):
                break
            n = next(iter(world_of[(s, a)]))
            cs = [usable(s, a, r) for r in range(n)]
            if all(cs):
                if plan is not None:
                    raise CheckpointError(
                        f"restore: step {s} was saved twice, as attempts {a} and {plan[1]}, and their manifests "
                        f"in tiers {[t.url for t in tiers]} do not say which is newer (the same commit time, "
                        "or none); delete the older one's step folder from the tier that holds it")
                plan = (s, a, n, cs)
        if plan is None:
            raise NoCheckpointError(
                f"no step is complete and verified for all its saved ranks in tiers {[t.url for t in tiers]} "
                f"(this job: {world} ranks; steps seen: {sorted({s for s, _a in world_of})}; "
                f"skipped: {'; '.join(notes) or 'none'})")
        s, a, n, cs = plan
        mine = [readable(c, rank) for c in cs]
        sent = [provider(c) for c in cs]
        # 1. the documents of the parts some rank cannot read, from their providers
        docs: dict[str, Any] = {}
        failed: dict[_PartCopy, str] = {}  # a copy this rank found failing -> why
        for r in range(n):
            p = sent[r]
            if p is not None and p[3] == rank and any(readable(cs[r], q) is None for q in range(world)):
                try:
                    st = _copy_store(p, folders, shared)
                    docs[str(r)] = [d.decode("latin-1") for d in _part_docs(st, s, a, r, n, p)]
                except Exception as e:
                    failed[p] = f"{type(e).__name__}: {e}"
        gathered = group.all_gather_json(docs)
        # 2. this rank's view of every part: read where it can, else the documents received
        stores: list[Store] = []
        received: dict[int, MemoryStore] = {}
        used: list[_PartCopy | None] = []
        manifests: list[dict[str, Any]] = []
        saved = None
        into_error: list[str] | None = None  # [its type, why]: `into` refused here, raised on every rank
        at = 0
        t0 = time.perf_counter()
        try:
            for r in range(n):
                at = r
                own_copy = mine[r]
                used.append(own_copy or sent[r])
                if own_copy is not None:
                    stores.append(_copy_store(own_copy, folders, shared))
                    continue
                p = sent[r]
                got = gathered[p[3]].get(str(r)) if p is not None else None
                if p is None or got is None:
                    raise CheckpointError(f"rank {p[3] if p else '?'} sent no documents of rank {r}'s part")
                mem = MemoryStore(f"{_copy_url(p, tiers)} (sent by rank {p[3]})")
                mem.put(manifest_key(s), got[0].encode("latin-1"))
                mem.put(_part_doc_key(s, a, r, n, p), got[1].encode("latin-1"))
                received[r] = mem
                stores.append(mem)
            where = f"checkpoint step {s} saved by {n} ranks, restored onto {world}"
            for r, st in enumerate(stores):
                at = r  # a failure here is this part's copy's
                manifests.append(_checked_manifest(st, s, a, r, n, used[r]))
                read_part(st, manifests[r], r if manifests[r]["world_size"] > 1 else 0, where)
            at = -1  # past this, a failure is of the parts together: every copy used is skipped
            saved = SavedStep(stores[0], s, manifests[0], where, joined=list(zip(stores, manifests)), prefer=rank)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            for c in [used[at]] if at >= 0 else used:
                if c is not None:
                    failed[c] = why
        need: set[int] = set()
        if saved is not None:
            try:
                need = parts_overlapping(saved, into, rank) if into is not None else set(range(n))
            except _INTO_ERRORS as e:  # about `into` itself (a DTensor's mesh, ...): no copy's fault
                into_error = [type(e).__name__, str(e)]
            except Exception as e:
                _blame(failed, used, range(n), e)
        requests = sorted([r, sent[r][3]] for r in need if mine[r] is None and sent[r] is not None)  # type: ignore[index]
        asked = group.all_gather_json(requests)
        # 3. send what others asked this rank for, then take what this rank asked for
        reqs: list[Any] = []
        holder_errors: list[str] = []
        for q, wanted in enumerate(asked):
            for r, h in wanted:
                if h == rank:
                    p = sent[r]
                    more, err = _send_replica(group, q, _copy_store(p, folders, shared), s, a, tag=r)
                    reqs += more
                    if err is not None:
                        holder_errors.append(err)
        for r, h in requests:
            try:
                _recv_files(group, h, r, received[r])
            except Exception as e:
                failed[sent[r]] = f"{type(e).__name__}: {e}"  # type: ignore[index]
        _wait_sends(reqs, rank, s, group.timeout_s)
        state: Any = None
        if not failed and saved is not None and into_error is None:
            try:
                state = (fill_into(saved, into, rank, map_location) if into is not None
                         else whole_state(saved, rank if rank < n else 0, map_location))
            except _INTO_ERRORS as e:
                if saved.failed_ranks:  # not raised for `into`: a read failed first
                    _blame(failed, used, saved.failed_ranks, e)
                else:  # `into` does not fit this step (the fill checks it before reading)
                    into_error = [type(e).__name__, str(e)]
            except Exception as e:
                _blame(failed, used, saved.failed_ranks or range(n), e)
        read_s = time.perf_counter() - t0
        kinds = sorted({(c[0] if mine[r] is not None else PEER_REPLICA) for r, c in enumerate(used)
                        if c is not None and r in need}, key=_PREFERENCE.__getitem__)
        me = kinds[-1] if kinds else LOCAL
        agreed = group.all_gather_json([[[list(c), why] for c, why in failed.items()], holder_errors, me,
                                        into_error])
        for q, (_f, herrs, _k, _i) in enumerate(agreed):
            for h in herrs:
                warnings.warn(f"restore: rank {q} sending a part of step {s}: {h}", stacklevel=3)
        refused = [(q, i) for q, (_f, _h, _k, i) in enumerate(agreed) if i is not None]
        if refused:
            # The caller's `into` does not fit the newest step: skipping its copies would
            # restore an older step whose shapes fit, and lose the progress since.
            q, (kind, why) = next(((q, i) for q, i in refused if q == rank), refused[0])
            error = UnsupportedStateError if kind == UnsupportedStateError.__name__ else CheckpointOptionError
            raise error(
                f"restore_checkpoint: {why}" if q == rank
                else f"restore_checkpoint: rank {q}'s into= does not fit step {s}: {why}")
        failures = [(q, tuple(c), why) for q, (f, _h, _k, _i) in enumerate(agreed) for c, why in f]
        if not failures:
            nbytes = sum(int(m["parts"][r if m["world_size"] > 1 else 0]["data_bytes"])
                         for r, m in enumerate(manifests) if r in need)
            url = next((st.root for r, st in enumerate(stores) if r in need), stores[0].root)
            return RestoreResult(state, s, me, url, [k for _f, _h, k, _i in agreed], notes, read_s, nbytes,
                                 time.perf_counter() - t_start, saved_world_size=n, resharded=n != world)
        for q, c, why in failures:
            bad.add(((str(c[0]), int(c[1]), int(c[2]), int(c[3])), s, a))
            note = f"{c[0]} copy of rank {c[2]}'s part of step {s} (saved by {n} ranks; read on rank {q}): {why}"
            notes.append(note)
            warnings.warn(f"restore: skipping the {note}", stacklevel=3)


def _wait_sends(reqs: list[Any], rank: int, step: int, timeout_s: float) -> None:
    """Wait for this rank's sends of parts; a receiver that stopped taking them (gone, or
    not the datapipe this one is) leaves them waiting out the group's timeout."""
    try:
        for q in reqs:
            q.wait()
    except Exception as e:
        raise CheckpointError(
            f"restore: rank {rank} sending parts of step {step}: a receiving rank stopped, or did not take them "
            f"within timeout_s={timeout_s} s ({type(e).__name__}: {e}); every rank must run the same datapipe; "
            "see the other ranks' errors") from e


def _blame(failed: dict[_PartCopy, str], used: list[_PartCopy | None], ranks: Any, e: BaseException) -> None:
    """Mark the copies of saved ``ranks`` that this rank used as failing with ``e``."""
    for r in sorted(ranks):
        c = used[r]
        if c is not None:
            failed[c] = f"{type(e).__name__}: {e}"


def _copy_store(c: _PartCopy, folders: dict[tuple[int, str, int], Store], shared: dict[int, Store]) -> Store:
    return shared[c[1]] if c[0] == REMOTE else folders[(c[1], c[0], c[2])]


def _copy_url(c: _PartCopy, tiers: list[Tier]) -> str:
    url = tiers[c[1]].url
    return url if c[0] == REMOTE else join_url(url, own_dir(c[2]) if c[0] == LOCAL else replica_dir(c[2]))


def _part_doc_key(s: int, a: str, r: int, n: int, c: _PartCopy) -> str:
    return part_key(s, a, r if c[0] == REMOTE and n > 1 else 0)


def _part_docs(store: Store, s: int, a: str, r: int, n: int, c: _PartCopy) -> tuple[bytes, bytes]:
    """The stored manifest and part document of saved rank ``r`` in a copy, checked first."""
    _checked_manifest(store, s, a, r, n, c)
    return store.get(manifest_key(s)), read_doc(store, _part_doc_key(s, a, r, n, c), "part", MAX_PART_BYTES)[0]


def _checked_manifest(store: Store, s: int, a: str, r: int, n: int, c: _PartCopy | None) -> dict[str, Any]:
    """The manifest of step ``s`` in ``store``, of this save: attempt ``a``, and either a
    one-part checkpoint of saved rank ``r`` of ``n`` (a node-local folder, or what was sent
    of one) or a shared step of ``n`` parts."""
    doc = read_manifest(store, s)
    if doc["attempt"] != a:
        raise CheckpointError(f"{store.url(manifest_key(s))}: attempt {doc['attempt']}, not {a}: "
                              "another save of this step replaced it")
    if c is not None and c[0] == REMOTE:
        if doc["world_size"] != n:
            raise CheckpointError(f"{store.url(manifest_key(s))}: saved by {doc['world_size']} ranks, not {n}")
    else:
        _check_origin(store, s, r, n)
        if doc["world_size"] != 1:
            raise CheckpointError(f"{store.url(manifest_key(s))}: {doc['world_size']} parts where one was expected")
    return doc
