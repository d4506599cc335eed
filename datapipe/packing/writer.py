"""`ShardWriter`: write samples one by one into shards at a URL, as WebDataset's
ShardWriter does, plus the index and checksums (published through :mod:`datapipe.publish`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import PackError
from ..format import ShardRecord, shard_name
from ..publish import (
    SHARD_FILES,
    UNSET_BYTES,
    UNSET_SAMPLES,
    ShardSeries,
    WriterLock,
    check_destination,
    commit,
    oversized_samples,
    write_index_files,
    writer_options,
)
from ..storage import open_store

__all__ = ["ShardWriter"]


class ShardWriter:
    """``with ShardWriter(dest) as w: w.write({"__key__": "a", "jpg": b"..."})``

    Shards roll over at ``shard_bytes`` (of tar bytes, before compression; default 128 MiB)
    or ``shard_samples`` (default 100,000), as in ``pack()``; webdataset's ``maxsize`` and
    ``maxcount``, and the older ``max_bytes`` and ``max_samples``, are taken for them too
    (one spelling per limit). A sample larger than the byte limit gets a shard of its own
    (webdataset's convention), listed in :attr:`oversized`. Bad arguments raise
    :class:`~datapipe.errors.PackOptionError`. On a clean exit the index and manifest are
    written; after an exception nothing is committed and the destination does not read as
    a dataset. From creation to
    ``close()``/``abort()`` it holds the destination's writer lock, as ``pack`` does: a
    second writer there gets :class:`~datapipe.errors.DestinationBusyError`.
    """

    def __init__(
        self,
        dest: str,
        *,
        shard_bytes: int = UNSET_BYTES,
        shard_samples: int = UNSET_SAMPLES,
        compression: str | None = None,
        level: int = 3,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        maxsize: int = UNSET_BYTES,
        maxcount: int = UNSET_SAMPLES,
        max_bytes: int = UNSET_BYTES,
        max_samples: int = UNSET_SAMPLES,
    ) -> None:
        o = writer_options(dest, shard_bytes=shard_bytes, shard_samples=shard_samples, maxsize=maxsize,
                           maxcount=maxcount, max_bytes=max_bytes, max_samples=max_samples, compression=compression,
                           level=level, storage_options=storage_options, overwrite=overwrite)
        self.limits, compression, level = o.limits, o.compression, o.level
        self._lock: WriterLock | None = WriterLock(open_store(o.dest, o.storage_options)).__enter__()
        self.store = self._lock.store
        try:
            check_destination(self.store, o.overwrite, files=SHARD_FILES)
        except BaseException:
            self._release()
            raise
        self.compression, self.level = compression, level
        self._series = ShardSeries(self.store, self.limits, compression, level,
                                   lambda i: shard_name(i, compression))
        self._closed = False

    @property
    def shards(self) -> list[ShardRecord]:
        """The shards finished so far."""
        return self._series.shards

    @property
    def oversized(self) -> list[tuple[str, int]]:
        """(key, tar bytes) of each sample so far that was larger than the byte limit and so
        was put in a shard of its own."""
        s = self._series
        return oversized_samples(s.shards, s.samples, self.limits.shard_bytes)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def write(self, sample: Mapping[str, Any]) -> None:
        if self._closed:
            raise PackError("write() on a closed ShardWriter: make a new one to write more")
        self._series.write(sample)

    def abort(self, exc: BaseException | None = None) -> None:
        """Discard the shard being written; commit nothing. ``exc`` is the error that ended
        the writing: if discarding the partial shard fails too, that failure is added to
        ``exc`` as a note (``exc`` stays the error the caller sees); without ``exc`` it is
        raised."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self._series.abort(exc or PackError("ShardWriter aborted"))
            except Exception as cleanup:
                if exc is None:
                    raise
                exc.add_note(f"ShardWriter: discarding the partial shard also failed: {cleanup!r}")
        finally:
            self._release()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._series.close()
            self._closed = True
            s = self._series
            if self._lock is not None:
                commit(self._lock, lambda store: write_index_files(store, s.shards, s.samples, self.compression,
                                                                    s.fields))
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
