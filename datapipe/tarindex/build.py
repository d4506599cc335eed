"""`index_shards`: the datapipe index (manifest, ``shards.parquet``, ``samples.parquet``) of
existing tar shards, which stay where they are.

Each shard is read once, whole, by one worker process (a shard's bytes are in memory
while it is scanned: memory is one shard per worker, two in-process; shards the machine's
memory cannot hold at once are refused before any is read) and scanned by the strict tar
parser (:func:`datapipe.format.tarscan.scan_tar`). Its rows are recorded at once under
``_index/`` in the destination, one small JSON object per shard keyed by its URL, so a
run that stops (a crash, a damaged shard, Ctrl-C) is finished by the same command: shards
whose record matches their size and version (mtime and inode locally, the ETag on S3)
are not read again, and neither are they when shards are added to the list later.
``part=(i, n)`` indexes only the i-th of n slices of the shard list and writes only
records (machines can share the work); a run without ``part`` commits. The commit writes
both index files, then the manifest, as a pack does: a destination without a manifest is
no dataset, and an index being rewritten loses its manifest first. A destination holding
files of those names that we did not write (a packed dataset, the user's own
``samples.parquet``) is refused before any shard is read, and nothing in it is replaced.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import (
    DatapipeError,
    DestinationExistsError,
    EmptyInputError,
    ObjectChangedError,
    PackOptionError,
    StorageError,
    TruncatedReadError,
)
from ..format import (
    MANIFEST,
    SAMPLES_FILE,
    SHARDS_FILE,
    TAR_INDEX,
    SampleRecords,
    ShardRecord,
    check_relative_name,
    parse_manifest,
    scan_tar,
)
from ..progress import progress_bar
from ..publish import RECORDS, WriterLock, commit, parse_part, write_index_files
from ..storage import Store, is_local_url, open_store, split_url
from .urls import ShardRef, expand_urls, stat_shards

__all__ = ["IndexResult", "index_shards", "RECORDS", "default_dest"]


@dataclass
class IndexResult:
    dest: str
    shards: int
    samples: int
    stored_bytes: int
    #: shards read by this run, and their bytes
    indexed_shards: int
    read_bytes: int
    #: shards an earlier run had indexed (their records matched)
    reused_shards: int
    seconds: float
    #: False for a ``part`` run: it wrote records only
    committed: bool
    #: tar members that name no sample (directories, names without key.field), passed over
    passed_over: int = 0

    def summary(self) -> str:
        rate = f", {self.read_bytes / 1e6 / self.seconds:,.1f} MB/s read" if self.seconds and self.read_bytes else ""
        what = f"indexed {self.samples:,} samples in {self.shards} shards" if self.committed \
            else f"indexed {self.indexed_shards} shards of this part (records only: run without --part to commit)"
        lines = [f"{what} at {self.dest}",
                 f"  {self.indexed_shards} shards read ({self.read_bytes / 1e6:,.1f} MB) in {self.seconds:.2f} s{rate}"]
        if self.reused_shards:
            lines.append(f"  {self.reused_shards} shards were already indexed by an earlier run (not read again)")
        if self.passed_over:
            lines.append(f"  passed over {self.passed_over} tar members that name no sample (directories, names "
                         "without key.field), as WebDataset does")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["read_mb_per_s"] = round(self.read_bytes / 1e6 / self.seconds, 1) if self.seconds else None
        return out


class _RecordLog:
    """Records of finished shards, written under ``_index/`` in batches: one JSON-lines
    file per flush (every ``FLUSH_S`` seconds, and when the run ends, however it ends), so
    10^4 shards cost a few hundred small writes, not 10^4 synced files."""

    FLUSH_S = 5.0

    def __init__(self, store: Store) -> None:
        self.store, self.token = store, uuid.uuid4().hex[:16]
        self.pending: list[dict[str, Any]] = []
        self.flushes, self.last = 0, time.monotonic()

    def add(self, rec: dict[str, Any]) -> None:
        self.pending.append(rec)
        if time.monotonic() - self.last >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            body = b"".join(json.dumps(r).encode() + b"\n" for r in self.pending)
            self.store.put(f"{RECORDS}/records-{self.token}-{self.flushes:06d}.jsonl", body)
            self.flushes += 1
            self.pending = []
        self.last = time.monotonic()


def _load_records(store: Store) -> dict[str, dict[str, Any]]:
    """Every record earlier runs wrote (by URL; a later one of a URL wins). A file that
    does not parse is passed over: its shards are indexed again."""
    out: dict[str, dict[str, Any]] = {}
    try:
        keys = [k for k in store.list(RECORDS + "/") if k.endswith(".jsonl")]
    except (DatapipeError, OSError):
        return out
    for k in keys:
        try:
            lines = store.get(k).splitlines()
        except (DatapipeError, OSError):
            continue
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("url"), str):
                out[doc["url"]] = doc
    return out


def default_dest(urls: list[str]) -> str:
    """The folder all ``urls`` share (an index in place), else :class:`DatapipeError`."""
    folders = {split_url(u)[0] for u in urls}
    if len(folders) != 1:
        raise StorageError(f"the shards lie in {len(folders)} folders ({', '.join(sorted(folders)[:3])}, ...): "
                           "pass --index-to DEST (dest=) to say where the index goes")
    return folders.pop()


# --- worker side --------------------------------------------------------------------


#: read buffers are reused from shard to shard (fresh memory costs page faults and
#: zeroing, about as much as the read itself); one of more than this is not kept
_KEEP_BUFFER = 1 << 30
_buffer = bytearray()  # a worker process's


def _read_shard(ref: ShardRef, storage_options: dict[str, Any] | None,
                buffer: bytearray) -> tuple[bytes | memoryview, bytearray]:
    """(the shard's bytes, all of them, as they were when it was listed (else
    :class:`ObjectChangedError`); the buffer to reuse next). A local shard is read into
    ``buffer`` (a larger one when it is too small): the view is good until that buffer is
    read into again."""
    folder, key = split_url(ref.url)
    store = open_store(folder, None if is_local_url(folder) else storage_options)
    path = store.local_path(key)
    try:
        if path is None:
            return (store.get_range_at(key, 0, ref.bytes, ref.version) if ref.bytes else b""), buffer
        if len(buffer) < ref.bytes:
            buffer = bytearray(ref.bytes)
    except MemoryError:
        raise PackOptionError(f"shard {ref.url} ({ref.bytes:,} bytes): no memory to hold it whole, as indexing "
                              f"does; {_FEWER}") from None
    buf = memoryview(buffer)[: ref.bytes]
    with open(path, "rb", buffering=0) as f:
        if store.stat(key)[1] != ref.version:
            raise ObjectChangedError(f"{ref.url} changed since it was listed; run the same command again")
        got = 0
        while got < ref.bytes:
            n = f.readinto(buf[got:])
            if not n:
                break
            got += n
        more = f.read(1)
    if got != ref.bytes or more or store.stat(key)[1] != ref.version:
        raise ObjectChangedError(f"{ref.url} changed while it was read (listed with {ref.bytes} bytes); "
                                 "run the same command again")
    return buf, (buffer if len(buffer) <= _KEEP_BUFFER else bytearray())


_FEWER = ("index with fewer workers (--workers, workers=), on a machine with more memory, or split the shard "
          "into smaller ones")


def _memory_bytes() -> int | None:
    """This machine's memory, or its cgroup's limit where lower (a container's); None
    where neither is known."""
    try:
        known = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (ValueError, OSError, AttributeError):  # no such sysconf name here
        known = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # else "max": no limit
            known.append(int(text))
    return min(known) if known else None


def _check_memory(todo: list[ShardRef], buffers: int) -> None:
    """Refuse, before any shard is read, shards that cannot be held at once in this
    machine's memory (``buffers`` of them are: one per worker process, two in-process; the
    largest ``buffers`` together are the worst case), naming the largest, its size and what
    to do: a raw MemoryError, or the kernel's OOM killer, would name nothing."""
    memory = _memory_bytes()
    largest = sorted(todo, key=lambda r: r.bytes, reverse=True)[:buffers]
    held = sum(r.bytes for r in largest)
    if memory is None or held <= memory:
        return
    big = largest[0]
    at_once = f"; with the next {len(largest) - 1} largest, {held:,} bytes" if len(largest) > 1 else ""
    raise PackOptionError(
        f"shard {big.url} holds {big.bytes:,} bytes{at_once}: more than this machine's {memory:,} bytes of "
        f"memory (a shard is read whole while it is scanned, {buffers} at once here: one per worker process, "
        f"two in-process); {_FEWER}")


def _record(ref: ShardRef, data: bytes | memoryview) -> dict[str, Any]:
    """The record of one shard from its bytes."""
    if len(data) != ref.bytes:
        raise TruncatedReadError(f"{ref.url}: read {len(data)} bytes, listed with {ref.bytes}")
    s = scan_tar(data, ref.url)
    return {"url": ref.url, "bytes": s.bytes, "version": ref.version, "checksum": s.checksum,
            "samples": vars(s.records), "fields": sorted(s.fields), "passed_over": s.passed_over}


def _scan_one(ref: ShardRef, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """A worker process's task: read one shard (into its reused buffer) and scan it."""
    global _buffer
    data, _buffer = _read_shard(ref, storage_options, _buffer)
    return _record(ref, data)


def _scan_in_process(todo: list[ShardRef], storage_options: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """Records of ``todo`` in order, in this process: a thread reads the next shard (the
    read releases the GIL) while this one scans the last, into two buffers in turn."""
    buffers = [bytearray(), bytearray()]
    with ThreadPoolExecutor(1, thread_name_prefix="datapipe-index-read") as reader:
        ahead = [reader.submit(_read_shard, ref, storage_options, buffers[0]) for ref in todo[:1]]
        for k, ref in enumerate(todo):
            data, buffers[k % 2] = ahead.pop().result()
            if k + 1 < len(todo):
                ahead.append(reader.submit(_read_shard, todo[k + 1], storage_options, buffers[(k + 1) % 2]))
            yield _record(ref, data)
            del data


# --- records ------------------------------------------------------------------------


def _matching(doc: dict[str, Any] | None, ref: ShardRef) -> dict[str, Any] | None:
    """The record ``doc`` an earlier run wrote, if it describes this very shard (URL, size,
    version) and has the shape we write; else None (the shard is indexed again)."""
    if not isinstance(doc, dict) or doc.get("url") != ref.url or doc.get("bytes") != ref.bytes \
            or doc.get("version") != ref.version or ref.version is None:
        return None
    s = doc.get("samples")
    ok = isinstance(s, dict) and all(isinstance(s.get(k), list) for k in ("keys", "offsets", "lengths", "checksums")) \
        and len({len(s[k]) for k in ("keys", "offsets", "lengths", "checksums")}) == 1 \
        and isinstance(doc.get("checksum"), str) and isinstance(doc.get("fields"), list) \
        and isinstance(doc.get("passed_over"), int)
    return doc if ok else None  # the values are checked again when the index is opened


def _shard_name(url: str, root: str) -> str:
    """The shard's name in the shard table: relative to the index folder when it lies
    inside it, else its URL (an absolute path locally)."""
    prefix = root.rstrip("/") + "/"
    if url.startswith(prefix):
        rel = url[len(prefix) :]
        try:
            return check_relative_name(rel, "shard", url)
        except DatapipeError:
            pass
    return url


def _progress_bar(total: int, enabled: bool) -> Any:
    return progress_bar(total, enabled, unit="B", unit_scale=True, desc="index", smoothing=0.1)


def _run(todo: list[ShardRef], store: Store, storage_options: dict[str, Any] | None, workers: int | None,
         progress: bool, found: dict[str, dict[str, Any]]) -> None:
    """Scan ``todo`` (in worker processes when more than one), writing each record as its
    shard is done; the first failure cancels what has not started and is raised."""
    nworkers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    _check_memory(todo, nworkers if nworkers > 1 else min(2, len(todo)))
    pool = None
    if nworkers > 1:
        # fork when this process runs no other thread (workers start in milliseconds, no
        # `__main__` guard needed), else forkserver: forking a threaded process can copy a
        # held lock into the child (as pack does)
        ctx = mp.get_context("fork" if threading.active_count() == 1 else "forkserver")
        pool = ProcessPoolExecutor(nworkers, mp_context=ctx)
        # the workers start now, before this process starts the progress bar's thread
        for f in [pool.submit(os.getpid) for _ in range(nworkers)]:
            f.result()
    bar = _progress_bar(sum(r.bytes for r in todo), progress)
    log = _RecordLog(store)
    try:
        if pool is None:
            for ref, rec in zip(todo, _scan_in_process(todo, storage_options)):
                log.add(rec)
                found[ref.url] = rec
                bar.update(ref.bytes)
            return
        pending = list(reversed(todo))
        running: dict[Future[dict[str, Any]], ShardRef] = {}
        while pending or running:
            while pending and len(running) < 2 * nworkers:  # a bounded queue: results arrive in order of work
                ref = pending.pop()
                running[pool.submit(_scan_one, ref, storage_options)] = ref
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                ref = running.pop(fut)
                rec = fut.result()
                log.add(rec)
                found[ref.url] = rec
                bar.update(ref.bytes)
    finally:
        bar.close()
        log.flush()  # what is done stays done, whatever ended the run
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def index_shards(urls: str | list[str], dest: str | None = None, *, storage_options: dict[str, Any] | None = None,
                 workers: int | None = None, part: str | tuple[int, int] | None = None,
                 progress: bool = False, shards: list[ShardRef] | None = None) -> IndexResult:
    """Index the existing tar shards ``urls`` (URLs, local paths, brace patterns such as
    ``shard-{000000..000999}.tar``, globs) into ``dest`` (default: the folder they share,
    an index in place), for :func:`datapipe.open_dataset`, :class:`~datapipe.StreamingDataset`
    and ``datapipe inspect/verify``. Shards are read once, in ``workers`` processes (default:
    the CPU count); a rerun skips shards already indexed; ``part=(i, n)`` (or ``"i/n"``)
    indexes one slice and commits nothing. A shard the strict tar parser refuses raises
    :class:`~datapipe.errors.CorruptShardError` naming it and the byte offset, and nothing
    is committed. ``.tar.gz``/``.tar.zst`` shards are refused (no sample of a whole-file
    compressed tar can be reached by offset: decompress them first)."""
    t0 = time.perf_counter()
    parsed = parse_part(part)
    refs = shards if shards is not None else stat_shards(expand_urls(urls, storage_options), storage_options)
    if dest is None:
        dest = default_dest([r.url for r in refs])
    dest = os.path.abspath(dest) if is_local_url(dest) and not dest.startswith("file://") else dest.rstrip("/")
    base = open_store(dest, storage_options)
    found: dict[str, dict[str, Any]] = {}
    earlier = _load_records(base)
    # records of other shards (another list's, or copied along with a folder) do not make
    # the index files here ours
    _check_destination(base, dest, any(ref.url in earlier for ref in refs))
    for ref in refs:
        rec = _matching(earlier.get(ref.url), ref)
        if rec is not None:
            found[ref.url] = rec
    if parsed is not None:  # the same slices as pack's --part
        i, n = parsed
        mine = refs[i * len(refs) // n : (i + 1) * len(refs) // n]
    else:
        mine = refs
    todo = [r for r in mine if r.url not in found]
    reused = len(mine) - len(todo)
    if parsed is not None:  # records only: parts of one list share the destination
        _run(todo, _writable(base, dest), storage_options, workers, progress, found)
        return IndexResult(dest, len(mine), sum(len(found[r.url]["samples"]["keys"]) for r in mine),
                           sum(r.bytes for r in mine), len(todo), sum(r.bytes for r in todo), reused,
                           time.perf_counter() - t0, False, sum(found[r.url]["passed_over"] for r in mine))
    with _locked(base, dest) as lock:
        _run(todo, lock.store, storage_options, workers, progress, found)
        result = _commit(lock, refs, found, dest, storage_options)
    result.indexed_shards, result.read_bytes = len(todo), sum(r.bytes for r in todo)
    result.reused_shards, result.seconds = reused, time.perf_counter() - t0
    return result


def _not_writable(dest: str, why: object) -> StorageError:
    return StorageError(f"cannot write the index at {dest} ({why}): for shards in a place you may not write, "
                        "pass --index-to DEST (dest=) to put the index elsewhere")


def _writable(store: Store, dest: str) -> Store:
    if not store.supports_writes:
        raise _not_writable(dest, "the store takes no writes")
    return store


@contextmanager
def _locked(store: Store, dest: str) -> Iterator[WriterLock]:
    """The destination's writer lock (taken before any shard is read, so a destination
    that cannot be written is known at once)."""
    lock = WriterLock(_writable(store, dest))
    try:
        lock.__enter__()
    except (OSError, StorageError) as e:
        if isinstance(e, DatapipeError) and not isinstance(e, StorageError):
            raise
        raise _not_writable(dest, e) from e
    try:
        yield lock
    finally:
        lock.release()


def _foreign_manifest(store: Store, dest: str) -> DestinationExistsError | None:
    """The refusal for a ``manifest.json`` at ``dest`` that is not an index of tars we
    wrote (a packed dataset, a file of the user's), else None."""
    where = store.url(MANIFEST)
    try:
        old = parse_manifest(store.get(MANIFEST), where)
    except DatapipeError:
        old = None
    if old is not None and old.get("origin") == TAR_INDEX:
        return None
    what = "a packed dataset" if old is not None else "a manifest.json that is not a datapipe index"
    return DestinationExistsError(f"{where} exists: {dest} holds {what}; choose another --index-to DEST")


def _check_destination(store: Store, dest: str, has_records: bool) -> None:
    """Refuse, before any shard is read, a destination whose index files we may not have
    written: a foreign manifest, or ``shards.parquet``/``samples.parquet`` without a
    manifest and without records of an earlier run of ours over these shards
    (``has_records``: a commit that stopped before its manifest leaves both: then the files
    are ours, and are replaced)."""
    if store.exists(MANIFEST):
        refusal = _foreign_manifest(store, dest)
        if refusal is not None:
            raise refusal
        return
    if has_records:
        return
    for name in (SHARDS_FILE, SAMPLES_FILE):
        if store.exists(name):
            raise DestinationExistsError(
                f"{store.url(name)} exists and is not part of an index we wrote (there is no manifest.json "
                f"and no {RECORDS}/ record of these shards beside it): indexing here would overwrite it; choose "
                "another --index-to DEST (or, if it is what is left of an index datapipe wrote, delete it yourself)")


def _same_index(dest: str, storage_options: dict[str, Any] | None, shards: list[ShardRecord]) -> bool:
    """Whether the index at ``dest`` (opened and verified as every reader opens it) lists
    exactly ``shards``: then a rerun leaves it as it is."""
    from ..dataset import open_index

    try:
        ix = open_index(dest, storage_options)
    except DatapipeError:
        return False
    return ix.manifest.get("origin") == TAR_INDEX and \
        [(s.name, s.bytes, s.samples, s.checksum) for s in ix.shards] == \
        [(s.name, s.bytes, s.samples, s.checksum) for s in shards]


def _commit(lock: WriterLock, refs: list[ShardRef], found: dict[str, dict[str, Any]], dest: str,
            storage_options: dict[str, Any] | None) -> IndexResult:
    store = lock.store
    records = [found[r.url] for r in refs]
    shards = [ShardRecord(_shard_name(r.url, store.root), rec["bytes"], len(rec["samples"]["keys"]),
                          rec["checksum"], rec["bytes"]) for r, rec in zip(refs, records)]
    samples = sum(s.samples for s in shards)
    passed = sum(rec["passed_over"] for rec in records)
    result = IndexResult(dest, len(shards), samples, sum(s.bytes for s in shards), 0, 0, 0, 0.0, True, passed)
    if samples == 0:
        raise EmptyInputError(f"the {len(shards)} shards hold no sample (members need key.field names, "
                              "WebDataset's rule); nothing to index")
    if store.exists(MANIFEST):
        if _same_index(dest, storage_options, shards):
            return result
        refusal = _foreign_manifest(store, dest)
        if refusal is not None:  # never delete a file we may not have written
            raise refusal
        lock.check()
        store.delete(MANIFEST)  # the old index stops existing before its files are replaced
    fields: set[str] = set()
    for rec in records:
        fields.update(rec["fields"])
    commit(lock, lambda store: write_index_files(store, shards, (SampleRecords(**rec["samples"]) for rec in records),
                                                 "none", fields, extra={"origin": TAR_INDEX}))
    return result
