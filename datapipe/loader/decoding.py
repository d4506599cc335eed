"""The decode/map stage of a pass: ``decode=`` and ``map=`` (one decoder, made by
:func:`datapipe.decode.make_decoder`) applied to every item the read stage gave, in stream
order, in the reading thread or in ``map_threads`` threads (worth it where they release the
GIL: PIL and torchvision decode and resize do). A decoder that raises on a sample is
``on_error``'s (a :class:`~datapipe.errors.DecodeError` naming shard and sample); positions
(``__shard__``/``__sample__``) go in after the map, so a map that builds a new sample keeps
them. A decoder that leaves samples as they are (``decode=None``, no ``map=``) is no stage:
the pass goes from read to batch.

With a :class:`~datapipe.telemetry.Telemetry`, the stage counts its decode/map time: two
``perf_counter`` calls around each sample's decoder (in its map thread, with
``map_threads``), summed here and recorded once per :data:`RECORD_EVERY` samples and at
each chunk's end (a record per sample would cost more than the timing).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import DatapipeError
from ..telemetry import Telemetry
from .chunks import Chunk
from .pass_state import ErrorPolicy, Progress, Skipped
from .readers import ChunkRead

__all__ = ["MapPool", "decode_chunks", "RECORD_EVERY"]

#: samples decoded between two records of their decode/map time into the telemetry
RECORD_EVERY = 64


class MapPool:
    """The map threads of one loader in this process, made on first use: a DataLoader
    worker (forked, or unpickled) makes its own, since threads do not cross processes."""

    def __init__(self) -> None:
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._pool = None

    def executor(self, threads: int) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None or pool[0] != os.getpid():
            pool = self._pool = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix="datapipe-map"))
        return pool[1]


def decode_chunks(reads: Iterable[ChunkRead], decoder: Callable[[Any, str], Any], progress: Progress,
                  on_error: ErrorPolicy, *, positions: bool, threads: int = 0,
                  pool: MapPool | None = None, telemetry: Telemetry | None = None) -> Iterator[ChunkRead]:
    """The decode/map stage: each chunk's items decoded (``threads`` > 0: by that many
    threads of ``pool``), with ``__shard__``/``__sample__`` added after the map when
    ``positions``; their decode/map time recorded into ``telemetry`` when given."""
    for read in reads:
        if read.items is not None:
            if threads > 0 and pool is not None:
                read.items = _decoded_in_threads(read.items, read.chunk, read.urls, decoder, progress, on_error,
                                                 positions, threads, pool.executor(threads), telemetry)
            elif telemetry is not None:
                read.items = _decoded_timed(read.items, read.chunk, read.urls, decoder, on_error, positions,
                                            telemetry)
            else:
                read.items = _decoded_here(read.items, read.chunk, read.urls, decoder, on_error, positions)
        yield read


def _decoded_here(items: Iterator[Any], chunk: Chunk, urls: dict[int, str], decoder: Callable[[Any, str], Any],
                  on_error: ErrorPolicy, with_pos: bool) -> Iterator[Any]:
    for item, g, j in zip(items, chunk.shard.tolist(), chunk.sample.tolist()):
        if item.__class__ is Skipped:
            yield item
            continue
        key = item["__key__"]
        try:
            item = decoder(item, urls[g])
        except DatapipeError as e:
            yield on_error(urls[g], key, e)
            continue
        if with_pos and isinstance(item, dict):
            item["__shard__"], item["__sample__"] = g, j
        yield item


def _decoded_timed(items: Iterator[Any], chunk: Chunk, urls: dict[int, str], decoder: Callable[[Any, str], Any],
                   on_error: ErrorPolicy, with_pos: bool, telemetry: Telemetry) -> Iterator[Any]:
    """:func:`_decoded_here`, each decoder call timed (kept apart: the untimed loop pays
    nothing for telemetry it does not record)."""
    clock = time.perf_counter
    times = _DecodeTimes(telemetry)
    try:
        for item, g, j in zip(items, chunk.shard.tolist(), chunk.sample.tolist()):
            if item.__class__ is Skipped:
                yield item
                continue
            key = item["__key__"]
            t0 = clock()
            try:
                item = decoder(item, urls[g])
            except DatapipeError as e:
                yield on_error(urls[g], key, e)
                continue
            finally:
                times.add(clock() - t0)
            if with_pos and isinstance(item, dict):
                item["__shard__"], item["__sample__"] = g, j
            yield item
    finally:
        times.flush()


class _DecodeTimes:
    """Decode seconds summed, recorded into ``telemetry`` once per :data:`RECORD_EVERY`
    calls and when the pass ends (``flush``)."""

    __slots__ = ("n", "seconds", "telemetry")

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.seconds, self.n = 0.0, 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.n += 1
        if self.n >= RECORD_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.n:
            self.telemetry.decode(self.seconds, self.n)
            self.seconds, self.n = 0.0, 0


def _timed(decoder: Callable[[Any, str], Any], item: Any, url: str) -> tuple[Any, float]:
    """``decoder(item, url)`` and its seconds (in a map thread)."""
    t0 = time.perf_counter()
    out = decoder(item, url)
    return out, time.perf_counter() - t0


def _decoded_in_threads(items: Iterator[Any], chunk: Chunk, urls: dict[int, str], decoder: Callable[[Any, str], Any],
                        progress: Progress, on_error: ErrorPolicy, with_pos: bool, threads: int,
                        pool: ThreadPoolExecutor, telemetry: Telemetry | None = None) -> Iterator[Any]:
    """As :func:`_decoded_here`, with decode and map run by ``threads`` threads, results in
    stream order. Samples are read up to two per thread ahead; each result carries the plan
    step its sample had, set when it is handed out, so the resume point counts only what
    the consumer took. With ``telemetry``, each call is timed in its thread (the threads'
    summed work, not the consumer's wait for it)."""
    ahead: deque[tuple[int, Any, int, int, Any]] = deque()
    source = zip(items, chunk.shard.tolist(), chunk.sample.tolist())
    times = None if telemetry is None else _DecodeTimes(telemetry)
    try:
        while True:
            while len(ahead) < 2 * threads:
                nxt = next(source, None)
                if nxt is None:
                    break
                item, g, j = nxt
                if item.__class__ is Skipped:
                    work = None
                elif times is not None:
                    work = pool.submit(_timed, decoder, item, urls[g])
                else:
                    work = pool.submit(decoder, item, urls[g])
                ahead.append((progress.steps, item, g, j, work))  # the reader set the step of `item`
            if not ahead:
                return
            step, item, g, j, work = ahead.popleft()
            progress.steps = step
            if work is None:
                yield item
                continue
            try:
                out = work.result()
            except DatapipeError as e:
                yield on_error(urls[g], item["__key__"], e)
                continue
            if times is not None:
                out, dt = out
                times.add(dt)
            if with_pos and isinstance(out, dict):
                out["__shard__"], out["__sample__"] = g, j
            yield out
    finally:
        if times is not None:
            times.flush()
