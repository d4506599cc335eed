"""Boards every rank reaches, where each publishes its window summaries, and the publisher
that does it from a thread of its own.

- :class:`StoreBoard`: the job's ``torch.distributed`` store (``TCPStore``, ``FileStore``,
  or a ``PrefixStore`` over one): one ``set`` of a small JSON per rank and window. Reading
  asks ``check`` before each ``get`` (a ``get`` of a missing key would wait for it), so
  reading never waits on a rank either.
- :class:`FileBoard`: a file per rank under ``<url>/health/`` (a shared folder, or any
  fsspec URL through :func:`datapipe.storage.open_store`), published by the store's atomic
  put (a temporary name, then a rename): a reader sees the previous summary or the new one.

Neither uses a collective, and a board is keyed by ``group``: a sub-group (a pipeline
stage, a tensor-parallel group) publishes and reads its own ranks only.

:class:`Publisher` hands each window a :class:`~datapipe.telemetry.Telemetry` closes to its
own thread, which publishes it: the trainer's thread never waits on the board, and a board
that is slow or down only delays (and at worst drops) summaries, with one warning.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..errors import DatapipeError, HealthError, ObjectChangedError, OptionError, TruncatedReadError
from ..options import check_int, check_path, show
from ..storage import LocalStore, Store, is_local_url, open_store
from ..telemetry import Telemetry, WindowSummary
from ..topology import Topology
from .summary import MAX_SUMMARY_BYTES, parse_summary

__all__ = ["Board", "BoardRead", "FileBoard", "StoreBoard", "Publisher", "BOARD_FOLDER"]

#: the folder of a run directory a :class:`FileBoard` writes to
BOARD_FOLDER = "health"

_GROUP = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RANK_FILE = re.compile(r"rank-(\d{6,12})\.json")
_READ_TRIES = 5  # reads of a summary replaced while it is read, before it is named unreadable


def _check_group(group: str | None) -> str | None:
    if group is not None and (not isinstance(group, str) or not _GROUP.fullmatch(group) or group in (".", "..")):
        raise OptionError(f"group={show(group)}: expected None or a name of 1-64 letters, digits, '_', '.', '-'")
    return group


def _encode(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


@dataclass
class BoardRead:
    """What a board held: the summary documents (one per rank) and the entries that are
    not summaries, as (rank or None, reason); :func:`~datapipe.health.detect` takes it."""

    docs: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[tuple[int | None, str]] = field(default_factory=list)

    def __iter__(self) -> Any:
        return iter(self.docs)


class Board(Protocol):
    """Where ranks publish summaries: ``publish(rank, doc)`` and ``read(ranks)``."""

    def publish(self, rank: int, doc: Mapping[str, Any]) -> None: ...

    def read(self, ranks: Iterable[int] | None = None) -> BoardRead: ...


def _checked_doc(data: bytes, where: str, rank: int | None, read: BoardRead) -> None:
    try:
        doc = parse_summary(data, where)
    except HealthError as e:
        read.unreadable.append((rank, str(e)))
        return
    if rank is not None and doc["rank"] != rank:
        read.unreadable.append((rank, f"{where} holds the summary of rank {doc['rank']}, not of rank {rank}"))
        return
    read.docs.append(doc)


class StoreBoard:
    """Summaries in a ``torch.distributed`` store (any object with ``set``, ``get`` and
    ``check``) under ``datapipe/health/[<group>/]rank-<rank>``. ``world_size``: the ranks
    :meth:`read` looks for when not told (default: the job's, from
    :class:`~datapipe.topology.Topology`). The store must be usable from a second thread
    (torch's stores are); :class:`Publisher` calls ``set`` from its own."""

    def __init__(self, store: Any, *, group: str | None = None, world_size: int | None = None) -> None:
        for method in ("set", "get", "check"):
            if not callable(getattr(store, method, None)):
                raise OptionError(f"store={show(store)}: expected a torch.distributed Store (TCPStore, FileStore, "
                                  f"PrefixStore), which has set/get/check; it has no {method}()")
        self.store = store
        self.group = _check_group(group)
        self.world_size = None if world_size is None else check_int("world_size", world_size, min=1, max=1 << 24)
        self.prefix = f"datapipe/health/{group}/" if group else "datapipe/health/"

    def key(self, rank: int) -> str:
        return f"{self.prefix}rank-{rank}"

    def publish(self, rank: int, doc: Mapping[str, Any]) -> None:
        """One ``set`` of the JSON of ``doc``: never waits on another rank."""
        self.store.set(self.key(rank), _encode(doc))

    def read(self, ranks: Iterable[int] | None = None) -> BoardRead:
        """The summaries of ``ranks`` (default ``range(world_size)``) that are there."""
        if ranks is None:
            world = self.world_size or Topology.resolve(environment=True).world_size
            ranks = range(world)
        out = BoardRead()
        for rank in ranks:
            key = self.key(rank)
            try:
                if not self.store.check([key]):
                    continue
                data = bytes(self.store.get(key))
            except Exception as e:  # a store that went away: say which and go on
                raise HealthError(f"cannot read {key} from the store {self.store!r}: {type(e).__name__}: {e}") from e
            _checked_doc(data, f"store key {key}", rank, out)
        return out


class FileBoard:
    """Summaries as files ``<url>/health/[<group>/]rank-<rank>.json`` (a run directory
    every rank and ``datapipe status`` reach: a shared filesystem, or an fsspec URL).
    Local files are replaced atomically without fsync (a summary is worth a window)."""

    def __init__(self, url: str, *, group: str | None = None, storage_options: dict[str, Any] | None = None) -> None:
        url = check_path("url", url)
        self.url = url
        self.group = _check_group(group)
        self.folder = f"{BOARD_FOLDER}/{group}/" if group else f"{BOARD_FOLDER}/"
        self.token = uuid.uuid4().hex[:12]
        self.store: Store = LocalStore(url, durable=False) if is_local_url(url) else open_store(url, storage_options)
        self._writer = self.store.for_writer(self.token)

    def key(self, rank: int) -> str:
        return f"{self.folder}rank-{rank:06d}.json"

    def publish(self, rank: int, doc: Mapping[str, Any]) -> None:
        """Write the summary of ``rank``: a temporary name of this board's, then a rename."""
        self._writer.put(self.key(rank), _encode(doc))

    def read(self, ranks: Iterable[int] | None = None) -> BoardRead:
        """The summaries on the board (of ``ranks`` when given). :class:`HealthError` when
        the board's folder cannot be listed."""
        wanted = None if ranks is None else set(ranks)
        try:
            keys = self.store.list(self.folder)
        except (DatapipeError, OSError) as e:
            raise HealthError(f"cannot list the health board {self.store.url(self.folder)}: {e}") from e
        out = BoardRead()
        for key in keys:
            name = key[len(self.folder):]
            m = _RANK_FILE.fullmatch(name)
            if m is None:
                continue  # another group's folder, or not a summary file
            rank = int(m.group(1))
            if wanted is not None and rank not in wanted:
                continue
            where = self.store.url(key)
            try:
                data = self._get(key, where)
            except (DatapipeError, OSError) as e:
                out.unreadable.append((rank, f"{where}: {e}"))
                continue
            _checked_doc(data, where, rank, out)
        return out

    def _get(self, key: str, where: str) -> bytes:
        """The summary at ``key``, one version of it (a rank may replace it meanwhile: then
        the new one is read), at most :data:`MAX_SUMMARY_BYTES`."""
        for _ in range(_READ_TRIES - 1):
            try:
                return self._get_once(key, where)
            except (ObjectChangedError, TruncatedReadError):
                continue
        return self._get_once(key, where)

    def _get_once(self, key: str, where: str) -> bytes:
        size, version = self.store.stat(key)
        if size > MAX_SUMMARY_BYTES:
            raise HealthError(f"{size} bytes, more than a window summary may be ({MAX_SUMMARY_BYTES})")
        return self.store.get_range_at(key, 0, size, version)

    def close(self) -> None:
        """Remove the temporaries this board's writes left (a write cut short); nothing
        else."""
        try:
            self.store.remove_temporaries(self.folder.rstrip("/"), tokens=[self.token])
        except (DatapipeError, OSError):
            pass


class Publisher:
    """Publishes every window ``telemetry`` closes to ``board``, as ``rank`` (default: the
    telemetry's rank, else the job's from :class:`~datapipe.topology.Topology`), from a
    thread of its own: the window thread only hands the summary over, the newest replacing
    one not yet published. ``published``: windows published; ``publish_seconds``: the time
    of the last ``board.publish``; ``errors``: publishes that failed (the first warns)."""

    def __init__(self, telemetry: Telemetry, board: Board, *, rank: int | None = None) -> None:
        if not isinstance(telemetry, Telemetry):
            raise OptionError(f"telemetry={show(telemetry)}: expected a datapipe.telemetry.Telemetry")
        if not (callable(getattr(board, "publish", None)) and callable(getattr(board, "read", None))):
            raise OptionError(f"board={show(board)}: expected a FileBoard, a StoreBoard or another object with "
                              "publish(rank, doc) and read(ranks)")
        if rank is None:
            rank = telemetry.rank if telemetry.rank is not None else Topology.resolve(environment=True).rank
        self.rank = check_int("rank", rank, min=0, max=1 << 40)
        self.telemetry = telemetry
        self.board = board
        self.published = 0
        self.errors = 0
        self.publish_seconds = 0.0
        self.last_seq = 0
        self._pending: WindowSummary | None = None
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="datapipe-health-publisher", daemon=True)
        self._thread.start()
        telemetry.on_window(self.offer)

    def offer(self, summary: WindowSummary) -> None:
        """Hand ``summary`` to the publishing thread (returns at once)."""
        with self._cond:
            self._pending = summary
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                summary, self._pending = self._pending, None
                if summary is None:
                    return
                self._busy = True
            try:
                self.publish(summary)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def publish(self, summary: WindowSummary) -> None:
        """Publish ``summary`` now, on this thread (the thread's own step)."""
        doc = replace(summary, rank=self.rank).to_dict()
        t0 = time.perf_counter()
        try:
            self.board.publish(self.rank, doc)
        except Exception as e:  # the board is down or full: the training goes on
            self.errors += 1
            if self.errors == 1:
                warnings.warn(f"datapipe health: rank {self.rank} could not publish its window summary to "
                              f"{self.board!r} ({type(e).__name__}: {e}); it keeps trying each window, and the "
                              "detector reports the rank as stale meanwhile", RuntimeWarning, stacklevel=2)
            return
        finally:
            self.publish_seconds = time.perf_counter() - t0
        self.published += 1
        self.last_seq = summary.seq

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the summary handed over last is published (at most ``timeout``
        seconds); whether it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self) -> None:
        """Stop taking windows, publish the one handed over, end the thread."""
        self.telemetry.remove_callback(self.offer)
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
