"""Packing benchmark (issue 2): ``datapipe.pack`` against webdataset's ``ShardWriter``,
MosaicML's ``MDSWriter`` and LitData's ``optimize()``, and against the floor: the least a
packer of these files into durable shards must do. Target: datapipe <= 1.2x the floor and
faster than every peer.

Every system runs with the same number of processes N (``--workers``; default datapipe's
own default, 2 x the cores): datapipe ``workers=N``, LitData ``num_workers=N``, webdataset and
MosaicML writing N slices in N processes, and the floor (the ratio's base, ``floor-np-pack``)
listing the files on its clock, then reading 1/N of them in each of N processes, each with
the next files opened ahead and the kernel asked to read them (``POSIX_FADV_WILLNEED``), as
datapipe's workers read (a floor that waited on one file at a time would not bound a packer
that does not: from a cold page cache that is most of the difference), and writing what it
read as a tar lays it out (header, data, padding: the bytes of an uncompressed shard) into
files of the shard limit, each fsync'd (datapipe's time includes making its shards durable;
the peers' does not, their ``+sync`` column does). A floor that leaves out the listing, the
tar's bytes or the writes and fsyncs does less than a packer must, and is no floor of one:
those are listed for reference (``floor-np``: N processes reading every file once, listed
before the clock; the same without read-ahead; one process; ``floor-np-write``: the reads
written into one fsync'd file per process, no tar bytes, listed before the clock), with
the ratio to the read floor beside the verdict. The ratio's row says how many processes
datapipe packed with; when they are not the floor's, the verdict says so.

    python -m benchmarks.bench_pack            # 30,000 samples x 3 files
    python -m benchmarks.bench_pack --quick    # 3,000 samples, best of 3

Each measurement runs in its own process (``benchmarks._pack_peers``) into a fresh
destination, after the page cache is dropped (as root) or, where that is refused, after an
untimed read pass that warms it; the output says which. Systems take turns round by round
and the best time of each is reported, because the machine is shared and noisy.
``run(config)`` returns every figure as JSON-able data."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from benchmarks._pack_peers import FLOORS, OURS, PEERS, SYSTEMS, list_samples
from tools.corpus import generate_corpus

__all__ = ["PackBenchConfig", "run", "format_table", "main"]

DEFAULT_ORDER = ("floor-np-pack", "floor-np", "floor-np-plain", "floor-np-write", "floor-1p", "datapipe",
                 "datapipe-zstd", "webdataset", "mds", "litdata")
#: the ratio column divides by this one: N processes listing, reading each file once and
#: writing its tar bytes into fsync'd files of the shard limit
BASE = "floor-np-pack"
READ_FLOOR = "floor-np"  # N processes reading each file once, the listing off the clock
TARGET_RATIO = 1.2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class PackBenchConfig:
    samples: int = 30_000
    quick: bool = False  # 3,000 samples, 8 MiB shards, best of 3
    workers: int | None = None  # processes for every system; None: datapipe.pack's default, 2 x the cores
    workdir: str = "/tmp/datapipe-bench-pack"
    repeats: int | None = None  # best of; default 2, or 3 with quick
    shard_mb: float | None = None  # shard / chunk limit for every system; default 64, or 8 with quick
    seed: int = 0
    mean_bytes: int = 16384
    systems: tuple[str, ...] = DEFAULT_ORDER
    cache: str = "auto"  # "drop" | "warm" | "auto" (drop if allowed, else warm)
    timeout_s: float = 900.0  # one measurement

    def resolved(self) -> PackBenchConfig:
        c = PackBenchConfig(**asdict(self))
        if c.quick and c.samples == PackBenchConfig.samples:
            c.samples = 3_000
        c.repeats = c.repeats or (3 if c.quick else 2)
        c.shard_mb = c.shard_mb or (8.0 if c.quick else 64.0)
        c.workers = c.workers or 2 * (os.cpu_count() or 1)  # datapipe.pack's own default
        c.systems = tuple(c.systems)
        unknown = [s for s in c.systems if s not in SYSTEMS]
        if unknown:
            raise ValueError(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
        if c.cache not in ("auto", "drop", "warm"):
            raise ValueError(f"cache must be auto, drop or warm, not {c.cache!r}")
        if c.samples <= 0 or c.repeats <= 0 or c.shard_mb <= 0:
            raise ValueError("samples, repeats and shard_mb must be positive")
        return c


# --- corpus -------------------------------------------------------------------------------


def ensure_corpus(c: PackBenchConfig) -> dict[str, Any]:
    """Generate the corpus, or reuse it when a finished one with the same parameters is
    there (``corpus.json`` is written beside the data only after generation completes)."""
    params = {"samples": c.samples, "seed": c.seed, "mean_bytes": c.mean_bytes}
    home = os.path.join(c.workdir, f"corpus-n{c.samples}-s{c.seed}-m{c.mean_bytes}")
    data, marker = os.path.join(home, "data"), os.path.join(home, "corpus.json")
    try:
        with open(marker) as f:
            info = json.load(f)
        if info.get("params") == params and os.path.isdir(data):
            return {**info, "path": data, "generated": False}
    except (OSError, ValueError):
        pass
    shutil.rmtree(home, ignore_errors=True)
    os.makedirs(home)
    t0 = time.perf_counter()
    nbytes = generate_corpus(data, c.samples, seed=c.seed, mean_bytes=c.mean_bytes, progress=False)
    info = {"params": params, "bytes": nbytes, "files": 3 * c.samples, "gen_seconds": time.perf_counter() - t0}
    with open(marker + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(marker + ".tmp", marker)
    return {**info, "path": data, "generated": True}


# --- page cache ---------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Drop clean pages, dentries and inodes; False where that is refused (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm_page_cache(src: str) -> None:
    for _, files in list_samples(src):
        for _, p in files:
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass


def prepare_cache(mode: str, src: str) -> str:
    if mode in ("auto", "drop") and drop_page_cache():
        return "drop"
    if mode == "drop":
        raise PermissionError("cannot write /proc/sys/vm/drop_caches (run as root, or use --cache warm)")
    warm_page_cache(src)
    return "warm"


# --- one measurement ----------------------------------------------------------------------


def measure_once(system: str, src: str, c: PackBenchConfig, tag: str) -> dict[str, Any]:
    dest = os.path.join(c.workdir, "out", f"{system}-{tag}")
    scratch = os.path.join(c.workdir, "scratch", f"{system}-{tag}")
    for p in (dest, scratch):
        shutil.rmtree(p, ignore_errors=True)
    os.makedirs(scratch)
    cache = prepare_cache(c.cache, src)
    cmd = [sys.executable, "-m", "benchmarks._pack_peers", system, src, dest,
           "--shard-bytes", str(int(c.shard_mb * 2**20)), "--workdir", scratch, "--workers", str(c.workers)]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=c.timeout_s)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {c.timeout_s:.0f} s", -1
    wall = time.perf_counter() - t0
    result: dict[str, Any] = {"cache": cache, "load_before": load_before, "load_after": os.getloadavg()[0],
                              "process_wall_s": wall}
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if rc != 0 or line is None:
        tail = (err or out).strip().splitlines()[-6:]
        result["error"] = f"exit {rc}: " + " | ".join(tail)
    else:
        result.update(json.loads(line[len("RESULT "):]))
    for p in (dest, scratch):
        shutil.rmtree(p, ignore_errors=True)
    return result


# --- the whole run --------------------------------------------------------------------------


def run(config: PackBenchConfig | dict[str, Any] | None = None, log: Any = None) -> dict[str, Any]:
    """Generate (or reuse) the corpus, measure every system ``repeats`` times round-robin,
    and return every figure (JSON-able). ``log`` is a callable for progress lines."""
    if isinstance(config, dict):
        known = {f.name for f in fields(PackBenchConfig)}
        bad = set(config) - known
        if bad:
            raise ValueError(f"unknown config keys {sorted(bad)}")
        config = PackBenchConfig(**config)
    c = (config or PackBenchConfig()).resolved()
    say = log or (lambda s: None)
    os.makedirs(c.workdir, exist_ok=True)
    corpus = ensure_corpus(c)
    src = corpus["path"]
    say(f"corpus: {c.samples} samples, {corpus['bytes'] / 1e6:.1f} MB at {src}"
        f" ({'generated' if corpus['generated'] else 'reused'})")

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in c.systems}
    for r in range(c.repeats):
        for s in c.systems:
            res = measure_once(s, src, c, f"r{r}")
            runs[s].append(res)
            shown = res.get("error") or f"{res['seconds']:.2f} s"
            say(f"round {r + 1}/{c.repeats} {s:15s} {shown} (load {res['load_before']:.1f}, cache {res['cache']})")

    systems: dict[str, dict[str, Any]] = {}
    for s, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        label = SYSTEMS[s].replace("N processes", f"{c.workers} processes")
        entry: dict[str, Any] = {"label": label, "runs": rs, "errors": [x["error"] for x in rs if "error" in x]}
        if ok:
            best = min(ok, key=lambda x: x["seconds"])
            entry.update(best=best["seconds"], best_incl_sync=min(x["seconds"] + x["sync_seconds"] for x in ok),
                         samples=best["samples"], out_bytes=best.get("out_bytes", 0), shards=best.get("shards"),
                         all_seconds=[x["seconds"] for x in ok],
                         complete=all(x["samples"] == c.samples for x in ok))
            if "list_seconds" in best:
                entry["list_seconds"] = min(x["list_seconds"] for x in ok)
            entry["processes"] = best.get("processes", 1)
            entry["settings"] = best.get("settings", {})
        systems[s] = entry

    # the ratio's base: the pack floor, or (when a run leaves it out) the first floor it measured
    base = next((f for f in (BASE, *FLOORS) if "best" in systems.get(f, {})), BASE)
    floor = systems.get(base, {}).get("best")
    peer_best = [systems[p]["best"] for p in PEERS if p in systems and "best" in systems[p]]
    peer_synced = [systems[p]["best_incl_sync"] for p in PEERS if p in systems and "best" in systems[p]]
    rows = []
    for s, e in systems.items():
        row: dict[str, Any] = {"system": s, "label": e["label"], "seconds": e.get("best"),
                               "seconds_incl_sync": e.get("best_incl_sync"),
                               "runs": len(e["all_seconds"]) if "best" in e else 0,
                               "processes": e.get("processes"), "settings": e.get("settings"),
                               "error": e["errors"][0] if e["errors"] else None}
        if "best" in e:
            row["samples_per_s"] = c.samples / e["best"]
            row["mb_per_s"] = corpus["bytes"] / 1e6 / e["best"]
            row["ratio_to_floor"] = e["best"] / floor if floor else None
            row["complete"] = e["complete"]
        if s in OURS:
            # "Faster than every peer" needs every peer measured; a failed peer is not a win.
            all_peers = len(peer_best) == len([p for p in PEERS if p in systems])
            row["faster_than_every_peer"] = (all_peers and bool(peer_best) and "best" in e
                                             and e["best"] < min(peer_best))
            # the same with every system's output on disk (datapipe fsyncs its own; the
            # peers' dirty pages are flushed by the os.sync() after them)
            row["faster_than_every_peer_incl_sync"] = (all_peers and bool(peer_synced) and "best" in e
                                                       and e["best_incl_sync"] < min(peer_synced))
        rows.append(row)

    dp = next((r for r in rows if r["system"] == "datapipe"), None)
    verdict = None
    if dp and dp.get("seconds") is not None and floor:
        # the ratio is to a floor with the processes datapipe used: say so when they differ
        floor_procs = systems[base].get("processes")
        write_floor = systems.get("floor-np-write", {}).get("best")
        read_floor = systems.get(READ_FLOOR, {}).get("best")
        verdict = {"ratio_to_floor": dp["ratio_to_floor"], "target_ratio": TARGET_RATIO,
                   "meets_ratio": dp["ratio_to_floor"] <= TARGET_RATIO,
                   "faster_than_every_peer": dp["faster_than_every_peer"],
                   "faster_than_every_peer_incl_sync": dp["faster_than_every_peer_incl_sync"],
                   "ratio_to_write_floor": dp["seconds"] / write_floor if write_floor else None,
                   "ratio_to_read_floor": dp["seconds"] / read_floor if read_floor else None,
                   "processes": dp["processes"], "floor_processes": floor_procs,
                   "same_processes": dp["processes"] == floor_procs}
    return {
        "config": asdict(c),
        "corpus": {k: corpus[k] for k in ("path", "bytes", "files", "generated", "gen_seconds")},
        "cache_modes": sorted({x["cache"] for rs in runs.values() for x in rs}),
        "machine": {"cpus": os.cpu_count(), "loadavg_end": list(os.getloadavg())},
        "floor_system": base,
        "systems": systems,
        "rows": rows,
        "verdict": verdict,
    }


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    corpus = report["corpus"]
    modes = report["cache_modes"]
    cache = ("page cache dropped before every run (sync; echo 3 > /proc/sys/vm/drop_caches)"
             if modes == ["drop"] else "page cache warmed by an untimed read pass before every run"
             if modes == ["warm"] else f"page cache: mixed {modes}")
    lines = [
        f"corpus: {c['samples']:,} samples x 3 files, {corpus['bytes'] / 1e6:,.1f} MB; shard limit "
        f"{c['shard_mb']:g} MiB; {c['workers']} processes for every system; best of {c['repeats']}",
        f"{cache}; {report['machine']['cpus']} CPUs, shared and noisy (load avg at end "
        f"{report['machine']['loadavg_end'][0]:.2f})",
        "",
        f"{'system':38s} {'seconds':>8s} {'+sync':>7s} {'samples/s':>10s} {'MB/s':>7s} {'x floor':>8s} "
        f"{'all runs (s)':>20s} {'procs':>5s}  faster than every peer",
    ]
    for r in report["rows"]:
        if r["seconds"] is None:
            lines.append(f"{r['label']:38s} FAILED: {r['error']}")
            continue
        runs = ", ".join(f"{x:.2f}" for x in report["systems"][r["system"]]["all_seconds"])
        beats = {True: "yes", False: "NO"}.get(r.get("faster_than_every_peer"), "")
        flag = "" if r["complete"] else "  INCOMPLETE sample count"
        ratio = "-" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}"
        lines.append(f"{r['label']:38s} {r['seconds']:8.2f} {r['seconds_incl_sync']:7.2f} {r['samples_per_s']:10,.0f} "
                     f"{r['mb_per_s']:7.1f} {ratio:>8s} {runs:>20s} {r['processes'] or 1:5d}  {beats}{flag}")
    base = report.get("floor_system", BASE)
    fl = report["systems"].get(base, {})
    if "best" in fl:
        if base == BASE:
            listing = (f"{fl['list_seconds']:.2f} s of it" if "list_seconds" in fl else "in its processes")
            held = f"whose time holds listing the files ({listing}); the read floors list before their clock"
        else:
            held = f"the pack floor not run: NOT the target's floor; listing the files, not in its time: " \
                   f"{fl.get('list_seconds', 0):.2f} s"
        lines.append(f"(x floor divides by '{fl.get('label', base)}', {held}; +sync adds the os.sync() after each run)")
    v = report["verdict"]
    if v:
        lines.append(f"datapipe.pack: {v['ratio_to_floor']:.2f}x the floor (target <= {v['target_ratio']}x: "
                     f"{'met' if v['meets_ratio'] else 'NOT met'}); faster than every peer: "
                     f"{'yes' if v['faster_than_every_peer'] else 'NO'}")
        if v.get("ratio_to_read_floor") is not None:
            lines.append(f"  {v['ratio_to_read_floor']:.2f}x the read floor (N processes reading every file once, "
                         "listed before the clock, nothing written)")
        if v.get("ratio_to_write_floor") is not None:
            lines.append(f"  {v['ratio_to_write_floor']:.2f}x the write floor (the reads, their bytes written and "
                         "fsync'd, no tar bytes, listed before the clock); with every system's output on disk (+sync), "
                         f"faster than every peer: {'yes' if v['faster_than_every_peer_incl_sync'] else 'NO'}")
        if not v.get("same_processes", True):
            lines.append(f"  (datapipe packed with {v['processes']} processes, the floor read with "
                         f"{v['floor_processes']}: the ratio is not to a floor with the same processes)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_pack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=PackBenchConfig.samples, help="corpus size (default 30000)")
    ap.add_argument("--quick", action="store_true", help="3000 samples, 8 MiB shards, best of 3")
    ap.add_argument("--workers", type=int, default=None, help="processes for every system and the floor (default: "
                    "datapipe.pack's own default, 2 x the cores)")
    ap.add_argument("--workdir", default=PackBenchConfig.workdir, help="corpus and outputs (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=None, help="best of N (default 2, 3 with --quick)")
    ap.add_argument("--shard-mb", type=float, default=None, help="shard/chunk limit, MiB (default 64, 8 with --quick)")
    ap.add_argument("--systems", default=",".join(DEFAULT_ORDER), help="comma-separated, from: " + ", ".join(SYSTEMS))
    ap.add_argument("--cache", choices=("auto", "drop", "warm"), default="auto",
                    help="drop the page cache before each run (needs root), or warm it; auto: drop if allowed")
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    a = ap.parse_args(argv)
    cfg = PackBenchConfig(samples=a.samples, quick=a.quick, workers=a.workers, workdir=a.workdir,
                          repeats=a.repeats, shard_mb=a.shard_mb, cache=a.cache,
                          systems=tuple(s.strip() for s in a.systems.split(",") if s.strip()))
    try:
        report = run(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        ap.error(str(e))
    print(format_table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
