"""Loader sweep (issues 12 and 29): shuffled warm reads of raw bytes in one process, in
datapipe's batched mode, and through each system's DataLoader with worker processes, over a
grid of (samples x mean sample size, shard size) cells, each read the ways users run it;
start-up figures on a dataset of 10^4 shards and 10^7 samples and a small job at every
system's defaults; plus a CPU-heavy map (decode and resize real JPEGs) through 1 and 2 workers.

    python -m benchmarks.bench_loader --quick                      # tiny cells, a few minutes
    python -m benchmarks.bench_loader --workdir /tmp/bl            # everything (formats kept in --workdir)
    python -m benchmarks.bench_loader --cells 16k-16M,256k-64M     # some cells only
    python -m benchmarks.bench_loader --parts map                  # only the JPEG map benchmark
    python -m benchmarks.bench_loader --startup --workdir /tmp/bl  # only the start-up part (a 10 GB dataset)

Cells (samples x mean size, shard size): 60k x 1 KiB at 16 and 64 MiB, 20k x 16 KiB at 16 and
64 MiB, 2k x 256 KiB at 64 MiB. The corpus is bench_read's: a jpg field of random bytes of the
mean size (lognormal), a cls and a json field, all read as undecoded bytes by everyone.

Systems, each at ``batch_size=256`` and ``num_workers=2`` where they apply:

- datapipe: ``StreamingDataset(decode=None)`` one sample at a time ("one_process"),
  ``StreamingDataset(batch_size=256, batched=True)`` ("batched", where available), and
  ``StreamingDataLoader`` with its default collate.
- LitData: ``litdata.StreamingDataset(shuffle=True)`` and ``litdata.StreamingDataLoader``.
- MosaicML Streaming: ``StreamingDataset(shuffle=True, batch_size=256)`` and torch's ``DataLoader``.
- WebDataset: ``WebDataset(shardshuffle=..).shuffle(1000)`` and ``WebLoader`` over ``.batched(256)``.

What users run, measured the same way for every system (each mode's job is a fresh
interpreter that imports the system first, untimed, and then builds a new dataset object):

- (a) the first epoch of a new dataset object: from the dataset's construction to its first
  epoch's last sample (``first_epoch``; with ``first_item_s``, the time to its first sample),
  against the same object's second epoch;
- (b) ``"dataloader_nonpersistent"``: every epoch with ``persistent_workers=False``
  (PyTorch's default, and LitData's and WebDataset's), each epoch reported: each starts new
  worker processes with new copies of the dataset; its time to the first batch, and each
  new worker's first batch after the worker started (its ``worker_init_fn`` notes the
  time; torch hands an iterable dataset's batches out from its workers in turn, so batch i
  is worker i's first);
- (c) steady state: the best of the epochs after the first, in one process and through
  ``"dataloader"`` with ``persistent_workers=True`` (datapipe's default).

Each cell prints a table of these (``benchmarks.tables.loader_modes_md``) with the ratios
the targets name: datapipe / LitData per mode (LitData the faster of its two settings),
first epoch / second epoch, non-persistent (slowest epoch) / persistent steady.

Each peer runs twice: at our settings (the cell's shard size, the same as datapipe's) and at
its own documented default shard size (``PEER_DEFAULTS`` names the source of each); both
run every mode above. The main process takes each batch's keys and touches no payload
byte: datapipe's stay in the shared-memory ring, the peers' have already been unpickled
into the main process when the batch arrives. Prepared corpora and formats stay in
``--workdir`` and are reused by later runs (a ``.done`` marker is written after each).

The start-up part (``--startup``): a dataset of ``startup_shards`` shards and
``startup_samples`` samples (10^4 and 10^7; tiny samples, packed from a Parquet table with
datapipe's public API), opened in fresh interpreters (one untimed warm-up, then
``startup_repeats`` of each): the time from ``StreamingDataset(...)`` to its first sample, and
through ``StreamingDataLoader(num_workers=2, persistent_workers=False)`` to the first batch of
each of two passes and each new worker's first batch after it started. And a small job at
every system's defaults (10^4 samples of 8 KiB, one process: the format and the dataset
built with nothing but the required arguments), beside each peer at our settings
(datapipe's default shard size, shuffled), modes (a) and (c).

Every measurement runs in a fresh interpreter (``--job``), so no two systems share imports,
allocator state or shared memory; the page cache of the format's files is warmed first by
an untimed read. Each mode runs ``--epochs`` epochs (3; steady state needs 2 or more); the
best and the median are reported as samples/s and payload MB/s, with samples per CPU-second
(this process plus its reaped worker processes). The keys of every epoch are checked: a
run that loses or repeats a sample is reported as an error, not as a speed. DataLoader runs
also report the peak resident memory of the main process and of each worker (sampled from
/proc by a thread, plus VmHWM).

``run(config)`` returns every figure as JSON-able data; ``main`` prints it as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import numpy as np

from benchmarks.output import print_json
from benchmarks.tables import loader_modes_md, loader_startup_md

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

#: cell id -> (samples, mean sample bytes, shard bytes)
CELLS: dict[str, tuple[int, int, int]] = {
    "1k-16M": (60_000, 1024, 16 * MiB),
    "1k-64M": (60_000, 1024, 64 * MiB),
    "16k-16M": (20_000, 16384, 16 * MiB),
    "16k-64M": (20_000, 16384, 64 * MiB),
    "256k-64M": (2_000, 262144, 64 * MiB),
}
#: tiny cells for --quick (and the test): several shards each, so two workers share the work
QUICK_CELLS: dict[str, tuple[int, int, int]] = {
    "q1k-256K": (1_500, 1024, 256 << 10),
    "q16k-1M": (300, 16384, 1 * MiB),
}
SYSTEMS = ("datapipe", "litdata", "mosaicml", "webdataset")
#: each peer's own default shard/chunk size, and where it is documented
PEER_DEFAULTS: dict[str, dict[str, Any]] = {
    "litdata": {"settings": {"chunk_bytes": "64MB"},
                "source": "litdata.optimize() has no default (it raises without chunk_size or chunk_bytes); "
                          "LitData's README example uses chunk_bytes=\"64MB\" (64e6 bytes)"},
    "mosaicml": {"settings": {"size_limit": 1 << 26},
                 "source": "streaming.MDSWriter(size_limit=1 << 26), the documented default"},
    "webdataset": {"settings": {"maxcount": 100_000, "maxsize": 3e9},
                   "source": "webdataset.ShardWriter(maxcount=100000, maxsize=3e9), the documented defaults"},
}
PARTS = ("sweep", "map", "startup")
DEFAULTS: dict[str, Any] = {
    "cells": list(CELLS), "systems": list(SYSTEMS), "parts": list(PARTS), "epochs": 3, "batch_size": 256,
    "workers": 2, "seed": 0, "workdir": None, "peer_defaults": True, "job_timeout_s": 600.0,
    "map_images": 2000, "map_side": 256, "map_out_side": 128, "map_batch_size": 64, "map_workers": [1, 2],
    "map_threads": [2], "map_shard_bytes": 2 * MiB, "map_systems": ["datapipe", "litdata"], "prepare_only": False,
    "startup_samples": 10**7, "startup_shards": 10**4, "startup_repeats": 3, "small_samples": 10**4,
    "small_mean_bytes": 8192,
}
QUICK: dict[str, Any] = {"cells": list(QUICK_CELLS), "epochs": 2, "map_images": 200, "map_side": 64,
                         "map_out_side": 32, "map_batch_size": 16, "map_shard_bytes": 64 << 10,
                         "startup_samples": 100_000, "startup_shards": 100, "startup_repeats": 2,
                         "small_samples": 2000}
#: the start-up target's dataset: time to the first sample is a target at this size only
STARTUP_TARGET_SIZE = (10**4, 10**7)  # shards, samples
#: the small job at defaults: a target at this size only
SMALL_TARGET_SIZE = (10**4, 8192)  # samples, mean bytes
ALL_CELLS = {**CELLS, **QUICK_CELLS}


# -- resident memory -------------------------------------------------------------------------


def _status_kb(pid: int | str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1])
    except OSError:
        pass
    return out


def _children() -> list[int]:
    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return pids


class MemorySampler:
    """Peak resident memory of this process and of each child process (DataLoader workers)
    while it runs: a thread reads VmRSS and VmHWM from /proc every ``interval`` seconds. A
    worker's peak is the largest of its sampled VmRSS and its last VmHWM (the kernel's own
    high-water mark up to the last sample before it exited). RSS counts shared pages (the
    parent's copy-on-write pages, shared-memory buffers) in every process that maps them."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.main_peak_kb = 0
        self.workers: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        self.main_peak_kb = max(self.main_peak_kb, _status_kb("self").get("VmRSS", 0))
        for pid in _children():
            s = _status_kb(pid)
            if s:
                self.workers[pid] = max(self.workers.get(pid, 0), s.get("VmRSS", 0), s.get("VmHWM", 0))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> MemorySampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, Any]:
        return {"main_peak_rss_MB": self.main_peak_kb / 1024,
                "main_hwm_MB": _status_kb("self").get("VmHWM", 0) / 1024,
                "worker_peak_rss_MB": [kb / 1024 for _, kb in sorted(self.workers.items())],
                "sample_interval_s": self.interval}


# -- corpora ---------------------------------------------------------------------------------


def corpus(work: str, n: int, mean_bytes: int, seed: int) -> dict[str, Any]:
    """bench_read's corpus (files under ``work``), reused when complete: its samples as
    (key, {field: path}), the payload bytes and the path of its key list."""
    from .bench_read import corpus_samples

    home = os.path.join(work, f"corpus-{n}-{mean_bytes}-{seed}")
    done = home + ".done"
    if not os.path.exists(done):
        shutil.rmtree(home, ignore_errors=True)
    samples = corpus_samples(home, n, mean_bytes, seed)
    if len(samples) != n:
        raise RuntimeError(f"{home}: {len(samples)} samples, expected {n}; delete it and run again")
    payload = sum(os.path.getsize(p) for _, files in samples for p in files.values())
    keys_path = home + ".keys.json"
    if not os.path.exists(done):
        with open(keys_path, "w") as f:
            json.dump([k for k, _ in samples], f)
        with open(done, "w") as f:
            json.dump({"samples": n, "payload": payload}, f)
    return {"dir": home, "samples": samples, "payload": payload, "keys": keys_path}


def prepare(system: str, setting: dict[str, Any], corpus_info: dict[str, Any], d: str) -> None:
    """Write ``corpus_info``'s samples in ``system``'s format at ``setting`` into ``d``."""
    from .bench_read import litdata_sample, sample_dict  # one reading of a corpus sample for every system

    samples = corpus_info["samples"]
    if system == "datapipe":
        import datapipe

        datapipe.pack(corpus_info["dir"], d, progress=False, **setting)
    elif system == "litdata":
        import litdata

        cache = tempfile.mkdtemp(prefix="litdata-cache-", dir=os.path.dirname(d))
        os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = os.path.join(cache, "chunks")
        os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = os.path.join(cache, "data")
        try:
            litdata.optimize(fn=litdata_sample, inputs=samples, output_dir=d, num_workers=2, mode="overwrite",
                             verbose=False, **setting)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    elif system == "mosaicml":
        from .bench_read import import_streaming

        streaming = import_streaming()
        cols = {"key": "str", "cls": "bytes", "jpg": "bytes", "json": "bytes"}
        with streaming.MDSWriter(out=d, columns=cols, **setting) as w:
            for item in samples:
                w.write(sample_dict(item))
    elif system == "webdataset":
        import webdataset as wds

        os.makedirs(d, exist_ok=True)
        with wds.ShardWriter(os.path.join(d, "shard-%06d.tar"), verbose=0, **setting) as w:
            for item in samples:
                s = sample_dict(item)
                w.write({"__key__": s.pop("key"), **s})
    else:
        raise ValueError(f"unknown system {system!r}")


def ensure_format(work: str, system: str, setting: dict[str, Any], corpus_info: dict[str, Any],
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The format directory for (system, setting, corpus), prepared once and reused."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(setting.items())) or "defaults"
    name = f"{system}-{tag}-{os.path.basename(corpus_info['dir'])}"
    d = os.path.join(work, "fmt", name)
    done = d + ".done"
    if os.path.exists(done):
        with open(done) as f:
            return dict(json.load(f), dir=d, reused=True)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.dirname(d), exist_ok=True)
    log(f"prepare {name}")
    t0 = time.perf_counter()
    # in a fresh interpreter, as every measurement: packers leave threads (tqdm's monitor),
    # environment variables (LitData's cache folders) and imports (the torchvision stand-in
    # MosaicML needs) behind, which must not change the process that started the sweep
    raw = _spawn({"kind": "prepare", "system": system, "setting": setting, "corpus_dir": corpus_info["dir"],
                  "samples": len(corpus_info["samples"]), "dir": d}, 3600.0)
    if "error" in raw:
        raise RuntimeError(raw["error"])
    files = [p for p in glob.glob(os.path.join(d, "**"), recursive=True) if os.path.isfile(p)]
    info = {"prepare_s": time.perf_counter() - t0, "files": len(files),
            "bytes": sum(os.path.getsize(p) for p in files)}
    with open(done, "w") as f:
        json.dump(info, f)
    return dict(info, dir=d, reused=False)


def _warm_page_cache(d: str) -> None:
    for p in glob.glob(os.path.join(d, "**"), recursive=True):
        if os.path.isfile(p):
            with open(p, "rb", buffering=0) as f:
                while f.read(8 * MiB):
                    pass


def synthetic_dataset(work: str, samples: int, shards: int, log: Callable[[str], None]) -> dict[str, Any]:
    """A datapipe dataset of ``shards`` shards holding ``samples`` samples of one tiny field
    (``cls``: one digit), for the start-up figures; packed by ``datapipe.pack`` from a Parquet
    table in a fresh interpreter, and reused when complete. Each sample is one tar member
    (a 512-byte header and a 512-byte block): about 1 KiB of disk per sample."""
    d = os.path.join(work, "fmt", f"datapipe-synthetic-{samples}-{shards}")
    done = d + ".done"
    if os.path.exists(done):
        with open(done) as f:
            return dict(json.load(f), dir=d, reused=True)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.dirname(d), exist_ok=True)
    need = samples * 1100 + (64 << 20)  # the shards, the index and the table packed from
    free = shutil.disk_usage(os.path.dirname(d)).free
    if free < need + (2 << 30):  # leave the machine 2 GiB beside it
        raise RuntimeError(f"{d}: a dataset of {samples:,} samples needs about {need / 2**30:.1f} GiB and "
                           f"{free / 2**30:.1f} GiB are free there; give --workdir on a larger disk, or smaller "
                           "startup_samples")
    log(f"prepare {os.path.basename(d)} ({samples:,} samples in {shards:,} shards, about {need / 2**30:.1f} GiB)")
    t0 = time.perf_counter()
    raw = _spawn({"kind": "synthetic", "samples": samples, "shards": shards, "dir": d}, 6 * 3600.0)
    if "error" in raw:
        raise RuntimeError(raw["error"])
    info = dict(raw, prepare_s=time.perf_counter() - t0)
    with open(done, "w") as f:
        json.dump(info, f)
    return dict(info, dir=d, reused=False)


def _synthetic_job(job: dict[str, Any]) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    import datapipe

    n, shards, d = job["samples"], job["shards"], job["dir"]
    table = d + ".table.parquet"
    schema = pa.schema([("__key__", pa.string()), ("cls", pa.binary())])
    step = 1 << 20
    with pq.ParquetWriter(table + ".tmp", schema) as w:
        for a in range(0, n, step):
            ids = np.arange(a, min(n, a + step), dtype=np.int64)
            keys = pc.utf8_lpad(pa.array(ids).cast(pa.string()), 10, "0")
            w.write_table(pa.table({"__key__": keys, "cls": pa.array((ids % 10).astype("S1"), pa.binary())},
                                   schema=schema))
    os.replace(table + ".tmp", table)
    try:
        r = datapipe.pack(table, d, shard_samples=-(-n // shards))
    finally:
        os.remove(table)  # written above, by this job
    if (r.shards, r.samples) != (shards, n):
        raise RuntimeError(f"{d}: packed {r.shards} shards of {r.samples} samples, expected {shards} of {n}")
    return {"shards": r.shards, "samples": r.samples, "bytes": r.stored_bytes, "pack_s": r.seconds}


# -- one measured job (a fresh interpreter) -------------------------------------------------------

#: the loader modes: (c) workers that persist across epochs, (b) new workers every epoch
LOADER_MODES = {"dataloader": True, "dataloader_nonpersistent": False}  # mode -> persistent_workers


def _keys_of(batch: Any) -> list[str]:
    """The sample keys of one batch (datapipe Batch, or a peer's dict of lists), as handed
    out: no per-sample work here, which would blur a batched reader's rate (a key that is not
    a ``str`` fails the exactly-once check rather than being converted)."""
    for k in ("__key__", "key"):
        try:
            keys = batch[k]
        except (KeyError, TypeError):
            continue
        return keys if isinstance(keys, list) else list(keys)
    raise TypeError(f"a batch of type {type(batch).__name__} has no '__key__' or 'key' field")


class WorkerStarts:
    """A DataLoader ``worker_init_fn`` that notes when each worker process starts
    (``time.monotonic``: one clock for every process of the machine) in a file per worker
    under ``folder``, for the main process to pair with that worker's first batch. Picklable
    (a folder name), so spawned workers get it too; it writes one small file per worker."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        t = time.monotonic()
        path = os.path.join(self.folder, str(worker_id))
        with open(path + ".tmp", "w") as f:
            f.write(repr(t))
        os.replace(path + ".tmp", path)

    def clear(self) -> None:
        for name in os.listdir(self.folder):
            os.remove(os.path.join(self.folder, name))

    def read(self) -> dict[int, float]:
        out = {}
        for name in os.listdir(self.folder):
            if name.isdigit():
                with open(os.path.join(self.folder, name)) as f:
                    out[int(name)] = float(f.read())
        return out


def worker_first_batches(starts: dict[int, float], arrivals: list[float], t_iter: float) -> list[dict[str, Any]]:
    """Each worker started in this pass: when it started after ``iter()`` (``start_s``) and
    how long after its start its first batch reached the main process (``first_batch_s``).
    Torch hands out an iterable dataset's batches from its workers in turn, so the pass's
    batch i is worker i's first."""
    return [{"worker": w, "start_s": t - t_iter, "first_batch_s": arrivals[w] - t}
            for w, t in sorted(starts.items()) if w < len(arrivals)]


def import_before_clock(system: str) -> None:
    """What a training script has done before it builds a dataset: imported torch and the
    system's package. Imports the first epoch still pays for (lazily) stay in its time."""
    import torch  # noqa: F401  # every system's loader is torch's

    if system == "datapipe":
        # the names themselves: the package's face imports a name's module on first use, so
        # `import datapipe.loader` alone would leave the loader's imports inside the clock
        from datapipe.loader import StreamingDataLoader, StreamingDataset  # noqa: F401
    elif system == "litdata":
        import litdata  # noqa: F401
    elif system == "mosaicml":
        from .bench_read import import_streaming

        import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()  # what an earlier job's crash left, not this job's cost
    elif system == "webdataset":
        import webdataset  # noqa: F401
    else:
        raise ValueError(f"unknown system {system!r}")


def _open(job: dict[str, Any], worker_init: Callable[[int], None] | None = None
          ) -> tuple[Any, Callable[[Any], Iterable[str]], dict[str, Any]]:
    """(iterable for one epoch, keys of one item, settings used) for the job's system and
    mode. ``job["defaults"]``: the dataset at its defaults (one process only), nothing but
    the path given."""
    system, mode, d = job["system"], job["mode"], job["dir"]
    bs, workers, seed = job["batch_size"], job["workers"], job["seed"]
    defaults = bool(job.get("defaults"))
    if defaults and mode != "one_process":
        raise ValueError(f"mode {mode!r} at defaults: only one_process is measured at defaults")
    loader_kw: dict[str, Any] = {}
    if mode in LOADER_MODES:
        loader_kw = {"num_workers": workers, "persistent_workers": LOADER_MODES[mode], "worker_init_fn": worker_init}
    if system == "datapipe":
        from datapipe.loader import StreamingDataLoader, StreamingDataset

        if defaults:
            ds = StreamingDataset(d)
            return ds, lambda s: (s["__key__"],), {"defaults": True, "window": ds.window, "shuffle": ds.shuffle}
        if mode == "one_process":
            ds = StreamingDataset(d, seed=seed, decode=None)
            return ds, lambda s: (s["__key__"],), {"decode": None, "window": ds.window}
        if mode == "batched":
            try:
                ds = StreamingDataset(d, seed=seed, decode=None, batch_size=bs, batched=True)
            except TypeError as e:
                raise NotImplementedError(f"StreamingDataset(batched=True) is not available here: {e}") from e
            return ds, _keys_of, {"decode": None, "batch_size": bs, "batched": True, "window": ds.window}
        ds = StreamingDataset(d, seed=seed, decode=None)
        dl = StreamingDataLoader(ds, batch_size=bs, **loader_kw)
        return dl, _keys_of, {"decode": None, "batch_size": bs, "num_workers": workers, "collate": "default",
                              "window": ds.window, "prefetch_bytes": ds.prefetch_bytes,
                              "persistent_workers": dl.persistent_workers}
    if system == "litdata":
        import litdata

        if defaults:
            ds = litdata.StreamingDataset(input_dir=d)
            return ds, lambda s: (s["key"],), {"defaults": True, "shuffle": ds.shuffle}
        ds = litdata.StreamingDataset(input_dir=d, shuffle=True, seed=seed)
        if mode == "one_process":
            return ds, lambda s: (s["key"],), {"shuffle": True}
        dl = litdata.StreamingDataLoader(ds, batch_size=bs, **loader_kw)
        return dl, _keys_of, {"shuffle": True, "batch_size": bs, "num_workers": workers,
                              "persistent_workers": dl.persistent_workers}
    if system == "mosaicml":
        import streaming
        import torch

        if defaults:
            ds = streaming.StreamingDataset(local=d)
            return ds, lambda s: (s["key"],), {"defaults": True, "shuffle": ds.shuffle}
        ds = streaming.StreamingDataset(local=d, shuffle=True, shuffle_seed=seed, batch_size=bs)
        if mode == "one_process":
            return ds, lambda s: (s["key"],), {"shuffle": True, "batch_size": bs}
        dl = torch.utils.data.DataLoader(ds, batch_size=bs, **loader_kw)
        return dl, _keys_of, {"shuffle": True, "batch_size": bs, "num_workers": workers,
                              "loader": "torch.utils.data.DataLoader", "persistent_workers": dl.persistent_workers}
    if system == "webdataset":
        import webdataset as wds

        urls = sorted(glob.glob(os.path.join(d, "*.tar")))
        if defaults:
            return wds.WebDataset(urls), lambda s: (s["__key__"],), {"defaults": True}
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False).shuffle(1000)
        if mode == "one_process":
            return ds, lambda s: (s["__key__"],), {"shardshuffle": len(urls), "shuffle_buffer": 1000}
        dl = wds.WebLoader(ds.batched(bs), batch_size=None, **loader_kw)
        return dl, _keys_of, {"shardshuffle": len(urls), "shuffle_buffer": 1000, "batched": bs,
                              "num_workers": workers, "loader": "webdataset.WebLoader",
                              "persistent_workers": dl.pipeline[0].persistent_workers}  # its torch DataLoader
    raise ValueError(f"unknown system {system!r}")


_TICK = os.sysconf("SC_CLK_TCK")


def _live_children_cpu_s() -> float:
    total = 0.0
    for pid in _children():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


def _batch_bytes(batch: Any) -> int:
    """Bytes of a batch's byte columns (with their offsets) and tensors."""
    total = 0
    for v in (batch.values() if hasattr(batch, "values") else ()):
        nb = getattr(v, "nbytes", None)
        if isinstance(nb, int):
            total += nb + 8 * (len(v) + 1)
    return total


def _cpu_s() -> float:
    """CPU seconds of this process, of its reaped children (workers joined at the end of an
    epoch) and of its live children (persistent workers, read from /proc): at any instant a
    worker is counted in exactly one of the last two."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + _live_children_cpu_s()


def _exactly_once(keys: list[str], expected: set[str]) -> dict[str, Any]:
    got = set(keys)
    return {"delivered": len(keys), "distinct": len(got), "missing": len(expected - got),
            "repeated": len(keys) - len(got), "unexpected": len(got - expected),
            "exactly_once": len(keys) == len(expected) and got == expected}


def read_floor(d: str, passes: int, threads: int) -> dict[str, Any]:
    """The cell's floor for any reader of datapipe's format: every shard file read once from
    the (warmed) page cache into buffers touched beforehand and kept across passes, by
    ``threads`` threads (one per core: the parallelism a reader has here), no parsing, no
    checksum, nothing handed out: the fastest rate at which epochs that each read every
    shard once can follow one another (one epoch can beat it by what was read ahead during
    the epoch before, at most the prefetch budget). ``passes`` timed passes."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(p for p in glob.glob(os.path.join(d, "*.tar")) if os.path.isfile(p))
    bufs = [bytearray(os.path.getsize(p)) for p in files]  # zero-filled: every page touched

    def read(path: str, buf: bytearray) -> int:
        with open(path, "rb", buffering=0) as f, memoryview(buf) as view:
            got = 0
            while got < len(buf) and (n := f.readinto(view[got:])):
                got += n
            return got

    _warm_page_cache(d)
    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            t0 = time.perf_counter()
            got = sum(pool.map(read, files, bufs))
            seconds.append(time.perf_counter() - t0)
    return {"files": len(files), "bytes": got, "threads": threads, "seconds": seconds}


def _epochs(job: dict[str, Any], it: Any, keys_of: Callable[[Any], Iterable[str]], expected: set[str],
            starts: WorkerStarts | None, out: list[dict[str, Any]]) -> int:
    """The job's timed epochs of ``it``, each appended to ``out``; returns the bytes of the
    largest first batch (datapipe through workers: the size the ring's slots hold)."""
    loader = job["mode"] in LOADER_MODES
    largest_batch = 0
    sizing = loader and job["system"] == "datapipe"
    # the first item, and with workers each worker's first batch, are timed as they arrive
    head = job["workers"] if loader else 1
    for epoch in range(job["epochs"]):
        if epoch and job["system"] == "datapipe":  # the peers advance their epoch themselves
            getattr(it, "stream", it).set_epoch(epoch)
        if starts:
            starts.clear()
        keys: list[str] = []
        arrivals: list[float] = []
        c0, t0, m0 = _cpu_s(), time.perf_counter(), time.monotonic()
        # one loop over one iter(): LitData's dataset restarts its epoch at each iter()
        for item in it:
            if len(arrivals) < head:
                arrivals.append(time.monotonic())
                if sizing and not keys:
                    largest_batch = max(largest_batch, _batch_bytes(item))
            keys.extend(keys_of(item))
        item = None  # a batch held on would keep its ring slot taken
        dt, cpu = time.perf_counter() - t0, _cpu_s() - c0
        ep = {"seconds": dt, "cpu_s": cpu, "first_item_s": arrivals[0] - m0 if arrivals else None,
              **_exactly_once(keys, expected)}
        if starts:
            ep["worker_first_batch"] = worker_first_batches(starts.read(), arrivals, m0)
        out.append(ep)
    return largest_batch


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One (system, setting, mode) measurement in this process: ``epochs`` timed epochs of
    one new dataset object (and loader), the first from its construction on."""
    if job["mode"] == "read_floor":
        return read_floor(job["dir"], job["epochs"], job["threads"])
    with open(job["keys"]) as f:
        expected = set(json.load(f))
    _warm_page_cache(job["dir"])
    t0 = time.perf_counter()
    import_before_clock(job["system"])
    import_s = time.perf_counter() - t0
    loader = job["mode"] in LOADER_MODES
    starts = WorkerStarts(tempfile.mkdtemp(prefix="bench_loader-starts-")) if loader else None
    try:
        t0 = time.perf_counter()
        try:
            it, keys_of, settings = _open(job, starts)
        except NotImplementedError as e:  # a mode this version of the system does not offer
            return {"unavailable": str(e)}
        out: dict[str, Any] = {"mode": job["mode"], "import_s": import_s, "open_s": time.perf_counter() - t0,
                               "settings": settings, "epochs": []}
        sampler = MemorySampler() if loader else None
        with sampler or contextlib.nullcontext():
            largest_batch = _epochs(job, it, keys_of, expected, starts, out["epochs"])
    finally:
        if starts:
            shutil.rmtree(starts.folder, ignore_errors=True)
    if sampler:
        out["memory"] = sampler.report()
        ring = getattr(it, "ring", None)
        if ring is not None and largest_batch:
            # The ring's slots are sized to the batches written into them (regrown by half when
            # one does not fit), so at least workers x slots x the largest batch: the lower
            # bound, which makes the memory check the stricter one.
            out["memory"]["ring_bytes"] = job["workers"] * ring.slots_per_worker * largest_batch
            out["memory"]["ring_estimate"] = (f"{job['workers']} workers x {ring.slots_per_worker} slots x the "
                                              f"largest batch's bytes ({largest_batch:,})")
        if "prefetch_bytes" in settings:
            out["memory"]["prefetch_bytes"] = settings["prefetch_bytes"]
    return out


def _summarise(raw: dict[str, Any], n: int, payload: int) -> dict[str, Any]:
    """A job's figures; an error if any epoch lost or repeated a sample. Every epoch's
    rate; (a) ``first_epoch``: from the dataset's construction to the first epoch's end
    (``first_item_s``: to its first sample or batch); the headline (``samples_per_s``, best,
    with the median and the slowest): with non-persistent workers every epoch (each starts
    new workers), otherwise (c) the epochs after the first, the steady state (none when
    only one epoch ran)."""
    eps = [dict(e, samples_per_s=n / e["seconds"]) for e in raw["epochs"]]
    res: dict[str, Any] = {"settings": raw["settings"], "import_s": raw.get("import_s"), "open_s": raw["open_s"],
                           "epochs": eps}
    if "memory" in raw:
        res["memory"] = raw["memory"]
    bad = [e for e in eps if not e["exactly_once"]]
    if bad:
        e = bad[0]
        res["error"] = (f"not exactly once: delivered {e['delivered']} of {n} samples ({e['distinct']} distinct, "
                        f"{e['missing']} missing, {e['repeated']} repeated, {e['unexpected']} unknown)")
        return res
    first, open_s = eps[0], raw["open_s"]
    res["first_epoch"] = {"seconds": open_s + first["seconds"], "samples_per_s": n / (open_s + first["seconds"]),
                          "first_item_s": None if first.get("first_item_s") is None else open_s + first["first_item_s"]}
    every = raw.get("mode") == "dataloader_nonpersistent"
    headline = eps if every else eps[1:]
    res["headline"] = "every epoch (each starts new workers)" if every else "epochs after the first (steady state)"
    if not headline:
        return res
    rates = [e["samples_per_s"] for e in headline]
    best = max(range(len(headline)), key=lambda i: rates[i])
    res.update(samples_per_s=rates[best], median_samples_per_s=statistics.median(rates),
               slowest_samples_per_s=min(rates), MB_per_s=payload / headline[best]["seconds"] / 1e6,
               median_MB_per_s=statistics.median(payload / e["seconds"] / 1e6 for e in headline),
               samples_per_cpu_s=n / headline[best]["cpu_s"] if headline[best]["cpu_s"] > 0 else None,
               seconds=headline[best]["seconds"])
    return res


def _spawn(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_loader", "--job", json.dumps(job)]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        lines = [x.strip() for x in (p.stderr or p.stdout).splitlines() if x.strip()]
        return {"error": f"exit {p.returncode}: " + (lines[-1] if lines else "no output")}
    res: dict[str, Any] = json.loads(line[len("RESULT "):])
    return res


# -- the figures of each mode, and their ratios ----------------------------------------------------

#: the figures compared across systems: key -> what it is
MODE_FIGURES: dict[str, str] = {
    "first_epoch": "(a) one process, first epoch of a new dataset object (its construction included)",
    "steady": "(c) one process, steady state (best epoch after the first)",
    "nonpersistent_slowest": "(b) DataLoader, persistent_workers=False: the slowest epoch (each starts new workers)",
    "persistent_steady": "(c) DataLoader, persistent_workers=True: steady state (best epoch after the first)",
}
LITDATA_VARIANTS = ("litdata", "litdata@default")


def _prepared(work: str, system: str, setting: Any, c: dict[str, Any], log: Callable[[str], None],
              entry: dict[str, Any]) -> dict[str, Any] | None:
    """The system's format for the cell, noted in ``entry``; None (with the error noted) when it
    could not be prepared: one peer failing must not hide the others' figures."""
    try:
        fmt = ensure_format(work, system, setting, c, log)
    except Exception as e:
        entry["error"] = f"prepare: {type(e).__name__}: {e}"
        return None
    entry["format"] = {k: fmt[k] for k in ("files", "bytes", "prepare_s", "reused")}
    return fmt


def _ok(r: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(r, dict) and "epochs" in r and "error" not in r and "unavailable" not in r


def _system_figures(e: dict[str, Any]) -> dict[str, Any]:
    f: dict[str, Any] = {}
    op = e.get("one_process")
    if _ok(op):
        f["first_epoch"] = op["first_epoch"]["samples_per_s"]
        f["first_sample_s"] = op["first_epoch"]["first_item_s"]
        if len(op["epochs"]) > 1:
            f["second_epoch"] = op["epochs"][1]["samples_per_s"]
            f["first_over_second"] = f["first_epoch"] / f["second_epoch"]
        if "samples_per_s" in op:
            f["steady"] = op["samples_per_s"]
    b = e.get("batched")
    if _ok(b):
        f["batched_first_epoch"] = b["first_epoch"]["samples_per_s"]
        if "samples_per_s" in b:
            f["batched_steady"] = b["samples_per_s"]
    fresh = e.get("dataloader_nonpersistent")
    if _ok(fresh):
        f["nonpersistent_epochs"] = [ep["samples_per_s"] for ep in fresh["epochs"]]
        f["nonpersistent_slowest"] = min(f["nonpersistent_epochs"])
        f["first_batch_s"] = fresh["first_epoch"]["first_item_s"]  # a new dataset object, new workers
        waits = [w["first_batch_s"] for ep in fresh["epochs"] for w in ep.get("worker_first_batch", [])]
        if waits:
            f["worker_first_batch_s"] = max(waits)  # the slowest new worker of any epoch
    p = e.get("dataloader")
    if _ok(p):
        f["persistent_first_epoch"] = p["epochs"][0]["samples_per_s"]
        if "samples_per_s" in p:
            f["persistent_steady"] = p["samples_per_s"]
    if "nonpersistent_slowest" in f and "persistent_steady" in f:
        f["nonpersistent_over_persistent"] = f["nonpersistent_slowest"] / f["persistent_steady"]
    return f


def faster_litdata(figures: dict[str, dict[str, Any]], key: str) -> tuple[float | None, str]:
    """The faster LitData variant's ``key`` figure (ours or its default: the stricter bar)."""
    got = [(float(v), name) for name in LITDATA_VARIANTS
           if isinstance(v := figures.get(name, {}).get(key), (int, float))]
    return max(got) if got else (None, "")


def mode_figures(cell: dict[str, Any]) -> dict[str, Any]:
    """Each system's figures by mode (see :data:`MODE_FIGURES`) and datapipe's ratio to the
    faster LitData in each: what the cell's table shows and the targets read."""
    systems = {name: _system_figures(e) for name, e in cell.get("systems", {}).items() if "same_format_as" not in e}
    ratios: dict[str, Any] = {}
    dp = systems.get("datapipe", {})
    for key in MODE_FIGURES:
        lit, which = faster_litdata(systems, key)
        ours = dp.get(key)
        if ours is not None and lit:
            ratios[key] = {"ratio": ours / lit, "datapipe": ours, "litdata": lit, "litdata_variant": which}
    return {"systems": systems, "datapipe_over_litdata": ratios, "figures": MODE_FIGURES}


# -- the sweep -----------------------------------------------------------------------------------


def _same_setting(system: str, shard_bytes: int) -> dict[str, Any]:
    return {"datapipe": {"shard_bytes": shard_bytes}, "litdata": {"chunk_bytes": shard_bytes},
            "mosaicml": {"size_limit": shard_bytes},
            "webdataset": {"maxsize": shard_bytes, "maxcount": 10**9}}[system]


def _modes(system: str) -> list[str]:
    return ["one_process"] + (["batched"] if system == "datapipe" else []) + list(LOADER_MODES)


def _shown(r: dict[str, Any]) -> str:
    if "error" in r or "unavailable" in r:
        return str(r.get("error") or r.get("unavailable"))
    text = f"first epoch {r['first_epoch']['samples_per_s']:,.0f} samples/s"
    if "samples_per_s" in r:
        text += f"; {r['headline']}: best {r['samples_per_s']:,.0f}, slowest {r['slowest_samples_per_s']:,.0f}"
    return text


def run_cell(cfg: dict[str, Any], cell: str, work: str, log: Callable[[str], None]) -> dict[str, Any]:
    n, mean_bytes, shard_bytes = ALL_CELLS[cell]
    c = corpus(work, n, mean_bytes, cfg["seed"])
    out: dict[str, Any] = {"samples": n, "mean_bytes": mean_bytes, "shard_bytes": shard_bytes,
                           "payload_MB": c["payload"] / 1e6, "systems": {}}
    for system in cfg["systems"]:
        variants = [("same", _same_setting(system, shard_bytes))]
        if system in PEER_DEFAULTS and cfg["peer_defaults"]:
            variants.append(("default", PEER_DEFAULTS[system]["settings"]))
        for label, setting in variants:
            entry: dict[str, Any] = {"format_settings": setting}
            name = system if label == "same" else f"{system}@default"
            out["systems"][name] = entry
            if label == "default" and setting == variants[0][1]:
                entry["same_format_as"] = system  # the same files, read the same ways: measured once
                continue
            fmt = _prepared(work, system, setting, c, log, entry)
            if fmt is None or cfg.get("prepare_only"):
                continue
            if name == "datapipe":
                out["read_floor"] = _floor(cfg, fmt["dir"], n, log, cell)
            for mode in _modes(system):
                # every system and setting is read the same ways: new workers each epoch
                # (persistent_workers=False, torch's default and LitData's and WebDataset's)
                # and workers that persist across epochs (datapipe's default)
                job = {"system": system, "mode": mode, "dir": fmt["dir"], "keys": c["keys"], "seed": cfg["seed"],
                       "epochs": cfg["epochs"], "batch_size": cfg["batch_size"], "workers": cfg["workers"]}
                raw = _spawn(job, cfg["job_timeout_s"])
                done = "error" in raw or "unavailable" in raw
                entry[mode] = raw if done else _summarise(raw, n, c["payload"])
                log(f"{cell} {name:22s} {mode:25s} {_shown(entry[mode])}")
    if not cfg.get("prepare_only"):
        out["modes"] = mode_figures(out)
        log(loader_modes_md(cell, out))
    return out


def _floor(cfg: dict[str, Any], d: str, n: int, log: Callable[[str], None], cell: str) -> dict[str, Any]:
    """:func:`read_floor` in a fresh interpreter: the best pass as samples/s of the cell."""
    threads = os.cpu_count() or 1
    raw = _spawn({"mode": "read_floor", "dir": d, "epochs": cfg["epochs"], "threads": threads},
                 cfg["job_timeout_s"])
    if "error" in raw:
        log(f"{cell} read floor: {raw['error']}")
        return raw
    best = min(raw["seconds"])
    res = dict(raw, samples_per_s=n / best, GB_per_s=raw["bytes"] / best / 1e9)
    log(f"{cell} read floor ({threads} threads): {res['samples_per_s']:,.0f} samples/s, {res['GB_per_s']:.2f} GB/s")
    return res


# -- start-up: a large index, a new worker's first batch, a small job at defaults ----------------------


def run_startup_job(job: dict[str, Any]) -> dict[str, Any]:
    """``what="first_sample"``: a new ``StreamingDataset`` at its defaults to its first
    sample, one process. ``what="first_batch"``: a new dataset through
    ``StreamingDataLoader(num_workers=job["workers"], persistent_workers=False)``, ``passes``
    passes (each with new workers), each taken to every worker's first batch and closed."""
    t0 = time.perf_counter()
    if job["what"] == "floor":
        return _startup_floor(job["dir"])
    import_before_clock("datapipe")
    from datapipe.loader import StreamingDataLoader, StreamingDataset

    out: dict[str, Any] = {"import_s": time.perf_counter() - t0}
    if job["what"] == "first_sample":
        m0 = time.monotonic()
        ds = StreamingDataset(job["dir"])
        m1 = time.monotonic()
        samples: Any = iter(ds)  # a generator: close() ends its pass
        key = next(samples)["__key__"]
        m2 = time.monotonic()
        samples.close()
        return dict(out, open_s=m1 - m0, first_sample_s=m2 - m0, keys=[key])
    workers = job["workers"]
    starts = WorkerStarts(tempfile.mkdtemp(prefix="bench_loader-starts-"))
    try:
        m0 = time.monotonic()
        ds = StreamingDataset(job["dir"])
        dl = StreamingDataLoader(ds, batch_size=job["batch_size"], num_workers=workers, persistent_workers=False,
                                 worker_init_fn=starts)
        out["open_s"] = time.monotonic() - m0
        passes, keys = [], []
        for p in range(job["passes"]):
            if p:
                ds.set_epoch(p)
            starts.clear()
            t_iter = time.monotonic()
            batches = iter(dl)
            arrivals = []
            for batch in batches:
                arrivals.append(time.monotonic())
                keys.append(_keys_of(batch))
                if len(arrivals) >= workers:
                    break
            batch = None  # its ring slot is free again
            batches.close()
            passes.append({"first_batch_s": arrivals[0] - t_iter, "since_new_dataset_s": arrivals[0] - m0,
                           "workers": worker_first_batches(starts.read(), arrivals, t_iter)})
    finally:
        shutil.rmtree(starts.folder, ignore_errors=True)
    return dict(out, passes=passes, keys=[k for b in keys for k in b], batch_sizes=[len(b) for b in keys])


def _startup_floor(d: str) -> dict[str, Any]:
    """The start-up floor: one read of the dataset's index (every file beside the shards;
    Parquet decoded into columns by pyarrow, one thread, as datapipe reads Parquet) and of
    one shard file, from the page cache; pyarrow imported first."""
    import pyarrow.parquet as pq

    names = sorted(os.listdir(d))
    m0 = time.monotonic()
    rows = 0
    for name in names:
        path = os.path.join(d, name)
        if name.endswith(".parquet"):
            rows += pq.ParquetFile(path, pre_buffer=False).read(use_threads=False).num_rows
        elif not name.endswith(".tar") and os.path.isfile(path):
            with open(path, "rb") as f:
                f.read()
    m1 = time.monotonic()
    shard = next(n for n in names if n.endswith(".tar"))
    with open(os.path.join(d, shard), "rb") as f:
        f.read()
    m2 = time.monotonic()
    return {"index_read_s": m1 - m0, "shard_read_s": m2 - m1, "floor_s": m2 - m0, "index_rows": rows,
            "index_files": [n for n in names if not n.endswith(".tar")]}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"best": min(values), "median": statistics.median(values), "slowest": max(values), "runs": values} \
        if values else {}


def run_startup_index(cfg: dict[str, Any], work: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Time to the first sample and to the first batches of a new dataset of
    ``startup_shards`` shards and ``startup_samples`` samples, each run in a fresh
    interpreter: one warm-up of each (untimed: it brings the index and the first shards into
    the page cache, as any earlier use of a local dataset would), then ``startup_repeats``;
    beside them the floor: one read of the index and of one shard (:func:`_startup_floor`)."""
    shards, samples = cfg["startup_shards"], cfg["startup_samples"]
    out: dict[str, Any] = {"shards": shards, "samples": samples, "workers": cfg["workers"],
                           "batch_size": cfg["batch_size"], "repeats": cfg["startup_repeats"],
                           "target_size": list(STARTUP_TARGET_SIZE)}
    fmt = synthetic_dataset(work, samples, shards, log)
    out["dataset"] = {k: v for k, v in fmt.items() if k != "dir"}
    if cfg.get("prepare_only"):
        return out
    jobs = {"floor": {"kind": "startup", "what": "floor", "dir": fmt["dir"]},
            "first_sample": {"kind": "startup", "what": "first_sample", "dir": fmt["dir"]},
            "first_batch": {"kind": "startup", "what": "first_batch", "dir": fmt["dir"], "workers": cfg["workers"],
                            "batch_size": cfg["batch_size"], "passes": 2}}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in jobs}
    for i in range(cfg["startup_repeats"] + 1):
        for what, job in jobs.items():
            raw = _spawn(job, cfg["job_timeout_s"])
            bad = [k for k in raw.get("keys", []) if not (isinstance(k, str) and k.isdigit() and int(k) < samples)]
            if bad:
                raw = {"error": f"keys not in the dataset: {bad[:3]}"}
            if i == 0:
                out.setdefault("warmup", {})[what] = raw
            else:
                runs[what].append(raw)
    out["runs"] = runs
    errors = [r["error"] for rs in runs.values() for r in rs if "error" in r]
    if errors:
        out["error"] = errors[0]
        log(f"startup: {errors[0]}")
        return out
    fs, fb = runs["first_sample"], runs["first_batch"]
    out["floor_s"] = _spread([r["floor_s"] for r in runs["floor"]])
    out["index_read_floor_s"] = _spread([r["index_read_s"] for r in runs["floor"]])
    out["first_sample_s"] = _spread([r["first_sample_s"] for r in fs])
    out["open_s"] = _spread([r["open_s"] for r in fs])
    out["first_batch_s"] = _spread([r["passes"][0]["since_new_dataset_s"] for r in fb])
    out["second_pass_first_batch_s"] = _spread([r["passes"][1]["first_batch_s"] for r in fb])
    # each run's slowest new worker, over both passes
    out["worker_first_batch_s"] = _spread([max(w["first_batch_s"] for p in r["passes"] for w in p["workers"])
                                          for r in fb])
    out["worker_start_s"] = _spread([max(w["start_s"] for p in r["passes"] for w in p["workers"]) for r in fb])
    return out


def run_small_defaults(cfg: dict[str, Any], work: str, log: Callable[[str], None]) -> dict[str, Any]:
    """A small job, one process: every system at its defaults (the format written and the
    dataset built with nothing but the required arguments; datapipe's are shuffled, LitData's
    and MosaicML's are not, WebDataset's shuffle no shard), and each peer also at our
    settings (datapipe's default shard size, shuffled as the sweep shuffles). Modes (a)
    and (c)."""
    n, mean = cfg["small_samples"], cfg["small_mean_bytes"]
    c = corpus(work, n, mean, cfg["seed"])
    shard_bytes = _datapipe_default_shard_bytes()
    out: dict[str, Any] = {"samples": n, "mean_bytes": mean, "payload_MB": c["payload"] / 1e6,
                           "datapipe_shard_bytes": shard_bytes, "target_size": list(SMALL_TARGET_SIZE),
                           "systems": {}}
    for system in cfg["systems"]:
        variants: list[tuple[str, dict[str, Any], bool]] = [("datapipe", {}, True)]  # (name, format, defaults)
        if system != "datapipe":
            variants = [(f"{system}@default", PEER_DEFAULTS[system]["settings"], True),
                        (system, _same_setting(system, shard_bytes), False)]
        for name, setting, defaults in variants:
            entry: dict[str, Any] = {"format_settings": setting,
                                     "loader": "its defaults" if defaults else "our settings (shuffled)"}
            out["systems"][name] = entry
            fmt = _prepared(work, system, setting, c, log, entry)
            if fmt is None or cfg.get("prepare_only"):
                continue
            job = {"system": system, "mode": "one_process", "dir": fmt["dir"], "keys": c["keys"], "seed": cfg["seed"],
                   "epochs": cfg["epochs"], "batch_size": cfg["batch_size"], "workers": cfg["workers"],
                   "defaults": defaults}
            raw = _spawn(job, cfg["job_timeout_s"])
            entry["one_process"] = raw if "error" in raw else _summarise(raw, n, c["payload"])
            log(f"small {name:22s} one_process {_shown(entry['one_process'])}")
    if not cfg.get("prepare_only"):
        out["modes"] = mode_figures(out)
    return out


def run_startup(cfg: dict[str, Any], work: str, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, fn in (("index", run_startup_index), ("small_defaults", run_small_defaults)):
        try:
            out[key] = fn(cfg, work, log)
        except Exception as e:  # one part failing must not hide the other's figures
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    if not cfg.get("prepare_only"):
        log(loader_startup_md(out))
    return out


# -- the JPEG map benchmark -------------------------------------------------------------------


def jpeg_corpus(work: str, n: int, side: int, seed: int) -> dict[str, Any]:
    """``n`` real JPEGs (``side`` x ``side``, smooth random content: an 8x8 random image
    scaled up bicubically, quality 90) and a cls field, as files; reused when complete."""
    from PIL import Image

    home = os.path.join(work, f"jpegs-{n}-{side}-{seed}")
    done = home + ".done"
    if not os.path.exists(done):
        shutil.rmtree(home, ignore_errors=True)
        rng = np.random.default_rng(seed)
        for i in range(n):
            d = os.path.join(home, f"{i // 1000:05d}")
            os.makedirs(d, exist_ok=True)
            small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
            small.resize((side, side), Image.Resampling.BICUBIC).save(os.path.join(d, f"sample{i:08d}.jpg"),
                                                                        quality=90)
            with open(os.path.join(d, f"sample{i:08d}.cls"), "wb") as f:
                f.write(str(i % 10).encode())
        keys = [f"{i // 1000:05d}/sample{i:08d}" for i in range(n)]
        with open(home + ".keys.json", "w") as f:
            json.dump(keys, f)
        with open(done, "w") as f:
            json.dump({"images": n}, f)
    from .bench_read import corpus_samples

    samples = corpus_samples(home, n, 0, seed)
    payload = sum(os.path.getsize(p) for _, files in samples for p in files.values())
    return {"dir": home, "samples": samples, "payload": payload, "keys": home + ".keys.json"}


#: the map's output side, set by the job before the loader starts (workers are forked)
_MAP_SIDE = 128


def _decode_resize(data: Any) -> Any:
    import torch
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB").resize((_MAP_SIDE, _MAP_SIDE), Image.Resampling.BILINEAR)
    # np.array (a writable copy, 48 KB) rather than np.asarray: torch.from_numpy warns on read-only arrays
    return torch.from_numpy(np.array(img))


def datapipe_jpeg_map(sample: dict[str, Any]) -> dict[str, Any]:
    """Decode the JPEG with PIL, resize it, and return it as a uint8 HWC tensor with the key."""
    return {"__key__": sample["__key__"], "img": _decode_resize(sample["jpg"])}


def litdata_jpeg_map(sample: dict[str, Any]) -> dict[str, Any]:
    """The same map for LitData's ``transform=`` (its samples carry the key as ``key``)."""
    return {"key": sample["key"], "img": _decode_resize(sample["jpg"])}


def run_map_job(job: dict[str, Any]) -> dict[str, Any]:
    global _MAP_SIDE
    _MAP_SIDE = job["side"]
    with open(job["keys"]) as f:
        expected = set(json.load(f))
    _warm_page_cache(job["dir"])
    bs, workers = job["batch_size"], job["workers"]
    if job["system"] == "datapipe":
        from datapipe.loader import StreamingDataLoader, StreamingDataset

        extra = {"map_threads": job["threads"]} if job.get("threads") else {}
        try:
            ds = StreamingDataset(job["dir"], seed=job["seed"], decode=None, map=datapipe_jpeg_map, **extra)
        except TypeError as e:
            return {"unavailable": f"StreamingDataset({extra}) is not available here: {e}"}
        it: Any = StreamingDataLoader(ds, batch_size=bs, num_workers=workers)
        settings = {"decode": None, "map": "datapipe_jpeg_map", "batch_size": bs, "num_workers": workers,
                    "persistent_workers": it.persistent_workers, **extra}
    else:
        import litdata

        lds = litdata.StreamingDataset(input_dir=job["dir"], shuffle=True, seed=job["seed"],
                                       transform=litdata_jpeg_map)
        # workers persist across epochs, as datapipe's do by default
        it = litdata.StreamingDataLoader(lds, batch_size=bs, num_workers=workers, persistent_workers=True)
        settings = {"transform": "litdata_jpeg_map", "batch_size": bs, "num_workers": workers,
                    "persistent_workers": True}
    eps = []
    shape = None
    for epoch in range(job["epochs"]):
        if epoch and job["system"] == "datapipe":
            it.stream.set_epoch(epoch)
        keys: list[str] = []
        c0, t0 = _cpu_s(), time.perf_counter()
        for batch in it:
            keys.extend(_keys_of(batch))
            shape = list(batch["img"].shape), str(batch["img"].dtype)
        eps.append({"seconds": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0, **_exactly_once(keys, expected)})
    return {"open_s": 0.0, "settings": settings, "epochs": eps, "batch_img": shape}


def run_map(cfg: dict[str, Any], work: str, log: Callable[[str], None]) -> dict[str, Any]:
    n = cfg["map_images"]
    c = jpeg_corpus(work, n, cfg["map_side"], cfg["seed"])
    out: dict[str, Any] = {"images": n, "side": cfg["map_side"], "out_side": cfg["map_out_side"],
                           "payload_MB": c["payload"] / 1e6, "batch_size": cfg["map_batch_size"],
                           "shard_bytes": cfg["map_shard_bytes"],
                           "map": "PIL decode + resize to out_side x out_side (bilinear) + torch.from_numpy, "
                                  "uint8 HWC", "systems": {}}
    for system in cfg["map_systems"]:
        entry: dict[str, Any] = {}
        out["systems"][system] = entry
        try:
            fmt = ensure_format(work, system, _same_setting(system, cfg["map_shard_bytes"]), c, log)
        except Exception as e:
            entry["error"] = f"prepare: {type(e).__name__}: {e}"
            continue
        # worker processes; and for datapipe, threads in the main process (map_threads=N,
        # num_workers=0): PIL releases the GIL while it decodes and resizes
        runs = [(f"workers_{w}", w, 0) for w in cfg["map_workers"]]
        if system == "datapipe":
            runs += [(f"threads_{t}", 0, t) for t in cfg["map_threads"]]
        for label, w, t in runs:
            job = {"kind": "map", "system": system, "dir": fmt["dir"], "keys": c["keys"], "seed": cfg["seed"],
                   "epochs": cfg["epochs"], "batch_size": cfg["map_batch_size"], "workers": w, "threads": t,
                   "side": cfg["map_out_side"]}
            raw = _spawn(job, cfg["job_timeout_s"])
            r = raw if "error" in raw or "unavailable" in raw else _summarise(raw, n, c["payload"])
            if "batch_img" in raw:
                r["batch_img"] = raw["batch_img"]
            entry[label] = r
            shown = r.get("error") or r.get("unavailable") or f"{r['samples_per_s']:,.0f} images/s"
            log(f"map {system:10s} {label:10s} {shown}")
        lo, hi = (entry.get(f"workers_{w}", {}) for w in (1, 2))
        if "samples_per_s" in lo and "samples_per_s" in hi:
            entry["two_over_one"] = hi["samples_per_s"] / lo["samples_per_s"]
    return out


# -- the issue's targets ---------------------------------------------------------------------------

GB_PER_S_TARGET = 1000.0  # MB/s of payload through StreamingDataLoader(num_workers=2), 16 KiB and larger
OVER_LITDATA_LOADER = 5.0
OVER_LITDATA_ONE_PROCESS = 1.5
BATCHED_OVER_LITDATA = 10.0
MAP_TWO_OVER_ONE = 1.8
MEMORY_SLACK_MB = 200.0


def _rate(cell: dict[str, Any], system: str, mode: str, key: str = "samples_per_s") -> float | None:
    v = cell.get("systems", {}).get(system, {}).get(mode, {}).get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _litdata_best(cell: dict[str, Any], mode: str) -> tuple[float | None, str]:
    """The faster of LitData at our chunk size and at its own default (the stricter bar)."""
    got = [(r, name) for name in ("litdata", "litdata@default") if (r := _rate(cell, name, mode)) is not None]
    return max(got) if got else (None, "")


def _check(name: str, met: bool | None, figures: list[str], issue: int = 12) -> dict[str, Any]:
    return {"issue": issue, "target": name, "status": "NOT MEASURED" if met is None else "MET" if met else "MISSED",
            "figures": figures}


def target_checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets, each MET, MISSED or NOT MEASURED, with the figures behind it,
    computed from this run's results (LitData is taken at the faster of its two settings)."""
    cells: dict[str, Any] = result.get("cells", {})
    out = []

    def per_cell(name: str, ratio: Callable[[dict[str, Any]], tuple[float | None, str]], bar: float,
                 only: Callable[[dict[str, Any]], bool] = lambda c: True) -> None:
        figs, oks = [], []
        for cid, c in cells.items():
            if not only(c):
                continue
            v, text = ratio(c)
            figs.append(f"{cid}: {text}")
            oks.append(None if v is None else v >= bar)
        met = None if not oks or None in oks else all(oks)
        out.append(_check(name, met, figs or ["not measured"]))

    def loader_mb(c: dict[str, Any]) -> tuple[float | None, str]:
        v = _rate(c, "datapipe", "dataloader", "MB_per_s")
        return v, "not measured" if v is None else f"{v:,.0f} MB/s"

    def ratio_to_lit(mode: str, lit_mode: str,
                     bar_of: float | None = None) -> Callable[[dict[str, Any]], tuple[float | None, str]]:
        def f(c: dict[str, Any]) -> tuple[float | None, str]:
            ours = _rate(c, "datapipe", mode)
            lit, which = _litdata_best(c, lit_mode)
            if ours is None or lit is None:
                err = c.get("systems", {}).get("datapipe", {}).get(mode, {})
                why = ("not available in this datapipe" if "unavailable" in err
                       else str(err.get("error", ""))[:100] or ("LitData not measured" if ours else "not run"))
                return None, f"not measured ({why})"
            text = f"{ours / lit:.2f}x ({ours:,.0f} vs {which} {lit:,.0f} samples/s)"
            floor = c.get("read_floor", {}).get("samples_per_s")
            if bar_of is not None and floor and bar_of * lit > floor:
                text += (f"; {bar_of:g}x is {bar_of * lit:,.0f} samples/s, above this cell's read floor "
                         f"{floor:,.0f} samples/s (epochs that each read every shard once)")
            return ours / lit, text
        return f

    per_cell(f"StreamingDataLoader(num_workers=2) >= {GB_PER_S_TARGET / 1000:g} GB/s of payload, 16 KiB and "
             "256 KiB samples", loader_mb, GB_PER_S_TARGET, lambda c: c.get("mean_bytes", 0) >= 16384)
    per_cell(f"StreamingDataLoader >= {OVER_LITDATA_LOADER:g}x LitData's StreamingDataLoader, every cell",
             ratio_to_lit("dataloader", "dataloader", OVER_LITDATA_LOADER), OVER_LITDATA_LOADER)
    per_cell(f"one process, per sample >= {OVER_LITDATA_ONE_PROCESS:g}x LitData, every cell",
             ratio_to_lit("one_process", "one_process", OVER_LITDATA_ONE_PROCESS), OVER_LITDATA_ONE_PROCESS)
    per_cell(f"batched mode >= {BATCHED_OVER_LITDATA:g}x LitData's per-sample rate, every cell",
             ratio_to_lit("batched", "one_process", BATCHED_OVER_LITDATA), BATCHED_OVER_LITDATA)
    m = result.get("map", {}).get("systems", {}).get("datapipe", {})
    r = m.get("two_over_one")
    if r is None:
        out.append(_check(f"JPEG map: 2 workers >= {MAP_TWO_OVER_ONE:g}x 1 worker", None, ["not measured"]))
    else:
        out.append(_check(f"JPEG map: 2 workers >= {MAP_TWO_OVER_ONE:g}x 1 worker", r >= MAP_TWO_OVER_ONE,
                          [f"{r:.2f}x ({m['workers_2']['samples_per_s']:,.0f} vs "
                           f"{m['workers_1']['samples_per_s']:,.0f} images/s)"]))
    figs, oks = [], []
    for cid, c in cells.items():
        mem = c.get("systems", {}).get("datapipe", {}).get("dataloader", {}).get("memory")
        if not mem:
            continue
        ring = mem.get("ring_bytes")
        limit = (mem.get("prefetch_bytes", 0) + (ring or 0)) / MiB + MEMORY_SLACK_MB
        peak_w = max(mem["worker_peak_rss_MB"], default=0.0)
        oks.append(max(mem["main_peak_rss_MB"], peak_w) <= limit)
        figs.append(f"{cid}: main {mem['main_peak_rss_MB']:,.0f} MB, largest worker {peak_w:,.0f} MB; limit "
                    f"{limit:,.0f} MB = prefetch_bytes {mem.get('prefetch_bytes', 0) / MiB:,.0f} MiB + ring "
                    + ("(size not exposed: counted as 0)" if ring is None else f"{ring / MiB:,.0f} MiB")
                    + f" + {MEMORY_SLACK_MB:g} MB")
    out.append(_check("memory: main and each worker within prefetch_bytes + ring + 200 MB over an epoch",
                      (all(oks) if oks else None), figs or ["not measured"]))
    return out + startup_checks(result)


FIRST_OVER_SECOND = 0.9
FIRST_OVER_LITDATA = 1.5
NONPERSISTENT_OVER_PERSISTENT = 0.9
NONPERSISTENT_OVER_LITDATA = 3.0
FIRST_SAMPLE_S = 0.1
WORKER_FIRST_BATCH_S = 0.1
SMALL_OVER_LITDATA = 1.5

Figure = Callable[[dict[str, Any]], tuple[bool | None, str]]


def _own_ratio(key: str, of: str, bar: float) -> Figure:
    """datapipe's ``key`` figure over its own ``of`` figure, against ``bar``."""
    def f(m: dict[str, Any]) -> tuple[bool | None, str]:
        d = m.get("systems", {}).get("datapipe", {})
        a, b = d.get(key), d.get(of)
        if a is None or b is None:
            return None, "not measured"
        return a / b >= bar, f"{a / b:.2f}x ({a:,.0f} vs {b:,.0f} samples/s)"
    return f


def _over_litdata(key: str, bar: float) -> Figure:
    def f(m: dict[str, Any]) -> tuple[bool | None, str]:
        r = m.get("datapipe_over_litdata", {}).get(key)
        if r is None:
            return None, "not measured"
        return r["ratio"] >= bar, (f"{r['ratio']:.2f}x ({r['datapipe']:,.0f} vs {r['litdata_variant']} "
                                   f"{r['litdata']:,.0f} samples/s)")
    return f


def startup_checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 29's targets (first epochs, non-persistent workers, start-up, a small job at
    defaults), each MET, MISSED or NOT MEASURED: a start-up figure counts only at the size
    the target names. Each cell's ratios are :func:`mode_figures`'."""
    out: list[dict[str, Any]] = []
    cells: dict[str, Any] = result.get("cells", {})

    def each_cell(name: str, figure: Figure) -> None:
        figs, oks = [], []
        for cid, c in cells.items():
            ok, text = figure(c.get("modes") or mode_figures(c))
            figs.append(f"{cid}: {text}")
            oks.append(ok)
        met = None if not oks or None in oks else all(oks)
        out.append(_check(name, met, figs or ["not measured"], 29))

    each_cell(f"(a) first epoch of a new StreamingDataset, one process >= {FIRST_OVER_SECOND:.0%} of the same "
              "object's second epoch, every cell", _own_ratio("first_epoch", "second_epoch", FIRST_OVER_SECOND))
    each_cell(f"(a) first epoch of a new StreamingDataset, one process >= {FIRST_OVER_LITDATA:g}x LitData's first "
              "epoch, every cell", _over_litdata("first_epoch", FIRST_OVER_LITDATA))
    each_cell(f"(b) non-persistent workers: every epoch >= {NONPERSISTENT_OVER_PERSISTENT:.0%} of persistent "
              "workers' steady state (slowest epoch / best steady epoch), every cell",
              _own_ratio("nonpersistent_slowest", "persistent_steady", NONPERSISTENT_OVER_PERSISTENT))
    each_cell(f"(b) non-persistent workers: every epoch >= {NONPERSISTENT_OVER_LITDATA:g}x LitData's "
              "StreamingDataLoader built the same way (slowest epochs), every cell",
              _over_litdata("nonpersistent_slowest", NONPERSISTENT_OVER_LITDATA))
    startup = result.get("startup", {})
    ix = startup.get("index", {})
    shards_t, samples_t = STARTUP_TARGET_SIZE
    for name, key, bar in ((f"time to the first sample of a new dataset <= {FIRST_SAMPLE_S * 1000:.0f} ms, local, "
                            f"{shards_t:,} shards and {samples_t:,} samples", "first_sample_s", FIRST_SAMPLE_S),
                           (f"a new worker's first batch <= {WORKER_FIRST_BATCH_S * 1000:.0f} ms after the worker "
                            "starts (the slowest worker of a run, two passes of new workers)", "worker_first_batch_s",
                            WORKER_FIRST_BATCH_S)):
        s = ix.get(key)
        if not s:
            out.append(_check(name, None, [str(ix.get("error", "not measured"))[:200]], 29))
            continue
        text = (f"median {s['median'] * 1000:,.0f} ms (best {s['best'] * 1000:,.0f}, slowest "
                f"{s['slowest'] * 1000:,.0f}; {len(s['runs'])} runs) on {ix['shards']:,} shards of "
                f"{ix['samples']:,} samples")
        if (ix["shards"], ix["samples"]) != STARTUP_TARGET_SIZE:
            out.append(_check(name, None, [text + "; not at the target's size"], 29))
            continue
        out.append(_check(name, s["median"] <= bar, [text], 29))
    small = startup.get("small_defaults", {})
    n_t, mean_t = SMALL_TARGET_SIZE
    name = (f"at defaults on small data ({n_t:,} samples of {mean_t / 1024:g} KiB), one process: "
            f">= {SMALL_OVER_LITDATA:g}x LitData at its defaults, (a) first epoch and (c) steady state")
    m = small.get("modes")
    if not m:
        out.append(_check(name, None, [str(small.get("error", "not measured"))[:200]], 29))
        return out
    oks, figs = [], []
    for key, label in (("first_epoch", "(a) first epoch"), ("steady", "(c) steady")):
        ok, text = _over_litdata(key, SMALL_OVER_LITDATA)(m)
        oks.append(ok)
        figs.append(f"{label}: {text}")
    if (small["samples"], small["mean_bytes"]) != SMALL_TARGET_SIZE:
        figs.append(f"measured on {small['samples']:,} samples of {small['mean_bytes'] / 1024:g} KiB: not at the "
                    "target's size")
        oks.append(None)
    out.append(_check(name, None if None in oks else all(oks), figs, 29))
    return out


# -- the whole run ---------------------------------------------------------------------------


def _datapipe_default_shard_bytes() -> int:
    """datapipe.pack's own default shard size, read from its signature (for the record)."""
    import inspect

    import datapipe

    return int(inspect.signature(datapipe.pack).parameters["shard_bytes"].default)


def run(config: dict[str, Any] | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every figure of the sweep and the map benchmark, as JSON-able data."""
    cfg = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(cfg["cells"]) - set(ALL_CELLS))
    if unknown:
        raise ValueError(f"unknown cells {unknown}; choose from {list(ALL_CELLS)}")
    bad = sorted(set(cfg["systems"]) - set(SYSTEMS))
    if bad:
        raise ValueError(f"unknown systems {bad}; choose from {list(SYSTEMS)}")
    bad = sorted(set(cfg["parts"]) - set(PARTS))
    if bad:
        raise ValueError(f"unknown parts {bad}; choose from {list(PARTS)}")
    for key in ("epochs", "startup_samples", "startup_shards", "startup_repeats", "small_samples", "small_mean_bytes"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ValueError(f"{key}={cfg[key]!r}: expected a whole number >= 1")
    if cfg["startup_shards"] > cfg["startup_samples"]:
        raise ValueError(f"startup_shards={cfg['startup_shards']} > startup_samples={cfg['startup_samples']}: "
                         "a shard holds at least one sample")
    if "startup" in cfg["parts"] and "datapipe" not in cfg["systems"]:
        raise ValueError("the startup part measures datapipe (and compares the peers with it): add datapipe to "
                         "the systems")
    say = log or (lambda s: None)
    work = cfg["workdir"] or tempfile.mkdtemp(prefix="bench_loader-")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"config": dict(cfg), "machine": {"cpus": os.cpu_count()},
                              "peer_defaults": PEER_DEFAULTS,
                              "datapipe_default_shard_bytes": _datapipe_default_shard_bytes()}
    try:
        if "sweep" in cfg["parts"]:
            result["cells"] = {cell: run_cell(cfg, cell, work, say) for cell in cfg["cells"]}
        if "map" in cfg["parts"] and not cfg["prepare_only"]:
            result["map"] = run_map(cfg, work, say)
        if "startup" in cfg["parts"]:
            result["startup"] = run_startup(cfg, work, say)
    finally:
        if not cfg["workdir"]:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = time.perf_counter() - t0
    if not cfg["prepare_only"]:
        result["targets"] = target_checks(result)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    return result


def _prepare_job(job: dict[str, Any]) -> dict[str, Any]:
    from .bench_read import corpus_samples

    samples = corpus_samples(job["corpus_dir"], job["samples"], 0, 0)  # the corpus exists: this only lists it
    if len(samples) != job["samples"]:
        raise RuntimeError(f"{job['corpus_dir']}: {len(samples)} samples, expected {job['samples']}")
    prepare(job["system"], job["setting"], {"dir": job["corpus_dir"], "samples": samples}, job["dir"])
    return {}


def _job_main(spec: str) -> None:
    job = json.loads(spec)
    kind = job.get("kind")
    jobs = {"map": run_map_job, "prepare": _prepare_job, "synthetic": _synthetic_job, "startup": run_startup_job}
    out = jobs.get(kind, run_job)(job)
    sys.stdout.flush()
    print("RESULT " + json.dumps(out, default=float), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_loader", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"tiny cells {list(QUICK_CELLS)} and a tiny JPEG corpus")
    ap.add_argument("--cells", help=f"comma-separated cells, from {', '.join(ALL_CELLS)}")
    ap.add_argument("--systems", help=f"comma-separated, from {', '.join(SYSTEMS)} (default all)")
    ap.add_argument("--parts", help=f"comma-separated, from {', '.join(PARTS)} (default all)")
    ap.add_argument("--startup", action="store_true",
                    help="only the start-up part (the same as --parts startup): time to the first sample and batch "
                         "of a dataset of --startup-shards shards and --startup-samples samples, and a small job at "
                         "every system's defaults")
    ap.add_argument("--startup-samples", type=int, help="samples of the start-up dataset (default 10^7; ~1 KiB of disk "
                    "each)")
    ap.add_argument("--startup-shards", type=int, help="shards of the start-up dataset (default 10^4)")
    ap.add_argument("--epochs", type=int, help="timed epochs per measurement (default 3: the first epoch of a new "
                    "dataset, then the steady state; best and median reported)")
    ap.add_argument("--no-peer-defaults", action="store_true",
                    help="measure peers only at datapipe's shard size, not also at their own defaults")
    ap.add_argument("--workdir", help="keep corpora and prepared formats here, reused by later runs")
    ap.add_argument("--prepare-only", action="store_true",
                    help="only write the corpora and formats into --workdir (no measurement), for a later run: "
                         "the sweep's, or those of the parts given (--parts, --startup)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # one measurement, run by the sweep in a fresh interpreter
    a = ap.parse_args(argv)
    if a.job:
        _job_main(a.job)
        return
    cfg: dict[str, Any] = dict(QUICK) if a.quick else {}
    if a.cells:
        cfg["cells"] = [x.strip() for x in a.cells.split(",") if x.strip()]
    if a.systems:
        cfg["systems"] = [x.strip() for x in a.systems.split(",") if x.strip()]
    if a.parts:
        cfg["parts"] = [x.strip() for x in a.parts.split(",") if x.strip()]
    if a.startup:
        if a.parts:
            ap.error("--startup is --parts startup: give one of them")
        cfg["parts"] = ["startup"]
    for key in ("startup_samples", "startup_shards", "epochs"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    if a.no_peer_defaults:
        cfg["peer_defaults"] = False
    if a.workdir:
        cfg["workdir"] = a.workdir
    if a.prepare_only:
        if not a.workdir:
            ap.error("--prepare-only needs --workdir (where the formats are kept)")
        cfg.update(prepare_only=True, parts=cfg.get("parts", ["sweep"]))
    try:
        res = run(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        ap.error(str(e))
    print_json(res, a.out)


if __name__ == "__main__":
    main()
