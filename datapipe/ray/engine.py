"""``datapipe pack SRC DEST --engine ray``: the local packer's listing rules and shard plan,
run as Ray tasks.

1. The driver lists the top of ``SRC`` without descending (more levels, up to three, while
   there are fewer folders than CPUs in the cluster), and Ray tasks list the folders below,
   each a whole subtree (``packing.list_directory(within=...)``). A sample's files always share a
   folder under both key rules, so no sample is split between listings.
2. The driver merges the listings (sorted by key, as a local pack lists), reports what
   was dropped and merged, and cuts the samples into shards with the local packer's
   ``plan_shards``: one Ray block per planned shard.
3. The blocks are written through :class:`~datapipe.ray.DatapipeDatasink` with rows of
   files: each write task reads its files straight into its shard (``pack_shard``, the
   local packer's own), so file bytes never pass through Ray's object store.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from typing import Any

import pyarrow as pa
import ray
import ray.data

from ..errors import EmptyInputError, PackOptionError
from ..packing import (
    DirectoryListing,
    FileSample,
    PackResult,
    describe_tree,
    list_directory,
    pack_options,
    plan_shards,
    refuse_tar_shards,
    source_kind,
)
from ..publish import option_path
from ..storage import open_store
from .sink import FILE_COLUMNS, DatapipeDatasink, write_through

__all__ = ["pack", "connect", "list_tree", "file_block"]

_MAX_DRIVER_LEVELS = 3  # the driver lists at most this many levels, until there is a folder per CPU


def connect(address: str | None = None, progress: bool = True) -> None:
    """Join the Ray cluster at ``address`` (``"auto"``: the one this machine belongs to),
    or start a local one when ``address`` is None and none is running."""
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = progress


def _listing_doc(listing: DirectoryListing) -> str:
    return json.dumps({"samples": [[s.key, s.files, s.tar_bytes] for s in listing.samples],
                       "dropped": listing.dropped, "bad": listing.bad, "passed_over": listing.passed_over})


def _list_folder(row: dict[str, Any], root: str, skip_errors: bool, follow_links: bool, exclude: str | None,
                 keys: str) -> dict[str, Any]:
    """Ray task: the listing of one folder of ``root``, as JSON (one row per folder)."""
    listing = list_directory(root, skip_errors, follow_links, exclude, keys, within=row["folder"], allow_empty=True)
    return {"listing": _listing_doc(listing)}


def _from_doc(doc: dict[str, Any]) -> DirectoryListing:
    return DirectoryListing([FileSample(k, [(f, p, n) for f, p, n in files], t) for k, files, t in doc["samples"]],
                            [(p, why) for p, why in doc["dropped"]], [(p, why) for p, why in doc["bad"]],
                            [(p, why) for p, why in doc["passed_over"]])


def _merge(into: DirectoryListing, other: DirectoryListing) -> None:
    into.samples.extend(other.samples)
    into.dropped.extend(other.dropped)
    into.bad.extend(other.bad)
    into.passed_over.extend(other.passed_over)


def list_tree(src: str, *, skip_errors: bool = False, follow_links: bool = False, exclude: str | None = None,
              keys: str = "first-dot") -> DirectoryListing:
    """The listing ``list_directory(src, ...)`` gives, made by Ray tasks, one per folder."""
    root = os.path.abspath(src)
    total = DirectoryListing([])
    folders = [""]
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    for _ in range(_MAX_DRIVER_LEVELS):  # the top levels here: few folders, each listed without descending
        if len(folders) >= cpus:
            break
        deeper = []
        for folder in folders:
            top = list_directory(root, skip_errors, follow_links, exclude, keys, within=folder, recursive=False,
                                 allow_empty=True)
            _merge(total, top)
            deeper.extend(top.folders)
        folders = deeper
    if folders:
        units = ray.data.from_items([{"folder": f} for f in folders], override_num_blocks=min(len(folders), 4 * cpus))
        listed = units.map(partial(_list_folder, root=root, skip_errors=skip_errors, follow_links=follow_links,
                                   exclude=exclude, keys=keys))
        for row in listed.iter_rows():
            _merge(total, _from_doc(json.loads(row["listing"])))
    total.samples.sort(key=lambda s: s.key)
    if not total.samples:
        hint = "files need a 'key.field' name, or pass --keys file" if keys == "first-dot" else "no regular file"
        raise EmptyInputError(f"no sample found under {root} ({hint})")
    return total


def file_block(samples: list[FileSample]) -> pa.Table:
    """The Ray block of one planned shard: a row per sample, its files as lists
    (:data:`~datapipe.ray.sink.FILE_COLUMNS`), for a sink with ``rows="files"``."""
    return pa.table({
        "__key__": pa.array([s.key for s in samples], pa.string()),
        "__fields__": pa.array([[f for f, _, _ in s.files] for s in samples], pa.list_(pa.string())),
        "__paths__": pa.array([[p for _, p, _ in s.files] for s in samples], pa.list_(pa.string())),
        "__sizes__": pa.array([[n for _, _, n in s.files] for s in samples], pa.list_(pa.int64())),
        "__tar_bytes__": pa.array([s.tar_bytes for s in samples], pa.int64()),
    }).select(list(FILE_COLUMNS))


def pack(src: str, dest: str, *, address: str | None = None, **options: Any) -> PackResult:
    """:func:`datapipe.pack` of a directory of files, on Ray (``address``: as
    :func:`connect`): the same samples, keys and bytes per sample as a local pack, in
    shards named by Ray write task (``shard-TTTTTT-NNNNNN.tar``). ``options``: those of
    :func:`datapipe.pack` (checked by the same rules, :func:`datapipe.packing.pack_options`),
    but ``workers`` and ``part``: Ray spreads the work over its cluster. Not resumable: a
    pack that failed is removed (what it wrote, by its journal); run it again. JSONL and
    Parquet tables: ``ray.data.read_parquet``/``read_json`` and :func:`datapipe.ray.write`."""
    t0 = time.perf_counter()
    local_only = sorted(n for n in ("workers", "part") if n in options)
    if local_only:
        raise PackOptionError(f"{' and '.join(local_only)}: options of a local pack (--engine local); Ray spreads "
                              "the work over its cluster")
    o = pack_options(**options)  # checked before Ray starts
    src, dest = option_path(src, "src"), option_path(dest, "dest")
    if source_kind(src) != "directory":
        raise PackOptionError(f"--engine ray packs a directory of files; {src} is a table: read it with "
                              "ray.data.read_parquet / read_json and write it with datapipe.ray.write(ds, DEST)")
    connect(address, o.progress)
    sink = DatapipeDatasink(dest, shard_bytes=o.limits.shard_bytes, shard_samples=o.limits.shard_samples,
                            compression=o.compression, level=o.level, storage_options=o.storage_options,
                            overwrite=o.overwrite, rows="files", skip_errors=o.skip_errors)
    sink.begin()  # the destination's lock now: a busy destination fails before the listing
    try:
        listing = list_tree(src, skip_errors=o.skip_errors, follow_links=o.follow_links,
                            exclude=open_store(dest, o.storage_options).local_path(""), keys=o.keys)
        if not o.tars_as_files:
            refuse_tar_shards(src, listing.samples)
        plan = plan_shards(listing.samples, o.limits.shard_bytes, o.limits.shard_samples)
        ds = ray.data.from_arrow([file_block(group) for group in plan])
    except BaseException as e:  # nothing written yet: the sink gives its lock back
        sink.on_write_failed(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        raise
    result = write_through(ds, sink)
    result.keys = o.keys
    result.skipped[:0] = list(listing.passed_over) + list(listing.bad)
    describe_tree(result, src, listing.dropped, listing.samples)
    result.dest, result.seconds = dest, time.perf_counter() - t0
    return result
