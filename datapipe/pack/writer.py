"""`ShardWriter`: write samples one by one into shards at a URL, as WebDataset's
ShardWriter does, plus the index and checksums."""

from __future__ import annotations

import numbers
import os
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from ..errors import DuplicateKeyError, PackError, PackOptionError
from ..format import COMPRESSIONS, SampleRecords, ShardBuilder, ShardRecord, encode_sample, shard_name
from ..format.tar import END_OF_ARCHIVE
from ..storage import Store, open_store
from .commit import check_destination, write_index
from .lock import WriterLock

__all__ = ["ShardWriter", "ShardSeries", "ShardLimits", "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES",
           "MIN_SHARD_BYTES", "ZSTD_LEVELS", "oversized_samples"]

DEFAULT_SHARD_BYTES = 128 * 2**20  # object stores serve 64-256 MB objects at full speed
DEFAULT_SHARD_SAMPLES = 100_000
#: the smallest shard limit: one header, one block of data and the end-of-archive blocks
MIN_SHARD_BYTES = 2049
#: the compression levels zstd takes (negative: its fast modes; 0: its default, 3)
ZSTD_LEVELS = (-(1 << 17), 22)
_MAX_INT = 2**63 - 1  # offsets, sizes and counts are int64 in the index

# --- argument checks: pack(), ShardWriter and the `datapipe pack` command -------------------
# Each names the argument (and its command-line flag), the value and what is allowed, as a
# PackOptionError; none coerces (workers=1.9 is refused, not read as 1).

_FLAGS = {"shard_bytes": "--shard-bytes", "shard_samples": "--shard-samples", "compression": "--compression",
          "level": "--level", "workers": "--workers", "part": "--part", "overwrite": "--overwrite",
          "skip_errors": "--skip-errors", "follow_links": "--follow-links", "keys": "--keys",
          "tars_as_files": "--tars-as-files", "storage_options": "--storage-options"}
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 60


def bad_option(name: str, value: object, allowed: str) -> PackOptionError:
    """The error for argument ``name`` given ``value``: ``allowed`` says what it may be."""
    flag = _FLAGS.get(name)
    named = f"{name} ({flag})" if flag else name
    return PackOptionError(f"{named}={_shown.repr(value)}: {allowed}")


def option_int(value: object, name: str, low: int, high: int = _MAX_INT) -> int:
    """``value`` as an int in [low, high]: an integer (not a bool, not a float, not a
    numeric string), else :class:`PackOptionError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
        raise bad_option(name, value, f"must be an integer from {low:,} to {high:,}")
    return int(value)


def option_flag(value: object, name: str) -> bool:
    """``value`` if it is True or False (a string such as "no" would read as true)."""
    if not isinstance(value, bool):
        raise bad_option(name, value, "must be True or False")
    return value


def option_path(value: object, name: str) -> str:
    """A local path or URL: a non-empty str (or ``os.PathLike`` of str)."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path or "\0" in path:
        raise bad_option(name, value, "must be a non-empty path or URL (a str or os.PathLike)")
    return path


def checked_compression(compression: object) -> str:
    """``compression`` as a name in :data:`COMPRESSIONS` (None: ``"none"``), else
    :class:`PackOptionError`."""
    if compression is None:
        return "none"
    if not isinstance(compression, str) or compression not in COMPRESSIONS:
        raise bad_option("compression", compression, f"must be one of {', '.join(COMPRESSIONS)} (or None)")
    return compression


def checked_level(level: object) -> int:
    """A zstd compression level (checked whatever the compression: a typo stays visible)."""
    return option_int(level, "level", *ZSTD_LEVELS)


def checked_workers(workers: object) -> int | None:
    """None (the default count) or a number of worker processes >= 1."""
    return None if workers is None else option_int(workers, "workers", 1)


def checked_storage_options(options: object) -> dict[str, Any] | None:
    """None or a mapping of option names (str) to values, as a new dict."""
    if options is None:
        return None
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise bad_option("storage_options", options, "must be None or a dict of fsspec options by name (str)")
    return dict(options)


class ShardLimits:
    """When a shard is full: the one rule every packing path follows. Sizes are tar bytes
    (before compression) and count the end-of-archive blocks. A sample larger than
    ``max_bytes`` is not refused: it gets a shard of its own (as webdataset's ShardWriter
    does), the only shard that exceeds the limit. ``names``: the arguments the limits came
    from, for the error a bad one gets."""

    def __init__(self, max_bytes: object, max_samples: object,
                 names: tuple[str, str] = ("max_bytes", "max_samples")) -> None:
        self.max_bytes = option_int(max_bytes, names[0], MIN_SHARD_BYTES)
        self.max_samples = option_int(max_samples, names[1], 1)

    def starts_new(self, shard_bytes: int, shard_samples: int, size: int) -> bool:
        """Whether a sample of ``size`` bytes must go to a new shard (after an oversized
        sample, the next one always does: that shard is already over the limit)."""
        return shard_samples > 0 and (shard_bytes + size + len(END_OF_ARCHIVE) > self.max_bytes
                                      or shard_samples >= self.max_samples)


def oversized_samples(shards: list[ShardRecord], samples: list[SampleRecords],
                      max_bytes: int) -> list[tuple[str, int]]:
    """(key, tar bytes) of each sample that was put in a shard of its own because it is
    larger than ``max_bytes``: a shard over the limit holds exactly one such sample."""
    return [(recs.keys[0], shard.tar_bytes - len(END_OF_ARCHIVE))
            for shard, recs in zip(shards, samples, strict=True)
            if shard.samples == 1 and shard.tar_bytes > max_bytes]


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
        """Add one sample (``__key__`` plus fields: bytes, str, numbers, dicts/lists as JSON).
        One larger than the shard limit gets a shard of its own."""
        if not isinstance(sample, Mapping) or not all(isinstance(k, str) for k in sample):
            raise PackOptionError(f"a sample must be a dict of fields by name (str) with a str '__key__', "
                                  f"not {_shown.repr(sample)}")
        key, parts = encode_sample(sample)  # the key is a str from here on
        if key in self._keys:
            raise DuplicateKeyError(f"sample key {key!r} was written twice")
        size = sum(len(p) for p in parts)
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

    Shards roll over at ``max_bytes`` (of tar bytes, before compression) or ``max_samples``;
    a sample larger than ``max_bytes`` gets a shard of its own (webdataset's convention),
    listed in :attr:`oversized`. Bad arguments raise
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
        max_bytes: int = DEFAULT_SHARD_BYTES,
        max_samples: int = DEFAULT_SHARD_SAMPLES,
        compression: str | None = None,
        level: int = 3,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        dest = option_path(dest, "dest")
        self.limits = ShardLimits(max_bytes, max_samples)
        compression = checked_compression(compression)
        level = checked_level(level)
        storage_options = checked_storage_options(storage_options)
        option_flag(overwrite, "overwrite")
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

    @property
    def oversized(self) -> list[tuple[str, int]]:
        """(key, tar bytes) of each sample so far that was larger than ``max_bytes`` and so
        was put in a shard of its own."""
        s = self._series
        return oversized_samples(s.shards, s.samples, self.limits.max_bytes)

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
