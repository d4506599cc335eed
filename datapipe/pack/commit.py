"""Publish a dataset: shard table and sample table first, ``manifest.json`` last (the
commit point: a dataset without a manifest does not exist for readers)."""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from typing import Any, BinaryIO, cast

from ..errors import DestinationExistsError
from ..format import (
    MANIFEST,
    SAMPLES_FILE,
    SHARDS_FILE,
    SampleRecords,
    SampleTableWriter,
    ShardRecord,
    make_manifest,
    shard_table_bytes,
)
from ..format.index import FileDigest, digest_bytes
from ..storage import Store

__all__ = ["write_index", "check_destination", "retract_dataset", "WORK", "PLAN", "LOCK", "LEASE"]


def write_index(
    store: Store,
    shards: list[ShardRecord],
    samples: Iterable[SampleRecords],
    compression: str,
    fields: Iterable[str],
    extra: dict[str, Any] | None = None,
) -> None:
    """``samples`` yields each shard's records in the order of ``shards``. The manifest
    records the checksums of both index files, so a damaged index is an error too."""
    with store.open_writer(SAMPLES_FILE) as f:
        sink = _HashingWriter(f)
        writer = SampleTableWriter(cast(BinaryIO, sink))  # pyarrow needs only write/tell/closed of it
        for i, records in enumerate(samples):
            writer.add(i, records)
        writer.close()
    if writer.rows != sum(s.samples for s in shards):
        raise ValueError("sample records do not match the shard table")  # internal invariant
    table = shard_table_bytes(shards)
    store.put(SHARDS_FILE, table)
    files = {SHARDS_FILE: digest_bytes(table), SAMPLES_FILE: sink.digest.finish()}
    store.put(MANIFEST, make_manifest(shards, compression, sorted(set(fields)), extra, index_files=files))


class _HashingWriter(io.RawIOBase):
    """Passes writes through and hashes them (pyarrow writes the Parquet file through it)."""

    def __init__(self, sink: Any) -> None:
        self.sink, self.digest, self.pos = sink, FileDigest(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sink.write(b)
        self.digest.update(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


WORK = "_pack"
PLAN = f"{WORK}/plan.json"
# The writer's own lock and lease: owned by `lock.WriterLock`, never deleted by a cleanup
# (deleting a held lock file would let a second writer lock a new one).
LOCK = f"{WORK}/writer.lock"
LEASE = f"{WORK}/lease.json"


def check_destination(store: Store, overwrite: bool, resumable: bool = False) -> None:
    """Refuse a destination that holds a dataset unless ``overwrite``; with it, retract the
    old dataset (manifest first, so it stops existing before its parts go). With
    ``resumable``, a dataset whose pack was killed before it removed its journal is left
    to the journal: the same pack run again finishes it (`Journal` refuses any other)."""
    if store.exists(MANIFEST):
        if not overwrite:
            if resumable and store.exists(PLAN):
                return
            raise DestinationExistsError(
                f"{store.url(MANIFEST)} exists: {store.root} already holds a dataset "
                "(pass overwrite=True / --overwrite to replace it)"
            )
        retract_dataset(store)
        return
    # No dataset: files at the names a pack publishes are someone's (or a retraction that
    # was cut short), unless a pack's journal accounts for them; a pack would replace them
    keys = store.list()
    if any(k.startswith(f"{WORK}/") and k not in (LOCK, LEASE) for k in keys):
        return  # a killed pack's journal: the pack (its Journal) decides what is its own
    theirs = [k for k in keys if _OWN.match(k) and k not in (LOCK, LEASE)]
    if theirs:
        if not overwrite:
            shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            raise DestinationExistsError(
                f"{store.root} holds no dataset but files at names a pack writes ({shown}): a pack "
                "would replace them. Pack into another folder, or pass overwrite=True / --overwrite "
                "to delete them first"
            )
        retract_dataset(store)


# What a pack writes, and so all that --overwrite may delete: never anything else that
# happens to live under the destination (the source folder, say).
# (shard-TTTTTT-NNNNNN: shard N of Ray write task T, see datapipe.ray)
_OWN = re.compile(r"^(part-\d{5}-of-\d{5}/)?(shard-(\d{6,}-)?\d{6}\.tar(\.zst)?|manifest\.json|shards\.parquet"
                  r"|samples\.parquet|_pack/.*)$")


def retract_dataset(store: Store) -> None:
    """Delete what a pack wrote at ``store``: the manifest first, so the dataset stops
    existing before its parts go."""
    store.delete(MANIFEST)
    for key in store.list():
        if _OWN.match(key) and not key.endswith((LOCK, LEASE)):
            store.delete(key)
