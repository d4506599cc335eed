"""The one error hierarchy of datapipe.

Every error datapipe raises on purpose derives from :class:`DatapipeError`, so a caller
can catch the whole family with one clause. Messages say what went wrong, where (URL,
shard, sample key, byte offset or state path) and, where there is one, what to do.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DatapipeError",
    "OptionError",
    "MissingDependencyError",
    "UrlError",
    "FormatError",
    "CorruptShardError",
    "CorruptIndexError",
    "IntegrityError",
    "ChecksumError",
    "PackError",
    "PackOptionError",
    "InputFileError",
    "EmptyInputError",
    "DuplicateKeyError",
    "InvalidMemberNameError",
    "SampleTooLargeError",
    "DestinationExistsError",
    "DestinationBusyError",
    "StorageError",
    "ObjectNotFoundError",
    "RemoteError",
    "ThrottledError",
    "TruncatedReadError",
    "ObjectChangedError",
    "LeaseBusyError",
    "LeaseLostError",
    "CacheBudgetError",
    "CacheOptionError",
    "PlanError",
    "StateMismatchError",
    "LoaderOptionError",
    "WorkerStateError",
    "TopologyError",
    "DecodeError",
    "CheckpointError",
    "NoCheckpointError",
    "CorruptCheckpointError",
    "UnsupportedStateError",
    "CheckpointOptionError",
    "HealthError",
]


class DatapipeError(Exception):
    """Base of every error datapipe raises on purpose."""


class OptionError(DatapipeError, ValueError):
    """A public argument is out of range or of the wrong kind (``batch_size=0``,
    ``window=nan``, ``seed="abc"``): the one error for bad arguments, naming the argument,
    the value given and what it may be. A ``ValueError`` too, so ``except ValueError`` keeps
    working."""


class MissingDependencyError(OptionError, ImportError):
    """An option needs an optional package that does not import here (``decode="pil"``
    without Pillow): names the package and the extra that installs it. Raised once, where
    the option is given, and never skipped by ``on_error="skip"``: no sample can succeed."""


# --- format: shard bytes and the index -------------------------------------------------


class FormatError(DatapipeError):
    """A shard, index or manifest does not follow docs/FORMAT.md."""


class CorruptShardError(FormatError):
    """A shard's bytes are not the tar (or zstd frame) the index promises."""


class IntegrityError(DatapipeError):
    """Stored bytes do not match the checksum recorded for them."""


class ChecksumError(IntegrityError):
    """A checksum mismatch, naming the object (and sample or chunk) that failed."""


class CorruptIndexError(FormatError, ChecksumError):
    """``manifest.json``, ``shards.parquet`` or ``samples.parquet`` fails its checksum or is
    inconsistent with itself or the others: no offset from it is used."""


# --- pack: small files -> shards ------------------------------------------------------


class PackError(DatapipeError):
    """Packing could not go on."""


class PackOptionError(PackError, OptionError):
    """An argument of :func:`~datapipe.pack` or :class:`~datapipe.ShardWriter` is out of
    range (compression, shard limits, ``--part``)."""


class InputFileError(PackError):
    """An input file could not be read (vanished, unreadable, not a regular file)."""


class EmptyInputError(PackError):
    """The input holds no sample."""


class DuplicateKeyError(PackError):
    """Two samples share one key, or one sample has the same field twice."""


class InvalidMemberNameError(PackError):
    """A key or field cannot be stored as a safe tar member name."""


class SampleTooLargeError(PackError):
    """One sample is larger than the shard size limit."""


class DestinationExistsError(PackError):
    """The destination already holds a dataset; pass overwrite=True (--overwrite)."""


class DestinationBusyError(PackError):
    """Another pack is writing the destination now (one writer per destination)."""


# --- storage: bytes by URL, in tiers ---------------------------------------------------


class StorageError(DatapipeError):
    """Reading or writing bytes at a URL failed."""


class UrlError(StorageError, OptionError):
    """A URL that cannot be what was meant (``s3:/bucket/x``, one slash, is a local path
    to Python; chained fsspec URLs): names the URL to give instead."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """No object exists at the URL."""


class RemoteError(StorageError):
    """The remote store failed, after the configured retries."""


class ThrottledError(RemoteError):
    """The remote store kept asking us to slow down (503 SlowDown, 429) for a request's
    whole total deadline (``RetryPolicy.deadline_s``): throttling is waited out, not
    counted as failed attempts, until then."""


class TruncatedReadError(StorageError):
    """A read returned fewer bytes than the object (or range) holds."""


class ObjectChangedError(StorageError):
    """An object was rewritten while it was being read, so its parts would not agree."""


class LeaseBusyError(StorageError):
    """Another live writer holds the lease. ``holder``: its document (None if unreadable);
    ``local``: the lease is a flock (freed when the holder's process exits); ``frees``:
    how the lease of a dead holder is freed, for messages."""

    def __init__(self, message: str, holder: dict[str, Any] | None, local: bool, frees: str) -> None:
        super().__init__(message)
        self.holder = holder
        self.local = local
        self.frees = frees


class LeaseLostError(StorageError):
    """This writer no longer holds its lease; ``why`` says how it was lost."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class CacheBudgetError(StorageError):
    """A cache budget cannot hold what it is asked to hold."""


class CacheOptionError(CacheBudgetError, OptionError):
    """An argument of :class:`~datapipe.TieredCache` that sets a budget is out of range or
    of the wrong kind (``hot_bytes=-1``, ``warm_bytes=1.5``)."""


# --- plan: order, partition and resume -------------------------------------------------


class PlanError(DatapipeError):
    """An epoch plan cannot be built from these arguments."""


class StateMismatchError(PlanError):
    """A resume state belongs to another dataset, seed or configuration."""


class LoaderOptionError(PlanError, OptionError):
    """An argument of :class:`~datapipe.StreamingDataset`, :class:`~datapipe.Stream`,
    :class:`~datapipe.StreamingDataLoader`, ``set_epoch`` or ``load_state_dict`` is out of
    range or of the wrong kind (``window=nan``, ``seed="abc"``, ``batch_size=0``)."""


class WorkerStateError(PlanError):
    """``StreamingDataset.state_dict()`` asked in the main process while the dataset's pass
    runs in DataLoader worker processes, whose progress this process cannot see: the state
    would describe an unread pass. ``StreamingDataLoader.state_dict()`` (or torchdata's
    ``StatefulDataLoader.state_dict()``) is the one that knows."""


# --- topology: this process's rank among the ranks ---------------------------------------


class TopologyError(OptionError):
    """A rank and world size that do not fit (rank outside ``[0, world_size)``, not
    integers, or a ``RANK``/``WORLD_SIZE`` environment that does not parse)."""


# --- loader: samples into items -------------------------------------------------------


class DecodeError(DatapipeError):
    """A field decoder, a ``decode=`` function or a ``map=`` function raised on a sample
    whose bytes passed their checks: the function's failure, not corruption. Names the
    shard, the sample key and (for a field decoder) the field; chained from what it raised."""


# --- checkpoint -----------------------------------------------------------------------


class CheckpointError(DatapipeError):
    """Saving or loading a checkpoint failed."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete checkpoint exists at the URL (or for the requested step)."""


class CorruptCheckpointError(CheckpointError, IntegrityError):
    """A checkpoint's manifest or data failed verification."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds an object the checkpoint format cannot store; names its path."""


class CheckpointOptionError(CheckpointError, OptionError):
    """A bad argument to a checkpoint writer, tier, load or restore (names the argument and
    the value): caught as a CheckpointError and as an OptionError (a ValueError) alike."""


# --- health: telemetry, straggler boards, tier checks ----------------------------------


class HealthError(DatapipeError):
    """Telemetry, a health board or a tier check could not do its job: a worker's counters
    that do not parse, a metrics port that cannot be bound, a board that cannot be read.
    A tier that fails its check is not an error: it is reported as failed."""
