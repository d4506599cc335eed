"""A series of shards: when a shard is full (:class:`ShardLimits`, the one rule every
writer of shards follows), and the loop that writes samples into shard after shard,
journaling each name before its first byte and publishing each shard atomically
(:class:`ShardSeries`: ``ShardWriter`` and each Ray write task run it).

The limits are spelt ``shard_bytes``/``shard_samples`` everywhere (``pack()``, ``datapipe
pack --shard-bytes``, ``ShardWriter``, the Ray sink). A writer may take other spellings of
the same limits, webdataset's ``maxsize``/``maxcount`` and datapipe's older
``max_bytes``/``max_samples`` (:data:`SPELLINGS`); :func:`shard_limits` takes whichever
one was given and refuses two spellings of one limit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import DuplicateKeyError, PackOptionError
from ..format import END_OF_ARCHIVE, SampleRecords, ShardBuilder, ShardRecord, encode_sample
from ..storage import Store
from .options import (
    checked_compression,
    checked_level,
    checked_storage_options,
    option_flag,
    option_int,
    option_path,
    shown,
)

__all__ = ["ShardLimits", "ShardSeries", "shard_limits", "WriterOptions", "writer_options", "oversized_samples",
           "Unset", "UNSET_BYTES", "UNSET_SAMPLES", "SPELLINGS", "WRITER_KEYWORDS", "DEFAULT_SHARD_BYTES",
           "DEFAULT_SHARD_SAMPLES", "MIN_SHARD_BYTES"]

DEFAULT_SHARD_BYTES = 128 * 2**20  # object stores serve 64-256 MB objects at full speed
DEFAULT_SHARD_SAMPLES = 100_000
#: the smallest shard limit: one header, one block of data and the end-of-archive blocks
MIN_SHARD_BYTES = 2049


class ShardLimits:
    """When a shard is full: the one rule every packing path follows. Sizes are tar bytes
    (before compression) and count the end-of-archive blocks. A sample larger than
    ``shard_bytes`` is not refused: it gets a shard of its own (as webdataset's ShardWriter
    does), the only shard that exceeds the limit. ``names``: the arguments the limits came
    from, for the error a bad one gets."""

    def __init__(self, shard_bytes: object, shard_samples: object,
                 names: tuple[str, str] = ("shard_bytes", "shard_samples")) -> None:
        self.shard_bytes = option_int(shard_bytes, names[0], MIN_SHARD_BYTES)
        self.shard_samples = option_int(shard_samples, names[1], 1)

    def starts_new(self, shard_bytes: int, shard_samples: int, size: int) -> bool:
        """Whether a sample of ``size`` bytes must go to a new shard that holds
        ``shard_bytes`` tar bytes in ``shard_samples`` samples so far (after an oversized
        sample, the next one always does: that shard is already over the limit)."""
        return shard_samples > 0 and (shard_bytes + size + len(END_OF_ARCHIVE) > self.shard_bytes
                                      or shard_samples >= self.shard_samples)


class Unset(int):
    """The default of a shard-limit keyword, told apart from the same number passed by a
    caller (only a spelling that was given counts; the signature still shows the value)."""


UNSET_BYTES: int = Unset(DEFAULT_SHARD_BYTES)
UNSET_SAMPLES: int = Unset(DEFAULT_SHARD_SAMPLES)

#: each limit's spellings: datapipe's own first, then webdataset's, then datapipe's older one
SPELLINGS = (("shard_bytes", "maxsize", "max_bytes"), ("shard_samples", "maxcount", "max_samples"))


def shard_limits(**given: object) -> ShardLimits:
    """The limits from a writer's keywords (any of :data:`SPELLINGS`; one left at
    :data:`UNSET_BYTES`/:data:`UNSET_SAMPLES`, or not passed, is not given): each limit
    from the one spelling given, else its default. Two spellings of one limit are refused,
    naming both; a bad value is refused naming the spelling it was given as."""
    chosen = []
    for spellings in SPELLINGS:
        named = [n for n in spellings if n in given and not isinstance(given[n], Unset)]
        if len(named) > 1:
            both = " and ".join(f"{n}={shown(given[n])}" for n in named)
            raise PackOptionError(f"{both}: both set the one limit {spellings[0]}; give one of them")
        chosen.append(named[0] if named else spellings[0])
    defaults = {"shard_bytes": DEFAULT_SHARD_BYTES, "shard_samples": DEFAULT_SHARD_SAMPLES}
    values = [given[n] if n in given and not isinstance(given[n], Unset) else defaults[s[0]]
              for n, s in zip(chosen, SPELLINGS)]
    return ShardLimits(values[0], values[1], names=(chosen[0], chosen[1]))


@dataclass(frozen=True)
class WriterOptions:
    """The options of a writer of a shard series (``ShardWriter``, the Ray sink), checked."""

    dest: str
    limits: ShardLimits
    compression: str
    level: int
    storage_options: dict[str, Any] | None
    overwrite: bool


#: the keywords :func:`writer_options` takes besides ``dest``
WRITER_KEYWORDS = (*SPELLINGS[0], *SPELLINGS[1], "compression", "level", "storage_options", "overwrite")


def writer_options(dest: object, **given: Any) -> WriterOptions:
    """``dest`` and the keywords ``given`` (:data:`WRITER_KEYWORDS`; those not given take
    their defaults: no compression, level 3, no storage options, no overwrite) checked, in
    this order, before anything is written: a bad one, or a keyword that is none of them,
    raises :class:`~datapipe.errors.PackOptionError` naming it."""
    unknown = sorted(set(given) - set(WRITER_KEYWORDS))
    if unknown:
        raise PackOptionError(f"{', '.join(unknown)}: not an option of a shard writer (its options: "
                              f"{', '.join(WRITER_KEYWORDS)})")
    path = option_path(dest, "dest")
    limits = shard_limits(**{k: v for k, v in given.items() if k in SPELLINGS[0] + SPELLINGS[1]})
    compression = checked_compression(given.get("compression"))
    level = checked_level(given.get("level", 3))
    storage_options = checked_storage_options(given.get("storage_options"))
    overwrite = option_flag(given.get("overwrite", False), "overwrite")
    return WriterOptions(path, limits, compression, level, storage_options, overwrite)


def oversized_samples(shards: list[ShardRecord], samples: list[SampleRecords],
                      shard_bytes: int) -> list[tuple[str, int]]:
    """(key, tar bytes) of each sample that was put in a shard of its own because it is
    larger than ``shard_bytes``: a shard over the limit holds exactly one such sample."""
    return [(recs.keys[0], shard.tar_bytes - len(END_OF_ARCHIVE))
            for shard, recs in zip(shards, samples, strict=True)
            if shard.samples == 1 and shard.tar_bytes > shard_bytes]


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
                                  f"not {shown(sample)}")
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
