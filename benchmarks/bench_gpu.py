"""Batches from ``StreamingDataLoader`` into accelerator memory, by number of workers (issue 12):
16 KiB samples (bench_loader's corpus), ``batch_size=256``, ``pin_memory=True``, each batch's
byte fields copied to the device; against a floor of plain pinned host-to-device copies of the
same bytes in batch-sized pieces.

    python -m benchmarks.bench_gpu --workdir /tmp/bg                 # 40k x 16 KiB, workers 0,1,2,4,8
    python -m benchmarks.bench_gpu --quick                           # tiny, seconds (CPU is fine)

How a batch reaches the device depends on what the loader hands out: a ``Batch`` (the
shared-memory ring) moves each field's ``as_tensor()`` data (one uint8 tensor per field); the
older list-of-bytes batch is joined into one uint8 tensor per field in the main process first,
as a trainer would (the output names the path used). Without a CUDA device the copies go to
the CPU ("device": "cpu"), which is a smoke run, not a measurement of the target.

Targets (issue 12): with >= 8 cores, 8 workers deliver >= 3 GB/s of 16 KiB samples into GPU
memory and >= 3x one worker. ``run(config)`` returns every figure as JSON-able data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks.output import print_json

DEFAULTS: dict[str, Any] = {"samples": 40_000, "mean_bytes": 16384, "shard_bytes": 64 << 20, "workers": [0, 1, 2, 4, 8],
                            "batch_size": 256, "epochs": 2, "seed": 0, "workdir": None}
QUICK: dict[str, Any] = {"samples": 600, "shard_bytes": 1 << 20, "workers": [0, 1], "batch_size": 64, "epochs": 1}
GPU_GB_PER_S = 3.0
GPU_OVER_ONE_WORKER = 3.0


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _to_device(batch: Any, fields: list[str], dev: Any) -> tuple[int, str]:
    """Copy the batch's byte fields to ``dev``; returns (bytes moved, the path used)."""
    import torch

    moved = 0
    path = "Batch.as_tensor"
    for f in fields:
        col = batch[f]
        if hasattr(col, "as_tensor"):
            data, _offsets = col.as_tensor()
        else:  # a list of bytes: joined here, in the main process
            path = "list of bytes joined in the main process"
            data = torch.frombuffer(bytearray(b"".join(bytes(x) for x in col)), dtype=torch.uint8)
        data.to(dev, non_blocking=True)
        moved += data.numel()
    return moved, path


def pinned_floor(total_bytes: int, piece: int, dev: Any) -> dict[str, Any]:
    """Plain copies of one pinned host buffer of ``piece`` bytes until ``total_bytes`` moved."""
    import torch

    host = torch.empty(piece, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    host.fill_(1)
    dst = torch.empty(piece, dtype=torch.uint8, device=dev)
    dst.copy_(host, non_blocking=True)
    _sync(dev)
    t0 = time.perf_counter()
    moved = 0
    while moved < total_bytes:
        dst.copy_(host, non_blocking=True)
        moved += piece
    _sync(dev)
    dt = time.perf_counter() - t0
    return {"bytes": moved, "piece_bytes": piece, "seconds": dt, "GB_per_s": moved / dt / 1e9}


def run(config: dict[str, Any] | None = None) -> dict[str, Any]:
    from datapipe.loader import StreamingDataLoader, StreamingDataset

    from .bench_loader import _exactly_once, _keys_of, corpus, ensure_format

    cfg = {**DEFAULTS, **(config or {})}
    work = cfg["workdir"] or tempfile.mkdtemp(prefix="bench_gpu-")
    os.makedirs(work, exist_ok=True)
    dev = _device()
    try:
        c = corpus(work, cfg["samples"], cfg["mean_bytes"], cfg["seed"])
        fmt = ensure_format(work, "datapipe", {"shard_bytes": cfg["shard_bytes"]}, c, lambda s: None)
        with open(c["keys"]) as f:
            expected = set(json.load(f))
        n = len(expected)
        out: dict[str, Any] = {"config": dict(cfg), "device": str(dev), "cpus": os.cpu_count(), "samples": n,
                               "payload_MB": c["payload"] / 1e6, "runs": {}}
        if dev.type == "cuda":
            import torch

            out["device_name"] = torch.cuda.get_device_name(dev)
        out["floor"] = pinned_floor(c["payload"], cfg["batch_size"] * cfg["mean_bytes"], dev)
        fields = ["cls", "jpg", "json"]
        for w in cfg["workers"]:
            ds = StreamingDataset(fmt["dir"], seed=cfg["seed"], decode=None)
            dl = StreamingDataLoader(ds, batch_size=cfg["batch_size"], num_workers=w, pin_memory=dev.type == "cuda")
            epochs = []
            path = ""
            for epoch in range(cfg["epochs"]):
                ds.set_epoch(epoch)
                keys: list[str] = []
                moved = 0
                t0 = time.perf_counter()
                for batch in dl:
                    keys.extend(_keys_of(batch))
                    b, path = _to_device(batch, fields, dev)
                    moved += b
                _sync(dev)
                dt = time.perf_counter() - t0
                epochs.append({"seconds": dt, "bytes_to_device": moved, **_exactly_once(keys, expected)})
            best = min(epochs, key=lambda e: e["seconds"])
            run_ = {"epochs": epochs, "path": path, "pin_memory": dev.type == "cuda",
                    "samples_per_s": n / best["seconds"], "GB_per_s": best["bytes_to_device"] / best["seconds"] / 1e9}
            if not all(e["exactly_once"] for e in epochs):
                run_ = {"epochs": epochs, "error": "not exactly once"}
            else:
                run_["of_floor"] = run_["GB_per_s"] / out["floor"]["GB_per_s"]
            out["runs"][str(w)] = run_
            print(f"workers={w}: " + (run_.get("error") or f"{run_['GB_per_s']:.2f} GB/s, {run_['samples_per_s']:,.0f} "
                                      f"samples/s ({path})"), file=sys.stderr, flush=True)
        one, eight = out["runs"].get("1", {}), out["runs"].get("8", {})
        if "GB_per_s" in eight:
            met = dev.type == "cuda" and eight["GB_per_s"] >= GPU_GB_PER_S
            ratio = eight["GB_per_s"] / one["GB_per_s"] if "GB_per_s" in one else None
            out["target"] = {"eight_workers_GB_per_s": eight["GB_per_s"], "eight_over_one": ratio,
                             "status": ("NOT MEASURED" if dev.type != "cuda" or ratio is None else
                                        "MET" if met and ratio >= GPU_OVER_ONE_WORKER else "MISSED")}
        return out
    finally:
        if not cfg["workdir"]:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"tiny: {QUICK}")
    ap.add_argument("--samples", type=int)
    ap.add_argument("--workers", help="comma-separated worker counts (default 0,1,2,4,8)")
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--workdir", help="keep the corpus and shards here, reused by later runs")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    cfg: dict[str, Any] = dict(QUICK) if a.quick else {}
    if a.samples:
        cfg["samples"] = a.samples
    if a.workers:
        cfg["workers"] = [int(x) for x in a.workers.split(",")]
    if a.epochs:
        cfg["epochs"] = a.epochs
    if a.workdir:
        cfg["workdir"] = a.workdir
    print_json(run(cfg), a.out)


if __name__ == "__main__":
    main()
