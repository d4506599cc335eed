"""Benchmark of the tiered shard cache against LRU, the Belady optimum and the peers.

Cold tier: moto's S3 server on loopback. Data: synthetic shard-sized objects (equal sizes,
so the offline Belady optimum is exact). For warm budgets of 10%, 50% and 90% of the
dataset, over several epochs with a fresh seeded shuffle each, it measures hit rate and
bytes fetched from cold per epoch for: datapipe LRU (no schedule), datapipe clairvoyant
(schedule given, prefetch off so hits are comparable), the offline Belady optimum, and,
when they run here, MosaicML Streaming's ``cache_limit`` and LitData's
``max_cache_size`` on the same bytes. It also measures warm-hit read throughput against a
direct read of the same local file.

    python -m benchmarks.bench_cache --quick
    python -m benchmarks.bench_cache --objects 64 --object-mib 4 --epochs 4 --json out.json

``run(config) -> dict`` returns every figure as JSON-able data.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from datapipe.cache import TieredCache, belady_hits, lru_hits
from datapipe.storage import open_store

__all__ = ["BenchConfig", "run", "main"]


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
            for frac in cfg.fractions:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (16 objects of 256 KiB, 3 epochs)")
    ap.add_argument("--objects", type=int, help="number of objects (default 64)")
    ap.add_argument("--object-mib", type=float, help="object size in MiB (default 4)")
    ap.add_argument("--epochs", type=int, help="epochs, each a fresh shuffle (default 4)")
    ap.add_argument("--fractions", type=str, help="cache sizes as fractions, e.g. 0.1,0.5,0.9")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--no-peers", action="store_true", help="skip MosaicML Streaming and LitData")
    ap.add_argument("--json", type=str, help="write the result to this file")
    a = ap.parse_args(argv)
    cfg = BenchConfig.quick() if a.quick else BenchConfig()
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
    cfg.peers = not a.no_peers
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
