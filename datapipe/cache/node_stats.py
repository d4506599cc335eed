"""Node-wide cache counters, through files in the shared warm directory.

A TieredCache counts hits, misses, bytes and waits in the process that does the reads; in
training those are DataLoader workers, each with its own copy of the cache, so the main
process alone sees nothing. Every process that uses a warm directory therefore writes its
counters to ``stats/<host>-<pid>-<token>.json`` there (a temporary name, then a rename, so
a reader sees a whole file or the previous one), and anyone can sum the files:

* when: a timer thread, at most every ``interval_s`` and only when a counter moved (cheap:
  no work on the read path); at ``close()``; at the end of a prefetch pass; and at process
  exit through a ``multiprocessing.util.Finalize``, which the interpreter's atexit runs in
  a main process and which ``multiprocessing`` runs in its children (forked children end
  with ``os._exit`` and skip plain atexit handlers, spawned ones run both). A DataLoader
  worker ends its epoch that way (sentinel, then join), so its last counters land. A
  process killed by a signal loses at most the last ``interval_s`` of counts.
* what: the files of every process, live or exited, since the directory was last cleared.
  ``clear_warm_dir`` starts a new *generation* (``stats/generation``) and deletes the
  files; a file of an older generation (written by a process racing the clear) is ignored,
  and that process's next write counts only what it did after its last write before the
  clear (at most ``interval_s`` of reads may fall on the wrong side of a clear).
* bounded: a process holds an exclusive ``flock`` on its own file while it may still
  write it (the kernel drops it when the process dies; ``close()`` drops it too). Summing
  first merges every unlocked file, whose writer is gone, into one
  ``stats/exited.summary`` and deletes it, so the directory holds one file per live process
  plus the summary however many DataLoader workers came and went. Merging takes
  ``stats/.merge.lock`` without waiting (a second merger skips its turn). The summary lists
  the files it absorbed (for ``_ABSORBED_KEEP_S``), and a reader adds the files it read
  before the summary it reads afterwards, skipping absorbed ones: each process counts once
  even while a merge runs.

The locks only ever make a file look live for longer: a forked child inherits its parent's
locked descriptor, and the parent's file is then merged once both have exited.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from multiprocessing import util as mp_util
from typing import Any

from .lockfds import close_lock, open_lock

__all__ = ["CounterFile", "CounterFlusher", "sum_counter_files", "merge_exited", "new_generation",
           "clear_counter_files", "COUNTER_KEYS", "STATS_DIR", "FLUSH_INTERVAL_S"]

# The counters TieredCache.stats() always reports (0 when nothing happened); others appear
# once counted.
COUNTER_KEYS = ("hot_hits", "hot_misses", "hot_bytes", "hot_evictions", "hot_not_admitted",
                "warm_hits", "warm_misses", "warm_bytes", "warm_fills", "warm_evictions",
                "warm_not_admitted", "warm_corrupt", "cold_reads", "cold_bytes", "cold_retries",
                "cold_refetches", "range_refetches", "prefetched", "prefetch_errors",
                "prefetch_not_admitted", "wait_seconds",
                # the shared tier (cluster-wide) and where each upper tier's misses came from
                "shared_hits", "shared_misses", "shared_bytes", "shared_fills", "shared_evictions",
                "shared_not_admitted", "shared_corrupt", "shared_waits", "shared_takeovers",
                "shared_read_around", "warm_from_shared", "warm_from_cold", "hot_from_shared",
                "hot_from_cold",
                # cold pacing (pacing.py)
                "cold_throttled", "cold_backoffs", "cold_limit_decreases")

STATS_DIR = "stats"
FLUSH_INTERVAL_S = 0.5
_GENERATION = "generation"
_FORMAT = "datapipe-cache-counters"
_STALE_TMP_S = 60.0  # a temporary file this old belongs to a writer that died mid-write
_SUMMARY = "exited.summary"
_SUMMARY_FORMAT = "datapipe-cache-counters-summary"
_MERGE_LOCK = ".merge.lock"
_ABSORBED_KEEP_S = 600.0  # longer than any one reader takes between its file reads and the summary
_SAFE = re.compile(r"[^A-Za-z0-9._]+")


def read_generation(stats_dir: str) -> str:
    try:
        with open(os.path.join(stats_dir, _GENERATION)) as f:
            return f.read().strip() or "0"
    except OSError:  # never cleared (or the folder is gone, or is a file now)
        return "0"


def new_generation(stats_dir: str) -> str:
    """Start a new counting period; files written under the old one stop counting."""
    os.makedirs(stats_dir, exist_ok=True)
    gen = uuid.uuid4().hex
    _write_atomic(stats_dir, _GENERATION, gen)
    return gen


def _write_atomic(stats_dir: str, name: str, text: str) -> None:
    tmp = os.path.join(stats_dir, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(stats_dir, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _snapshot(counters: Mapping[str, Any]) -> dict[str, float]:
    if hasattr(counters, "snapshot"):  # the cache's locked Stats
        counters = counters.snapshot()
    for _ in range(5):
        try:
            # dict() of a Counter copies in C under the GIL; retry covers other mappings
            return {k: v for k, v in dict(counters).items() if isinstance(v, (int, float))}
        except RuntimeError:  # changed size during iteration
            continue
    return {k: v for k, v in dict(counters).items() if isinstance(v, (int, float))}


def publish_locked(folder: str, name: str, text: str) -> int:
    """Publish ``text`` as ``folder/name`` by rename, the new file locked (``flock``) before
    it is visible, and return its fd: while the fd is open, the lock says its writer lives
    (the counter files here, the node's published futures). Re-creates ``folder`` when it
    was deleted under us, never the cache directory it lies in: that is re-created only by
    the cache's repair, which first checks that nobody else's folder took its path."""
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = open_lock(tmp, flags, 0o644)
    except FileNotFoundError:
        try:
            os.mkdir(folder)
        except FileExistsError:
            pass
        fd = open_lock(tmp, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # before the rename: the file is never seen unlocked
        os.write(fd, text.encode())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        close_lock(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return fd


class CounterFile:
    """One process's counter file in ``<root>/stats/``. ``flush(counters)`` writes the
    counters (minus what was counted before the last clear) if they moved."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, STATS_DIR)
        os.makedirs(self.dir, exist_ok=True)
        host = _SAFE.sub("_", socket.gethostname())[:64] or "host"
        self.pid = os.getpid()
        self.started = time.time()
        self.name = f"{host}-{self.pid}-{time.time_ns()}-{uuid.uuid4().hex[:6]}.json"
        self.path = os.path.join(self.dir, self.name)
        self.generation = read_generation(self.dir)
        self._baseline: dict[str, float] = {}
        self._written: dict[str, float] | None = None  # absolute counters last written
        self._lock = threading.Lock()
        self._fd = -1  # the published file, locked: this process may still write it
        self.closed = False
        self.errors = 0
        self.writes = 0
        #: while this says True (the warm tier is out of the path), nothing is written:
        #: the tier's own warning says why, and the counters are written whole when it is back
        self.paused: Callable[[], bool] = lambda: False
        #: whether a failed write is the warm tier's failure (said once by the tier), so it
        #: is not warned about here too
        self.tier_failed: Callable[[OSError], bool] = lambda e: False
        self._warned = False

    def _publish(self, text: str) -> None:
        fd = publish_locked(self.dir, self.name, text)
        old, self._fd = self._fd, fd
        if old >= 0:
            close_lock(old)

    def finish(self, counters: Mapping[str, Any]) -> None:
        """The last write: then the file is unlocked and may be merged into the summary."""
        if self.closed:
            return
        self.flush(counters)
        with self._lock:
            self.closed = True
            fd, self._fd = self._fd, -1
            if fd >= 0:
                close_lock(fd)

    def abandon(self) -> None:
        """Write nothing more: the folder is no longer the cache's (someone else's files
        are at its path now)."""
        with self._lock:
            self.closed = True
            fd, self._fd = self._fd, -1
            if fd >= 0:
                close_lock(fd)

    def flush(self, counters: Mapping[str, Any], *, force: bool = False) -> bool:
        """Write the counters if they changed since the last write (or ``force``, which
        also re-reads the generation). True when a file was written. Never raises an
        OSError: the first one warns, the rest are counted in ``errors``."""
        with self._lock:
            if self.closed or self.paused():
                return False
            snap = _snapshot(counters)
            if snap == self._written and not force:
                return False
            gen = read_generation(self.dir)
            if gen != self.generation:
                # Cleared since our last write: what we had written by then belongs to the
                # old period; count from there.
                self._baseline = dict(self._written or {})
                self.generation = gen
            delta = {k: v - self._baseline.get(k, 0) for k, v in snap.items()}
            payload = {"format": _FORMAT, "version": 1, "generation": gen,
                       "host": socket.gethostname(), "pid": self.pid, "started": self.started,
                       "updated": time.time(), "counters": delta}
            try:
                self._publish(json.dumps(payload))
            except OSError as e:
                self.errors += 1
                failed = e
            else:
                self._written = snap
                self.writes += 1
                return True
        if not self.tier_failed(failed) and not self._warned:
            self._warned = True
            warnings.warn(f"cache counters not written to {self.path} ({failed}); "
                          "node-wide stats will miss this process", RuntimeWarning, stacklevel=2)
        return False


class CounterFlusher:
    """The timer thread and the exit hook of one CounterFile. Holds the counters, never
    the object that owns them, so the owner can be collected (which also flushes)."""

    def __init__(self, owner: object, file: CounterFile, counters: Mapping[str, Any],
                 interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.file = file
        self._stop = threading.Event()
        self._finalizer = mp_util.Finalize(owner, _final_flush, args=(file, counters, self._stop),
                                           exitpriority=10)
        self._thread = threading.Thread(target=_tick, args=(file, counters, self._stop, interval_s),
                                        name="datapipe-cache-stats", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the timer and write the last counters (once; the exit hook is then spent)."""
        self._finalizer()
        self._thread.join(timeout=2)


def _tick(file: CounterFile, counters: Mapping[str, Any], stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        file.flush(counters)


def _final_flush(file: CounterFile, counters: Mapping[str, Any], stop: threading.Event) -> None:
    stop.set()
    if file.pid == os.getpid():  # a forked child inherits nothing it should write
        file.finish(counters)


def sum_counter_files(root: str) -> dict[str, Any]:
    """``{"counters": {name: total}, "processes": n, "unreadable": m}`` over the counter
    files of the current generation in ``<root>/stats/`` (every name in COUNTER_KEYS
    present, 0 when nobody counted it)."""
    stats_dir = os.path.join(root, STATS_DIR)
    try:
        merge_exited(stats_dir)
    except OSError:
        pass  # a read-only directory still sums; its files just are not merged
    totals: dict[str, float] = {}
    gen = read_generation(stats_dir)
    # the files first, the summary after (see the module docstring)
    docs, unreadable = _read_counter_files(stats_dir, gen)
    summary = _read_summary(stats_dir, gen)
    processes = summary["processes"]
    _add(totals, summary["counters"])
    for name, doc in docs.items():
        if name not in summary["absorbed"]:
            processes += 1
            _add(totals, doc["counters"])
    counters: dict[str, Any] = {k: totals.pop(k, 0) for k in COUNTER_KEYS}
    counters.update(sorted(totals.items()))
    counters["wait_seconds"] = float(counters["wait_seconds"])
    return {"counters": counters, "processes": processes, "unreadable": unreadable}


def _add(totals: dict[str, float], counters: Mapping[str, Any]) -> None:
    for k, v in counters.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            totals[k] = totals.get(k, 0) + v


def _read_counter_files(stats_dir: str, gen: str, *,
                        unlocked_only: bool = False) -> tuple[dict[str, dict[str, Any]], int]:
    """``({name: doc}, unreadable)`` over the counter files of generation ``gen``; with
    ``unlocked_only``, only files whose writer is gone (read while holding their lock)."""
    docs: dict[str, dict[str, Any]] = {}
    unreadable = 0
    try:
        names = os.listdir(stats_dir)
    except FileNotFoundError:
        names = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            fd = os.open(os.path.join(stats_dir, name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # cleared or merged meanwhile
        except OSError:
            unreadable += 1
            continue
        try:
            if unlocked_only:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer lives
            with os.fdopen(os.dup(fd), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            unreadable += 1
            continue
        finally:
            os.close(fd)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("counters"), dict):
            unreadable += 1
            continue
        if doc.get("generation") == gen:  # else written before the last clear
            docs[name] = doc
    return docs, unreadable


def _read_summary(stats_dir: str, gen: str) -> dict[str, Any]:
    try:
        with open(os.path.join(stats_dir, _SUMMARY)) as f:
            doc = json.load(f)
        if (isinstance(doc, dict) and doc.get("format") == _SUMMARY_FORMAT and doc.get("generation") == gen
                and isinstance(doc.get("counters"), dict) and isinstance(doc.get("absorbed"), dict)
                and isinstance(doc.get("processes"), int)):
            return doc
    except (OSError, ValueError):
        pass  # none yet, or of an older generation: the files still hold every count
    return {"format": _SUMMARY_FORMAT, "generation": gen, "processes": 0, "counters": {}, "absorbed": {}}


def merge_exited(stats_dir: str) -> int:
    """Fold the counter files of exited processes into the summary and delete them;
    returns how many were merged (0 when another process is merging right now)."""
    if not os.path.isdir(stats_dir):
        return 0
    lock = open_lock(os.path.join(stats_dir, _MERGE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        gen = read_generation(stats_dir)
        summary = _read_summary(stats_dir, gen)
        docs, _bad = _read_counter_files(stats_dir, gen, unlocked_only=True)
        now = time.time()
        fresh = {n: d for n, d in docs.items() if n not in summary["absorbed"]}
        for name, doc in fresh.items():
            summary["processes"] += 1
            _add(summary["counters"], doc["counters"])
            summary["absorbed"][name] = now
        if fresh:
            summary["absorbed"] = {n: t for n, t in summary["absorbed"].items() if now - t < _ABSORBED_KEEP_S}
            _write_atomic(stats_dir, _SUMMARY, json.dumps(summary))
        for name in docs:  # absorbed now or by a merge whose deletion did not finish
            try:
                os.unlink(os.path.join(stats_dir, name))
            except FileNotFoundError:
                pass
        return len(fresh)
    finally:
        close_lock(lock)


def clear_counter_files(root: str) -> int:
    """Start a new generation and delete the counter files (and temporary files left by
    writers that died); returns how many files were removed."""
    stats_dir = os.path.join(root, STATS_DIR)
    if not os.path.isdir(stats_dir):
        return 0
    new_generation(stats_dir)  # first: a writer racing the deletion now writes a stale file
    removed = 0
    now = time.time()
    for name in os.listdir(stats_dir):
        p = os.path.join(stats_dir, name)
        try:
            if (name.endswith(".json") and not name.startswith(".")) or name == _SUMMARY:
                os.unlink(p)
                removed += 1
            elif name.endswith(".tmp") and now - os.stat(p).st_mtime > _STALE_TMP_S:
                os.unlink(p)  # a live writer's temporary file is left to its rename
                removed += 1
        except FileNotFoundError:
            pass
    return removed
