"""One measured packing run per process: the floor (reading every input file once),
``datapipe.pack`` and the peers (webdataset ``ShardWriter``, MosaicML ``MDSWriter``, LitData
``optimize()``). ``bench_pack`` starts ``python -m benchmarks._pack_peers SYSTEM SRC DEST ...``
once per measurement, so no two systems share an interpreter, imports or allocator state;
this module prints one ``RESULT {json}`` line.

Every system gets the same number of processes, ``--workers N``: datapipe's ``workers=N``,
LitData's ``num_workers=N``, the floor reads 1/N of the files in each of N processes (with
the read-ahead datapipe's workers use; ``floor-np-plain`` without it), and
webdataset and MosaicML (whose writers are single-process) write N contiguous slices of the
samples in N forked processes, as their documentation does for parallel conversion (one
``ShardWriter`` per process with its own shard names; one ``MDSWriter`` per sub-folder, then
``streaming.base.util.merge_index``). Each result states the processes it used.

Every system's clock starts after its imports (importing ``streaming`` alone takes seconds
because it pulls in ``transformers``) and includes finding the input files, because every
packer has to list them. The read floors list them before their clock starts: they are the
strict "read every file once" bound. ``floor-np-pack`` is the least a packer that makes its
shards durable must do (``bench_pack``'s ratio divides by it): the listing on its clock
(names only, as ``os.walk`` gives them; the top folders listed by the N processes, as
datapipe lists them), every file read once with the read-ahead, its bytes written as a tar
lays them out (a 512-byte header, the data, zeros to the next 512 bytes: the bytes an
uncompressed shard holds) into files of the shard limit, each fsync'd."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

SYSTEMS = {
    "floor-np": "floor: read all files, N processes",
    "floor-np-plain": "floor: no read-ahead, N processes",
    "floor-np-write": "floor: read+write+fsync, N processes",
    "floor-np-pack": "floor: list+read+tar+fsync, N procs",
    "floor-1p": "floor: read all files, 1 process",
    "floor-1p-bytes": "floor: read() to new bytes, 1 proc",
    "datapipe": "datapipe.pack",
    "datapipe-zstd": "datapipe.pack zstd",
    "webdataset": "webdataset ShardWriter",
    "mds": "streaming MDSWriter",
    "litdata": "litdata optimize()",
}
FLOORS = ("floor-np", "floor-np-plain", "floor-np-write", "floor-np-pack", "floor-1p", "floor-1p-bytes")
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


AHEAD = 32  # files opened ahead of their reads, the kernel asked to read them meanwhile (as datapipe.pack does)


def _opened_ahead(paths: list[str], ahead: int) -> Iterator[int]:
    """A descriptor of each file of ``paths`` in turn (closed once the next is asked for),
    the next ``ahead`` already open with POSIX_FADV_WILLNEED, as datapipe.pack reads them:
    from a cold page cache a process then waits on many files at once, and a floor that
    waited on one at a time would not be the floor of a packer that does not."""
    advise = getattr(os, "posix_fadvise", None) if ahead > 1 else None
    opened: list[int] = []
    it = iter(paths)
    try:
        while True:
            while len(opened) < max(ahead, 1):
                p = next(it, None)
                if p is None:
                    break
                opened.append(os.open(p, os.O_RDONLY))
                if advise is not None:
                    advise(opened[-1], 0, 0, os.POSIX_FADV_WILLNEED)
            if not opened:
                return
            fd = opened.pop(0)
            try:
                yield fd
            finally:
                os.close(fd)
    finally:
        for fd in opened:
            os.close(fd)


def _read_into(paths: list[str], ahead: int = AHEAD) -> int:
    # One buffer reused for every file: first-touch page faults on fresh memory are slow on
    # this machine, and the floor should be the cheapest way to read each file once.
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    total = 0
    for fd in _opened_ahead(paths, ahead):
        while True:
            n = os.readv(fd, [view])
            total += n
            if n < len(buf):
                break
    return total


def _read_write(part: tuple[list[str], str]) -> int:
    """The write floor of one process: each file of ``paths`` read once (with the
    read-ahead) into a 4 MiB buffer, written to the file ``out`` a buffer at a time, and
    that file fsync'd: the least I/O a packer that makes its output durable does."""
    paths, out = part
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    fill = total = 0
    sink = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for fd in _opened_ahead(paths, AHEAD):
            while True:
                if fill == len(buf):
                    os.write(sink, view)
                    fill = 0
                n = os.readv(fd, [view[fill:]])
                fill += n
                total += n
                if not n or fill < len(buf):
                    break
        os.write(sink, view[:fill])
        os.fsync(sink)
    finally:
        os.close(sink)
    return total


_ZEROS = memoryview(bytes(1024))


def _read_tar(part: tuple[list[str], str, int]) -> int:
    """The pack floor of one process: each file of ``paths`` read once (with the
    read-ahead) into a 4 MiB buffer behind a 512-byte header's room and followed by the
    zeros that pad it to 512 bytes (a tar's bytes; what a header says costs a packer
    nothing the floor should leave out), written a buffer at a time into files named
    ``<out>-<n>``, a new one once ``shard_bytes`` are written, each ended by a tar's two
    zero blocks; every file fsync'd once all are written (the cheapest order: no write
    waits on the disk). Returns the bytes read."""
    paths, out, shard_bytes = part
    buf = bytearray(1 << 22)  # a multiple of 512: a file's padding always fits after it
    view = memoryview(buf)
    fill = total = in_file = shards = 0
    sink = -1
    written: list[int] = []

    def flush() -> None:
        nonlocal fill, in_file
        os.write(sink, view[:fill])
        in_file += fill
        fill = 0

    def start() -> None:
        nonlocal sink, shards, in_file
        sink = os.open(f"{out}-{shards:03d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        shards, in_file = shards + 1, 0

    def end() -> None:
        nonlocal fill, sink
        if fill + len(_ZEROS) > len(buf):
            flush()
        view[fill : fill + len(_ZEROS)] = _ZEROS
        fill += len(_ZEROS)
        flush()
        written.append(sink)
        sink = -1

    start()
    try:
        for fd in _opened_ahead(paths, AHEAD):
            if in_file + fill >= shard_bytes:
                end()
                start()
            if fill + 512 > len(buf):
                flush()
            fill += 512
            size = 0
            while True:
                if fill == len(buf):
                    flush()
                n = os.readv(fd, [view[fill:]])
                fill += n
                size += n
                if not n or fill < len(buf):
                    break
            pad = -size % 512
            view[fill : fill + pad] = _ZEROS[:pad]
            fill += pad
            total += size
        end()
        for fd in written:
            os.fsync(fd)
    finally:
        for fd in [*written, sink] if sink >= 0 else written:
            os.close(fd)
    return total


def _list_read_tar(part: tuple[list[str], str, int]) -> tuple[int, int, int]:
    """One process of the pack floor over whole folders: their files listed (names only),
    then :func:`_read_tar`. Returns (samples, files, bytes read)."""
    folders, out, shard_bytes = part
    samples = [s for folder in folders for s in list_samples(folder)]
    paths = [p for _, files in samples for _, p in files]
    return len(samples), len(paths), _read_tar((paths, out, shard_bytes))


def _pack_floor(src: str, workers: int, dest: str, shard_bytes: int) -> dict[str, Any]:
    """``floor-np-pack``: the listing on the clock, in the N processes when the files lie in
    top folders (each process lists and packs a contiguous run of them, as datapipe's
    listing hands out folders), else here; then :func:`_read_tar` in each process."""
    import multiprocessing as mp

    os.makedirs(dest, exist_ok=True)
    t0 = time.perf_counter()
    entries = sorted(os.scandir(src), key=lambda e: e.name)
    folders = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    if len(folders) >= workers > 1 and not any(e.is_file() for e in entries):
        tasks = [(part, os.path.join(dest, f"floor-{i:03d}"), shard_bytes)
                 for i, part in enumerate(_slices(folders, workers))]
        with mp.get_context("fork").Pool(len(tasks)) as pool:
            done = pool.map(_list_read_tar, tasks)
        samples, files, nbytes = (sum(x) for x in zip(*done))
        list_s = None  # on the clock, in the processes
    else:
        listed = list_samples(src)
        list_s = time.perf_counter() - t0
        paths = [p for _, fs in listed for _, p in fs]
        tasks_p = [(part, os.path.join(dest, f"floor-{i:03d}"), shard_bytes)
                   for i, part in enumerate(_slices(paths, workers))]
        with mp.get_context("fork").Pool(len(tasks_p)) as pool:
            nbytes = sum(pool.map(_read_tar, tasks_p))
        samples, files, tasks = len(listed), len(paths), tasks_p
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"seconds": seconds, "samples": samples, "files": files, "input_bytes": nbytes,
                           "out_bytes": _tree_bytes(dest), "processes": len(tasks)}
    if list_s is not None:
        out["list_seconds"] = list_s
    return out


def _read_plain(paths: list[str]) -> int:
    return _read_into(paths, ahead=1)


def _read_new_bytes(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            total += len(f.readall())
    return total


def _slices(items: list[Any], n: int) -> list[list[Any]]:
    """``n`` contiguous slices of ``items`` of near-equal length (none empty unless items are few)."""
    n = max(1, min(n, len(items)))
    return [items[i * len(items) // n : (i + 1) * len(items) // n] for i in range(n)]


def _floor(src: str, variant: str, workers: int, dest: str = "") -> dict[str, Any]:
    t0 = time.perf_counter()
    samples = list_samples(src)
    list_s = time.perf_counter() - t0
    paths = [p for _, files in samples for _, p in files]
    procs = 1
    t0 = time.perf_counter()
    if variant == "floor-np-write":
        import multiprocessing as mp

        os.makedirs(dest, exist_ok=True)
        parts = [(part, os.path.join(dest, f"floor-{i:03d}")) for i, part in enumerate(_slices(paths, workers))]
        procs = len(parts)
        with mp.get_context("fork").Pool(procs) as pool:
            nbytes = sum(pool.map(_read_write, parts))
    elif variant in ("floor-np", "floor-np-plain") and workers > 1:
        import multiprocessing as mp

        # fork: the children start with the list already in memory, so the clock holds
        # process start-up and reading, nothing else.
        parts = _slices(paths, workers)
        procs = len(parts)
        with mp.get_context("fork").Pool(procs) as pool:
            nbytes = sum(pool.map(_read_plain if variant == "floor-np-plain" else _read_into, parts))
    elif variant == "floor-1p-bytes":
        nbytes = _read_new_bytes(paths)
    else:
        nbytes = _read_into(paths)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "list_seconds": list_s, "samples": len(samples), "files": len(paths),
            "input_bytes": nbytes, "out_bytes": _tree_bytes(dest) if dest else 0, "processes": procs}


# --- datapipe ----------------------------------------------------------------------------


def _datapipe(src: str, dest: str, shard_bytes: int, workers: int | None, compression: str | None) -> dict[str, Any]:
    import datapipe

    t0 = time.perf_counter()
    res = datapipe.pack(src, dest, shard_bytes=shard_bytes, compression=compression, workers=workers,
                        progress=False)
    seconds = time.perf_counter() - t0
    # the processes that read and wrote, as the pack reports them (a large shard is written
    # in pieces by several; the pack process itself plans and commits)
    return {"seconds": seconds, "samples": res.samples, "shards": res.shards, "out_bytes": res.stored_bytes,
            "pack_reported_seconds": res.seconds, "processes": res.workers, "settings": {"workers": workers}}


# --- webdataset ----------------------------------------------------------------------------


def _in_processes(fn: Callable[[tuple[int, list[Sample]]], int], samples: list[Sample],
                  workers: int) -> tuple[int, int]:
    """Run ``fn((i, slice_i))`` over ``workers`` contiguous slices of ``samples`` in forked
    processes (inline for one); returns (samples written, processes used)."""
    parts = list(enumerate(_slices(samples, workers)))
    if len(parts) <= 1:
        return sum(fn(p) for p in parts), 1
    import multiprocessing as mp

    with mp.get_context("fork").Pool(len(parts)) as pool:
        return sum(pool.map(fn, parts)), len(parts)


_WDS: dict[str, Any] = {}  # the running webdataset measurement's dest and shard size (read by forked workers)


def _wds_part(part: tuple[int, list[Sample]]) -> int:
    import webdataset as wds

    i, samples = part
    pattern = os.path.join(_WDS["dest"], f"shard-p{i:03d}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=10**9, maxsize=_WDS["shard_bytes"], verbose=0) as sink:
        for key, files in samples:
            sample: dict[str, Any] = {"__key__": key}
            sample.update(read_fields(files))
            sink.write(sample)
    return len(samples)


def _webdataset(src: str, dest: str, shard_bytes: int, workers: int) -> dict[str, Any]:
    os.makedirs(dest, exist_ok=True)
    _WDS.update(dest=dest, shard_bytes=shard_bytes)
    t0 = time.perf_counter()
    n, procs = _in_processes(_wds_part, list_samples(src), workers)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": n, "shards": len(os.listdir(dest)), "out_bytes": _tree_bytes(dest),
            "processes": procs, "settings": {"processes": procs, "ShardWriter": f"maxsize={shard_bytes}"}}


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


# The cheapest typed mapping of our fields: jpg as raw bytes, cls as an int, the JSON caption
# as a str (the "json" column type would parse and re-dump it); the key as a str so that MDS
# stores what the other formats store.
_MDS_COLUMNS = {"key": "str", "jpg": "bytes", "cls": "int", "json": "str"}
_MDS: dict[str, Any] = {}  # the running MDS measurement's out folder and shard size (read by forked workers)


def _mds_part(part: tuple[int, list[Sample]]) -> int:
    streaming = _import_streaming()
    i, samples = part
    out = _MDS["dest"] if _MDS["workers"] <= 1 else os.path.join(_MDS["dest"], f"part-{i:03d}")
    with streaming.MDSWriter(out=out, columns=_MDS_COLUMNS, compression=None, size_limit=_MDS["shard_bytes"]) as sink:
        for key, files in samples:
            f = read_fields(files)
            sink.write({"key": key, "jpg": f["jpg"], "cls": int(f["cls"]), "json": f["json"].decode()})
    return len(samples)


def _mds(src: str, dest: str, shard_bytes: int, workers: int) -> dict[str, Any]:
    _import_streaming()
    from streaming.base.util import merge_index

    _MDS.update(dest=dest, shard_bytes=shard_bytes, workers=workers)
    t0 = time.perf_counter()
    n, procs = _in_processes(_mds_part, list_samples(src), workers)
    if procs > 1:
        merge_index(dest, keep_local=True)  # one index.json over the parts, as MosaicML's docs do
    seconds = time.perf_counter() - t0
    shards = sum(1 for _, _, names in os.walk(dest) for x in names if x.endswith(".mds"))
    return {"seconds": seconds, "samples": n, "shards": shards, "out_bytes": _tree_bytes(dest), "processes": procs,
            "settings": {"processes": procs, "MDSWriter": f"size_limit={shard_bytes}",
                         "merge_index": procs > 1}}


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
    return {"seconds": seconds, "samples": n, "shards": shards, "out_bytes": _tree_bytes(dest), "processes": workers,
            "settings": {"num_workers": workers, "chunk_bytes": shard_bytes}}


# --- entry point ----------------------------------------------------------------------------


def measure(system: str, src: str, dest: str, shard_bytes: int, workers: int, workdir: str) -> dict[str, Any]:
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "floor-np": lambda: _floor(src, "floor-np", workers),
        "floor-np-plain": lambda: _floor(src, "floor-np-plain", workers),
        "floor-np-write": lambda: _floor(src, "floor-np-write", workers, dest),
        "floor-np-pack": lambda: _pack_floor(src, workers, dest, shard_bytes),
        "floor-1p": lambda: _floor(src, "floor-1p", 1),
        "floor-1p-bytes": lambda: _floor(src, "floor-1p-bytes", 1),
        "datapipe": lambda: _datapipe(src, dest, shard_bytes, workers, None),
        "datapipe-zstd": lambda: _datapipe(src, dest, shard_bytes, workers, "zstd"),
        "webdataset": lambda: _webdataset(src, dest, shard_bytes, workers),
        "mds": lambda: _mds(src, dest, shard_bytes, workers),
        "litdata": lambda: _litdata(src, dest, shard_bytes, workers, workdir),
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
        import datapipe.packing.packer  # noqa: F401
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
    ap.add_argument("--workers", type=int, required=True, help="processes for every system (see the module doc)")
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    out = measure(a.system, a.src, a.dest, a.shard_bytes, a.workers, a.workdir)
    sys.stdout.flush()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
