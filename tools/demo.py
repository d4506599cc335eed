"""The main job end to end on an embedded default: ``python -m tools.demo``.

Generates a small corpus of small files, packs it into shards on a cold tier (a loopback
S3 endpoint, or a local directory with --no-s3), verifies them, reads samples back, then
streams two shuffled epochs through a TieredCache with StreamingDataset and a DataLoader
with workers into a tiny torch model while CheckpointWriter saves every few steps, stops
the run mid-epoch as a crash would, resumes from the latest checkpoint with the loader's
state, and checks that every sample of the interrupted epoch was trained on exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from typing import Any

import datapipe
from tools.corpus import generate_corpus


def _step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(workdir: str, samples: int, use_s3: bool) -> dict[str, Any]:
    """Run the demo in ``workdir``; return its summary (what ``--json`` writes)."""
    summary: dict[str, Any] = {}
    corpus = os.path.join(workdir, "corpus")
    _step(f"generate {samples} samples of small files in {corpus}")
    shutil.rmtree(corpus, ignore_errors=True)
    t = time.perf_counter()
    nbytes = generate_corpus(corpus, samples, seed=0, mean_bytes=8192, progress=True)
    print(f"{samples * 3} files, {nbytes / 1e6:.1f} MB in {time.perf_counter() - t:.1f} s")

    server = None
    storage_options = None
    if use_s3:
        from tools.s3_endpoint import LocalS3

        server = LocalS3().start()
        root = server.create_bucket("datapipe-demo")
        storage_options = server.storage_options
        print(f"cold tier: moto S3 on {server.endpoint_url}, bucket {root}")
    else:
        root = os.path.join(workdir, "cold")
        shutil.rmtree(root, ignore_errors=True)
        print(f"cold tier: local directory {root}")
    try:
        dest = f"{root}/shards"
        _step(f"pack into {dest}")
        r = datapipe.pack(corpus, dest, shard_bytes=4 << 20, compression="zstd", storage_options=storage_options,
                          overwrite=True, progress=True)
        print(r.summary())
        summary["pack"] = {"samples": r.samples, "shards": r.shards, "seconds": round(r.seconds, 2)}

        _step("verify every shard against the index")
        v = datapipe.verify_dataset(dest, storage_options=storage_options, progress=True)
        print(("OK: " if v.ok else "FAILED: ") + f"{v.shards} shards, {v.samples} samples, {v.bytes / 1e6:.1f} MB")
        summary["verify"] = {"ok": v.ok, "shards": v.shards, "samples": v.samples}
        if not v.ok:
            raise SystemExit(f"verify failed: {v.problems[0]}")

        _step("random access: one range read per sample")
        ds = datapipe.open_dataset(dest, storage_options)
        picks = random.Random(0).sample(range(len(ds)), 50)
        t = time.perf_counter()
        for i in picks:
            s = ds[i]
        dt = time.perf_counter() - t
        print(f"read 50 random samples in {dt * 1e3:.0f} ms; e.g. {s['__key__']}: {s['json'].decode()[:60]}")
        summary["random_access_ms_per_sample"] = round(dt / 50 * 1e3, 2)

        from tools.demo_train import train_and_resume

        summary.update(train_and_resume(dest, workdir, storage_options, _step))
    finally:
        if server is not None:
            server.stop()
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None,
                    help="where corpus, shards, cache and checkpoints go (default: a temp dir)")
    ap.add_argument("--samples", type=int, default=2000, help="corpus size (default 2000)")
    ap.add_argument("--no-s3", action="store_true", help="cold tier in a local directory instead of loopback S3")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the summary as JSON to PATH")
    a = ap.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="datapipe-demo-")
    os.makedirs(workdir, exist_ok=True)
    summary = run(workdir, a.samples, not a.no_s3)
    _step("summary")
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"(files under {workdir})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
