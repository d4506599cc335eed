"""Make a dataset visible, and refuse or retract what a destination already holds.

The commit point is the manifest: a writer writes its part files and its index files,
then the manifest, last (:func:`commit`, which first checks the writer still holds the
destination); a dataset without a manifest does not exist for readers. A sample dataset's
index is ``shards.parquet`` and ``samples.parquet`` (:func:`write_index_files`), and its
manifest records their checksums, so a damaged index is an error too."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from ..errors import DestinationExistsError, PackError
from ..format import (
    MANIFEST,
    SAMPLES_FILE,
    SHARDS_FILE,
    FileDigest,
    SampleRecords,
    SampleTableWriter,
    ShardRecord,
    digest_bytes,
    make_manifest,
    shard_table_bytes,
)
from ..storage import Store
from .layout import LEASE, LOCK, PLAN, SHARD_FILES, WORK, DatasetFiles

if TYPE_CHECKING:
    from .lock import WriterLock

__all__ = ["commit", "write_index", "write_index_files", "check_destination", "retract_dataset"]


def commit(lock: WriterLock, write_files: Callable[[Store], bytes], *, manifest: str = MANIFEST) -> None:
    """Publish a dataset whose part files are all published: refuse (``DestinationBusyError``)
    if another writer took the destination over, then ``write_files(store)`` writes the
    index files and returns the manifest's bytes, which go to ``manifest`` last. The
    journal, if any, is the caller's to remove afterwards (:meth:`Journal.remove`): a
    writer killed between the two finds its manifest and only cleans up."""
    lock.check()
    body = write_files(lock.store)
    lock.store.put(manifest, body)


def write_index_files(store: Store, shards: list[ShardRecord], samples: Iterable[SampleRecords],
                      compression: str, fields: Iterable[str], extra: dict[str, Any] | None = None) -> bytes:
    """Write a sample dataset's index files and return its manifest (not written: see
    :func:`commit`). ``samples`` yields each shard's records in the order of ``shards``;
    the manifest records the checksums of both index files."""
    with store.open_writer(SAMPLES_FILE) as f:
        sink = _HashingWriter(f)
        writer = SampleTableWriter(cast(BinaryIO, sink))  # pyarrow needs only write/tell/closed of it
        for i, records in enumerate(samples):
            writer.add(i, records)
        writer.close()
    if writer.rows != sum(s.samples for s in shards):  # a writer's bug: nothing is committed
        raise PackError(f"{store.root}: {writer.rows} sample records for shards of {sum(s.samples for s in shards)} "
                        "samples; the index was not committed (a datapipe bug: please report it)")
    table = shard_table_bytes(shards)
    store.put(SHARDS_FILE, table)
    files = {SHARDS_FILE: digest_bytes(table), SAMPLES_FILE: sink.digest.finish()}
    return make_manifest(shards, compression, sorted(set(fields)), extra, index_files=files)


def write_index(store: Store, shards: list[ShardRecord], samples: Iterable[SampleRecords], compression: str,
                fields: Iterable[str], extra: dict[str, Any] | None = None) -> None:
    """A sample dataset's index files, then its manifest, at ``store`` (no writer lock:
    writers commit through :func:`commit`)."""
    store.put(MANIFEST, write_index_files(store, shards, samples, compression, fields, extra))


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


def check_destination(store: Store, overwrite: bool, resumable: bool = False,
                      files: DatasetFiles = SHARD_FILES) -> None:
    """Refuse a destination that holds a dataset unless ``overwrite``; with it, retract the
    old dataset (manifest first, so it stops existing before its parts go). With
    ``resumable``, a dataset whose writer was killed before it removed its journal is left
    to the journal: the same writer run again finishes it (`Journal` refuses any other).
    ``files``: the names this kind of writer publishes."""
    if store.exists(files.manifest):
        if not overwrite:
            if resumable and store.exists(PLAN):
                return
            raise DestinationExistsError(
                f"{store.url(files.manifest)} exists: {store.root} already holds a dataset "
                "(pass overwrite=True / --overwrite to replace it)"
            )
        retract_dataset(store, files)
        return
    # No dataset: files at the names a writer publishes are someone's (or a retraction that
    # was cut short), unless a writer's journal accounts for them; a writer would replace them
    keys = store.list()
    if any(k.startswith(f"{WORK}/") and k not in (LOCK, LEASE) for k in keys):
        return  # a killed writer's journal: the writer (its Journal) decides what is its own
    theirs = [k for k in keys if files.owns(k) and k not in (LOCK, LEASE)]
    if theirs:
        if not overwrite:
            shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            raise DestinationExistsError(
                f"{store.root} holds no dataset but files at names a pack writes ({shown}): a pack "
                "would replace them. Pack into another folder, or pass overwrite=True / --overwrite "
                "to delete them first"
            )
        retract_dataset(store, files)


def retract_dataset(store: Store, files: DatasetFiles = SHARD_FILES) -> None:
    """Delete what a writer of ``files`` wrote at ``store``: the manifest first, so the
    dataset stops existing before its parts go. Nothing else under the destination (the
    source folder, say) is touched, nor the writer's own lock."""
    store.delete(files.manifest)
    for key in store.list():
        if files.owns(key) and not key.endswith((LOCK, LEASE)):
            store.delete(key)
