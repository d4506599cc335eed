"""`ShardWriter`: write samples one by one into shards at a URL, as WebDataset's
ShardWriter does, plus the index and checksums."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from ..errors import DuplicateKeyError, PackError, PackOptionError, SampleTooLargeError
from ..format import COMPRESSIONS, SampleRecords, ShardBuilder, ShardRecord, encode_sample, shard_name
from ..format.tar import END_OF_ARCHIVE
from ..storage import Store, open_store
from .commit import check_destination, write_index
from .lock import WriterLock

__all__ = ["ShardWriter", "ShardSeries", "ShardLimits", "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES"]

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


class ShardSeries:
    """Samples into a series of shards at ``store``, rolled over at ``limits``: the one
    loop that `ShardWriter` and each Ray write task (:mod:`datapipe.ray`) run. ``names(i)``
    names the i-th shard; ``before_open(name)``, if given, runs before that shard's first
    byte (a write task journals the name there, so cleanup knows the file is its own).
    Each shard is published atomically when it is full or at ``close()``; ``results``
    then holds its index rows as ``pack`` journals them (``record``, ``samples``,
    ``fields``). Keys are checked for repeats within the series only."""

    def __init__(self, store: Store, limits: ShardLimits, compression: str, level: int,
                 names: Callable[[int], str], before_open: Callable[[str], None] | None = None) -> None:
        self.store, self.limits, self.compression, self.level = store, limits, compression, level
        self._names, self._before_open = names, before_open
        self.shards: list[ShardRecord] = []
        self.samples: list[SampleRecords] = []
        self.fields: set[str] = set()
        self.shard_fields: list[set[str]] = []
        self._keys: set[str] = set()
        self._ctx: Any = None
        self._builder: ShardBuilder | None = None

    @property
    def results(self) -> list[dict[str, Any]]:
        """Each finished shard's index rows, in the form ``pack`` journals them."""
        return [{"record": asdict(r), "samples": vars(s), "fields": sorted(f)}
                for r, s, f in zip(self.shards, self.samples, self.shard_fields)]

    def _open_shard(self) -> ShardBuilder:
        name = self._names(len(self.shards))
        if self._before_open is not None:
            self._before_open(name)
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
        self.samples.append(b.records)
        self.shard_fields.append(set(b.fields))
        self.fields |= b.fields
        self._builder = self._ctx = None

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample (``__key__`` plus fields: bytes, str, numbers, dicts/lists as JSON)."""
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

    def close(self) -> None:
        """Publish the shard being written, if any."""
        self._close_shard()

    def abort(self, exc: BaseException) -> None:
        """Discard the shard being written (its temporary goes); ``exc`` ended the writing.
        A failure to discard is raised."""
        ctx, self._builder, self._ctx = self._ctx, None, None
        if ctx is not None:
            ctx.__exit__(type(exc), exc, None)


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
        self._series = ShardSeries(self.store, self.limits, compression, level,
                                   lambda i: shard_name(i, compression))
        self._closed = False

    @property
    def shards(self) -> list[ShardRecord]:
        """The shards finished so far."""
        return self._series.shards

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def write(self, sample: Mapping[str, Any]) -> None:
        if self._closed:
            raise ValueError("write() on a closed ShardWriter")
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
            if self._lock is not None:
                self._lock.check()
            s = self._series
            write_index(self.store, s.shards, s.samples, self.compression, s.fields)
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
