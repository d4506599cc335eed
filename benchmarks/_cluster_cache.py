"""The simulated cluster of ``python -m benchmarks.bench_cache --cluster N``.

N nodes are N process groups on this machine: each a spawned process (its own session, so
it can be killed with its workers) running its own :class:`StreamingDataLoader` with
DataLoader worker processes, as rank ``i`` of ``N``, over a TieredCache with a node-local
directory of its own (a small budget) and, unless ``shared=False``, one directory every node
shares as the shared tier. Every node reads the same dataset from a
:class:`tools.s3_endpoint.LocalS3` that counts GETs per object and injects 503 SlowDown.

While the nodes run, the parent samples the bytes in each local directory's budget (copies
and downloads in flight) every few milliseconds. Each node checks every sample it gets
against the bytes the generator wrote (``payload``) and reports its keys per epoch.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from datapipe.storage.faults import FaultInjectingStore

__all__ = ["ClusterConfig", "payload", "run_cluster", "shared_tier_supported"]


@dataclass
class ClusterConfig:
    nodes: int = 8
    workers: int = 2  # DataLoader worker processes per node
    shards: int = 32
    samples_per_shard: int = 8
    sample_bytes: int = 32 << 10
    epochs: int = 2
    local_fraction: float = 0.25  # each node's local budget, as a fraction of the dataset
    shared_fraction: float = 1.25  # the shared tier's budget (>= 1: the whole dataset fits)
    slowdown_rate: float = 0.05  # share of object GETs answered 503 SlowDown
    window: int | None = None  # None: a full global shuffle, so each node reads from most shards
    batch_size: int = 4
    seed: int = 0
    shared: bool = True
    kill_node: bool = False  # SIGKILL node 0's process group mid-download, then restart it
    lease_timeout_s: float = 10.0  # silence after which a shared-tier lease is taken over
    timeout_s: float = 600.0


def payload(key: str, size: int) -> bytes:
    """The bytes of sample ``key``: a pure function, so any process can check a sample."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{key}/{counter}".encode(), digest_size=64).digest()
        counter += 1
    return bytes(out[:size])


def shared_tier_supported() -> bool:
    """Whether this datapipe's TieredCache has a shared tier (``shared_dir``)."""
    import inspect

    from datapipe import TieredCache

    return "shared_dir" in inspect.signature(TieredCache.__init__).parameters


def _cache_kwargs(cfg: dict[str, Any], node: int, work: str, opts: dict[str, Any], slow: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"warm_dir": os.path.join(work, f"node-{node}", "local"),
                          "warm_bytes": cfg["local_budget"], "storage_options": opts}
    if slow:  # the node to be killed answers its first read of each shard late: it holds leases long
        kw["cold_wrapper"] = functools.partial(FaultInjectingStore, delays=1, delay_s=1.0)
    if cfg["shared"]:
        kw.update(shared_dir=os.path.join(work, "shared"), shared_bytes=cfg["shared_budget"],
                  lease_timeout_s=cfg["lease_timeout_s"])
    return kw


def _node(node: int, cfg: dict[str, Any], work: str, opts: dict[str, Any], env: dict[str, str], q: Any,
          slow: bool = False) -> None:
    """One node: rank ``node`` of ``cfg['nodes']``, reading every epoch through its loader."""
    os.setsid()  # a process group of its own: the node and its workers die together
    os.environ.update(env)
    try:
        from datapipe import TieredCache
        from datapipe.loader import StreamingDataLoader, StreamingDataset

        cache = TieredCache(**_cache_kwargs(cfg, node, work, opts, slow))
        ds = StreamingDataset(cfg["root"], cache=cache, seed=cfg["seed"], window=cfg["window"],
                              batch_size=cfg["batch_size"], rank=node, world_size=cfg["nodes"])
        loader = StreamingDataLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"])
        epochs = []
        bad = 0
        for epoch in range(cfg["epochs"]):
            ds.set_epoch(epoch)
            keys: list[str] = []
            for batch in loader:
                names = list(batch["__key__"])
                for key, data in zip(names, batch["bin"].tolist()):
                    bad += data != payload(key, cfg["sample_bytes"])
                keys += names
            epochs.append(keys)
            q.put(("epoch", node, epoch))
        q.put(("done", node, {"epochs": epochs, "mismatches": bad, "stats": cache.stats()}))
    except BaseException as e:
        q.put(("error", node, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _budget_bytes(local: str) -> int:
    """Bytes a local directory holds inside its budget: published copies and downloads in
    flight (objects/ and tmp/; locks, counters and metadata lie outside the budget),
    counted under its budget lock, as the cache counts them (between two unlocked scans an
    eviction and a new download would both be seen)."""
    try:
        fd = os.open(os.path.join(local, "budget.lock"), os.O_RDONLY)
    except FileNotFoundError:
        return 0  # not created yet
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _scan(local)
    finally:
        os.close(fd)


def _scan(local: str) -> int:
    total = 0
    for sub in ("objects", "tmp"):
        try:
            with os.scandir(os.path.join(local, sub)) as it:
                for entry in it:
                    try:
                        if entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue  # evicted or published between the listing and the stat
        except FileNotFoundError:
            continue
    return total


class _Sampler(threading.Thread):
    """Samples each node's local directory until stopped; keeps the peak and the count."""

    def __init__(self, dirs: list[str], every_s: float = 0.02) -> None:
        super().__init__(name="local-dir-sampler", daemon=True)
        self.dirs, self.every_s = dirs, every_s
        self.peaks = [0] * len(dirs)
        self.samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for i, d in enumerate(self.dirs):
                self.peaks[i] = max(self.peaks[i], _budget_bytes(d))
            self.samples += 1
            self.stop.wait(self.every_s)


def _write_dataset(c: ClusterConfig, root: str, opts: dict[str, Any]) -> list[str]:
    from datapipe import ShardWriter

    keys = []
    with ShardWriter(root, max_samples=c.samples_per_shard, storage_options=opts) as w:
        for s in range(c.shards):
            for i in range(c.samples_per_shard):
                key = f"s{s:05d}-{i:04d}"
                w.write({"__key__": key, "bin": payload(key, c.sample_bytes)})
                keys.append(key)
    return keys


def _start(ctx: Any, node: int, cfg: dict[str, Any], work: str, s3: Any, q: Any, slow: bool = False) -> Any:
    p = ctx.Process(target=_node, args=(node, cfg, work, s3.storage_options, s3.env, q, slow), name=f"node-{node}")
    p.start()
    return p


def run_cluster(c: ClusterConfig, s3: Any, work: str, log: Any = print) -> dict[str, Any]:
    """Run the simulated cluster against the running endpoint ``s3``; every figure as JSON-able data."""
    from datapipe import open_dataset

    if c.shared and not shared_tier_supported():
        raise RuntimeError("this TieredCache has no shared tier (shared_dir); run with --no-shared for the "
                           "baseline of node-local caches only")
    bucket = "bench-cluster"
    root = s3.create_bucket(bucket) + "/ds"
    opts = s3.storage_options
    keys = _write_dataset(c, root, opts)
    shard_info = open_dataset(root, storage_options=opts).index.shards
    shard_keys = {f"{bucket}/ds/{s.name}" for s in shard_info}
    dataset_bytes = sum(int(s.bytes) for s in shard_info)
    largest = max(int(s.bytes) for s in shard_info)
    local_budget = max(int(c.local_fraction * dataset_bytes), largest)
    cfg = {"root": root, "nodes": c.nodes, "workers": c.workers, "epochs": c.epochs, "seed": c.seed,
           "window": c.window, "batch_size": c.batch_size, "sample_bytes": c.sample_bytes, "shared": c.shared,
           "local_budget": local_budget, "shared_budget": max(int(c.shared_fraction * dataset_bytes), largest),
           "lease_timeout_s": c.lease_timeout_s}
    s3.reset_traffic()
    s3.set_slowdown_rate(c.slowdown_rate)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sampler = _Sampler([os.path.join(work, f"node-{n}", "local") for n in range(c.nodes)])
    sampler.start()
    t0 = time.perf_counter()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    killed: tuple[dict[str, Any], _DeadLeases] | None = None
    deadline = time.monotonic() + c.timeout_s
    procs: dict[int, Any] = {}
    if c.kill_node:
        # node 0 first, alone and slow: killed while it holds the lease of its first
        # download; the other nodes start then, and meet the dead lease
        procs[0] = _start(ctx, 0, cfg, work, s3, q, slow=True)
        while killed is None and procs[0].is_alive() and time.monotonic() < deadline:
            killed = _maybe_kill(work, procs, ctx, cfg, s3, q)
            time.sleep(0.002)
    procs.update({n: _start(ctx, n, cfg, work, s3, q) for n in range(c.nodes) if n not in procs})
    try:
        while len(results) + len(errors) < c.nodes:
            try:
                kind, node, body = q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not finish within {c.timeout_s:g} s") from None
                dead = [n for n, p in procs.items() if not p.is_alive() and n not in results and n not in errors]
                for n in dead:
                    if procs[n].exitcode not in (0, None):
                        errors[n] = f"node {n} exited with {procs[n].exitcode}"
                continue
            if kind == "done":
                results[node] = body
            elif kind == "error":
                errors[node] = body
            elif kind == "epoch":
                log(f"  node {node}: epoch {body} read ({time.perf_counter() - t0:.1f} s)")
    finally:
        sampler.stop.set()
        sampler.join()
        if killed is not None:
            killed[1].stop.set()
            killed[1].join()
        for p in procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
    seconds = time.perf_counter() - t0
    traffic = s3.traffic()
    s3.set_slowdown_rate(0.0)
    cold_gets = sum(n for k, n in traffic["gets"].items() if k in shard_keys)
    cold_bytes = sum(n for k, n in traffic["bytes"].items() if k in shard_keys)
    slowdowns = sum(n for k, n in traffic["slowdowns"].items() if k in shard_keys)
    per_shard = [traffic["gets"].get(k, 0) for k in sorted(shard_keys)]
    byte_exact = not errors and len(results) == c.nodes
    coverage = []
    for e in range(c.epochs):
        seen = set()
        for r in results.values():
            seen.update(r["epochs"][e])
        coverage.append(len(seen) == len(keys) and seen == set(keys))
        byte_exact = byte_exact and coverage[-1]
    byte_exact = byte_exact and all(r["mismatches"] == 0 for r in results.values())
    stats = {n: r["stats"] for n, r in results.items()}
    return {
        "nodes": c.nodes,
        "workers_per_node": c.workers,
        "shards": len(shard_keys),
        "samples_per_shard": c.samples_per_shard,
        "dataset_bytes": dataset_bytes,
        "epochs": c.epochs,
        "shared_tier": c.shared,
        "local_budget_bytes": local_budget,
        "shared_budget_bytes": cfg["shared_budget"],
        "cold_gets": cold_gets,
        "cold_gets_per_shard": cold_gets / len(shard_keys) / c.epochs,
        "cold_gets_per_shard_whole_run": cold_gets / len(shard_keys),
        "cold_gets_per_shard_max": max(per_shard),
        "cold_bytes": cold_bytes,
        "cold_bytes_per_epoch_over_dataset": cold_bytes / c.epochs / dataset_bytes,
        "slowdowns_injected": slowdowns,
        "slowdown_rate": c.slowdown_rate,
        "byte_exact": byte_exact,
        "every_sample_each_epoch": coverage,
        "local_budget_exceeded": any(p > local_budget for p in sampler.peaks),
        "local_peak_bytes": sampler.peaks,
        "local_dir_samples": sampler.samples,
        "seconds": seconds,
        "killed": None if killed is None else {**killed[0], **killed[1].report(cfg["lease_timeout_s"])},
        "errors": {str(n): e[-600:] for n, e in errors.items()},
        "node_cache_stats": {str(n): {k: v for k, v in s.items() if isinstance(v, (int, float)) and v}
                             for n, s in stats.items()},
    }


def _group_pids(pgid: int) -> set[int]:
    """The processes of process group ``pgid`` (a node and its DataLoader workers), from /proc."""
    pids = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
            pids.add(int(name))
    return pids


def _lease_holder(path: str) -> tuple[Any, Any] | None:
    """(pid, writer) named by a lease file, None when it is gone or unreadable."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read() or b"null")
    except (OSError, ValueError):
        return None
    return (doc.get("pid"), doc.get("writer")) if isinstance(doc, dict) else None


class _DeadLeases(threading.Thread):
    """After a kill: how long each shared-tier lease the dead processes held stays theirs
    (until another node takes it over, or it is gone), counted from the kill and from the
    moment another node first held a lease (the others were running and could wait on it)."""

    def __init__(self, leases: str, paths: dict[str, tuple[Any, Any]], every_s: float = 0.01) -> None:
        super().__init__(name="dead-lease-watch", daemon=True)
        self.leases, self.paths, self.every_s = leases, dict(paths), every_s
        self.dead_pids = {h[0] for h in paths.values()}
        self.t0 = time.monotonic()
        self.others_from: float | None = None
        self.ended: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.ended) < len(self.paths):
            now = time.monotonic() - self.t0
            for path, holder in self.paths.items():
                if path not in self.ended and _lease_holder(path) != holder:
                    self.ended[path] = now
            if self.others_from is None:
                for name in os.listdir(self.leases):
                    h = _lease_holder(os.path.join(self.leases, name))
                    if h is not None and h[0] not in self.dead_pids:
                        self.others_from = now
                        break
            self.stop.wait(self.every_s)

    def report(self, timeout_s: float) -> dict[str, Any]:
        longest = max(self.ended.values(), default=0.0)
        others = self.others_from if self.others_from is not None else 0.0
        return {"dead_leases": len(self.paths), "taken_over_or_gone": len(self.ended),
                "left_untouched": len(self.paths) - len(self.ended), "longest_since_kill_s": longest,
                "others_holding_leases_from_s": self.others_from,
                "longest_since_others_ran_s": max(0.0, longest - others), "lease_timeout_s": timeout_s,
                # a waiter polls the lease at most every 0.25 s: 1 s of slack for polling and load
                "lease_blocked_beyond_timeout": longest - others > timeout_s + 1.0}


def _maybe_kill(work: str, procs: dict[int, Any], ctx: Any, cfg: dict[str, Any], s3: Any,
                q: Any) -> tuple[dict[str, Any], _DeadLeases] | None:
    """Once a process of node 0 holds a shared-tier lease (a download in flight: node 0's
    first read of each shard from cold answers 1 s late), SIGKILL node 0's process group
    (the node and its workers), start it again (at full speed), and watch the leases the
    dead processes held; None until then."""
    leases = os.path.join(work, "shared", "leases")
    try:
        names = os.listdir(leases)
    except FileNotFoundError:
        return None
    if not names or not procs[0].is_alive():
        return None
    holders = {os.path.join(leases, n): _lease_holder(os.path.join(leases, n)) for n in names}
    group = _group_pids(procs[0].pid)
    held = {p: h for p, h in holders.items() if h is not None and h[0] in group}
    if not held:
        return None
    budget = os.path.join(work, "shared", "budget.lease")  # held while room is made in the shared tier
    holder = _lease_holder(budget)
    if holder is not None and holder[0] in group:
        held[budget] = holder
    old = procs[0]
    os.killpg(old.pid, signal.SIGKILL)
    watch = _DeadLeases(leases, held)
    watch.start()
    old.join(30)
    procs[0] = _start(ctx, 0, cfg, work, s3, q)
    return ({"node": 0, "pids_killed": sorted(group), "signal": "SIGKILL",
             "while": f"holding {len(held)} shared-tier lease(s)",
             "leases": sorted(os.path.relpath(p, os.path.join(work, "shared")) for p in held)}, watch)
