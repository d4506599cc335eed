"""Elastic drill on torchrun: a slow node named with its cause, a node lost and the job
shrunk onto the survivor, the node back and the job grown again, every sample once.

    python -m tools.elastic_drill                  # a temporary folder, 1-2 minutes on 2 cores
    python -m tools.elastic_drill --dir /tmp/ed --samples 3072 --local-every 4 --json

Two "nodes" on this machine, each a torchrun agent of its own session (``torchrun
--nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT``),
train a small FSDP2 model (``fully_shard`` over gloo, CPU: DTensor parameters and Adam
state) on a packed dataset through a StreamingDataset with a TieredCache per node (its
own warm folder; the cold folder is the packed dataset). Every rank checkpoints with a
CheckpointWriter to its node's local tier, with a peer replica on the other node
(``Tier(replicate=1)``), and to a remote tier; it records a datapipe Telemetry (data wait
around ``next()``, step marks, compute) and publishes each window to a FileBoard in the
run folder, which this process reads with ``datapipe.health.detect`` (what ``datapipe
status RUN_DIR`` prints). Every (re)start restores the newest checkpoint, resharded when
the world size changed, and resumes the data stream from the saved loader state.

1. node 1's data path is throttled below the loader (its cold reads, through the cache's
   ``cold_wrapper``) and the detector must name node 1's ranks, cause "data", within two
   windows;
2. node 1 is killed (SIGKILL to its agent's and its ranks' process groups; its folders are
   deleted: a replaced node); node 0's agent re-forms the group with world size 2, which
   restores the newest checkpoint (node 1's parts from the replicas node 0 holds,
   resharded from 4 ranks to 2) and trains on;
3. node 1 is started again: node 0's agent restarts its ranks when the new node waits to
   join, and the job goes on at world size 4 from the newest checkpoint (2 -> 4).

It prints the time from the kill to the next step beside the process start + restore read
time, the steps lost, ``named straggler: node 1 (data)`` and ``every sample exactly once:
<bool>``, computed from the ranks' logs of (attempt, step, sample keys) along the chain of
restores (see :func:`sample_timeline`). The exit status is 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from datapipe.storage import Store
from tools.drill_work import claim_work_dir, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, RANKS_PER_NODE = 2, 2
FULL_WORLD = NODES * RANKS_PER_NODE
MARKER = ".datapipe-elastic-drill"  # in a --dir the drill made: it may delete its own subfolders there
WORK_SUBDIRS = ("node0", "node1", "remote", "log", "health", "data", "corpus")
CONTROL = "control.json"

__all__ = ["ThrottledStore", "Run", "drill", "sample_timeline", "exactly_once", "restore", "make_model", "make_tiers",
           "checkpoint_state", "node_tier", "run_rank", "main"]


# -- the throttle below the loader -------------------------------------------------------

class ThrottledStore(Store):
    """A cold store as the cache sees it, slowed to ``bytes_per_s`` (shared by this process's
    reads in flight) while the file ``switch`` exists. Passed through
    ``TieredCache(cold_wrapper=)``, the one public hook below the loader, so the slow reads
    are the cache's cold reads (which its ``telemetry=`` times); it delegates everything
    else to ``inner`` and reports no local path, so every cold read comes through here.
    ``throttled``: the reads slowed so far (in this process)."""

    def __init__(self, inner: Store, *, switch: str, bytes_per_s: float) -> None:
        super().__init__(inner.root)
        self.inner, self.switch, self.bytes_per_s = inner, switch, bytes_per_s
        self.throttled = 0
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the throttled link is free again (reads in parallel share it)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _read(self, n_of: Callable[[Any], int], read: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        data = read()
        if os.path.exists(self.switch):
            with self._lock:  # this read's bytes pass after those already queued on the link
                done = self._free_at = max(self._free_at, t0) + n_of(data) / self.bytes_per_s
                self.throttled += 1
            # in slices, so that a read under way ends soon after the switch is removed
            while (left := done - time.perf_counter()) > 0 and os.path.exists(self.switch):
                time.sleep(min(left, 0.05))
        return data

    def url(self, key: str) -> str:
        return self.inner.url(key)

    def get(self, key: str) -> bytes:
        return bytes(self._read(len, lambda: self.inner.get(key)))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self._read(len, lambda: self.inner.get_range(key, start, end)))

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        return bytes(self._read(len, lambda: self.inner.get_range_at(key, start, end, version)))

    def readinto(self, key: str, buf: memoryview, start: int = 0) -> int:
        return int(self._read(int, lambda: self.inner.readinto(key, buf, start)))

    def stat(self, key: str) -> tuple[int, str | None]:
        return self.inner.stat(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.inner.put(key, data)

    def open_writer(self, key: str) -> Any:
        return self.inner.open_writer(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


# -- one rank -------------------------------------------------------------------------------

def _process_created() -> float:
    """This process's creation time (wall clock), from /proc: what a restart costs before
    the interpreter runs a line."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _all_gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order, as JSON over the process group (a peer's message
    is data, never pickle)."""
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    top = max(int(s) for s in sizes)
    mine = torch.zeros(top, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(top, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, mine)
    return [json.loads(bytes(b[: int(s)].numpy())) for b, s in zip(bufs, sizes)]


def _write_json(path: str, doc: Any) -> None:
    """Publish ``doc`` at ``path`` by a rename: the drill never reads half a record."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def node_tier(work: str, node: int) -> str:
    """The node-local checkpoint tier of ``node`` (a folder only that node would see)."""
    return os.path.join(work, f"node{node}", "ckpt")


def _any_checkpoint(work: str, node: int) -> bool:
    """Whether this node's tier or the remote tier holds a complete step of any world size
    (a folder of the node's tier is an own or a replica folder of some rank)."""
    from datapipe.checkpoint import list_checkpoints

    tier = node_tier(work, node)
    folders = [os.path.join(tier, n) for n in (os.listdir(tier) if os.path.isdir(tier) else [])]
    return any(info.complete for url in [*folders, os.path.join(work, "remote")] if os.path.isdir(url)
               for info in list_checkpoints(url))


def _target_state(model: Any, opt: Any) -> dict[str, Any]:
    """What a restore fills in place on this world: the model's DTensors (FSDP2 shards on
    this world's mesh) and Adam moments of the same layout; the rest of the saved state
    (param groups, loader state, the save's record) comes from the checkpoint."""
    import torch
    from torch.distributed.tensor import DTensor

    def zeros(p: Any) -> Any:
        return DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    return {"model": model.state_dict(),
            "optim": {"state": {i: {"step": torch.zeros(()), "exp_avg": zeros(p), "exp_avg_sq": zeros(p)}
                                for i, p in enumerate(model.parameters())}}}


def restore(work: str, node: int, tiers: list[Any], model: Any, opt: Any) -> dict[str, Any] | None:
    """Restore the newest checkpoint onto this world, whatever world size saved it: one
    ``restore_checkpoint(reshard=True, into=...)`` (node 1's parts from the replicas node 0
    keeps, or the remote tier; a part no rank of a node can read sent by one that holds it).
    Every rank calls this at once; None when there is no checkpoint at all, an error when
    checkpoints exist and none loads. Returns the loader state, the save's record and where
    it came from."""
    import torch

    from datapipe.checkpoint import restore_checkpoint
    from datapipe.errors import NoCheckpointError

    t0 = time.perf_counter()
    try:
        r = restore_checkpoint(tiers, ranks_per_node=RANKS_PER_NODE, reshard=True, into=_target_state(model, opt),
                               timeout_s=120)
    except NoCheckpointError as e:
        if not any(_all_gather_json(_any_checkpoint(work, node))):
            return None
        # checkpoints exist and none loads: starting afresh would look like a restore
        raise RuntimeError(f"no checkpoint step is whole on any node or in the remote tier: nothing to resume "
                           f"from ({e})") from e
    st = r.state
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(st["model"][name].to_local())
    opt.load_state_dict({"state": st["optim"]["state"], "param_groups": st["optim"]["param_groups"]})
    return {"step": r.step, "drill": st["drill"], "loader": st["loader"], "source": r.source, "sources": r.sources,
            "read_s": max(_all_gather_json(r.read_s)), "restore_s": time.perf_counter() - t0,
            "saved_world": r.saved_world_size, "resharded": r.resharded}


class _Control:
    """The drill's word to the ranks (a JSON file it replaces): the step at which one node
    holds still to be killed. Read once per step, parsed only when it changed."""

    def __init__(self, path: str) -> None:
        self.path, self.mtime = path, 0.0
        self.doc: dict[str, Any] = {}

    def hold(self) -> dict[str, Any]:
        try:
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return {}
        if mtime != self.mtime:
            self.mtime, self.doc = mtime, _read_json(self.path) or {}
        return dict(self.doc.get("hold") or {})


def make_model(world: int, hidden: int) -> tuple[Any, Any]:
    """The model every attempt trains (FSDP2 over a mesh of this world's ranks: DTensor
    parameters sharded on dim 0) and its Adam optimizer."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tools.demo_train import CLASSES, FEATURES

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def make_tiers(work: str, node: int, world: int, local_every: int, remote_every: int) -> list[Any]:
    """This node's local tier, with a peer replica on the next node when there is one,
    and the remote tier every node sees."""
    from datapipe.checkpoint import Tier

    replicate = 1 if world // RANKS_PER_NODE >= 2 else 0  # a replica needs another node
    return [Tier(node_tier(work, node), every=local_every, keep_last=2, replicate=replicate, node_local=True),
            Tier(os.path.join(work, "remote"), every=remote_every, keep_last=2)]


def checkpoint_state(model: Any, opt: Any, loader_state: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """What a save holds: the model's DTensors, the optimizer's state (its ``step`` counters
    stored once, its moments sharded), the loader's resume state and the save's record
    (attempt, world size, step) that the drill follows restores by."""
    from datapipe.checkpoint import Replicated

    return {"model": model.state_dict(), "optim": Replicated(opt.state_dict()), "loader": loader_state,
            "drill": record}


def run_rank(a: argparse.Namespace) -> None:
    """One rank, started by torchrun; every (re)start of the group runs this from the top."""
    created = _process_created()
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import datapipe
    from datapipe.checkpoint import CheckpointWriter
    from datapipe.health import FileBoard, Publisher
    from datapipe.telemetry import Telemetry
    from tools.demo_train import to_example

    work, node = a.work, a.node
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = {"rank": rank, "node": node, "pid": os.getpid(), "created": created}
    peers = _all_gather_json(me)
    attempt = 0
    if rank == 0:  # the job's rank 0 numbers the attempts: the first number no attempt claimed
        attempt = 1
        while True:
            try:
                os.close(os.open(os.path.join(work, "log", f"attempt-{attempt:03d}.claim"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                attempt += 1
    attempt = int(_all_gather_json(attempt)[0])
    tag = f"attempt-{attempt:03d}"
    logdir = os.path.join(work, "log")
    log = open(os.path.join(logdir, f"{tag}-rank-{rank}.jsonl"), "a")

    def event(**kw: Any) -> None:
        log.write(json.dumps({"t": time.time(), **kw}) + "\n")
        log.flush()

    try:
        tel = Telemetry(window_s=a.window_s, rank=rank, metrics_path=os.path.join(logdir, f"{tag}-metrics.jsonl"))
        publisher = Publisher(tel, FileBoard(work), rank=rank)
        model, opt = make_model(world, a.hidden)
        wrapper = functools.partial(ThrottledStore, switch=os.path.join(work, f"throttle-node{node}"),
                                    bytes_per_s=a.throttle_bps)
        # the cache records each tier's reads, hits and misses into the rank's telemetry
        cache = datapipe.TieredCache(warm_dir=os.path.join(work, f"node{node}", "warm"), warm_bytes=256 << 20,
                                     cold_wrapper=wrapper, telemetry=tel)
        # No read-ahead (chunks of one batch, a budget of one byte, one fetch at a time) and
        # shards read one after the other (window=1: samples shuffled within a shard, the
        # shards' order shuffled): a slow tier shows as a wait every shard, within a window
        ds = datapipe.StreamingDataset(os.path.join(work, "data"), cache=cache, shuffle=True, seed=7, window=1,
                                       decode="auto", map=to_example, drop_last=True, prefetch_bytes=1,
                                       concurrency=1, chunk_samples=a.batch, rank=rank, world_size=world)
        loader = datapipe.StreamingDataLoader(ds, batch_size=a.batch, num_workers=0)
        tiers = make_tiers(work, node, world, a.local_every, a.remote_every)
        ready = time.time()
        restored = restore(work, node, tiers, model, opt)
        step = 0
        if restored is not None:
            loader.load_state_dict(restored["loader"])
            step = restored["step"]
        ds.set_epoch(0)
        if rank == 0:
            _write_json(os.path.join(logdir, f"{tag}.json"), {
                "attempt": attempt, "world": world, "nodes": {str(p["rank"]): p["node"] for p in peers},
                "pids": {str(p["rank"]): p["pid"] for p in peers},
                "created": {str(p["rank"]): p["created"] for p in peers},
                "ready": {str(p["rank"]): r for p, r in zip(peers, _all_gather_json(ready))},
                "restored_at": time.time(),
                "restore": None if restored is None else {k: v for k, v in restored.items() if k != "loader"}})
        else:
            _all_gather_json(ready)
        if restored is None and world < a.start_world:
            # the first rendezvous closed before every node joined: wait to be restarted
            # with them (the agent restarts this group when a node waits to join)
            event(event="waiting", why=f"world {world} < --start-world {a.start_world}, no checkpoint")
            time.sleep(a.timeout)
            raise RuntimeError(f"no restart came within {a.timeout} s")
        # A restart saves steps the lost run may have saved already; they replace them.
        warnings.filterwarnings("ignore", message="saving step")
        writer = CheckpointWriter(tiers=tiers, ranks_per_node=RANKS_PER_NODE, commit_timeout=a.timeout,
                                  chunk_bytes=1 << 20, background="thread")
        control = _Control(os.path.join(work, CONTROL))
        event(event="start", step=step, world=world)
        it: Iterator[Any] = iter(loader)
        while True:
            w0 = tel.wait_begin()
            try:
                x, y, keys = next(it)
            except StopIteration:
                tel.wait_end(w0)
                break
            tel.wait_end(w0)
            tel.step()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # FSDP's collectives run in forward and backward
            t0 = time.perf_counter()
            opt.step()
            time.sleep(a.step_s)  # the accelerator's share of a step: this machine has none
            tel.compute(time.perf_counter() - t0)  # this rank's own work, without collectives
            step += 1
            log.write(json.dumps({"step": step, "t": time.time(), "keys": list(keys)}) + "\n")
            log.flush()
            if any(t.due(step) for t in tiers):
                writer.save(step, checkpoint_state(model, opt, loader.state_dict(),
                                                   {"attempt": attempt, "world": world, "step": step}))
            hold = control.hold()
            if hold.get("attempt") == attempt and hold.get("step") == step:
                writer.wait()  # every save so far is durable, as a job keeping up with its cadence has them
                if hold.get("node") == node:
                    event(event="held", step=step)
                    open(os.path.join(logdir, f"{tag}-held-rank-{rank}"), "w").close()
                    time.sleep(a.timeout)
                    raise RuntimeError(f"held at step {step} for {a.timeout} s and not killed")
        writer.close()
        publisher.close()
        tel.close()
        event(event="end", step=step)
        if rank == 0:
            _write_json(os.path.join(logdir, f"{tag}-done.json"), {"attempt": attempt, "step": step})
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:
        # a peer that died shows here as a gloo error: say so and leave at once, so the
        # agent restarts the group (a finalizer waiting on a dead peer would only delay it)
        event(event="failed", error=f"{type(e).__name__}: {e}"[:500])
        print(f"rank {rank} (attempt {attempt}, node {node}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Without the interpreter's finalization (a gloo thread dropping a collective's
    # tensors there can abort the process: see tests/checkpoint/test_reshard.py)
    os._exit(0)


# -- the drill ------------------------------------------------------------------------------


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


class Node:
    """One "node": a torchrun agent in a session of its own, its ranks in theirs."""

    def __init__(self, index: int, a: argparse.Namespace, work: str, port: int, run_id: str, generation: int) -> None:
        self.index, self.a, self.work, self.port, self.run_id = index, a, work, port, run_id
        self.generation = generation
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = os.path.join(work, "log", f"agent-node{index}-{generation}.log")

    def command(self) -> list[str]:
        a = self.a
        # node 0 hosts the rendezvous store and, alone, closes a round --last-call-s after it
        # joined; node 1 is a client and, when it joins first, waits for node 0. A node is
        # dead 3 s after its last heartbeat (torch's default is 15 s; fewer than 3 missed
        # beats let a loaded machine's late heartbeat split the job in two worlds)
        conf = (f"is_host={int(self.index == 0)},last_call_timeout={a.last_call_s if self.index == 0 else 60},"
                f"keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout={int(a.timeout)}")
        worker = ["--worker", "--work", self.work, "--drill-node", str(self.index), "--batch", str(a.batch),
                  "--local-every", str(a.local_every), "--remote-every", str(a.remote_every),
                  "--step-s", str(a.step_s), "--window-s", str(a.window_s), "--throttle-bps", str(a.throttle_bps),
                  "--hidden", str(a.hidden), "--start-world", str(FULL_WORLD), "--timeout", str(a.timeout)]
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{NODES}",
                f"--nproc-per-node={RANKS_PER_NODE}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id={self.run_id}", f"--max-restarts={a.max_restarts}", "--monitor-interval=0.1",
                "--local-addr=127.0.0.1", f"--rdzv-conf={conf}",
                f"--log-dir={os.path.join(self.work, 'log', 'torchelastic')}", "-m", "tools.elastic_drill", *worker]

    def start(self) -> Node:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", LOGLEVEL="INFO", PYTHONUNBUFFERED="1",
                   # torch 2.13's agents share their rendezvous TCP store with the ranks; a new
                   # node joining a group whose rank 0 stayed then waits forever for a master
                   # address nobody publishes in the new round: each round gets its own store
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command(), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, ranks: Sequence[int] = (), timeout: float = 30.0) -> None:
        """SIGKILL to the agent's process group and to each of its ranks' (torchrun starts
        every rank in a session of its own), as a node that fails takes all of them; wait
        until none is left. ``ranks``: pids of this node's ranks that the drill knows from
        the run folder, killed too if still alive (an agent that died alone leaves them
        orphaned, out of its tree); a pid is signalled only while it is still ours."""
        if self.proc is None:
            return
        tree: list[int] = []
        if self.proc.poll() is None:  # not reaped: the pid is still our agent's
            try:
                os.killpg(self.proc.pid, signal.SIGSTOP)  # no new rank starts while the tree is read
            except ProcessLookupError:
                pass
            tree = _descendants(self.proc.pid)
        tree += [p for p in ranks if p not in tree and _is_rank_of(p, self.work, self.index)]
        for p in tree:
            for send in (os.killpg, os.kill):
                try:
                    send(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()
        deadline = time.monotonic() + timeout
        for p in tree:
            while _state(p) not in ("Z", None):
                if time.monotonic() > deadline:
                    raise SystemExit(f"process {p} of node {self.index} outlived SIGKILL for {timeout} s")
                time.sleep(0.01)

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


def _is_rank_of(pid: int, work: str, node: int) -> bool:
    """Whether ``pid`` is a rank of this drill's ``node`` (its command line says so)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    if "--worker" not in args or "--drill-node" not in args or work not in args:
        return False
    i = args.index("--drill-node")
    return args[i + 1:i + 2] == [str(node)]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Run:
    """What the ranks wrote to the run folder, read by the drill."""

    def __init__(self, work: str) -> None:
        self.work, self.logdir = work, os.path.join(work, "log")

    def attempts(self) -> dict[int, dict[str, Any]]:
        return self._attempt_docs(r"attempt-(\d{3})\.json")

    def log(self, attempt: int, rank: int) -> list[dict[str, Any]]:
        """A rank's log lines; one cut short by SIGKILL is the last one and dropped."""
        path = os.path.join(self.logdir, f"attempt-{attempt:03d}-rank-{rank}.jsonl")
        out = []
        try:
            with open(path) as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        break
        except FileNotFoundError:
            pass
        return out

    def steps(self, attempt: int, rank: int) -> list[dict[str, Any]]:
        return [e for e in self.log(attempt, rank) if "step" in e and "keys" in e]

    def last_step(self, attempt: int, rank: int) -> int:
        """The last step a rank logged (0 before any), from the end of its log only."""
        path = os.path.join(self.logdir, f"attempt-{attempt:03d}-rank-{rank}.jsonl")
        try:
            with open(path, "rb") as f:
                f.seek(max(os.fstat(f.fileno()).st_size - 65536, 0))
                tail = f.read().decode(errors="replace")
        except FileNotFoundError:
            return 0
        for line in reversed(tail.splitlines()):
            m = re.match(r'\{"step": (\d+),', line)
            if m and line.endswith("}"):  # a whole line (a rank killed mid-write leaves half of one)
                return int(m.group(1))
        return 0

    def step_now(self, attempt: int, world: int) -> int:
        """The last step every rank of ``attempt`` has logged (0 before any)."""
        return min(self.last_step(attempt, r) for r in range(world))

    def pids(self, node: int) -> list[int]:
        """Every pid a rank of ``node`` had, in any attempt."""
        return [int(d["pids"][r]) for d in self.attempts().values() for r, n in d["nodes"].items() if n == node]

    def done(self) -> dict[int, dict[str, Any]]:
        return self._attempt_docs(r"attempt-(\d{3})-done\.json")

    def _attempt_docs(self, pattern: str) -> dict[int, dict[str, Any]]:
        """attempt -> its JSON document, for the log files named by ``pattern``."""
        out = {}
        for name in os.listdir(self.logdir):
            m = re.fullmatch(pattern, name)
            if m and (doc := _read_json(os.path.join(self.logdir, name))) is not None:
                out[int(m.group(1))] = doc
        return out

    def held(self, attempt: int, ranks: list[int]) -> bool:
        return all(os.path.exists(os.path.join(self.logdir, f"attempt-{attempt:03d}-held-rank-{r}")) for r in ranks)


def sample_timeline(run: Run, attempts: dict[int, dict[str, Any]], final: int) -> dict[str, Any]:
    """The run as training saw it in the end. Each attempt logs (step, sample keys) per rank;
    the final attempt restored a checkpoint saved by an earlier attempt at step s, which
    itself restored one saved at step s' by an earlier one, and so on: the chain of
    restores. An attempt of the chain counts for the steps after the one it restored, up to
    the step the next attempt of the chain restored (steps it trained past that were lost
    and redone by the next); the final attempt for all it trained. Over that timeline
    every step must appear once on every rank of its attempt, and every sample of the
    epoch exactly once."""
    chain = [final]
    while (r := attempts[chain[-1]].get("restore")) is not None:
        chain.append(int(r["drill"]["attempt"]))
        if len(chain) > len(attempts):
            raise SystemExit(f"the chain of restores loops: {chain}")
    chain.reverse()
    keys: list[str] = []
    spans, problems = [], []
    for i, att in enumerate(chain):
        doc = attempts[att]
        lo = doc["restore"]["step"] if doc.get("restore") else 0
        if i + 1 < len(chain):
            hi = int(attempts[chain[i + 1]]["restore"]["step"])
        else:
            hi = max(e["step"] for e in run.steps(att, 0))
        for rank in range(doc["world"]):
            by_step: dict[int, list[str]] = {}
            for e in run.steps(att, rank):
                if e["step"] in by_step:
                    problems.append(f"attempt {att} rank {rank} logged step {e['step']} twice")
                by_step[e["step"]] = e["keys"]
            missing = [s for s in range(lo + 1, hi + 1) if s not in by_step]
            if missing:
                problems.append(f"attempt {att} rank {rank} lacks steps {missing[:5]}")
            for s in range(lo + 1, hi + 1):
                keys += by_step.get(s, [])
        spans.append({"attempt": att, "world": doc["world"], "steps": [lo + 1, hi]})
    return {"chain": chain, "spans": spans, "keys": keys, "problems": problems}


def exactly_once(timeline: dict[str, Any], expected: set[str]) -> bool:
    """Whether the timeline holds every step once on every rank and every sample of
    ``expected`` exactly once."""
    counts = Counter(timeline["keys"])
    return not timeline["problems"] and set(counts) == expected and set(counts.values()) == {1}


def _wait(what: str, cond: Callable[[], Any], timeout: float, nodes: dict[int, Node], poll: float = 0.1) -> Any:
    """Poll ``cond`` until it returns something truthy; an agent that ends meanwhile, or
    ``timeout`` seconds, fail the drill naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        for n in nodes.values():
            if n.proc is not None and not n.alive():
                raise SystemExit(f"waiting for {what}: node {n.index}'s agent ended (exit {n.proc.returncode}); "
                                 f"its log ({n.log}) ends:\n{n.tail()}")
        if time.monotonic() > deadline:
            logs = sorted({os.path.dirname(n.log) for n in nodes.values()})
            raise SystemExit(f"waiting for {what}: not within {timeout:.0f} s; the agents' and ranks' logs are in "
                             f"{', '.join(logs)}")
        time.sleep(poll)


def _latest(run: Run, world: int, after: float = 0.0, min_steps: int = 1) -> dict[str, Any] | None:
    """The newest attempt of ``world`` ranks started after ``after`` whose every rank has
    logged ``min_steps`` steps."""
    for att, doc in sorted(run.attempts().items(), reverse=True):
        if doc["world"] == world and min(doc["created"].values()) > after:
            if run.step_now(att, world) - (doc["restore"] or {}).get("step", 0) >= min_steps:
                return doc
            return None
    return None


def _board_docs(work: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The window summaries the ranks of attempt ``doc`` published (a rank's file of an
    earlier attempt is not theirs)."""
    from datapipe.health import FileBoard

    pids = {int(r): p for r, p in doc["pids"].items()}
    return [d for d in FileBoard(work).read(range(doc["world"])).docs if pids.get(d["rank"]) == d["pid"]]


def _named(work: str, doc: dict[str, Any], k: float) -> tuple[Any, list[dict[str, Any]]]:
    from datapipe.health import detect

    docs = _board_docs(work, doc)
    return detect(docs, k=k, ranks=list(range(doc["world"]))), docs


def drill(a: argparse.Namespace) -> dict[str, Any]:
    import datapipe
    from tools.corpus import generate_corpus

    work = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="elastic-drill-"))
    claim_work_dir(work, MARKER, "elastic")
    for name in WORK_SUBDIRS:  # only in a folder the drill made (its marker is there)
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    for name in (CONTROL, "throttle-node0", "throttle-node1"):
        if os.path.exists(os.path.join(work, name)):
            os.remove(os.path.join(work, name))
    os.makedirs(os.path.join(work, "log"))
    t_begin = time.perf_counter()
    generate_corpus(os.path.join(work, "corpus"), a.samples, mean_bytes=a.sample_bytes)
    packed = datapipe.pack(os.path.join(work, "corpus"), os.path.join(work, "data"), shard_samples=a.shard_samples,
                           workers=1)
    expected = {f"{i // 1000:05d}/sample{i:08d}" for i in range(a.samples)}  # tools.corpus's names
    shards = [f for f in os.listdir(os.path.join(work, "data")) if f.endswith(".tar")]
    shard_bytes = sum(os.path.getsize(os.path.join(work, "data", f)) for f in shards) / len(shards)
    a.throttle_bps = shard_bytes / a.throttle_s  # what node 1's ranks are told
    run = Run(work)
    run_id = f"elastic-drill-{uuid.uuid4().hex[:8]}"
    port = free_port()
    nodes: dict[int, Node] = {}
    node1 = os.path.join(work, "throttle-node1")
    print(f"drill: {a.samples} samples in {packed.shards} shards (cold folder {os.path.join(work, 'data')}); "
          f"{NODES} torchrun agents (--nnodes=1:{NODES} --nproc-per-node={RANKS_PER_NODE}, c10d on 127.0.0.1:{port}); "
          f"FSDP2 over gloo; batch {a.batch} per rank; local tier every {a.local_every} steps (replicate=1), "
          f"remote every {a.remote_every}; telemetry windows of {a.window_s:g} s", flush=True)
    out: dict[str, Any] = {"work": work}
    try:
        # node 1 first: a client of node 0's store until it is up, so both join the first round
        nodes[1] = Node(1, a, work, port, run_id, 1).start()
        nodes[0] = Node(0, a, work, port, run_id, 1).start()
        first = _wait("the job to train at world size 4", lambda: _latest(run, FULL_WORLD, min_steps=a.local_every + 1),
                      a.timeout, nodes)
        att1 = first["attempt"]
        by_node = {n: sorted(int(r) for r, m in first["nodes"].items() if m == n) for n in range(NODES)}
        print(f"phase 0: attempt {att1} trains at world size 4 after {time.perf_counter() - t_begin:.1f} s; "
              f"node 0 = ranks {by_node[0]}, node 1 = ranks {by_node[1]}", flush=True)
        _wait("a window summary from every rank", lambda: len(_board_docs(work, first)) == FULL_WORLD, a.timeout, nodes)

        # -- phase 1: node 1's data path is throttled; the detector must name it ----------
        before, _docs = _named(work, first, a.k)
        seq0 = {d["rank"]: d["seq"] for d in _board_docs(work, first)}
        with open(node1, "w") as f:
            f.write(f"{a.throttle_bps}\n")
        t_on = time.time()

        found: list[tuple[Any, int, float]] = []  # (report, windows, time) of each report naming node 1

        def named() -> Any:
            # data stragglers, all of node 1, each named from a window that closed after the
            # throttle began (compute findings elsewhere are printed, not counted). The first
            # such report is the detection; a window that saw no throttled read finish names
            # no tier, so later reports within the limit are read for the cause.
            report, docs = _named(work, first, a.k)
            data = {f.rank for f in report.stragglers if f.kind == "data"}
            seqs = {d["rank"]: d["seq"] for d in docs}
            late = found and min(seqs[r] - seq0[r] for r in seqs if first["nodes"][str(r)] == 1) > a.windows
            if data and {first["nodes"][str(r)] for r in data} == {1} and all(seqs[r] > seq0[r] for r in data):
                found.append((report, max(seqs[r] - seq0[r] for r in data), time.time()))
                if any(" tier reads " in f.message for f in report.stragglers if f.kind == "data"):
                    return True
            return late

        _wait("the detector to name node 1", named, a.windows * a.window_s + 30, nodes, poll=0.25)
        windows, t_named = found[0][1], found[0][2]
        report = next((r for r, w, _t in found if w <= a.windows and any(" tier reads " in f.message for f in
                                                                          r.stragglers if f.kind == "data")),
                      found[0][0])
        os.remove(node1)
        data_findings = [f for f in report.stragglers if f.kind == "data"]
        finding = next((f for f in data_findings if " tier reads " in f.message), data_findings[0])
        straggler_nodes = sorted({first["nodes"][str(f.rank)] for f in report.stragglers if f.kind == "data"})
        print(f"phase 1: node 1's cold reads throttled to {a.throttle_bps / 1e3:.0f} kB/s (a shard in "
              f"{a.throttle_s:g} s) at {t_on:.1f}; the "
              f"detector named ranks {sorted(f.rank for f in report.stragglers)} after {windows} window(s) "
              f"({t_named - t_on:.1f} s); before the throttle it said: "
              f"{'nothing' if not before.stragglers else '; '.join(map(str, before.stragglers))}", flush=True)
        for f in report.stragglers:
            print(f"  {'straggler' if f.kind == 'data' else 'also named'} {f}", flush=True)

        # -- phase 2: node 1 is killed; node 0's agent shrinks the job to 2 ranks ----------
        now = run.step_now(att1, FULL_WORLD)
        e = a.local_every
        kill_at = ((now + 2 - e // 2) // e + 1) * e + e // 2  # mid-interval (after a local save), ahead of now
        _write_json(os.path.join(work, CONTROL), {"hold": {"attempt": att1, "node": 1, "step": kill_at}})
        _wait(f"node 1's ranks to reach step {kill_at}", lambda: run.held(att1, by_node[1]), a.timeout, nodes)
        t_kill = time.time()
        nodes.pop(1).kill(run.pids(1))
        failed_at = max(run.last_step(att1, r) for r in range(FULL_WORLD))
        for sub in ("ckpt", "warm"):  # a replaced node: its disks are gone with it
            shutil.rmtree(os.path.join(work, "node1", sub), ignore_errors=True)
        _write_json(os.path.join(work, CONTROL), {})
        print(f"phase 2: SIGKILL to node 1 (agent and ranks {by_node[1]}) at step {failed_at}; its local tier and "
              "warm cache deleted", flush=True)
        second = _wait("the job to train at world size 2", lambda: _latest(run, 2, after=t_kill, min_steps=2 * e),
                       a.timeout, nodes)
        att2 = second["attempt"]
        r2 = second["restore"]
        print(f"  attempt {att2}: world size 2, restored step {r2['step']} saved by {r2['saved_world']} ranks "
              f"(attempt {r2['drill']['attempt']}) from node 0's {r2['source']} tier"
              f"{', resharded' if r2['resharded'] else ''}", flush=True)

        # -- phase 3: node 1 comes back; the job grows to 4 ranks at the next restart ------
        t_join = time.time()
        nodes[1] = Node(1, a, work, port, run_id, 2).start()
        third = _wait("the job to grow back to world size 4", lambda: _latest(run, FULL_WORLD, after=t_join),
                      a.timeout, nodes)
        att3 = third["attempt"]
        r3 = third["restore"]
        last2 = run.last_step(att2, 0)
        print(f"phase 3: node 1 started again; attempt {att3}: world size 4 after {time.time() - t_join:.1f} s, "
              f"restored step {r3['step']} saved by {r3['saved_world']} ranks (attempt {r3['drill']['attempt']}) "
              f"from {r3['source']}{', resharded' if r3['resharded'] else ''}; attempt {att2} had reached step "
              f"{last2}", flush=True)
        codes = {}
        for i, n in nodes.items():
            assert n.proc is not None
            try:
                codes[i] = n.proc.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"node {i}'s agent did not end within {a.timeout:.0f} s after the epoch") from None
        if any(codes.values()):
            bad = next(i for i, c in codes.items() if c)
            raise SystemExit(f"node {bad}'s agent ended with {codes[bad]}; its log ends:\n{nodes[bad].tail()}")

        # -- the figures -------------------------------------------------------------------
        attempts = run.attempts()
        done = run.done()
        if len(done) != 1:
            raise SystemExit(f"expected one attempt to finish the epoch, got {sorted(done)}")
        final = next(iter(done))
        timeline = sample_timeline(run, attempts, final)
        counts = Counter(timeline["keys"])
        once = exactly_once(timeline, expected)
        # the world sizes the training ran at, in order (a rendezvous that closed before the
        # returning node joined repeats a size: the same world size again)
        worlds = [s["world"] for s in timeline["spans"] if s["steps"][1] >= s["steps"][0]]
        worlds = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
        first_steps = [run.steps(att2, r)[0] for r in range(2)]
        t_step = max(x["t"] for x in first_steps)
        created, ready = min(second["created"].values()), max(second["ready"].values())
        start_s = max(second["ready"][r] - second["created"][r] for r in second["ready"])  # the slowest rank's
        read_s = float(r2["read_s"])
        kill_to_step = t_step - t_kill
        floor = start_s + read_s
        lost = failed_at - r2["step"]
        lost_grow = last2 - r3["step"]
        print(f"kill -> next step: {kill_to_step:.2f} s; process start {start_s:.2f} s + restore read {read_s:.3f} s "
              f"= {floor:.2f} s (target <= 2x: {kill_to_step / floor:.1f}x, "
              f"{'met' if kill_to_step <= 2 * floor else 'not met'})")
        print(f"  of it: SIGKILL -> new rank processes {created - t_kill:.2f} s (gloo error, torchrun's restart and "
              f"re-rendezvous), -> every rank ready to restore {ready - created:.2f} s, -> restored "
              f"{second['restored_at'] - ready:.2f} s, -> first step {t_step - second['restored_at']:.2f} s")
        print(f"lost steps: {lost} (killed at step {failed_at}, restored step {r2['step']}; local tier interval {e}); "
              f"at the regrow {lost_grow} (restart at step {last2}, restored step {r3['step']})")
        names = ", ".join(f"node {n}" for n in straggler_nodes)
        print(f"named straggler: {names} ({finding.kind}) after {windows} window(s)")
        spans = ", ".join(f"{s['steps'][0]}-{s['steps'][1]}" for s in timeline["spans"])
        print(f"world sizes: {' -> '.join(map(str, worlds))} (attempts {' -> '.join(map(str, timeline['chain']))}, "
              f"steps {spans})")
        for p in timeline["problems"]:
            print(f"  timeline: {p}")
        print(f"samples: {len(timeline['keys'])} trained along the timeline, {len(counts)} distinct of "
              f"{len(expected)}")
        print(f"every sample exactly once: {once}")
        print(f"wall time: {time.perf_counter() - t_begin:.1f} s")
        out.update({
            "every_sample_exactly_once": once, "named_straggler_nodes": straggler_nodes,
            "named_kind": finding.kind, "named_message": finding.message, "named_after_windows": windows,
            "world_sizes": worlds, "chain": timeline["chain"], "spans": timeline["spans"],
            "lost_steps": lost, "lost_steps_at_regrow": lost_grow, "failed_at": failed_at,
            "restored": {"shrink": r2, "grow": r3}, "kill_to_step_s": kill_to_step, "process_start_s": start_s,
            "restore_read_s": read_s, "kill_to_step_ratio": kill_to_step / floor, "local_every": e,
            "problems": timeline["problems"]})
    finally:
        for i, n in nodes.items():
            n.kill(run.pids(i))
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return out


def checks_hold(out: dict[str, Any], a: argparse.Namespace) -> bool:
    """Every check of the drill (the timing target is printed, not checked)."""
    return bool(out["every_sample_exactly_once"] and out["named_straggler_nodes"] == [1]
                and out["named_kind"] == "data" and out["named_after_windows"] <= a.windows
                and out["world_sizes"] == [4, 2, 4] and 0 <= out["lost_steps"] <= a.local_every)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.elastic_drill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="work folder (kept): new, empty, or one an earlier drill made; "
                   "default: a temporary one, removed after")
    p.add_argument("--samples", type=int, default=3072, help="dataset size (default 3072)")
    p.add_argument("--sample-bytes", type=int, default=512, help="mean bytes of a sample's image field (default 512)")
    p.add_argument("--shard-samples", type=int, default=16, help="samples per shard (default 16)")
    p.add_argument("--batch", type=int, default=4, help="batch per rank, even (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width of the model, a multiple of 4 (default 256)")
    p.add_argument("--local-every", type=int, default=4, help="local tier cadence in steps (default 4)")
    p.add_argument("--remote-every", type=int, default=8, help="remote tier cadence in steps (default 8)")
    p.add_argument("--step-s", type=float, default=0.05,
                   help="seconds per step spent 'on the accelerator' (a sleep: this machine has none; default 0.05)")
    p.add_argument("--window-s", type=float, default=3.0, help="telemetry window in seconds (default 3)")
    p.add_argument("--throttle-s", type=float, default=0.8,
                   help="seconds node 1 takes to read a shard from its cold store while throttled (default 0.8)")
    p.add_argument("--throttle-bps", type=float, default=0.0, help=argparse.SUPPRESS)  # a rank's: from --throttle-s
    p.add_argument("--windows", type=int, default=2, help="windows within which the straggler must be named (2)")
    p.add_argument("-k", type=float, default=1.5, help="the detector's k (default 1.5)")
    p.add_argument("--last-call-s", type=int, default=1,
                   help="node 0's rendezvous last call: how long a round waits for more nodes (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts (default 3)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="give up on any wait after this many seconds (default 120)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    # one rank (started by torchrun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--drill-node", dest="node", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start-world", type=int, default=FULL_WORLD, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        run_rank(a)
        return
    if a.batch < 2 or a.batch % 2:
        p.error("--batch must be even: a world of 2 then leaves a remainder 4 ranks split evenly")
    if a.samples % (FULL_WORLD * a.batch):
        p.error(f"--samples must be a multiple of {FULL_WORLD} ranks x --batch ({FULL_WORLD * a.batch})")
    if a.hidden % FULL_WORLD or a.hidden < FULL_WORLD:
        p.error(f"--hidden must be a multiple of {FULL_WORLD}")
    if a.local_every < 1 or a.remote_every < 1 or a.window_s <= 0 or a.throttle_s <= 0 or a.timeout <= 0:
        p.error("--local-every, --remote-every, --window-s, --throttle-s and --timeout must be positive")
    # SIGTERM (a scheduler, a test's timeout) ends the drill through its cleanup, which
    # kills every process it started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = drill(a)
    if a.json:
        print(json.dumps(out, indent=1, default=str))
    if not checks_hold(out, a):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
