"""`datapipe index` against the floor of reading the shards once, and opening the index of
10^4 shards.

    PYTHONPATH=$PWD python -m benchmarks.bench_tar_index [--shards 8] [--shard-mb 32] [--sample-kb 100]

1. Writes ``--shards`` tar shards with ``webdataset.ShardWriter`` (samples of about
   ``--sample-kb`` KB: a jpg-like blob, a caption, a class), then, with the page cache
   warm and then cold (the shards' pages dropped with ``POSIX_FADV_DONTNEED`` before each
   run, so reads come from the disk): the floor (every shard read once into one reused
   buffer, one process, in order), and ``index_shards`` with the default workers and with
   one. Prints each one's MB/s and the ratio floor time / index time (the target: >= 0.8).
2. Writes a synthetic index of 10^4 shards (``--samples-per-shard`` rows each; the shards
   themselves do not exist, opening does not read them) and prints the median of five
   ``open_index`` calls (the target: under a second).

Prints one ``RESULT {json}`` line at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def _write_shards(root: str, shards: int, shard_mb: int, sample_kb: int) -> list[str]:
    import webdataset as wds

    per_shard = max(1, shard_mb * 1024 // sample_kb)
    with wds.ShardWriter(os.path.join(root, "shard-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for i in range(shards * per_shard):
            w.write({"__key__": f"s{i:08d}", "jpg": os.urandom(sample_kb * 1024), "txt": f"caption {i}".encode(),
                     "cls": str(i % 1000).encode()})
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".tar"))


def _read_once(paths: list[str]) -> float:
    """Every shard read once into memory, in order, into one reused buffer (the strict
    floor: no fresh memory per shard, nothing done with the bytes)."""
    buf = bytearray(max(os.path.getsize(p) for p in paths))
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            view, got = memoryview(buf)[:size], 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
    return time.perf_counter() - t0


def _evict(paths: list[str]) -> None:
    """Drop the shards' pages from the page cache (POSIX_FADV_DONTNEED on clean pages of
    these files only), so that the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _synthetic_index(dest: str, shards: int, per_shard: int) -> None:
    from datapipe.format import SampleRecords, ShardRecord
    from datapipe.format.index import TAR_INDEX
    from datapipe.publish import write_index
    from datapipe.storage import open_store

    size = per_shard * 2048 + 10240
    records = [ShardRecord(f"/nonexistent/shards/shard-{i:06d}.tar", size, per_shard, f"xxh3_64:{i:016x}", size)
               for i in range(shards)]

    def samples():
        for i in range(shards):
            yield SampleRecords([f"s{i:06d}_{j:04d}" for j in range(per_shard)], [j * 2048 for j in range(per_shard)],
                                [2048] * per_shard, [f"xxh3_64:{j:016x}" for j in range(per_shard)])

    write_index(open_store(dest), records, samples(), "none", ["jpg", "txt"], extra={"origin": TAR_INDEX})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mb", type=int, default=32)
    ap.add_argument("--sample-kb", type=int, default=100)
    ap.add_argument("--index-shards", type=int, default=10_000)
    ap.add_argument("--samples-per-shard", type=int, default=100)
    a = ap.parse_args()

    from datapipe import index_shards
    from datapipe.dataset import open_index

    root = tempfile.mkdtemp(prefix="bench-tar-index-")
    try:
        src = os.path.join(root, "shards")
        os.makedirs(src)
        paths = _write_shards(src, a.shards, a.shard_mb, a.sample_kb)
        total = sum(os.path.getsize(p) for p in paths)
        mb = total / 1e6
        load = os.getloadavg()[0]
        print(f"{len(paths)} shards, {mb:,.1f} MB; {os.cpu_count()} CPUs, load average {load:.1f} at the start")
        result: dict[str, object] = {"shards": len(paths), "bytes": total, "cpus": os.cpu_count(), "load": load}
        for cache in ("warm", "cold"):
            def prepare(cache: str = cache) -> None:
                if cache == "cold":
                    _evict(paths)
                else:
                    _read_once(paths)

            floors = []
            for _ in range(3):
                prepare()
                floors.append(_read_once(paths))
            floor = min(floors)
            print(f"  page cache {cache}: floor (each shard read once into one reused buffer, 1 process): "
                  f"{floor:.3f} s, {mb / floor:,.0f} MB/s")
            result[f"{cache}_floor_s"] = floor
            for label, workers in (("default workers", None), ("1 worker", 1)):
                times = []
                for k in range(3):
                    prepare()
                    t0 = time.perf_counter()
                    index_shards(paths, os.path.join(root, f"ix-{cache}-{workers}-{k}"), workers=workers)
                    times.append(time.perf_counter() - t0)
                t = min(times)
                print(f"    index_shards ({label}): {t:.3f} s, {mb / t:,.0f} MB/s, {floor / t:.2f} x the floor")
                result[f"{cache}_index_s_{label.replace(' ', '_')}"] = t
                result[f"{cache}_ratio_{label.replace(' ', '_')}"] = floor / t

        big = os.path.join(root, "ix-synthetic")
        _synthetic_index(big, a.index_shards, a.samples_per_shard)
        opens = []
        for _ in range(5):
            t0 = time.perf_counter()
            ix = open_index(big)
            opens.append(time.perf_counter() - t0)
        median = statistics.median(opens)
        print(f"open_index of {ix.num_shards:,} shards / {ix.num_samples:,} samples: median {median:.3f} s "
              f"of 5 (min {min(opens):.3f} s)")
        result.update(open_index_shards=ix.num_shards, open_index_median_s=median)
        print("RESULT " + json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
