"""A torch DataLoader that keeps the StreamingDataset's resume state for you and hands out
whole batches at memory speed.

With its default collate, the dataset cuts whole :class:`~.batch.Batch` es itself (columnar,
no Python work per sample where the shards are laid out alike; see
:func:`.batch.batch_chunks`), and worker processes pass them to this process
through a :class:`~.ring.BatchRing` of shared-memory slots, not as pickled ``bytes``: the
batch arrives as views of the slot, and the slot is reused once the batch is dropped. With
``collate_fn=`` given, samples are collated by it as in a plain DataLoader.

A dataset that sends groups of batches (``grouped``: the token loaders, whose workers take
groups of consecutive batches in turn, a :class:`~.batch.BatchGroup` to a message) has its
groups written into one slot each and handed out here batch by batch: torch's worker queue
costs about 0.3 ms of this process's CPU a message, which a batch of 8 token sequences of
2,048 does not.

It sets the dataset's ``batch_size`` to its own (so workers take whole batches in turn and
the output is the rank's stream in order) and counts the samples it hands out, so
``state_dict()`` needs no argument even with worker processes.

With ``on_error="skip"``, a sample skipped in a worker process is not simply left out: the
batch carries a :class:`~.pass_state.Skipped` marker for it, and this process records it
(``skipped``), warns naming shard and sample at the end of the pass, and counts it as
consumed: each batch is still one batch of the plan, so the resume point stays exact.

Telemetry (``telemetry=``, ``metrics_path=``, ``metrics_port=``): this process records the
trainer's data wait (the time from its ``next()`` on the loader to the batch, around the
whole of it: the workers' queue, opening the ring slot, pinning) and the step time (between
two batches handed out): two ``perf_counter`` calls and a few counter additions a batch.
What runs in a worker (decode/map, prefetch depth, reads per cache tier, cold retries and
throttling) is recorded into the worker's copy of the recorder (see
:mod:`datapipe.telemetry`), whose :meth:`~datapipe.telemetry.Telemetry.export` travels in
the collated batch (``_Batch.telemetry``: mostly None, a few KiB at most every
``export_interval_s``, and with a batch shorter than ``batch_size``); this process merges
it before it opens the batch, so the worker's time lands in this process's windows. What a
worker recorded since its last export arrives with its next one: with persistent workers
(the default) the next pass's first batch; a worker that exits after its pass takes it
along (at most ``export_interval_s`` of its counts).

A plain torch ``DataLoader`` over a ``StreamingDataset(telemetry=...)`` has no such path:
its workers count into copies nobody reads (``num_workers=0`` records in this process), and
nothing times ``next()``; the trainer can time it itself (``t = tel.wait_begin(); batch =
next(it); tel.wait_end(t); tel.step()``).
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import context as mp_context
from typing import Any, NamedTuple

import torch.multiprocessing
from torch.utils.data import DataLoader, default_collate, default_convert, get_worker_info

from ..errors import HealthError, LoaderOptionError, PlanError, TopologyError
from ..options import MAX_COUNT, check_bool, check_callable, check_choice, check_float, check_int, check_path, show
from ..telemetry import Telemetry
from ..topology import Topology
from .batch import Batch, BatchGroup
from .control import PassControl
from .dataset import StreamingDataset
from .pass_state import Skipped, skip_report, split_skipped
from .ring import BatchRing, RingBatch

__all__ = ["StreamingDataLoader"]


class _Batch(NamedTuple):
    """What the wrapped collate function returns (a named tuple: pin_memory pins ``batch``
    inside it): the collated batch (None if every sample was skipped; a :class:`RingBatch`
    when it waits in a shared-memory slot), the plan steps it covers, the samples
    skipped among them, and the worker's telemetry since its last export (or None)."""

    batch: Any
    steps: int
    skipped: tuple[Skipped, ...]
    telemetry: bytes | None = None


class _Collate:
    """Runs in the worker (picklable, for spawned workers). Columnar: the dataset's
    :class:`Batch` goes into a ring slot when the ring has one free, else as it is (its
    columns pickle as their own bytes only). Per sample: markers of skipped samples are
    taken out of the batch before ``collate`` runs, and returned beside it. With a
    telemetry, a worker's export goes beside the batch (see the module docstring)."""

    def __init__(self, collate: Callable[[Any], Any] | None, batched: bool,
                 telemetry: Telemetry | None = None, size: int = 1) -> None:
        self.collate = collate  # None: columnar batches cut by the dataset
        self.batched = batched
        self.ring: BatchRing | None = None
        #: the recorder: in a worker, its copy (the dataset's and the cache's, as they are
        #: pickled or forked together)
        self.telemetry = telemetry
        self.size = size

    def __call__(self, data: Any) -> _Batch:
        out = self._collated(data)
        tel = self.telemetry
        if tel is not None and tel.worker:
            # a short batch (or group) is the last of the worker's pass: its counts go with it
            short = not data.full if isinstance(data, BatchGroup) else out.steps < self.size
            delta = tel.export(force=short)
            if delta is not None:
                return out._replace(telemetry=delta)
        return out

    def _collated(self, data: Any) -> _Batch:
        if self.collate is None:
            batch: Batch | BatchGroup = data
            if isinstance(batch, BatchGroup):  # the token loaders' batches carry no skips
                info = get_worker_info()
                written = self.ring.write(info.id, batch) if info is not None and self.ring is not None else None
                return _Batch(batch if written is None else written, batch.steps, ())
            if batch.size == 0:
                return _Batch(None, batch.steps, batch.skipped)
            info = get_worker_info()
            if info is not None and self.ring is not None:
                written = self.ring.write(info.id, batch)
                if written is not None:
                    return _Batch(written, batch.steps, batch.skipped)
            return _Batch(batch, batch.steps, batch.skipped)
        if not self.batched:  # one sample at a time
            if isinstance(data, Skipped):
                return _Batch(None, 1, (data,))
            return _Batch(self.collate(data), 1, ())
        items, skipped = split_skipped(data)
        return _Batch(self.collate(items) if items else None, len(data), skipped)


#: the most worker processes, and batches in flight per worker, a loader may ask for
MAX_WORKERS = 1024


def _check_loader_options(kw: dict[str, Any]) -> None:
    """:class:`LoaderOptionError` for a DataLoader argument that is not one, is of the
    wrong kind, or does not apply to a StreamingDataset (whose order is its own: no
    sampler, no shuffle); the values checked are put back as their plain types."""
    E = LoaderOptionError
    unknown = sorted(set(kw) - _LOADER_OPTIONS)
    if unknown:
        raise E(f"StreamingDataLoader({unknown[0]}=...): not an argument of it; it takes "
                f"{', '.join(sorted(_LOADER_OPTIONS))}")
    for name in ("sampler", "batch_sampler"):
        if kw.get(name) is not None:
            raise E(f"{name}={show(kw[name])}: a StreamingDataset orders its samples itself (seed=, shuffle=, "
                    "window=); samplers do not apply")
    if kw.get("shuffle") is not None and kw["shuffle"] is not False:
        raise E(f"shuffle={show(kw['shuffle'])}: a StreamingDataset shuffles itself (StreamingDataset(shuffle=..., "
                "seed=..., window=...)); leave the loader's shuffle unset")
    if "num_workers" in kw:
        kw["num_workers"] = check_int("num_workers", kw["num_workers"], min=0, max=MAX_WORKERS, error=E)
    workers = kw.get("num_workers", 0)
    if kw.get("prefetch_factor") is not None:
        if workers == 0:
            raise E(f"prefetch_factor={show(kw['prefetch_factor'])}: applies only with num_workers > 0")
        kw["prefetch_factor"] = check_int("prefetch_factor", kw["prefetch_factor"], min=1, max=MAX_WORKERS,
                                          error=E)
    for name in ("persistent_workers", "pin_memory", "drop_last", "in_order"):
        if name in kw:
            kw[name] = check_bool(name, kw[name], error=E)
    if kw.get("persistent_workers") and workers == 0:
        raise E("persistent_workers=True: applies only with num_workers > 0")
    if "timeout" in kw:
        kw["timeout"] = check_float("timeout", kw["timeout"], min=0, error=E, hint="seconds to wait for a batch")
    for name in ("collate_fn", "worker_init_fn"):
        if kw.get(name) is not None:
            check_callable(name, kw[name], error=E)
    context = kw.get("multiprocessing_context")
    if isinstance(context, str):
        check_choice("multiprocessing_context", context, ("fork", "spawn", "forkserver"), error=E)
    elif context is not None and not isinstance(context, mp_context.BaseContext):
        raise E(f"multiprocessing_context={show(context)}: expected 'fork', 'spawn', 'forkserver', a "
                "multiprocessing context or None")
    generator = kw.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise E(f"generator={show(generator)}: expected a torch.Generator or None")
    if not isinstance(kw.get("pin_memory_device", ""), str):
        raise E(f"pin_memory_device={show(kw['pin_memory_device'])}: expected a device name (a str)")


_LOADER_OPTIONS = frozenset({"shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory",
                             "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
                             "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order"})


class StreamingDataLoader(DataLoader):  # type: ignore[type-arg]  # torch's DataLoader is generic in its batch type; ours varies with collate_fn
    """``StreamingDataLoader(dataset, batch_size=256, num_workers=4, ...)``: a DataLoader
    over a :class:`StreamingDataset` that yields :class:`~.batch.Batch` es (bytes fields as
    zero-copy :class:`~.batch.Column` s, tensors from ``map=`` stacked, numbers as tensors,
    other values as lists) through shared memory, or what ``collate_fn`` makes when one is
    given. ``state_dict()``/``load_state_dict()`` resume exactly; ``skipped`` lists the
    samples skipped in the last pass (``on_error="skip"``).

    Telemetry (see the module docstring): ``telemetry``, a
    :class:`~datapipe.telemetry.Telemetry` (its windows, ``window_s``/``window_steps``, are
    its own; default: the dataset's, if it was given one), handed to the dataset and its
    cache where they have none; ``metrics_path``: each closed window appended as one JSON
    line (a Telemetry with ``window_s=10`` is made when none is given); ``metrics_port``:
    a Prometheus endpoint on ``metrics_addr`` (``0``: any free port; ``metrics_server.port``
    and ``.url``), through ``prometheus_client`` (``pip install 'datapipe[metrics]'``,
    else :class:`~datapipe.errors.MissingDependencyError`). :meth:`stats` is the window so
    far; :meth:`close` stops the endpoint and closes a telemetry the loader made (its last
    window, ``final``). The straggler detector reads the same windows from a board:

        loader = StreamingDataLoader(ds, batch_size=32, num_workers=4, telemetry=Telemetry(window_s=10))
        Publisher(loader.telemetry, FileBoard(run_dir))   # datapipe.health; `datapipe status run_dir`
    """

    def __init__(self, dataset: StreamingDataset | Any, batch_size: int | None = 1, *,
                 telemetry: Telemetry | None = None, metrics_path: str | os.PathLike[str] | None = None,
                 metrics_port: int | None = None, metrics_addr: str = "0.0.0.0", **kwargs: Any) -> None:
        # or a dataset that keeps StreamingDataset's protocol with this loader (the token
        # loaders, datapipe.TokenDataset and TokenMix: batch_size, batched, epoch, state_dict)
        if not isinstance(dataset, StreamingDataset) and getattr(dataset, "feeds_streaming_loader", False) is not True:
            raise LoaderOptionError(f"dataset={show(dataset)}: StreamingDataLoader needs a StreamingDataset (or a "
                                    f"TokenDataset or TokenMix), got {type(dataset).__name__}")
        if batch_size is not None:
            batch_size = check_int("batch_size", batch_size, min=1, max=MAX_COUNT, error=LoaderOptionError,
                                   hint="or None for one sample at a time")
        _check_loader_options(kwargs)
        tel, made = _loader_telemetry(dataset, telemetry, metrics_path, metrics_port, metrics_addr)
        if not kwargs.get("in_order", True):
            # samples_seen counts a prefix of the stream: batches handed out of order would
            # make state_dict() skip some samples on resume and repeat others
            raise PlanError("StreamingDataLoader(in_order=False): batches out of stream order break exact resume "
                            "(state_dict() counts a prefix of the stream, so a resume would skip some samples and "
                            "repeat others); leave in_order=True")
        # Workers that live across passes keep their shard buffers, verified-shard memo,
        # layouts and ring slots: a new worker pays for all of them again (fresh memory,
        # hashing, parsing). set_epoch()/load_state_dict() reach them through a PassControl.
        kwargs.setdefault("persistent_workers", int(kwargs.get("num_workers", 0)) > 0)
        # the workers share the stream out in blocks of the batch size; without batching
        # torch takes one sample from each worker in turn, so the blocks are one sample
        dataset.batch_size = 1 if batch_size is None else batch_size
        collate = kwargs.pop("collate_fn", None)
        #: batches cut by the dataset and passed through shared memory (no collate_fn given)
        self.columnar = collate is None and batch_size is not None
        self._drop_last = bool(kwargs.get("drop_last", False))
        size = 1 if batch_size is None else batch_size
        if self.columnar:
            kwargs.pop("drop_last", None)  # torch refuses it without auto-batching: applied here
            super().__init__(dataset, batch_size=None, collate_fn=_Collate(None, False, tel, size), **kwargs)
            object.__setattr__(self, "batch_size", batch_size)  # DataLoader refuses a plain assignment after __init__
        else:
            if collate is None:
                collate = default_collate if batch_size is not None else default_convert
            super().__init__(dataset, batch_size=batch_size,
                             collate_fn=_Collate(collate, batch_size is not None, tel, size), **kwargs)
        self.samples_seen = 0
        #: (shard url, sample key or None, reason) of the samples skipped in the current
        #: or last pass, by whichever process read them
        self.skipped: list[tuple[str, str | None, str]] = []
        self._live: object | None = None
        #: the dataset, typed as what it is (torch types ``self.dataset`` as any Dataset)
        self.stream: StreamingDataset = dataset
        #: the shared-memory ring of the running workers (columnar, with workers)
        self.ring: BatchRing | None = None
        #: where persistent workers read each pass's epoch and resume state
        self._control = PassControl() if self.persistent_workers else None
        #: the recorder of this loader's windows (``telemetry=``, or the one made for
        #: ``metrics_path=``/``metrics_port=``, or the dataset's), or None: what
        #: :meth:`stats` reads and a :class:`datapipe.health.Publisher` takes
        self.telemetry: Telemetry | None = tel
        self._own_telemetry = made
        self._merge_failed = False
        #: the Prometheus endpoint of ``metrics_port=`` (``.port``, ``.url``), or None
        self.metrics_server: Any = None
        self._server_closer: weakref.finalize[Any, Any] | None = None
        if tel is not None and metrics_port is not None:
            from ..health import serve  # prometheus_client only when asked for

            try:
                self.metrics_server = serve(tel, metrics_port, addr=metrics_addr)
            except BaseException:
                if made:
                    tel.close()
                raise
            # the port is freed when the loader is dropped without close()
            self._server_closer = weakref.finalize(self, self.metrics_server.close)
            self._server_closer.atexit = False

    def __len__(self) -> int:
        if not self.columnar:
            return super().__len__()
        n, b = len(self.stream), int(self.batch_size or 1)
        return n // b if self._drop_last else -(-n // b)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator of batches, as DataLoader's iterator yields
        # one pass at a time, for the reason StreamingDataset.__iter__ gives
        if self._live is not None:
            raise PlanError("this StreamingDataLoader is already being iterated: finish or close() the first "
                            "iterator before starting another; samples_seen and state_dict() describe one pass")
        token = self._live = object()
        self.samples_seen = 0
        self.skipped = []
        dataset = self.stream
        dataset.yield_skip_markers = True
        dataset.batched = self.columnar
        # a token loader: its workers send groups of batches (read once, as they start)
        grouping: Any = dataset if hasattr(dataset, "grouped") else None
        if grouping is not None:
            grouping.grouped = self.columnar and self.num_workers > 0
        collate: _Collate = self.collate_fn  # type: ignore[assignment]  # set in __init__
        starting = self.num_workers > 0 and getattr(self, "_iterator", None) is None
        if starting:  # worker processes start in this pass (else persistent ones resume)
            self.ring = None
            if self.columnar:
                context = self.multiprocessing_context or torch.multiprocessing.get_context()
                # prefetch_factor batches in flight per worker, one held by the trainer, one just handed out
                self.ring = BatchRing(self.num_workers, (self.prefetch_factor or 2) + 2, context)
            dataset._control = self._control
        if self._control is not None:
            self._control.write(dataset.epoch, dataset._resume)
        ring = self.ring
        collate.ring = ring
        size = int(self.batch_size or 1)
        tel = self.telemetry
        clock = time.perf_counter
        t0 = clock()  # the trainer waits from its first next() (workers start) and from each yield's return
        try:
            batches = super().__iter__()  # worker processes start here, with a copy of the dataset
            # pin_memory=True pins only where an accelerator is present (torch decides, and warns)
            pin = bool(getattr(batches, "_pin_memory", False))
            if self.num_workers > 0:
                # this process's copy is not read by the loader: a direct pass over it gets
                # samples and no markers (the single-process iterator reads it lazily: it keeps them)
                dataset.yield_skip_markers = False
                dataset.batched = False
                dataset._control = None
            if grouping is not None:
                grouping.grouped = False
            collate.ring = None  # the workers have their copies; this process only opens batches
            while True:
                try:
                    out = next(batches)
                except StopIteration:
                    break  # the wait for the pass's end is no batch's: not counted
                batch, steps, skipped, delta = out
                if delta is not None and tel is not None:
                    self._merge(tel, delta)
                if skipped:
                    self.skipped.extend((s[0], s[1], s[2]) for s in skipped)
                if batch is None:  # every sample of this batch was skipped
                    self.samples_seen += steps
                    continue
                counted: list[tuple[Any, int]]  # each batch and the plan steps it covers
                if isinstance(batch, RingBatch) and ring is not None:
                    counted = [(b.pin_memory() if pin else b, b.steps)  # torch's pin thread passed the slot's
                               for b in ring.open_all(batch, steps, skipped)]  # description through
                else:
                    counted = [(b, b.steps) for b in batch] if isinstance(batch, BatchGroup) else [(batch, steps)]
                    if ring is not None:
                        ring.fallbacks += len(counted)
                del batch, out
                for part, part_steps in counted:
                    if self.columnar and self._drop_last and part_steps < size:
                        continue  # the short last batch, as DataLoader(drop_last=True) drops it
                    self.samples_seen += part_steps
                    item = part.unwrap() if isinstance(part, Batch) else part
                    if tel is not None:
                        tel.data_wait(clock() - t0)
                        tel.step()
                    yield item
                    t0 = clock()
                # a group's batches held here while the next message is awaited would keep its slot taken
                counted = part = item = None  # type: ignore[assignment]
            dataset.end_resumed_pass()
        finally:
            dataset.yield_skip_markers = False
            dataset.batched = False
            if grouping is not None:
                grouping.grouped = False
            dataset._control = None
            collate.ring = None
            if ring is not None and not self.persistent_workers:
                ring.close()
            if self._live is token:
                self._live = None
            if self.skipped:
                dataset.skipped = list(self.skipped)
                warnings.warn(skip_report(self.skipped), RuntimeWarning, stacklevel=2)

    def _merge(self, tel: Telemetry, delta: bytes) -> None:
        if self._merge_failed:
            return
        try:
            tel.merge(delta)
        except HealthError as e:  # telemetry never stops the training
            self._merge_failed = True
            warnings.warn(f"datapipe telemetry: {e}; this loader's windows go on without its workers' counts",
                          RuntimeWarning, stacklevel=3)

    def stats(self) -> dict[str, Any]:
        """The current telemetry window so far (since the last closed one), as the dict a
        ``metrics_path`` line holds (:meth:`datapipe.telemetry.WindowSummary.to_dict`):
        ``steps``, ``step_s``, ``step_mean_s``/``_p50_s``/``_p95_s``, ``waits``,
        ``data_wait_s``, ``data_wait_mean_s``/``_p50_s``/``_p95_s``, ``data_wait_fraction``,
        ``waiting_now_s``, ``decode_s``, ``decoded_samples``, ``decode_per_sample_s``,
        ``cold_retries``, ``cold_throttled``, ``prefetch_depth`` (bytes read ahead now, this
        process and its workers), ``prefetch_depth_mean``, ``cache_hit_ratio``, ``tiers``
        (per tier read: ``reads``, ``bytes``, ``seconds``, ``hits``, ``misses``,
        ``errors``, ``bytes_per_s``, ``latency_mean_s``/``_p50_s``/``_p95_s``,
        ``hit_ratio``), and ``format``, ``version``, ``seq``, ``rank``, ``host``, ``pid``,
        ``time``, ``duration_s``, ``final``, ``computes``, ``compute_s``,
        ``compute_mean_s``. :class:`LoaderOptionError` when the loader records nothing."""
        if self.telemetry is None:
            raise LoaderOptionError("StreamingDataLoader.stats(): this loader records no telemetry; give it "
                                    "telemetry=Telemetry(...), metrics_path= or metrics_port= (or the dataset a "
                                    "telemetry=)")
        return self.telemetry.snapshot().to_dict()

    def close(self) -> None:
        """Stop serving ``metrics_port`` and close the telemetry the loader made itself
        (its open window becomes the ``final`` line of ``metrics_path``); a telemetry
        given is the caller's to close."""
        server, self.metrics_server = self.metrics_server, None
        if self._server_closer is not None:
            self._server_closer.detach()
        if server is not None:
            server.close()
        if self._own_telemetry and self.telemetry is not None:
            self.telemetry.close()

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict(self.samples_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self.samples_seen = 0


def _loader_telemetry(dataset: Any, telemetry: Any, metrics_path: Any, metrics_port: Any,
                      metrics_addr: Any) -> tuple[Telemetry | None, bool]:
    """(the loader's recorder, whether the loader made it): ``telemetry``, else the
    dataset's, else a new one when ``metrics_path`` or ``metrics_port`` asks for one. The
    recorder is handed to the dataset and its cache where they have none; one given that
    differs from theirs is a :class:`LoaderOptionError` (their counts would land elsewhere)."""
    E = LoaderOptionError
    if telemetry is not None and not isinstance(telemetry, Telemetry):
        raise E(f"telemetry={show(telemetry)}: expected a datapipe.telemetry.Telemetry or None")
    path = None if metrics_path is None else check_path("metrics_path", metrics_path, error=E)
    if metrics_port is not None:
        check_int("metrics_port", metrics_port, min=0, max=65535, error=E, hint="a TCP port, 0 for any free one")
    if not isinstance(metrics_addr, str):
        raise E(f"metrics_addr={show(metrics_addr)}: expected an address to bind (a str, e.g. '0.0.0.0' or "
                "'127.0.0.1')")
    cache = getattr(dataset, "cache", None)
    theirs = getattr(dataset, "telemetry", None)
    if telemetry is not None and theirs is not None and theirs is not telemetry:
        raise E(f"telemetry={show(telemetry)}: the dataset records into another Telemetry ({show(theirs)}); give "
                "the loader that one, or neither a telemetry=")
    tel = telemetry if telemetry is not None else theirs
    made = False
    if tel is None and (path is not None or metrics_port is not None):
        rank = getattr(dataset, "rank", None)
        if not isinstance(rank, int):
            try:
                rank = Topology.resolve(environment=True).rank
            except TopologyError:
                rank = None
        tel, made = Telemetry(metrics_path=path, rank=rank), True
    elif tel is not None and path is not None:
        if tel.metrics_path is None:
            tel.metrics_path = path
        elif os.path.abspath(tel.metrics_path) != os.path.abspath(path):
            raise E(f"metrics_path={path}: the telemetry given appends to metrics_path={tel.metrics_path} already; "
                    "give one of them")
    if tel is not None:
        if hasattr(dataset, "telemetry") and theirs is None:
            dataset.telemetry = tel
        if cache is not None and getattr(cache, "telemetry", tel) is None:
            cache.telemetry = tel
    return tel, made
