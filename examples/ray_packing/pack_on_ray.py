"""Pack a folder of files on Ray, check the dataset, read it back on Ray, stream it into a
DataLoader.

    python examples/ray_packing/pack_on_ray.py                    # a local Ray of 2 CPUs, a temporary folder
    python examples/ray_packing/pack_on_ray.py --address auto     # the Ray cluster this machine is in
    python examples/ray_packing/pack_on_ray.py --src /shared/images --dest s3://bucket/train --address auto

Without ``--src`` a folder of caption-and-bytes samples is generated. ``datapipe.ray.pack`` lists
the folder's subfolders in Ray tasks, plans shards as the local packer does and writes one shard
per Ray write task; the driver commits the index and the manifest last. SRC and DEST must be
reachable from every node of the cluster (a shared filesystem, or S3).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import ray

import datapipe
import datapipe.ray


def generate(folder: str, samples: int) -> None:
    for i in range(samples):
        sub = os.path.join(folder, f"{i // 250:03d}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"{i:05d}.txt"), "w") as f:
            f.write(f"caption of sample {i}")
        with open(os.path.join(sub, f"{i:05d}.bin"), "wb") as f:
            f.write(bytes([i % 256]) * 1024)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="a folder of files (default: generated)")
    ap.add_argument("--dest", help="where the dataset goes (default: a temporary folder)")
    ap.add_argument("--samples", type=int, default=1000, help="samples to generate (default 1000)")
    ap.add_argument("--address", help="a Ray cluster to join (default: a local Ray of --cpus CPUs)")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--workdir", help="where generated files and the default DEST go (default: a temporary folder)")
    a = ap.parse_args(argv)

    workdir = a.workdir or tempfile.mkdtemp(prefix="datapipe-ray-packing-")
    src = a.src or os.path.join(workdir, "files")
    if a.src is None:
        generate(src, a.samples)
    dest = a.dest or os.path.join(workdir, "train")

    if a.address:
        ray.init(address=a.address, include_dashboard=False)
    else:
        ray.init(num_cpus=a.cpus, include_dashboard=False)
    try:
        result = datapipe.ray.pack(src, dest, shard_samples=250)  # the options of datapipe.pack
        print(result.summary())
        report = datapipe.verify_dataset(dest)  # every shard re-read against its checksums
        print(f"verified {report.shards} shards, {report.samples} samples: {'ok' if report.ok else report.problems}")
        rows = datapipe.ray.read(dest).count()  # the verified reader, as Ray read tasks
        print(f"read back on Ray: {rows} rows")
    finally:
        ray.shutdown()

    loader = datapipe.StreamingDataLoader(datapipe.StreamingDataset(dest, decode="txt", seed=0),
                                          batch_size=100, num_workers=2)
    streamed = sum(len(batch["__key__"]) for batch in loader)
    print(f"streamed {streamed} samples through StreamingDataLoader(num_workers=2)")
    return {"samples": result.samples, "shards": result.shards, "verified": report.ok, "ray_rows": rows,
            "streamed": streamed}


if __name__ == "__main__":
    main()
