"""`ShardWriter`: write samples one by one into shards at a URL, as WebDataset's
ShardWriter does, plus the index and checksums."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import DuplicateKeyError, PackError, PackOptionError, SampleTooLargeError
from ..format import COMPRESSIONS, SampleRecords, ShardBuilder, ShardRecord, encode_sample, shard_name
from ..format.tar import END_OF_ARCHIVE
from ..storage import open_store
from .commit import check_destination, write_index
from .lock import WriterLock

__all__ = ["ShardWriter", "ShardLimits", "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES"]

DEFAULT_SHARD_BYTES = 128 * 2**20  # object stores serve 64-256 MB objects at full speed
DEFAULT_SHARD_SAMPLES = 100_000


def checked_compression(compression: str | None) -> str:
    """``compression`` as a name in :data:`COMPRESSIONS` (None: ``"none"``), else
    :class:`PackOptionError`."""
    compression = compression or "none"
    if compression not in COMPRESSIONS:
        raise PackOptionError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    return compression


class ShardLimits:
    """When a shard is full: the one rule every packing path follows. Sizes are tar bytes
    (before compression) and count the end-of-archive blocks."""

    def __init__(self, max_bytes: int, max_samples: int) -> None:
        if max_bytes <= 0 or max_samples <= 0:
            raise PackOptionError(f"shard limits must be positive, got {max_bytes} bytes and {max_samples} samples")
        self.max_bytes, self.max_samples = max_bytes, max_samples

    def check(self, key: str, size: int, where: str = "") -> None:
        """Refuse one sample that no shard can hold."""
        if size + len(END_OF_ARCHIVE) > self.max_bytes:
            raise SampleTooLargeError(f"{where}sample {key!r} takes {size} bytes in a shard, more than the "
                                      f"shard limit of {self.max_bytes} (raise --shard-bytes / max_bytes)")

    def starts_new(self, shard_bytes: int, shard_samples: int, size: int) -> bool:
        """Whether a sample of ``size`` bytes must go to a new shard."""
        return shard_samples > 0 and (shard_bytes + size + len(END_OF_ARCHIVE) > self.max_bytes
                                      or shard_samples >= self.max_samples)


class ShardWriter:
    """``with ShardWriter(dest) as w: w.write({"__key__": "a", "jpg": b"..."})``

    Shards roll over at ``max_bytes`` (of tar bytes, before compression) or ``max_samples``.
    On a clean exit the index and manifest are written; after an exception nothing is
    committed and the destination does not read as a dataset. From creation to
    ``close()``/``abort()`` it holds the destination's writer lock, as ``pack`` does: a
    second writer there gets :class:`~datapipe.errors.DestinationBusyError`.
    """

    def __init__(
        self,
        dest: str,
        *,
        max_bytes: int = DEFAULT_SHARD_BYTES,
        max_samples: int = DEFAULT_SHARD_SAMPLES,
        compression: str | None = None,
        level: int = 3,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        compression = checked_compression(compression)
        self.limits = ShardLimits(max_bytes, max_samples)
        self._lock: WriterLock | None = WriterLock(open_store(dest, storage_options)).__enter__()
        self.store = self._lock.store
        try:
            check_destination(self.store, overwrite)
        except BaseException:
            self._release()
            raise
        self.compression, self.level = compression, level
        self.shards: list[ShardRecord] = []
        self._samples: list[SampleRecords] = []
        self._fields: set[str] = set()
        self._keys: set[str] = set()
        self._ctx: Any = None
        self._builder: ShardBuilder | None = None
        self._closed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def _open_shard(self) -> ShardBuilder:
        name = shard_name(len(self.shards), self.compression)
        self._ctx = self.store.open_writer(name)
        sink = self._ctx.__enter__()
        self._builder = ShardBuilder(sink, name, self.compression, self.level)
        return self._builder

    def _close_shard(self) -> None:
        b = self._builder
        if b is None:
            return
        record = b.finish()
        self._ctx.__exit__(None, None, None)
        self.shards.append(record)
        self._samples.append(b.records)
        self._fields |= b.fields
        self._builder = self._ctx = None

    def write(self, sample: Mapping[str, Any]) -> None:
        if self._closed:
            raise ValueError("write() on a closed ShardWriter")
        key = sample.get("__key__")
        if key in self._keys:
            raise DuplicateKeyError(f"sample key {key!r} was written twice")
        key, parts = encode_sample(sample)
        size = sum(len(p) for p in parts)
        self.limits.check(key, size)
        b = self._builder
        if b is not None and self.limits.starts_new(b.tar_bytes, len(b.records), size):
            self._close_shard()
            b = None
        b = b or self._open_shard()
        b.add_encoded(key, parts, [k for k in sample if not k.startswith("__")])
        self._keys.add(key)

    def abort(self, exc: BaseException | None = None) -> None:
        """Discard the shard being written; commit nothing. ``exc`` is the error that ended
        the writing: if discarding the partial shard fails too, that failure is added to
        ``exc`` as a note (``exc`` stays the error the caller sees); without ``exc`` it is
        raised."""
        ctx, self._builder, self._ctx, self._closed = self._ctx, None, None, True
        try:
            if ctx is None:
                return
            err = exc or PackError("ShardWriter aborted")
            try:
                ctx.__exit__(type(err), err, None)
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
            self._close_shard()
            self._closed = True
            if self._lock is not None:
                self._lock.check()
            write_index(self.store, self.shards, self._samples, self.compression, self._fields)
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
