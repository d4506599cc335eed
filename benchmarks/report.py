"""Every benchmark in one run, side by side with the peers and the machine's floors:

    python -m benchmarks.report                 # default corpus and the whole loader sweep
    python -m benchmarks.report --samples 5000  # smaller corpus
    python -m benchmarks.report --quick         # a smoke run of every part, a few minutes
    python -m benchmarks.report --parts loader --workdir /tmp/dp-bench   # the issue-12 sweep alone, formats kept

Writes ``benchmarks/results/`` (or ``--out``): ``results.json`` (every figure), ``TABLES.md`` (tables
with ratios to the floors and peers), and PNG plots: pack and read throughput per system, hit
rate and bytes from cold against cache size per policy, the loader sweep (samples/s per cell and
system in each mode: the first epoch of a new dataset, non-persistent and persistent DataLoader
workers, steady state; with the start-up part, a 10^7-sample dataset of about 10 GB in the
workdir unless --quick), checkpoint stall and total time
against state size per system. Each part runs the module of the same name
(``benchmarks.bench_pack`` ...), which can also be run alone. ``REPORT.md`` beside them is
the hand-written narrative (which run printed each figure, what it means): a run never writes it,
it links the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from . import plots, tables

PARTS = ("pack", "read", "loader", "cache", "checkpoint")
OPTIONAL_PARTS = ("gpu",)  # only when asked (--parts ...,gpu): batches into accelerator memory
HERE = os.path.dirname(os.path.abspath(__file__))
#: what a run writes into its output folder besides the plots (never REPORT.md: it is written by hand)
RESULTS, TABLES = "results.json", "TABLES.md"


def machine() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_GiB": mem, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": list(os.getloadavg())}


def run_pack(samples: int, quick: bool, work: str) -> dict[str, Any]:
    from .bench_pack import PackBenchConfig, run

    cfg = PackBenchConfig(samples=samples, quick=False, workdir=os.path.join(work, "pack"),
                          repeats=1 if quick else 2, shard_mb=8.0 if quick else 64.0)
    return run(cfg, log=lambda s: print("  " + s, flush=True))


def run_read(samples: int, quick: bool, work: str) -> dict[str, Any]:
    from .bench_read import QUICK, run

    cfg: dict[str, Any] = {"samples": samples, "workdir": os.path.join(work, "read")}
    if quick:
        cfg.update({k: v for k, v in QUICK.items() if k != "samples"}, warm_epochs=2)
    return run(cfg)


def run_loader(quick: bool, work: str, cells: list[str] | None) -> dict[str, Any]:
    from .bench_loader import QUICK, run

    cfg: dict[str, Any] = dict(QUICK) if quick else {}
    if cells:
        cfg["cells"] = cells
    cfg["workdir"] = os.path.join(work, "loader")
    return run(cfg, log=lambda s: print("  " + s, flush=True))


def run_gpu(quick: bool, work: str) -> dict[str, Any]:
    from .bench_gpu import QUICK, run

    cfg: dict[str, Any] = dict(QUICK) if quick else {}
    cfg["workdir"] = os.path.join(work, "gpu")
    return run(cfg)


def run_cache(quick: bool, work: str) -> dict[str, Any]:
    from .bench_cache import BenchConfig, run

    cfg = BenchConfig.quick() if quick else BenchConfig(objects=48, epochs=3)
    os.makedirs(work, exist_ok=True)
    cfg.workdir = tempfile.mkdtemp(prefix="cache-", dir=work)  # fresh: its objects depend on the config
    return run(cfg)


def run_checkpoint(quick: bool, work: str) -> dict[str, Any]:
    from .bench_checkpoint import run

    sizes = [4, 16] if quick else [16, 32, 64]  # Linear(1024, 1024) layers: 12.6 MB of params+Adam each
    out = {}
    for layers in sizes:
        print(f"  checkpoint: {layers} x Linear(1024, 1024) with Adam", flush=True)
        d = os.path.join(work, f"ckpt-{layers}")
        os.makedirs(d, exist_ok=True)
        out[str(layers)] = run({"layers": layers, "width": 1024, "saves": 3, "dir": d})
    return out


def write_outputs(report: dict[str, Any], out: str) -> str:
    """Write a run's figures (``results.json``), plots and tables (``TABLES.md``) into ``out``;
    returns the tables. ``REPORT.md`` there is left as it is: it is the narrative, and links them."""
    with open(os.path.join(out, RESULTS), "w") as f:
        json.dump(report, f, indent=1, default=str)
    images = plots.write_all(report, out)
    md = tables.report_markdown(report, images)
    with open(os.path.join(out, TABLES), "w") as f:
        f.write(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20_000, help="corpus size for pack and read (default 20000)")
    ap.add_argument("--quick", action="store_true", help="small sizes everywhere: a smoke run")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} "
                    f"(default all of them), plus {','.join(OPTIONAL_PARTS)} where a CUDA device is present")
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="where results go (default benchmarks/results)")
    ap.add_argument("--workdir", default=None, help="scratch space for corpora and formats (default: a temp dir; "
                    "give one to reuse the prepared formats in later runs)")
    ap.add_argument("--cells", default=None, help="comma-separated cells of the loader sweep (default: all; "
                    "see python -m benchmarks.bench_loader --help)")
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = sorted(set(parts) - set(PARTS) - set(OPTIONAL_PARTS))
    if bad:
        ap.error(f"unknown parts {bad}; choose from {PARTS + OPTIONAL_PARTS}")
    samples = 3000 if a.quick and a.samples == 20_000 else a.samples
    work = a.workdir or tempfile.mkdtemp(prefix="datapipe-report-")
    os.makedirs(a.out, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.report"]
                            + [shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])]),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "samples": samples,
        "quick": a.quick,
        "seconds": {},
    }
    runners = {"pack": lambda: run_pack(samples, a.quick, work), "read": lambda: run_read(samples, a.quick, work),
               "loader": lambda: run_loader(a.quick, work, [c for c in (a.cells or "").split(",") if c.strip()]),
               "cache": lambda: run_cache(a.quick, work), "checkpoint": lambda: run_checkpoint(a.quick, work),
               "gpu": lambda: run_gpu(a.quick, work)}
    for part in parts:
        print(f"== {part}", flush=True)
        t0 = time.perf_counter()
        try:
            report[part] = runners[part]()
        except Exception as e:  # one part failing must not lose the others' figures
            report[part] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {part} FAILED: {e}", flush=True)
        report["seconds"][part] = round(time.perf_counter() - t0, 1)
        with open(os.path.join(a.out, RESULTS), "w") as f:  # each part's figures kept as it ends
            json.dump(report, f, indent=1, default=str)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    md = write_outputs(report, a.out)
    print(md)
    print(f"wrote {a.out}/{RESULTS}, {TABLES} and the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
