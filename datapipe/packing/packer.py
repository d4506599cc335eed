"""`pack()`: many small files (or table rows) into shards, in parallel, partitionable over
machines, and resumable: each finished shard is recorded under ``_pack/`` in the
destination, and running the same command again skips what is recorded."""

from __future__ import annotations

import errno
import gc
import inspect
import multiprocessing as mp
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, BinaryIO, cast

from ..errors import (
    DatapipeError,
    DuplicateKeyError,
    EmptyInputError,
    InputFileError,
    PackError,
    PackOptionError,
    StorageError,
)
from ..format import (
    SHARDS_FILE,
    STAGING_BYTES,
    SampleRecords,
    ShardBuilder,
    ShardRecord,
    encode_sample,
    read_shard_table,
    shard_name,
)
from ..gcpause import collections_paused
from ..progress import polled_progress, progress_bar
from ..publish import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_SAMPLES,
    SHARD_FILES,
    WORK,
    Journal,
    ShardLimits,
    WriterLock,
    bad_option,
    check_destination,
    checked_compression,
    checked_level,
    checked_storage_options,
    checked_workers,
    commit,
    die_with_parent,
    fingerprint,
    option_flag,
    option_path,
    oversized_samples,
    parse_part,
    part_dir,
    write_index_files,
)
from ..storage import LocalStore, Store, in_this_process, open_store
from .pieces import ShardAssembly, cut_pieces
from .sources import (
    KEY_RULES,
    NO_EXTENSION,
    DirectoryListing,
    FileSample,
    count_table_rows,
    iter_table,
    list_directory,
    list_in_pieces,
    source_kind,
)

__all__ = ["pack", "PackResult", "PackOptions", "pack_options", "plan_shards", "pack_shard", "commit_shards",
           "describe_tree", "refuse_tar_shards"]


@dataclass
class PackResult:
    dest: str
    shards: int
    samples: int
    stored_bytes: int
    input_bytes: int
    seconds: float
    resumed_shards: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: the key rule of a directory source (see ``pack(keys=)``)
    keys: str = "first-dot"
    #: files of a directory source not packed, by reason (no extension, dot-file, ...)
    dropped: dict[str, int] = field(default_factory=dict)
    #: (path relative to the source, reason): the first few dropped, for each reason
    dropped_examples: list[tuple[str, str]] = field(default_factory=list)
    #: samples made of more than one file, and the files in them
    merged_samples: int = 0
    merged_files: int = 0
    #: (key, its first few file paths relative to the source, its number of files) of the
    #: first few such samples
    merged_examples: list[tuple[str, list[str], int]] = field(default_factory=list)
    #: samples larger than the shard limit, each put in a shard of its own (the only shards
    #: over the limit), and (key, size in the tar) of the first few
    oversized: int = 0
    oversized_examples: list[tuple[str, int]] = field(default_factory=list)
    #: the processes that read the inputs and wrote the shards (worker processes, or 1:
    #: this one), at most ``pack(workers=)``
    workers: int = 1

    def summary(self) -> str:
        mb = self.input_bytes / 1e6
        rate = f"{self.samples / self.seconds:,.0f} samples/s, {mb / self.seconds:,.1f} MB/s" if self.seconds else ""
        lines = [
            f"packed {self.samples:,} samples into {self.shards} shards at {self.dest}",
            f"  {mb:,.1f} MB in, {self.stored_bytes / 1e6:,.1f} MB stored, {self.seconds:.2f} s ({rate})",
        ]
        if self.resumed_shards:
            lines.append(f"  {self.resumed_shards} shards were already done by an earlier run")
        if self.oversized:
            shown = ", ".join(f"{key} ({size:,} bytes)" for key, size in self.oversized_examples)
            more = ", ..." if self.oversized > len(self.oversized_examples) else ""
            what = ("1 sample larger than --shard-bytes was put in a shard of its own" if self.oversized == 1 else
                    f"{self.oversized:,} samples larger than --shard-bytes were each put in a shard of their own")
            lines.append(f"  {what}, e.g. {shown}{more}")
        lines += self._tree_report()
        if self.skipped:
            lines.append(f"  SKIPPED {len(self.skipped)} inputs:")
            lines += [f"    {p}: {why}" for p, why in self.skipped[:50]]
            if len(self.skipped) > 50:
                lines.append(f"    ... and {len(self.skipped) - 50} more")
        return "\n".join(lines)


    def _tree_report(self) -> list[str]:
        """What the key rule did to a directory tree: files dropped, files merged."""
        lines = []
        if self.dropped:
            lines.append(f"  dropped {sum(self.dropped.values()):,} (not packed):")
            for reason, n in self.dropped.items():
                shown = [path for path, why in self.dropped_examples if why == reason]
                more = ", ..." if n > len(shown) else ""
                lines.append(f"    {n:,} {reason}, e.g. {', '.join(shown)}{more}")
            if self.keys == "first-dot" and NO_EXTENSION in self.dropped:
                lines.append("    (--keys file packs files without an extension too, as field 'bin')")
        if self.merged_samples:
            lines.append(f"  merged {self.merged_files:,} files into {self.merged_samples:,} samples of several "
                         "fields (WebDataset's rule: the key ends at the first dot of the file name)")
            for key, files, n in self.merged_examples[:3]:
                more = f", ... ({n} files)" if n > len(files) else ""
                lines.append(f"    e.g. {key}: {', '.join(files)}{more}")
            lines.append("    (--keys file makes one sample per file, its field the last extension)")
        return lines


def describe_tree(result: PackResult, src: str, dropped: list[tuple[str, str]], samples: list[FileSample],
                   examples: int = 3) -> None:
    """Fill ``result``'s counts and examples of dropped and merged files."""
    root = os.path.abspath(src)
    for path, reason in dropped:
        n = result.dropped.get(reason, 0)
        result.dropped[reason] = n + 1
        if n < examples:
            result.dropped_examples.append((os.path.relpath(path, root), reason))
    for s in samples:
        if len(s.files) > 1:
            result.merged_samples += 1
            result.merged_files += len(s.files)
            if len(result.merged_examples) < examples:
                shown = [os.path.relpath(p, root) for _, p, _ in s.files[:examples + 1]]
                result.merged_examples.append((s.key, shown, len(s.files)))


# --- worker side --------------------------------------------------------------------

_progress: Any = None  # (samples, bytes) shared counters, set in each worker


def _init_worker(counters: Any, parent: int | None = None, lock_fd: tuple[int, int, int] | None = None) -> None:
    global _progress
    _progress = counters
    if parent is not None:  # a forked worker process
        # What the worker inherited is never garbage here: the collector's full passes
        # over it (the pack's whole heap, its imports) were a fifth of a worker's time
        # (when workers listed folders), and each dirtied the pages it visited, copying
        # them from the parent.
        gc.freeze()
        die_with_parent(parent, lock_fd)


class _InputFault(Exception):
    """An input file could not be read as listed: names that file, not another of its sample."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(path, why)
        self.path, self.why = path, why


#: how far a worker opens its inputs ahead of their reads (files, and bytes not yet read)
_AHEAD_FILES, _AHEAD_BYTES = 32, 16 << 20
_ADVISE = hasattr(os, "posix_fadvise")  # Linux; elsewhere files are opened as they are read


class _Inputs:
    """The input files of one task, in order, each opened a few files ahead of its read
    with the kernel asked to read it meanwhile (``POSIX_FADV_WILLNEED``): from a cold page
    cache a worker then waits on many small files at once instead of one after another
    (four processes read 20,000 samples 1.3-3.5x faster here, as many files as the disk
    takes at once). At most :data:`_AHEAD_FILES` files and :data:`_AHEAD_BYTES` bytes
    ahead; :meth:`close` closes what is still open."""

    def __init__(self, samples: list[FileSample]) -> None:
        self._next = ((path, size) for s in samples for _, path, size in s.files)
        self._opened = 0  # files opened (or failed to open) so far, in order
        self._ahead: deque[tuple[int, str, int | OSError, int]] = deque()  # (position, path, fd or error, size)
        self._bytes = 0
        self._files = _AHEAD_FILES if _ADVISE else 1

    def _open_ahead(self) -> None:
        while len(self._ahead) < self._files and self._bytes < _AHEAD_BYTES:
            item = next(self._next, None)
            if item is None:
                return
            path, size = item
            try:
                # O_NONBLOCK: a FIFO or device put in place of a listed file must not block
                # the open (it is refused when read); a regular file ignores the flag.
                fd: int | OSError = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                fd = e
            if isinstance(fd, int) and _ADVISE and size:
                try:
                    os.posix_fadvise(fd, 0, min(size, _AHEAD_BYTES), os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass  # advice only
            self._ahead.append((self._opened, path, fd, size))
            self._opened += 1
            self._bytes += size

    def fill(self, position: int, path: str, size: int, view: memoryview) -> int:
        """Read input number ``position`` (of this task's files, in order; those before it
        that are still open belong to a sample that failed, and are closed) at ``path``
        into ``view``, ``size + 1`` bytes long: straight into the shard's staging buffer."""
        while True:
            if not self._ahead:
                self._open_ahead()
            if not self._ahead:
                raise PackError(f"input #{position} ({path}) was never opened (a datapipe bug: please report it)")
            at, _, fd, n = self._ahead.popleft()
            self._bytes -= n
            if at == position:
                break
            if isinstance(fd, int):
                os.close(fd)
        self._open_ahead()
        if isinstance(fd, OSError):
            raise _InputFault(path, fd.strerror or str(fd))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _InputFault(path, "no longer a regular file")
            got = os.readv(fd, [view])
            # A regular file returns short only at its end, so one read of size + 1 bytes
            # both fills the data and proves the file did not grow. Read on only if it came
            # short of the listed size (a filesystem that returns short reads).
            want = len(view) - 1
            while 0 < got < want:
                more = os.readv(fd, [view[got:]])
                if not more:
                    break
                got += more
        except OSError as e:
            raise _InputFault(path, e.strerror or str(e)) from None
        finally:
            os.close(fd)
        if got != size:
            grew = "grew" if got > size else "shrank"
            raise _InputFault(path, f"changed while packing: it {grew} from the {size} bytes listed")
        return got

    def close(self) -> None:
        while self._ahead:
            fd = self._ahead.popleft()[2]
            if isinstance(fd, int):
                os.close(fd)


@contextmanager
def _writing(url: str) -> Iterator[None]:
    """An OS error while writing output names what was written and what to do (the bare
    error of a full disk names no file)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, DatapipeError):
            raise
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            hint = "free space there or choose another destination, then run the same command again"
        else:
            hint = "fix that, then run the same command again"
        raise StorageError(f"cannot write {url}: {e.strerror or e} ({hint}: finished shards are kept)") from None


_staging: bytearray | None = None  # one reused staging buffer per worker process


def _pack_files(store: Store, name: str, compression: str, level: int, samples: list[FileSample],
                skip_errors: bool) -> dict[str, Any]:
    with _writing(store.url(name)), store.open_writer(name) as sink:
        b, skipped = _write_samples(sink, name, compression, level, samples, skip_errors, None)
        if not b.records.keys:
            raise _AllSkipped(skipped)
        record = b.finish()
    return {"record": asdict(record), "samples": vars(b.records), "fields": sorted(b.fields), "skipped": skipped}


def _write_samples(sink: BinaryIO, name: str, compression: str, level: int, samples: list[FileSample],
                   skip_errors: bool, piece_at: int | None) -> tuple[ShardBuilder, list[tuple[str, str]]]:
    """Read each sample's files into a shard (or, from ``piece_at``, a piece of one) on
    ``sink``; the builder (flushed) and the inputs skipped. In a piece, the first input
    skipped ends the piece: it moves every later offset (see :mod:`.pieces`)."""
    global _staging
    if _staging is None:
        _staging = bytearray(STAGING_BYTES)
    skipped: list[tuple[str, str]] = []
    done_samples = done_bytes = 0
    b = ShardBuilder(sink, name, compression, level, staging=_staging, piece_at=piece_at)
    inputs = _Inputs(samples)
    fill, position = inputs.fill, 0
    try:
        for s in samples:
            members = [(fld, size, partial(fill, position + j, path, size))
                       for j, (fld, path, size) in enumerate(s.files)]
            position += len(members)
            try:
                b.add_members(s.key, members)
            except _InputFault as e:
                if not skip_errors:
                    raise InputFileError(
                        f"cannot read {e.path}: {e.why} (sample {s.key!r}; pass --skip-errors to skip such samples)"
                    ) from None
                skipped.append((e.path, e.why))
                if piece_at is not None:
                    break
                continue
            done_samples += 1
            done_bytes += sum(size for _, _, size in s.files)
            if _progress is not None and done_samples % 64 == 0:
                _bump(done_samples, done_bytes)
                done_samples = done_bytes = 0
    finally:
        inputs.close()
    if piece_at is not None:
        b.flush()
    _bump(done_samples, done_bytes)
    return b, skipped


def pack_piece(args: tuple[Any, ...]) -> dict[str, Any]:
    """Write one piece of a shard (:mod:`.pieces`) into the shard's temporary file, which
    the pack process created: ``args`` = (path, url, name, piece, samples, skip_errors)
    (``url``: the shard's, for errors), samples None in a worker forked with the plan.
    Returns the piece's sample records, or ``redo`` when an input was skipped (the shard is
    then written again, whole)."""
    path, url, name, piece, samples, skip_errors = args
    if samples is None:
        samples = _inherited_plan()[piece.shard][piece.start : piece.stop]
    with _writing(url):
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)  # never created here: the pack owns the file
        with open(fd, "wb", buffering=0) as sink:
            os.lseek(fd, piece.offset, os.SEEK_SET)
            b, skipped = _write_samples(sink, name, "none", 0, samples, skip_errors, piece.offset)
    if skipped:
        return {"redo": True}
    if b.stored_bytes != piece.end:
        raise PackError(f"{path}: piece {piece} ended at byte {b.stored_bytes}, its plan at {piece.end} "
                        "(a datapipe bug: please report it)")
    return {"samples": vars(b.records), "fields": sorted(b.fields)}


#: the plan of the pack that forked this worker (None elsewhere): tasks then name their
#: samples by position instead of carrying them
_plan: list[list[FileSample]] | None = None


def _inherited_plan() -> list[list[FileSample]]:
    if _plan is None:
        raise PackError("a pack task names its samples by position, in a worker that has no plan (a datapipe bug)")
    return _plan


def _bump(samples: int, nbytes: int) -> None:
    if _progress is not None:
        with _progress.get_lock():
            _progress[0] += samples
            _progress[1] += nbytes


class _AllSkipped(Exception):
    def __init__(self, skipped: list[tuple[str, str]]) -> None:
        super().__init__("every sample of the shard was skipped")
        self.skipped = skipped


# --- planning ----------------------------------------------------------------------


def plan_shards(samples: list[FileSample], shard_bytes: int, shard_samples: int) -> list[list[FileSample]]:
    """Cut listed samples, in order, into shards of at most ``shard_bytes`` tar bytes and
    ``shard_samples`` samples (the files of a sample are never split; a sample larger than
    ``shard_bytes`` is a shard of its own)."""
    shards: list[list[FileSample]] = []
    cur: list[FileSample] = []
    cur_bytes = 0
    limits = ShardLimits(shard_bytes, shard_samples)
    for s in samples:
        if limits.starts_new(cur_bytes, len(cur), s.tar_bytes):
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += s.tar_bytes
    if cur:
        shards.append(cur)
    return shards


def _progress_bar(total: int, enabled: bool) -> Any:
    return progress_bar(total, enabled, unit="samples", unit_scale=True, desc="pack", smoothing=0.1)


def pack(
    src: str,
    dest: str,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    shard_samples: int = DEFAULT_SHARD_SAMPLES,
    compression: str | None = None,
    level: int = 3,
    workers: int | None = None,
    part: str | tuple[int, int] | None = None,
    overwrite: bool = False,
    skip_errors: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
    follow_links: bool = False,
    keys: str = "first-dot",
    tars_as_files: bool = False,
) -> PackResult:
    """Pack ``src`` (a directory of small files, a JSONL file, or a Parquet file/directory)
    into shards at ``dest`` (a local path or any fsspec URL). With ``part=(i, n)`` pack only
    the i-th of n deterministic slices, into ``dest/part-0000i-of-0000n``; `join_parts`
    makes one dataset of them.

    ``keys``: how a directory's files become samples. ``"first-dot"`` (default, WebDataset's
    rule): key = the path up to the first dot of the file name, field = the rest, so
    ``img1.jpg`` and ``img1.json`` are one sample and a name without a dot (``copyright``)
    is not packed. ``"file"``: one sample per file, key = its relative path with the dots
    of its name written ``%2E``, field = the last extension in lower case (``bin`` where there is none;
    see :func:`datapipe.packing.file_key`). Dot-files and dot-folders are never packed.
    ``PackResult`` counts the files dropped and merged, with examples.

    Symbolic links in a source directory are followed only to files inside it, unless
    ``follow_links``; FIFOs, sockets and devices are never opened. What is passed over is
    listed in ``PackResult.skipped``. One pack writes a destination at a time: a second
    gets `DestinationBusyError`. A folder of nothing but tar files (existing shards) is
    refused, pointing at `datapipe index`, unless ``tars_as_files`` (pack each tar as one
    sample's field).

    Shards hold at most ``shard_bytes`` tar bytes and ``shard_samples`` samples; a sample
    larger than ``shard_bytes`` is put in a shard of its own (webdataset's convention: that
    shard alone exceeds the limit), counted in ``PackResult.oversized``. Every argument is
    checked before anything is read or written: a bad one raises
    :class:`~datapipe.errors.PackOptionError` naming it."""
    t0 = time.perf_counter()
    src, dest = option_path(src, "src"), option_path(dest, "dest")
    o = pack_options(shard_bytes=shard_bytes, shard_samples=shard_samples, compression=compression, level=level,
                     workers=workers, part=part, overwrite=overwrite, skip_errors=skip_errors,
                     storage_options=storage_options, progress=progress, follow_links=follow_links, keys=keys,
                     tars_as_files=tars_as_files)
    parsed, keys = o.part, o.keys
    if parsed is not None:
        dest = dest.rstrip("/") + "/" + part_dir(*parsed)
    kind = source_kind(src)
    if keys != "first-dot" and kind != "directory":
        raise PackOptionError(f"keys={keys!r} applies to a directory of files; {src} is a {kind} table "
                              "(a row is a sample, a column a field)")
    opts = {"shard_bytes": o.limits.shard_bytes, "shard_samples": o.limits.shard_samples,
            "compression": o.compression, "level": o.level, "part": parsed, "kind": kind, "src": os.path.abspath(src)}
    # the listing, plan and records (a few objects per input file) live until the commit
    with WriterLock(open_store(dest, o.storage_options)) as lock, collections_paused():
        store = lock.store
        check_destination(store, o.overwrite, resumable=True, files=SHARD_FILES)
        if kind == "directory":
            result = _pack_directory(src, lock, opts, o.workers, o.skip_errors, o.progress, o.overwrite,
                                     o.follow_links, keys, o.tars_as_files)
        else:
            result = _pack_table(src, kind, lock, opts, o.progress, o.overwrite)
    result.dest = dest
    result.seconds = time.perf_counter() - t0
    return result


@dataclass(frozen=True)
class PackOptions:
    """The options of :func:`pack` (and of the Ray engine, :func:`datapipe.ray.pack`), each
    checked: made by :func:`pack_options`."""

    limits: ShardLimits
    compression: str
    level: int
    workers: int | None
    part: tuple[int, int] | None
    storage_options: dict[str, Any] | None
    overwrite: bool
    skip_errors: bool
    progress: bool
    follow_links: bool
    keys: str
    tars_as_files: bool


def pack_options(**given: Any) -> PackOptions:
    """The keyword arguments of :func:`pack` in ``given`` (those not given take its
    defaults), each checked before anything is read or written: a bad one, or a keyword
    ``pack`` does not take, raises :class:`~datapipe.errors.PackOptionError` naming it."""
    defaults = {n: p.default for n, p in inspect.signature(pack).parameters.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise PackOptionError(f"{', '.join(unknown)}: not an option of pack (its options: {', '.join(defaults)})")
    a = {**defaults, **given}
    limits = ShardLimits(a["shard_bytes"], a["shard_samples"])
    compression, level = checked_compression(a["compression"]), checked_level(a["level"])
    workers, part = checked_workers(a["workers"]), parse_part(a["part"])
    storage_options = checked_storage_options(a["storage_options"])
    flags = [option_flag(a[n], n) for n in ("overwrite", "skip_errors", "progress", "follow_links", "tars_as_files")]
    if not isinstance(a["keys"], str) or a["keys"] not in KEY_RULES:
        raise bad_option("keys", a["keys"], f"must be one of {', '.join(KEY_RULES)}")
    overwrite, skip_errors, progress, follow_links, tars_as_files = flags
    return PackOptions(limits, compression, level, workers, part, storage_options, overwrite, skip_errors, progress,
                       follow_links, a["keys"], tars_as_files)


_TAR_FIELDS = ("tar", "tar.gz", "tgz", "tar.zst", "tar.zstd", "tar.bz2", "tar.xz")


def refuse_tar_shards(src: str, samples: list[FileSample]) -> None:
    """A folder holding only tar files is a folder of existing shards: packing would store
    each whole shard as one sample with a field named ``tar``."""
    if samples and all(len(s.files) == 1 and s.files[0][0] in _TAR_FIELDS for s in samples):
        raise PackError(
            f"{src} holds only tar files ({samples[0].files[0][1]}, ...): these look like existing shards, and "
            "packing would store each whole tar as one sample. Read them in place with `datapipe index "
            f"{src}` (or `datapipe index {src} --index-to DEST`), or pass --tars-as-files (tars_as_files=True) "
            "to pack each tar as a file"
        )


def _pack_directory(src: str, lock: WriterLock, opts: dict[str, Any], workers: int | None, skip_errors: bool,
                    progress: bool, overwrite: bool, follow_links: bool, keys: str,
                    tars_as_files: bool = False) -> PackResult:
    store = lock.store
    # a destination inside the source is not input: the top one, where other parts go too
    dest_dir = lock.base.local_path("")
    if dest_dir is not None and opts["part"] is not None:
        dest_dir = os.path.dirname(dest_dir.rstrip(os.sep))
    # Packing small files waits on the disk more than on the CPU: twice as many workers
    # as cores overlap those waits (measured here, cold page cache: 4 workers 6.7 s vs
    # 2 workers 8.6 s for 30k samples on 2 cores; warm: 2.7 s vs 2.2 s).
    wanted = workers or 2 * (os.cpu_count() or 1)
    if in_this_process(lock.base):
        # worker processes would write into their own copies of this process's memory and
        # the shards would be lost with them: pack here
        wanted = 1
    listing = _list_source(src, wanted, skip_errors, follow_links, dest_dir, keys)
    samples = listing.samples
    if not tars_as_files:
        refuse_tar_shards(src, samples)
    if opts["part"] is not None:
        i, n = opts["part"]
        samples = samples[i * len(samples) // n : (i + 1) * len(samples) // n]
    plan = plan_shards(samples, opts["shard_bytes"], opts["shard_samples"])
    names = [shard_name(i, opts["compression"]) for i in range(len(plan))]
    with _writing(store.url(WORK)):
        work = Journal(store, fingerprint([opts, [[s.key, s.files, s.tar_bytes] for s in samples]]), overwrite)
    result = PackResult("", len(plan), 0, 0, 0, 0.0, skipped=list(listing.passed_over) + list(listing.bad),
                        keys=keys)
    describe_tree(result, src, listing.dropped, samples)
    if work.committed:
        return _finish_cleanup(store, work, result)
    done = work.done()
    todo = [i for i, name in enumerate(names) if name not in done]
    result.resumed_shards = len(plan) - len(todo)
    # few large shards would leave workers idle: those worth it are written in pieces
    pieces = cut_pieces(plan, todo, wanted) if opts["compression"] == "none" and isinstance(store, LocalStore) else {}
    jobs = [(i, k) for i in todo for k in (range(len(pieces[i])) if i in pieces else (None,))]
    nworkers = max(1, min(wanted, len(jobs)))
    result.workers = nworkers
    # fork when this process runs no other thread: no `if __name__ == "__main__"` guard is
    # needed in callers' scripts and workers start in milliseconds (filesystem objects are
    # re-created per process), and they inherit the plan (a task names its samples by
    # position). A caller with threads (a trainer) gets forkserver: forking a threaded
    # process can copy a held lock into the child.
    forked = threading.active_count() == 1
    ctx = mp.get_context("fork" if forked else "forkserver")
    counters = ctx.Array("q", 2)
    compression, level = opts["compression"], opts["level"]

    def task(i: int, k: int | None) -> tuple[Any, tuple[Any, ...]]:
        if k is None:
            return _pack_planned, (i, store, names[i], compression, level, None if forked else plan[i], skip_errors)
        p = pieces[i][k]
        return pack_piece, (assemblies[i].path, store.url(names[i]), names[i], p,
                            None if forked else plan[i][p.start : p.stop], skip_errors)

    global _plan
    assemblies: dict[int, ShardAssembly] = {}
    pool = None
    futures: dict[Future[dict[str, Any]], tuple[int, int | None]] = {}
    try:
        if nworkers > 1:
            for i in pieces:
                with _writing(store.url(names[i])):
                    assemblies[i] = ShardAssembly(cast(LocalStore, store), names[i], pieces[i])
            _plan = plan if forked else None
            pool = ProcessPoolExecutor(nworkers, mp_context=ctx, initializer=_init_worker,
                                       initargs=(counters, os.getpid(), lock.inherited_fd()))
            try:
                for job in jobs:
                    fn, a = task(*job)
                    futures[pool.submit(fn, a)] = job
            except BrokenProcessPool:  # a worker died while the work was being handed out
                raise _worker_lost(store, 0) from None
        # after the workers started: tqdm's monitor thread would make the next pool forkserver's
        bar = _progress_bar(sum(len(plan[i]) for i in todo), progress)

        def rate(b: Any) -> str:
            return f"{counters[1] / 1e6 / (b.format_dict['elapsed'] or 1e-9):,.1f} MB/s"

        with polled_progress(bar, counters, rate, progress):
            if pool is None:
                _init_worker(counters)
                try:
                    for i in todo:
                        _finish(work, names[i], pack_shard((store, names[i], compression, level, plan[i], skip_errors)),
                                done)
                finally:
                    _init_worker(None)
            else:
                pending = set(futures)
                try:
                    while pending:
                        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            i, k = futures.pop(fut)
                            res = fut.result()
                            if k is not None:
                                asm = assemblies[i]
                                with _writing(store.url(names[i])):
                                    asm.add(k, res)
                                    if not asm.complete:
                                        continue
                                    del assemblies[i]
                                    if asm.redo:  # an input was skipped: the shard again, whole, as one task
                                        asm.release()
                                        fn, args = task(i, None)
                                        redo = pool.submit(fn, args)
                                        futures[redo] = (i, None)
                                        pending.add(redo)
                                        continue
                                    res = asm.publish()
                            _finish(work, names[i], res, done)
                except BrokenProcessPool:
                    raise _worker_lost(store, len(done) - (len(plan) - len(todo))) from None
                except BaseException:
                    for fut in pending:
                        fut.cancel()
                    raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        _plan = None
        for asm in assemblies.values():  # shards left unpublished by a pack that failed
            asm.discard()
    return commit_shards(lock, work, names, done, compression, result, shard_bytes=opts["shard_bytes"])


def _list_source(src: str, workers: int, skip_errors: bool, follow_links: bool, exclude: str | None,
                 keys: str) -> DirectoryListing:
    """The listing of the folder ``src``: its first folders listed here (whole folders,
    for ``_TELLS_WAITS_S`` seconds or more: at least one of the ``2 x workers`` pieces), and
    the rest here too unless those waited on their storage (:func:`_listing_waits`), then by
    up to ``workers`` threads of this process.

    A listing that waits (a cold network file system: each file's status a round trip)
    overlaps its waits on threads, which wait without the GIL. One that does not (warm, or
    a local disk that reads ahead) is a status call and a few Python operations per file,
    and threads only contend for the GIL: 90,000 files here (2 cores), warm, took 1.25 s in
    one thread against 1.46 s in 2 and 1.69 s in 4; cold, 2.55 s against 2.64 and 3.16 s
    (2026-12-04). Worker processes took half as much CPU again as threads (60,000 files:
    0.52-0.83 s against 0.34-0.56 s), a third of it pickling every listed path back to this
    process, which unpickled it alone, on the pack's clock."""
    if workers < 2:
        return list_directory(src, skip_errors, follow_links, exclude=exclude, keys=keys)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="datapipe-list")

    def list_folders(folders: list[str]) -> Iterator[DirectoryListing]:
        args = [(src, skip_errors, follow_links, exclude, keys, f) for f in folders]
        wall = cpu = 0.0
        for i, a in enumerate(args):
            if wall >= _TELLS_WAITS_S:  # listed long enough to tell: once
                if _listing_waits(wall, cpu):
                    yield from pool.map(_list_folder, args[i:])
                    return
                yield from map(_list_folder, args[i:])
                return
            w, c = time.perf_counter(), time.thread_time()
            listed = _list_folder(a)
            wall, cpu = wall + time.perf_counter() - w, cpu + time.thread_time() - c
            yield listed

    try:
        return list_in_pieces(src, skip_errors, follow_links, exclude, keys, pieces=2 * workers,
                              list_folders=list_folders)
    finally:
        # every thread ended before the pack's workers are forked (see _pack_directory)
        pool.shutdown(wait=True, cancel_futures=True)


#: seconds of listing timed before a pack decides whether its listing waits on storage
_TELLS_WAITS_S = 0.05


def _listing_waits(wall: float, cpu: float) -> bool:
    """Whether a listing that took ``wall`` seconds and ``cpu`` of its thread's CPU waited
    on its storage more than it computed (then threads overlap the waits)."""
    return wall > 2 * cpu


def _list_folder(args: tuple[Any, ...]) -> DirectoryListing:
    src, skip_errors, follow_links, exclude, keys, folder = args
    return list_directory(src, skip_errors, follow_links, exclude, keys, within=folder, allow_empty=True)


def _worker_lost(store: Store, new_shards: int) -> PackError:
    return PackError(
        f"a pack worker process died (killed by a signal, e.g. by the out-of-memory killer) while packing "
        f"into {store.root}; {new_shards} new shards are recorded: run the same command again to resume "
        "(with fewer --workers if memory is short)"
    )


def pack_shard(args: tuple[Any, ...]) -> dict[str, Any]:
    """Write one planned shard of files: ``args`` = (store, name, compression, level,
    samples, skip_errors). Returns its journal record (``record`` None when every sample
    was skipped). Runs in a pack worker process, or in a Ray write task."""
    try:
        return _pack_files(*args)
    except _AllSkipped as e:
        return {"record": None, "skipped": e.skipped}


def _pack_planned(args: tuple[Any, ...]) -> dict[str, Any]:
    """``pack_shard`` of planned shard ``args[0]``: ``args[1:]`` as ``pack_shard`` takes
    them, samples None in a worker forked with the plan."""
    i, store, name, compression, level, samples, skip_errors = args
    return pack_shard((store, name, compression, level, _inherited_plan()[i] if samples is None else samples,
                       skip_errors))


def _finish(work: Journal, name: str, res: dict[str, Any], done: dict[str, Any]) -> None:
    with _writing(work.store.url(f"{WORK}/{name}.json")):
        work.record(name, res)
    done[name] = res


def commit_shards(lock: WriterLock, work: Journal, names: list[str], done: dict[str, Any], compression: str,
                  result: PackResult, *, shard_bytes: int | None = None) -> PackResult:
    """Publish the shards ``names`` (in that order) from their records in ``done``: the
    index, then the manifest, then the journal's removal. Refuses if another writer took
    the destination over. ``shard_bytes``: the shard limit, for ``result``'s count of the
    samples larger than it (each in a shard of its own)."""
    store = lock.store
    shards, sample_recs, fields = [], [], set()
    for name in names:
        res = done[name]
        result.skipped.extend(tuple(x) for x in res.get("skipped", []))
        if res["record"] is None:
            continue
        shards.append(ShardRecord(**res["record"]))
        sample_recs.append(SampleRecords(**res["samples"]))
        fields.update(res["fields"])
    if not shards:
        raise PackError(f"nothing packed into {store.root}: every sample was skipped")
    with _writing(f"the index of {store.root}"):
        commit(lock, lambda store: write_index_files(store, shards, sample_recs, compression, fields))
    with _writing(store.url(WORK)):
        work.remove()
    if shard_bytes is not None:
        oversized = oversized_samples(shards, sample_recs, shard_bytes)
        result.oversized, result.oversized_examples = len(oversized), oversized[:_EXAMPLES]
    return _tally(result, shards)


_EXAMPLES = 3  # of the samples larger than the shard limit, the summary names this many


def _finish_cleanup(store: Store, work: Journal, result: PackResult) -> PackResult:
    """This plan's manifest is written; only the journal's removal was cut short (a kill):
    remove it, and report the dataset as it stands. Nothing published is rewritten."""
    shards = read_shard_table(store.get(SHARDS_FILE), store.url(SHARDS_FILE))
    with _writing(store.url(WORK)):
        work.remove()
    result.resumed_shards = len(shards)
    return _tally(result, shards)


def _tally(result: PackResult, shards: list[ShardRecord]) -> PackResult:
    result.shards = len(shards)
    result.samples = sum(s.samples for s in shards)
    result.stored_bytes = sum(s.bytes for s in shards)
    result.input_bytes = sum(s.tar_bytes for s in shards)
    return result


def _pack_table(src: str, kind: str, lock: WriterLock, opts: dict[str, Any], progress: bool,
                overwrite: bool) -> PackResult:
    """Rows are read in order in this process; shard boundaries depend only on the rows and
    the limits, so a rerun skips the shards an earlier run recorded."""
    store = lock.store
    st = os.stat(src)
    total = count_table_rows(src, kind)
    start, stop = 0, total
    if opts["part"] is not None:
        i, n = opts["part"]
        start, stop = i * total // n, (i + 1) * total // n
    with _writing(store.url(WORK)):
        work = Journal(store, fingerprint([opts, st.st_size, st.st_mtime_ns]), overwrite)
    if work.committed:
        return _finish_cleanup(store, work, PackResult("", 0, 0, 0, 0, 0.0))
    done = work.done()
    names: list[str] = []
    result = PackResult("", 0, 0, 0, 0, 0.0)
    keys: set[str] = set()
    bar = _progress_bar(stop - start, progress)
    limits = ShardLimits(opts["shard_bytes"], opts["shard_samples"])
    pending: list[tuple[str, list[bytes | bytearray | memoryview], list[str]]] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = shard_name(len(names), opts["compression"])
        names.append(name)
        if name in done:
            result.resumed_shards += 1
        else:
            with _writing(store.url(name)), store.open_writer(name) as sink:
                b = ShardBuilder(sink, name, opts["compression"], opts["level"])
                for key, parts, flds in pending:
                    b.add_encoded(key, parts, flds)
                record = b.finish()
            res = {"record": asdict(record), "samples": vars(b.records), "fields": sorted(b.fields)}
            _finish(work, name, res, done)
        pending, pending_bytes = [], 0

    try:
        for sample in iter_table(src, kind, start, stop):
            key, parts = encode_sample(sample)
            if key in keys:
                raise DuplicateKeyError(f"{src}: sample key {key!r} appears twice")
            keys.add(key)
            size = sum(len(p) for p in parts)
            if limits.starts_new(pending_bytes, len(pending), size):
                flush()
            pending.append((key, parts, [k for k in sample if not k.startswith("__")]))
            pending_bytes += size
            bar.update(1)
        if pending:
            flush()
    finally:
        bar.close()
    if not names:
        raise EmptyInputError(f"{src}: no rows to pack" + (" in this part" if opts["part"] else ""))
    return commit_shards(lock, work, names, done, opts["compression"], result, shard_bytes=opts["shard_bytes"])
