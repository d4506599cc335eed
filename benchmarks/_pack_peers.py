"""One measured packing run per process: the floor (reading every input file once),
``datapipe.pack`` and the peers (webdataset ``ShardWriter``, MosaicML ``MDSWriter``, LitData
``optimize()``). ``bench_pack`` starts ``python -m benchmarks._pack_peers SYSTEM SRC DEST ...``
once per measurement, so no two systems share an interpreter, imports or allocator state;
this module prints one ``RESULT {json}`` line.

Every system's clock starts after its imports (importing ``streaming`` alone takes seconds
because it pulls in ``transformers``) and includes finding the input files, because every
packer has to list them. The floor lists them before its clock starts: it is the strict
"read every file once" bound."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

SYSTEMS = {
    "floor-1p": "floor: read all files, 1 process",
    "floor-1p-bytes": "floor: read() to new bytes, 1 proc",
    "floor-2p": "floor: read all files, 2 processes",
    "datapipe": "datapipe.pack",
    "datapipe-zstd": "datapipe.pack zstd",
    "webdataset": "webdataset ShardWriter",
    "mds": "streaming MDSWriter",
    "litdata": "litdata optimize()",
}
FLOORS = ("floor-1p", "floor-1p-bytes", "floor-2p")
PEERS = ("webdataset", "mds", "litdata")
OURS = ("datapipe", "datapipe-zstd")

Sample = tuple[str, list[tuple[str, str]]]  # (key, [(field, path), ...])


# --- input, the same for every peer -----------------------------------------------------


def list_samples(root: str) -> list[Sample]:
    """Group the files under ``root`` into samples by WebDataset's key rule (the key is the
    relative path up to the first dot of the file name), sorted by key, as datapipe does."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.startswith(".") or "." not in name:
                continue
            stem, field = name.split(".", 1)
            key = stem if rel_dir == "." else f"{rel_dir}/{stem}"
            groups.setdefault(key, []).append((field, os.path.join(dirpath, name)))
    return [(k, sorted(groups[k])) for k in sorted(groups)]


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_fields(files: list[tuple[str, str]]) -> dict[str, bytes]:
    return {field: read_bytes(path) for field, path in files}


def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


# --- the floor ---------------------------------------------------------------------------


def _read_into(paths: list[str]) -> int:
    # One buffer reused for every file: first-touch page faults on fresh memory are slow on
    # this machine, and the floor should be the cheapest way to read each file once.
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [view])
                total += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
    return total


def _read_new_bytes(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            total += len(f.readall())
    return total


def _floor(src: str, variant: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    samples = list_samples(src)
    list_s = time.perf_counter() - t0
    paths = [p for _, files in samples for _, p in files]
    t0 = time.perf_counter()
    if variant == "floor-2p":
        import multiprocessing as mp

        # fork: the children start with the list already in memory, so the clock holds
        # process start-up and reading, nothing else.
        half = len(paths) // 2
        with mp.get_context("fork").Pool(2) as pool:
            nbytes = sum(pool.map(_read_into, [paths[:half], paths[half:]]))
    elif variant == "floor-1p-bytes":
        nbytes = _read_new_bytes(paths)
    else:
        nbytes = _read_into(paths)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "list_seconds": list_s, "samples": len(samples), "files": len(paths),
            "input_bytes": nbytes, "out_bytes": 0}


# --- datapipe ----------------------------------------------------------------------------


def _datapipe(src: str, dest: str, shard_bytes: int, workers: int | None, compression: str | None) -> dict[str, Any]:
    import datapipe

    t0 = time.perf_counter()
    res = datapipe.pack(src, dest, shard_bytes=shard_bytes, compression=compression, workers=workers,
                        progress=False)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": res.samples, "shards": res.shards, "out_bytes": res.stored_bytes,
            "pack_reported_seconds": res.seconds}


# --- webdataset ----------------------------------------------------------------------------


def _webdataset(src: str, dest: str, shard_bytes: int) -> dict[str, Any]:
    import webdataset as wds

    os.makedirs(dest, exist_ok=True)
    t0 = time.perf_counter()
    n = 0
    with wds.ShardWriter(os.path.join(dest, "shard-%06d.tar"), maxcount=10**9, maxsize=shard_bytes,
                         verbose=0) as sink:
        for key, files in list_samples(src):
            sample: dict[str, Any] = {"__key__": key}
            sample.update(read_fields(files))
            sink.write(sample)
            n += 1
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": n, "shards": len(os.listdir(dest)), "out_bytes": _tree_bytes(dest)}


# --- MosaicML streaming --------------------------------------------------------------------


def _import_streaming() -> Any:
    """``import streaming`` imports torchvision (``streaming.vision.base``: ``VisionDataset``
    and ``to_tensor``; ``streaming.vision.convert.cifar10``: ``CIFAR10``), and PyPI's
    torchvision fails to import beside this torch build ("operator torchvision::nms does
    not exist"). Packing with ``MDSWriter`` uses none of it, so, in this adapter only, a
    stand-in module offers just those three names. It carries a ``__spec__`` because
    ``transformers`` (imported by ``streaming.base.dataloader``) probes it with
    ``importlib.util.find_spec``."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # the broken install raises RuntimeError, a missing one ImportError
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]

        def stub(name: str) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = m
            return m

        tv, datasets = stub("torchvision"), stub("torchvision.datasets")
        transforms, functional = stub("torchvision.transforms"), stub("torchvision.transforms.functional")

        class VisionDataset:  # base class of StreamingVisionDataset, never used when packing
            pass

        class CIFAR10(VisionDataset):
            pass

        def to_tensor(x: Any) -> Any:
            raise NotImplementedError("torchvision stand-in (benchmarks._pack_peers): to_tensor is unavailable")

        datasets.VisionDataset, datasets.CIFAR10 = VisionDataset, CIFAR10
        functional.to_tensor = to_tensor
        tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    import streaming

    return streaming


def _mds(src: str, dest: str, shard_bytes: int) -> dict[str, Any]:
    streaming = _import_streaming()
    # The cheapest typed mapping of our fields: jpg as raw bytes, cls as an int, the JSON
    # caption as a str (the "json" column type would parse and re-dump it); the key as a str
    # so that MDS stores what the other formats store.
    columns = {"key": "str", "jpg": "bytes", "cls": "int", "json": "str"}
    t0 = time.perf_counter()
    n = 0
    with streaming.MDSWriter(out=dest, columns=columns, compression=None, size_limit=shard_bytes) as sink:
        for key, files in list_samples(src):
            f = read_fields(files)
            sink.write({"key": key, "jpg": f["jpg"], "cls": int(f["cls"]), "json": f["json"].decode()})
            n += 1
    seconds = time.perf_counter() - t0
    shards = sum(1 for x in os.listdir(dest) if x.endswith(".mds"))
    return {"seconds": seconds, "samples": n, "shards": shards, "out_bytes": _tree_bytes(dest)}


# --- LitData --------------------------------------------------------------------------------


def litdata_item(item: Sample) -> dict[str, Any]:
    """LitData's per-item function (module level: LitData's workers are spawned)."""
    key, files = item
    f = read_fields(files)
    return {"key": key, "jpg": f["jpg"], "cls": int(f["cls"]), "json": f["json"].decode()}


def _litdata(src: str, dest: str, shard_bytes: int, workers: int, workdir: str) -> dict[str, Any]:
    # LitData stages chunks under a cache folder (default ~/.lightning or /cache); keep it in
    # the benchmark's work directory, fresh per run.
    os.environ.setdefault("DATA_OPTIMIZER_CACHE_FOLDER", os.path.join(workdir, "litdata-cache", "chunks"))
    os.environ.setdefault("DATA_OPTIMIZER_DATA_CACHE_FOLDER", os.path.join(workdir, "litdata-cache", "data"))
    from litdata import optimize

    t0 = time.perf_counter()
    inputs = list_samples(src)
    optimize(fn=litdata_item, inputs=inputs, output_dir=dest, chunk_bytes=shard_bytes, num_workers=workers,
             verbose=False)
    seconds = time.perf_counter() - t0
    shards = sum(1 for x in os.listdir(dest) if x.endswith(".bin"))
    with open(os.path.join(dest, "index.json")) as fh:
        n = sum(c.get("chunk_size", 0) for c in json.load(fh).get("chunks", []))
    return {"seconds": seconds, "samples": n, "shards": shards, "out_bytes": _tree_bytes(dest)}


# --- entry point ----------------------------------------------------------------------------


def measure(system: str, src: str, dest: str, shard_bytes: int, workers: int | None, workdir: str) -> dict[str, Any]:
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "floor-1p": lambda: _floor(src, "floor-1p"),
        "floor-1p-bytes": lambda: _floor(src, "floor-1p-bytes"),
        "floor-2p": lambda: _floor(src, "floor-2p"),
        "datapipe": lambda: _datapipe(src, dest, shard_bytes, workers, None),
        "datapipe-zstd": lambda: _datapipe(src, dest, shard_bytes, workers, "zstd"),
        "webdataset": lambda: _webdataset(src, dest, shard_bytes),
        "mds": lambda: _mds(src, dest, shard_bytes),
        "litdata": lambda: _litdata(src, dest, shard_bytes, workers or 2, workdir),
    }
    if system not in runners:
        raise SystemExit(f"unknown system {system!r}; one of {sorted(runners)}")
    _preload(system)
    out = runners[system]()
    # Datapipe fsyncs what it publishes; the peers leave dirty pages behind. The time to
    # flush them is reported beside each figure, so neither view hides the other.
    t0 = time.perf_counter()
    os.sync()
    out["sync_seconds"] = time.perf_counter() - t0
    return out


def _preload(system: str) -> None:
    """Import before the clock starts (this also pulls the libraries into the page cache
    after a cache drop, so spawned workers do not read them from disk on the clock)."""
    if system.startswith("datapipe"):
        import datapipe
        import datapipe.pack.packer  # noqa: F401
    elif system == "webdataset":
        import webdataset  # noqa: F401
    elif system == "mds":
        _import_streaming()
    elif system == "litdata":
        import litdata  # noqa: F401


def main() -> None:
    ap = argparse.ArgumentParser(description="one measured packing run (used by benchmarks.bench_pack)")
    ap.add_argument("system", choices=sorted(SYSTEMS))
    ap.add_argument("src")
    ap.add_argument("dest")
    ap.add_argument("--shard-bytes", type=int, required=True)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    out = measure(a.system, a.src, a.dest, a.shard_bytes, a.workers, a.workdir)
    sys.stdout.flush()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
