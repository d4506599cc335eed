"""Benchmark of the tiered shard cache against LRU, the Belady optimum and the peers.

Cold tier: moto's S3 server on loopback (:class:`tools.s3_endpoint.LocalS3`, which counts
GETs and bytes per object). Data: synthetic shard-sized objects (equal sizes, so the
offline Belady optimum is exact). For warm budgets of 10%, 50% and 90% of the dataset,
over several epochs with a fresh seeded shuffle each:

- ``loader`` (what a trainer gets): a packed dataset of one sample per shard read through
  ``StreamingDataset`` with a TieredCache, the cache told only what the loader tells it
  (each pass: its fetches to the end of the next epoch). Hit rate against the offline
  Belady optimum and LRU for the same access sequence (the loader's fetches, checked
  against the cache's own count of reads), bytes from cold per epoch (counted by the
  endpoint), and the same loader over a cache that ignores the future (LRU).
- ``policies`` (an oracle): the cache handed every epoch's order of raw objects up front.
- ``peers``: MosaicML Streaming's ``cache_limit`` and LitData's ``max_cache_size`` on the
  same bytes, when they run here.
- warm-hit read throughput against a direct read of the same local file.

``--cluster N`` runs the simulated cluster instead (:mod:`._cluster_cache`): N nodes, each
a process group with its own DataLoader workers and local directory, sharing one directory
as the shared tier, reading from the endpoint with 503 SlowDown injected; then the loader
rows above at a small size. Its last line printed is one JSON object.

    python -m benchmarks.bench_cache --quick
    python -m benchmarks.bench_cache --objects 64 --object-mib 4 --epochs 4 --json out.json
    python -m benchmarks.bench_cache --cluster 8

``run(config) -> dict`` and ``cluster(...) -> dict`` return every figure as JSON-able data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from datapipe.cache import TieredCache, belady_hits, lru_hits
from datapipe.storage import open_store

__all__ = ["BenchConfig", "FutureBlindCache", "cluster", "extrapolate", "loader_rows", "run", "main"]


@dataclass
class BenchConfig:
    objects: int = 64
    object_bytes: int = 4 << 20
    epochs: int = 4
    fractions: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    seed: int = 0
    peers: bool = True
    throughput_bytes: int = 64 << 20
    throughput_repeats: int = 15
    workdir: str | None = None
    oracle: bool = True  # the `policies` rows (the cache handed every epoch's order up front)
    throughput: bool = True

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(objects=16, object_bytes=256 << 10, epochs=3, throughput_bytes=8 << 20,
                   throughput_repeats=7)


def epoch_orders(names: list[str], epochs: int, seed: int) -> list[list[str]]:
    """A fresh seeded shuffle per epoch."""
    out = []
    for e in range(epochs):
        order = list(names)
        random.Random(seed * 1000 + e).shuffle(order)
        out.append(order)
    return out


def _policy_run(urls_by_epoch, cfg, opts, warm_dir, budget, clairvoyant, lookahead=0):
    cache = TieredCache(warm_dir=warm_dir, warm_bytes=budget, storage_options=opts,
                        max_inflight_bytes=max(cfg.object_bytes * 4, 64 << 20))
    if clairvoyant:
        cache.set_schedule([u for order in urls_by_epoch for u in order], lookahead=lookahead)
    per_epoch = []
    prev = cache.stats()
    t0 = time.perf_counter()
    for order in urls_by_epoch:
        for u in order:
            cache.read(u)
        s = cache.stats()
        hits = s["warm_hits"] - prev["warm_hits"]
        per_epoch.append({
            "hits": hits,
            "hit_rate": hits / len(order),
            "cold_bytes": s["cold_bytes"] - prev["cold_bytes"],
            "evictions": s["warm_evictions"] - prev["warm_evictions"],
        })
        prev = s
    seconds = time.perf_counter() - t0
    final = cache.stats()
    cache.close()
    return {"per_epoch": per_epoch, "seconds": seconds, "warm_used_bytes": final["warm_used_bytes"],
            "total_hits": final["warm_hits"], "wait_seconds": final["wait_seconds"],
            "prefetched": final["prefetched"]}


class FutureBlindCache(TieredCache):
    """The same TieredCache, deaf to what the loader tells it of the future: it evicts LRU.
    The baseline of the loader rows."""

    def set_schedule(self, urls, **kwargs) -> None:
        return None


def _shard_traffic(s3, prefix: str) -> tuple[int, int]:
    """(GETs answered, bytes served) of the objects under "bucket/prefix" so far."""
    t = s3.traffic()
    gets = sum(n for k, n in t["gets"].items() if k.startswith(prefix) and k.endswith(".tar"))
    sent = sum(n for k, n in t["bytes"].items() if k.startswith(prefix) and k.endswith(".tar"))
    return gets, sent


def loader_rows(cfg: BenchConfig, s3, payloads: dict[str, bytes], work: str, log=print) -> dict:
    """Per warm budget: StreamingDataset over a TieredCache (told the future by the loader,
    or blind to it) against Belady and LRU for the same accesses, epochs read in this
    process (the loader's own prefetch threads fetch; no DataLoader workers, so that
    one cache's counters see every read). {"dataset_bytes", "rows": {fraction: row}}."""
    from datapipe import ShardWriter, open_dataset
    from datapipe.loader import StreamingDataset

    bucket = "bench-loader"
    root = s3.create_bucket(bucket) + "/ds"
    opts = s3.storage_options
    with ShardWriter(root, max_samples=1, storage_options=opts) as w:
        for name in sorted(payloads):
            w.write({"__key__": name.replace(".", "_"), "bin": payloads[name]})
    shards = open_dataset(root, storage_options=opts).index.shards
    shard_sizes = {s.url: int(s.bytes) for s in shards}
    dataset_bytes = sum(shard_sizes.values())
    equal = len(set(shard_sizes.values())) == 1
    size = max(shard_sizes.values())
    out: dict = {"dataset_bytes": dataset_bytes, "shards": len(shards), "equal_shard_sizes": equal, "rows": {}}
    for frac in cfg.fractions:
        budget = int(frac * len(shards)) * size
        row: dict = {"warm_bytes": budget}
        accesses: list[str] | None = None
        for name, cls in (("datapipe_loader", TieredCache), ("datapipe_loader_lru", FutureBlindCache)):
            cache = cls(warm_dir=os.path.join(work, f"loader-{name}-{frac}"), warm_bytes=budget,
                        storage_options=opts)
            ds = StreamingDataset(root, cache=cache, seed=cfg.seed, batch_size=1)
            seq: list[str] = []
            per_epoch = []
            t0 = time.perf_counter()
            for epoch in range(cfg.epochs):
                ds.set_epoch(epoch)
                urls = [ds.source.url(g) for g in ds.future_shards(epochs=1).tolist()]
                before, (g0, b0) = cache.stats(), _shard_traffic(s3, f"{bucket}/ds/")
                samples = sum(1 for _ in ds)
                after, (g1, b1) = cache.stats(), _shard_traffic(s3, f"{bucket}/ds/")
                hits = after["warm_hits"] - before["warm_hits"]
                reads = hits + after["warm_misses"] - before["warm_misses"]
                if samples != len(shards) or reads != len(urls):
                    raise RuntimeError(f"{name} epoch {epoch}: {samples} samples and {reads} cache reads, "
                                       f"expected {len(shards)} and {len(urls)} (the loader's fetches)")
                per_epoch.append({"accesses": len(urls), "hits": hits, "hit_rate": hits / len(urls),
                                  # misses read through, not stored (Belady's non-admission)
                                  "not_admitted": after["warm_not_admitted"] - before["warm_not_admitted"],
                                  "cold_gets": g1 - g0, "cold_bytes": b1 - b0})
                seq += urls
            cache.close()
            shutil.rmtree(os.path.join(work, f"loader-{name}-{frac}"), ignore_errors=True)
            if accesses is not None and seq != accesses:
                raise RuntimeError("the loader's accesses differ between two runs of the same seeds")
            accesses = seq
            hits = sum(e["hits"] for e in per_epoch)
            steady = [e["cold_bytes"] for e in per_epoch[1:]] or [per_epoch[0]["cold_bytes"]]
            row[name] = {"per_epoch": per_epoch, "hits": hits, "hit_rate": hits / len(seq),
                         "seconds": time.perf_counter() - t0,
                         "steady_cold_bytes_per_epoch": statistics.mean(steady),
                         "steady_cold_over_dataset": statistics.mean(steady) / dataset_bytes}
        if accesses is None:  # pragma: no cover - the loop above ran
            raise RuntimeError("no loader run")
        sizes = {u: shard_sizes[u] for u in accesses}
        optimum = belady_hits(accesses, sizes, budget)
        row["accesses"] = len(accesses)
        row["belady_optimum"] = {"hits": optimum, "hit_rate": optimum / len(accesses)}
        row["lru_offline"] = {"hits": lru_hits(accesses, sizes, budget)}
        for name in ("datapipe_loader", "datapipe_loader_lru"):
            row[name]["fraction_of_belady"] = row[name]["hits"] / optimum if optimum else None
        out["rows"][str(frac)] = row
        log(_fmt_loader_row(frac, row, dataset_bytes))
    return out


def _fmt_loader_row(frac: float, row: dict, dataset_bytes: int) -> str:
    parts = [f"loader, cache {frac:.0%}: {row['accesses']} accesses, belady hit rate "
             f"{row['belady_optimum']['hit_rate']:.3f}, offline LRU {row['lru_offline']['hits'] / row['accesses']:.3f}"]
    for name in ("datapipe_loader", "datapipe_loader_lru"):
        r = row[name]
        of = "n/a" if r["fraction_of_belady"] is None else f"{r['fraction_of_belady']:.2%}"
        parts.append(f"{name}: hit rate {r['hit_rate']:.3f} ({of} of belady), not admitted "
                     f"{sum(e['not_admitted'] for e in r['per_epoch'])}, cold MB/epoch "
                     f"{[round(e['cold_bytes'] / 1e6, 2) for e in r['per_epoch']]}, steady "
                     f"{r['steady_cold_over_dataset']:.3f}x the dataset ({dataset_bytes / 1e6:.1f} MB), "
                     f"{r['seconds']:.1f} s")
    return "\n  ".join(parts)


def hit_rate_over_belady(loader: dict) -> dict[str, float | None]:
    """{fraction: the loader's hits / Belady's hits} of :func:`loader_rows`."""
    return {f: row["datapipe_loader"]["fraction_of_belady"] for f, row in loader["rows"].items()}


def _summarise(res, n_access, dataset_bytes, fraction, optimum_hits):
    steady = [e["cold_bytes"] for e in res["per_epoch"][1:]] or [res["per_epoch"][0]["cold_bytes"]]
    res["hit_rate"] = res["total_hits"] / n_access
    res["fraction_of_belady"] = (res["total_hits"] / optimum_hits) if optimum_hits else None
    res["steady_cold_bytes_per_epoch"] = statistics.mean(steady)
    res["cold_bytes_target"] = (1 - fraction) * dataset_bytes + 0.05 * dataset_bytes
    res["meets_cold_target"] = res["steady_cold_bytes_per_epoch"] <= res["cold_bytes_target"]
    return res


def warm_hit_throughput(cfg: BenchConfig, work: str) -> dict:
    """cache.read of a warm hit vs reading the same file directly (both from page cache)."""
    cold = os.path.join(work, "tp-cold")
    os.makedirs(cold, exist_ok=True)
    url = os.path.join(cold, "big.bin")
    with open(url, "wb") as f:
        f.write(os.urandom(cfg.throughput_bytes))
    from datapipe.checksum import checksum

    ck = checksum(open(url, "rb").read())
    cache = TieredCache(warm_dir=os.path.join(work, "tp-warm"), warm_bytes=2 * cfg.throughput_bytes)
    path = cache.local_path(url)  # fills the warm copy
    cache.release(url)
    cache.read(url)

    def direct():
        with open(path, "rb", buffering=0) as f:
            return f.read()

    def timed(fn):
        ts = []
        for _ in range(cfg.throughput_repeats):
            t0 = time.perf_counter()
            data = fn()
            ts.append(time.perf_counter() - t0)
            if len(data) != cfg.throughput_bytes:
                raise RuntimeError("short read in benchmark")
            del data  # free before the next read, so neither contender pays fresh pages
        return cfg.throughput_bytes / statistics.median(ts) / 1e6

    # interleave to share any drift in machine load between the contenders
    out = {"bytes": cfg.throughput_bytes, "direct_MBps": [], "warm_hit_MBps": [], "warm_hit_verified_MBps": []}
    for _ in range(3):
        out["direct_MBps"].append(timed(direct))
        out["warm_hit_MBps"].append(timed(lambda: cache.read(url)))
        out["warm_hit_verified_MBps"].append(timed(lambda: cache.read(url, checksum=ck)))
    for k in ("direct_MBps", "warm_hit_MBps", "warm_hit_verified_MBps"):
        out[k] = max(out[k])
    out["warm_hit_vs_direct"] = out["warm_hit_MBps"] / out["direct_MBps"]
    out["verified_vs_direct"] = out["warm_hit_verified_MBps"] / out["direct_MBps"]
    if cache.stats()["cold_reads"] != 1:
        raise RuntimeError("warm-hit benchmark read from cold more than once")
    cache.close()
    return out


def run(config: BenchConfig | dict | None = None) -> dict:
    cfg = config if isinstance(config, BenchConfig) else BenchConfig(**(config or {}))
    from tools.s3_endpoint import LocalS3

    work = cfg.workdir or tempfile.mkdtemp(prefix="bench-cache-")
    os.makedirs(work, exist_ok=True)
    result: dict = {"config": asdict(cfg), "policies": {}, "peers": {}}
    try:
        with LocalS3() as s3:
            root = s3.create_bucket("bench-cache") + "/ds"
            opts = s3.storage_options
            store = open_store(root, opts)
            names = [f"shard-{i:05d}.bin" for i in range(cfg.objects)]
            payloads = {}
            for n in names:
                payloads[n] = os.urandom(cfg.object_bytes)
                store.put(n, payloads[n])
            dataset_bytes = cfg.objects * cfg.object_bytes
            orders = epoch_orders(names, cfg.epochs, cfg.seed)
            urls = [[f"{root}/{n}" for n in o] for o in orders]
            flat = [u for o in urls for u in o]
            sizes = {u: cfg.object_bytes for u in flat}
            result["dataset_bytes"] = dataset_bytes
            result["loader"] = loader_rows(cfg, s3, payloads, work)
            result["hit_rate_over_belady"] = hit_rate_over_belady(result["loader"])
            for frac in (cfg.fractions if cfg.oracle else []):
                slots = int(frac * cfg.objects)
                budget = slots * cfg.object_bytes
                optimum = belady_hits(flat, sizes, budget)
                row = {
                    "warm_bytes": budget,
                    "belady_optimum": {"hits": optimum, "hit_rate": optimum / len(flat)},
                    "lru_offline": {"hits": lru_hits(flat, sizes, budget)},
                }
                # The prefetch row's hits include objects fetched ahead of the reader, so
                # they are not comparable with demand-paging Belady; its cold bytes are.
                for name, clair, ahead in (("datapipe_lru", False, 0), ("datapipe_clairvoyant", True, 0),
                                           ("datapipe_clairvoyant_prefetch", True, 4)):
                    wd = os.path.join(work, f"warm-{name}-{frac}")
                    res = _policy_run(urls, cfg, opts, wd, budget, clair, ahead)
                    row[name] = _summarise(res, len(flat), dataset_bytes, frac, optimum)
                    shutil.rmtree(wd, ignore_errors=True)
                result["policies"][str(frac)] = row
                print(_fmt_row(frac, row), flush=True)
            if cfg.peers:
                from . import _peers_cache

                result["peers"] = _peers_cache.run_peers(cfg, s3, payloads, orders, work)
                for peer, rows in result["peers"].items():
                    print(f"{peer}: {json.dumps(rows)[:400]}", flush=True)
        if cfg.throughput:
            result["warm_hit_throughput"] = warm_hit_throughput(cfg, work)
            print(f"warm hit: {json.dumps(result['warm_hit_throughput'])}", flush=True)
    finally:
        if cfg.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _fmt_row(frac: float, row: dict) -> str:
    opt = row["belady_optimum"]["hit_rate"]
    parts = [f"cache {frac:.0%}: belady hit rate {opt:.3f}"]
    for name in ("datapipe_lru", "datapipe_clairvoyant", "datapipe_clairvoyant_prefetch"):
        r = row[name]
        parts.append(
            f"{name}: hit rate {r['hit_rate']:.3f} ({(r['fraction_of_belady'] or 0):.2%} of belady), "
            f"cold MB/epoch {[round(e['cold_bytes'] / 1e6, 1) for e in r['per_epoch']]}, "
            f"steady {r['steady_cold_bytes_per_epoch'] / 1e6:.1f} <= {r['cold_bytes_target'] / 1e6:.1f}: "
            f"{r['meets_cold_target']}, {r['seconds']:.1f} s, waited {r['wait_seconds']:.2f} s")
    return "\n  ".join(parts)


def cluster(c, bench: BenchConfig | None = None, log=print) -> dict:
    """The simulated cluster (``c``: a :class:`._cluster_cache.ClusterConfig`), then the
    loader rows of ``bench`` (default: 24 objects of 256 KiB, 3 epochs, no peers) for
    ``hit_rate_over_belady``. Every figure as JSON-able data."""
    from tools.s3_endpoint import LocalS3

    from ._cluster_cache import run_cluster

    bench = bench or BenchConfig(objects=24, object_bytes=256 << 10, epochs=3, peers=False)
    work = bench.workdir or tempfile.mkdtemp(prefix="bench-cluster-")
    os.makedirs(work, exist_ok=True)
    try:
        with LocalS3(seed=c.seed) as s3:
            log(f"cluster: {c.nodes} nodes x {c.workers} workers, {c.shards} shards x {c.samples_per_shard} "
                f"samples x {c.sample_bytes} B, {c.epochs} epochs, shared tier {'on' if c.shared else 'off'}, "
                f"{c.slowdown_rate:.0%} of GETs answered 503")
            out = run_cluster(c, s3, os.path.join(work, "cluster"), log=log)
            log(f"cluster: {out['cold_gets']} cold GETs for {out['shards']} shards x {out['epochs']} epochs "
                f"({out['cold_gets_per_shard']:.3f} per shard per epoch, at most {out['cold_gets_per_shard_max']} "
                f"for one shard), {out['slowdowns_injected']} answered 503, byte-exact {out['byte_exact']}, "
                f"local peaks {out['local_peak_bytes']} of {out['local_budget_bytes']} B "
                f"({out['local_dir_samples']} samples), {out['seconds']:.1f} s")
            payloads = {f"shard-{i:05d}.bin": os.urandom(bench.object_bytes) for i in range(bench.objects)}
            loader = loader_rows(bench, s3, payloads, work, log=log)
        out["hit_rate_over_belady"] = hit_rate_over_belady(loader)
        out["loader"] = loader
        return out
    finally:
        if bench.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


S3_GETS_PER_PREFIX = 5500  # S3's documented GET/HEAD rate per prefix, per second


def extrapolate(shared: dict, baseline: dict, *, nodes: int, dataset_bytes: float, shard_bytes: float,
                sample_bytes: float, epoch_s: float) -> dict:
    """The cluster measured (``shared``: a ``--cluster`` result with the shared tier;
    ``baseline``: the same run with ``--no-shared``) scaled on paper to ``nodes`` nodes
    reading ``dataset_bytes`` in shards of ``shard_bytes`` holding samples of
    ``sample_bytes``, a global shuffle, one epoch per ``epoch_s``.

    A node reads ``1/nodes`` of the samples, so it touches a share ``1 - exp(-s / nodes)``
    of the shards (``s`` samples per shard). Measured: ``r`` = cold GETs per touched shard
    per epoch per node without the shared tier (``baseline cold_gets_per_shard / nodes /
    (1 - exp(-s / nodes))``: its local misses, refetches included), and ``g`` = cold GETs
    per shard for the whole shared run. Then ``m = r * (1 - exp(-s / nodes))`` fetches per
    shard per epoch per node. Without the shared tier every one goes to S3: egress per epoch
    ``nodes * m * dataset``, GETs/s ``nodes * m * shards / epoch_s`` on one prefix. With it
    S3 serves ``g * dataset`` once (the shared tier holds the dataset), and the same fetches
    go to the shared file system: ``nodes * m * shards / epoch_s`` opens/s and ``nodes * m *
    dataset / epoch_s`` bytes/s, the new limit."""
    s_m, n_m = baseline["samples_per_shard"], baseline["nodes"]
    r = baseline["cold_gets_per_shard"] / n_m / (1 - math.exp(-s_m / n_m))
    g = shared["cold_gets_per_shard_whole_run"]
    shards = dataset_bytes / shard_bytes
    s = shard_bytes / sample_bytes

    def m_at(n: float) -> float:
        return r * (1 - math.exp(-s / n))

    m = m_at(nodes)
    without_gets = nodes * m * shards / epoch_s
    # the node count at which one prefix reaches S3's rate (gets/s grows with n * m(n))
    lo, hi = 1.0, 1e9
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if mid * m_at(mid) * shards / epoch_s < S3_GETS_PER_PREFIX else (lo, mid)
    limit = hi if hi * m_at(hi) * shards / epoch_s >= S3_GETS_PER_PREFIX and hi < 1e9 else None
    return {
        "inputs": {"r_fetches_per_touched_shard_per_epoch_per_node": r, "g_cold_gets_per_shard_shared": g,
                   "measured_nodes": [n_m, shared["nodes"]], "measured_samples_per_shard": s_m,
                   "nodes": nodes, "dataset_bytes": dataset_bytes, "shard_bytes": shard_bytes,
                   "samples_per_shard": s, "shards": shards, "epoch_s": epoch_s,
                   "m_fetches_per_shard_per_epoch_per_node": m},
        "without_shared_tier": {"cold_egress_bytes_per_epoch": nodes * m * dataset_bytes,
                                "gets_per_s_one_prefix": without_gets,
                                "over_s3_prefix_limit": without_gets / S3_GETS_PER_PREFIX,
                                "nodes_at_prefix_limit": limit},
        "with_shared_tier": {"cold_egress_bytes_first_epoch": g * dataset_bytes,
                             "cold_egress_bytes_later_epochs": 0.0,
                             "gets_per_s_one_prefix_first_epoch": g * shards / epoch_s,
                             "shared_fs_opens_per_s": without_gets,
                             "shared_fs_bytes_per_s": nodes * m * dataset_bytes / epoch_s},
    }


def _print_extrapolation(x: dict) -> None:
    i, wo, w = x["inputs"], x["without_shared_tier"], x["with_shared_tier"]
    print(f"measured: r = {i['r_fetches_per_touched_shard_per_epoch_per_node']:.3f} cold GETs per touched shard "
          f"per epoch per node without the shared tier, g = {i['g_cold_gets_per_shard_shared']:.3f} cold GETs per "
          f"shard with it (nodes {i['measured_nodes']}, {i['measured_samples_per_shard']} samples per shard)")
    print(f"scaled to {i['nodes']:,} nodes, {i['dataset_bytes'] / 1e12:,.1f} TB in {i['shards']:,.0f} shards of "
          f"{i['shard_bytes'] / 2**20:,.0f} MiB ({i['samples_per_shard']:,.0f} samples each), an epoch per "
          f"{i['epoch_s'] / 3600:g} h: m = {i['m_fetches_per_shard_per_epoch_per_node']:.3f} fetches per shard per "
          "epoch per node")
    print(f"without the shared tier: {wo['cold_egress_bytes_per_epoch'] / 1e15:,.1f} PB from S3 per epoch, "
          f"{wo['gets_per_s_one_prefix']:,.0f} GET/s on one prefix = {wo['over_s3_prefix_limit']:,.1f}x S3's "
          f"{S3_GETS_PER_PREFIX:,}/s; one prefix saturates at "
          + (f"{wo['nodes_at_prefix_limit']:,.0f} nodes" if wo["nodes_at_prefix_limit"] else "no node count"))
    print(f"with it: {w['cold_egress_bytes_first_epoch'] / 1e12:,.1f} TB from S3 in the first epoch, 0 after; "
          f"{w['gets_per_s_one_prefix_first_epoch']:,.2f} GET/s on one prefix; the limit moves to the shared file "
          f"system: {w['shared_fs_opens_per_s']:,.0f} shard opens/s, {w['shared_fs_bytes_per_s'] / 1e12:,.2f} TB/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (16 objects of 256 KiB, 3 epochs)")
    ap.add_argument("--objects", type=int, help="number of objects (default 64; with --cluster, 24 for the "
                    "loader rows)")
    ap.add_argument("--object-mib", type=float, help="object size in MiB (default 4; with --cluster, 0.25)")
    ap.add_argument("--epochs", type=int, help="epochs, each a fresh shuffle (default 4; with --cluster, 3 "
                    "for the loader rows)")
    ap.add_argument("--fractions", type=str, help="cache sizes as fractions, e.g. 0.1,0.5,0.9")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--no-peers", action="store_true", help="skip MosaicML Streaming and LitData")
    ap.add_argument("--no-oracle", action="store_true", help="skip the rows of a cache handed every order up front")
    ap.add_argument("--json", type=str, help="write the result to this file")
    cl = ap.add_argument_group("simulated cluster (--cluster N)")
    cl.add_argument("--cluster", type=int, metavar="N", help="run N simulated nodes sharing one shared tier; the "
                    "last line printed is one JSON object")
    cl.add_argument("--node-workers", type=int, default=2, help="DataLoader workers per node (default 2)")
    cl.add_argument("--shards", type=int, default=32, help="shards of the cluster's dataset (default 32)")
    cl.add_argument("--samples-per-shard", type=int, default=8, help="default 8")
    cl.add_argument("--sample-kib", type=float, default=32, help="sample size in KiB (default 32)")
    cl.add_argument("--cluster-epochs", type=int, default=2, help="epochs each node reads (default 2)")
    cl.add_argument("--local-fraction", type=float, default=0.25,
                    help="each node's local budget as a fraction of the dataset (default 0.25)")
    cl.add_argument("--shared-fraction", type=float, default=1.25,
                    help="the shared tier's budget as a fraction of the dataset (default 1.25)")
    cl.add_argument("--slowdown-rate", type=float, default=0.05,
                    help="share of object GETs answered 503 SlowDown (default 0.05)")
    cl.add_argument("--window", type=int, default=0, help="shuffle window in shards (default 0: a global shuffle, "
                    "so each node reads from most shards)")
    cl.add_argument("--no-shared", action="store_true", help="no shared tier: node-local caches only (the baseline)")
    cl.add_argument("--kill-node", action="store_true",
                    help="SIGKILL node 0's process group while it holds a shared-tier lease, then start it again")
    ex = ap.add_argument_group("paper extrapolation (--extrapolate SHARED.json BASELINE.json)")
    ex.add_argument("--extrapolate", nargs=2, metavar=("SHARED", "BASELINE"),
                    help="--json results of --cluster N and of --cluster N --no-shared: scale them to --to-nodes")
    ex.add_argument("--to-nodes", type=int, default=10_000, help="default 10,000")
    ex.add_argument("--dataset-tb", type=float, default=100.0, help="dataset size in TB (default 100)")
    ex.add_argument("--shard-mib", type=float, default=256.0, help="shard size in MiB (default 256)")
    ex.add_argument("--to-sample-kib", dest="x_sample_kib", type=float, default=100.0,
                    help="sample size in KiB (default 100)")
    ex.add_argument("--epoch-hours", type=float, default=24.0, help="hours per epoch (default 24)")
    cl.add_argument("--lease-timeout", type=float, default=10.0,
                    help="seconds of silence after which a shared-tier lease is taken over (default 10)")
    a = ap.parse_args(argv)
    if a.extrapolate:
        with open(a.extrapolate[0]) as f:
            shared = json.load(f)
        with open(a.extrapolate[1]) as f:
            baseline = json.load(f)
        x = extrapolate(shared, baseline, nodes=a.to_nodes, dataset_bytes=a.dataset_tb * 1e12,
                        shard_bytes=a.shard_mib * 2**20, sample_bytes=a.x_sample_kib * 1024,
                        epoch_s=a.epoch_hours * 3600)
        _print_extrapolation(x)
        print(json.dumps(x), flush=True)
        return 0
    cfg = BenchConfig.quick() if a.quick else BenchConfig()
    if a.cluster:
        cfg = BenchConfig(objects=24, object_bytes=256 << 10, epochs=3, peers=False, oracle=False, throughput=False)
    if a.objects:
        cfg.objects = a.objects
    if a.object_mib:
        cfg.object_bytes = int(a.object_mib * (1 << 20))
    if a.epochs:
        cfg.epochs = a.epochs
    if a.fractions:
        cfg.fractions = [float(x) for x in a.fractions.split(",")]
    if a.seed is not None:
        cfg.seed = a.seed
    cfg.peers = not a.no_peers and not a.cluster
    cfg.oracle = not a.no_oracle
    if a.cluster:
        from ._cluster_cache import ClusterConfig

        c = ClusterConfig(nodes=a.cluster, workers=a.node_workers, shards=a.shards,
                          samples_per_shard=a.samples_per_shard, sample_bytes=int(a.sample_kib * 1024),
                          epochs=a.cluster_epochs, local_fraction=a.local_fraction,
                          shared_fraction=a.shared_fraction, slowdown_rate=a.slowdown_rate,
                          window=a.window or None, seed=cfg.seed, shared=not a.no_shared, kill_node=a.kill_node,
                          lease_timeout_s=a.lease_timeout)
        out = cluster(c, cfg)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
        summary = {k: v for k, v in out.items() if k not in ("loader", "node_cache_stats")}
        print(json.dumps(summary), flush=True)
        return 0
    out = run(cfg)
    text = json.dumps(out, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
