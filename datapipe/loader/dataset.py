"""StreamingDataset: what a trainer iterates.

    ds = StreamingDataset("s3://bucket/ds", cache=TieredCache(...), seed=0, window=16,
                          batch_size=32)
    loader = StreamingDataLoader(ds, batch_size=32, num_workers=4)
    for epoch in range(start, n):
        ds.set_epoch(epoch)
        for batch in loader: ...
        state = loader.state_dict()          # a few integers; ds.load_state_dict(state)

Order, partition and resume come from :mod:`datapipe.plan`. The dataset holds the
configuration (sources, decode, batch size, budgets) and the state (epoch, resume point,
the topology: explicit arguments, else ``torch.distributed`` if initialised, else the
``RANK``/``WORLD_SIZE`` environment, else one rank); a pass is the loader's stages in
order, each a function of the stage before, each in its own module:

    plan (.chunks) -> fetch (.prefetch, .source) -> read (.readers) -> decode/map (.decoding) -> batch (.batch)

Without torch installed it is a plain iterable.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import numpy.random  # the plan's shard shuffle draws from it: imported here, not by the first pass
from numpy.typing import NDArray

from ..decode import make_decoder
from ..errors import LoaderOptionError, PlanError, StateMismatchError, TopologyError, WorkerStateError
from ..options import MAX_COUNT, check_bool, check_bytes, check_choice, check_int, check_mapping, check_path, show
from ..plan import EpochPlan, fetch_order, layout_fingerprint
from ..tables import ParquetTable
from ..tarindex import resolve_source
from ..telemetry import Telemetry
from ..topology import Topology
from .batch import batch_chunks
from .chunks import EpochPlanner, PassKey, pass_chunks, share_size
from .control import WorkerPasses
from .decoding import MapPool, decode_chunks
from .mixing import Stream, check_layout_size, epoch_layout, stream_targets
from .pass_state import ErrorPolicy, Progress, skip_report
from .prefetch import PassCount, PassFetch, Prefetcher, ReadAhead, reads_ahead, take_read_ahead
from .readers import read_chunks
from .source import ShardSource

try:  # torch is optional: without it the dataset is a plain iterable
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover - torch is installed in the test environment
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["StreamingDataset", "check_worker_state", "resolve_topology", "set_resumable_epoch", "skip_report",
           "worker_info"]

#: ``window=None``: every shard
ALL_SHARDS = 1 << 62
#: seeds are taken modulo 2**64 by the plan: larger ones would repeat smaller ones' orders
MAX_SEED = (1 << 64) - 1
#: the most threads one argument may start (fetches, decode/map threads)
MAX_THREADS = 256
#: the most epochs :meth:`StreamingDataset.future_shards` looks ahead
MAX_FUTURE_EPOCHS = 64
#: the largest epoch number (a resume state holds it as a JSON integer; JSON readers hold int64)
MAX_EPOCH = (1 << 63) - 1


def resolve_topology(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit (both or neither; :class:`LoaderOptionError` when they
    do not fit), else torch.distributed, else RANK/WORLD_SIZE, else (0, 1)
    (:class:`PlanError` when the environment does not fit)."""
    if (rank is None) != (world_size is None):
        raise LoaderOptionError(f"rank={show(rank)}, world_size={show(world_size)}: give both rank and world_size, "
                                "or neither")
    if rank is not None and world_size is not None:
        r = check_int("rank", rank, min=0, error=LoaderOptionError)
        w = check_int("world_size", world_size, min=1, error=LoaderOptionError)
        try:
            return Topology.checked(r, w)
        except TopologyError as e:
            raise LoaderOptionError(f"rank={show(r)}, world_size={show(w)}: {e} (0 <= rank < world_size)") from None
    try:
        return Topology.resolve(environment=True)
    except TopologyError as e:
        raise PlanError(str(e)) from None


def _check_source(source: Any) -> list[str | Stream]:
    """``source`` as a non-empty list of URLs (str) and :class:`Stream` s, or
    :class:`LoaderOptionError`."""
    if isinstance(source, (str, os.PathLike, Stream)):
        items = [source]
    elif isinstance(source, (list, tuple)):
        items = list(source)
    else:
        raise LoaderOptionError(f"source={show(source)}: expected a dataset URL (a str or os.PathLike), a list of "
                                "URLs or a list of Stream")
    if not items:
        raise LoaderOptionError("source=[]: a StreamingDataset needs at least one dataset URL")
    return [s if isinstance(s, Stream) else check_path(f"source[{i}]", s, error=LoaderOptionError)
            for i, s in enumerate(items)]


def worker_info() -> Any:
    """torch's worker info in a DataLoader worker process, else None."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return None
    return get_worker_info()


def check_worker_state(worker: Any, batch_size: int, share: Callable[[int, int], int],
                       batch_name: str = "batch_size") -> int:
    """The steps one DataLoader worker's state (``worker``: ``{id, num_workers, batch_size,
    taken}``) says it handed out, checked against this worker: same id, worker count and
    ``batch_size`` (steps in a batch; ``batch_name`` is what the error calls it), and
    ``taken`` within the worker's ``share(id, num_workers)``. A :class:`StateMismatchError`
    otherwise, and in the main process (such a state loads only in its worker)."""
    info = worker_info()
    if info is None:
        raise StateMismatchError(
            "this state is one DataLoader worker's (torchdata's StatefulDataLoader saves one per worker, "
            "inside the workers): load it with StatefulDataLoader.load_state_dict(), which hands each "
            "worker its own, not into the dataset in the main process")
    fields = ("id", "num_workers", "batch_size", "taken")
    if not isinstance(worker, dict) or not all(type(worker.get(k)) is int for k in fields):
        raise StateMismatchError(f"the state's worker entry {show(worker)} is not {{{', '.join(fields)}: int}}")
    mine = {"id": int(info.id), "num_workers": int(info.num_workers), "batch_size": batch_size}
    for k, v in mine.items():
        if worker[k] != v:
            raise StateMismatchError(f"the state is of a pass with worker {k} {show(worker[k])}, this one's is "
                                     f"{v}: resume with the same num_workers and {batch_name}")
    n = share(mine["id"], mine["num_workers"])
    if not 0 <= worker["taken"] <= n:
        raise StateMismatchError(f"the state's worker took {show(worker['taken'])} steps of a share of {n}")
    return int(worker["taken"])


def set_resumable_epoch(self: Any, epoch: int) -> None:
    """``set_epoch`` of the resumable loaders (:class:`StreamingDataset`, the token loaders,
    as their method): a resume state of another epoch is dropped, the plan made again, and
    the state is this process's from now on."""
    self.epoch = check_int("epoch", epoch, min=0, max=MAX_EPOCH, error=LoaderOptionError)
    if self._resume is not None and self._resume.get("epoch") != self.epoch:
        self._resume = None
        self._worker_skip = 0
    self._plan = None
    self._state_is_here()


def _worker() -> tuple[int, int]:
    info = worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class StreamingDataset(_Base):  # type: ignore[type-arg]  # torch's IterableDataset is generic in its item type; ours vary with decode/map
    """Samples of one or more packed datasets in a deterministic, resumable, shuffled order.

    ``source``: a dataset URL, a list of URLs (read as one dataset), or a list of
    :class:`Stream` (a mix with weights or repeat counts; ``epoch_size`` sizes a weighted
    mix). ``window``: shards a sample may be shuffled across (``None``: all, a full global
    shuffle). ``drop_last``: every rank yields the same number of samples per epoch by
    dropping the last ``< world`` samples (True) or repeating as many (False).
    ``batch_size``: the DataLoader's, so that workers take whole batches in turn and the
    loader's output is the rank's stream in order (exact resume). ``decode``: what each
    sample's fields become (the same options as :func:`~datapipe.open_dataset`; details in
    :mod:`datapipe.decode`): ``None``/``"raw"`` (default) bytes; ``"auto"`` json, txt, cls
    and npy fields to objects, str, int and numpy arrays; ``"json"``, ``"txt"``, ``"cls"``,
    ``"npy"`` only those; images (jpg, jpeg, png, webp, bmp, gif, tif, ...) with ``"pil"``
    (RGB ``PIL.Image``; ``"pilrgba"``, ``"pill"``), ``"rgb8"`` (uint8 HWC numpy) or
    ``"torch"``/``"torchvision"`` (uint8 CHW RGB tensor; torchvision where it imports, else
    PIL); a list combines names (``["pil", "auto"]``); a dict ``{ext: fn}`` adds to
    ``"auto"``; a callable gets the whole sample. Images over ``PIL.Image.MAX_IMAGE_PIXELS``
    do not decode. ``map``: a function applied to each decoded item. ``on_error``: "raise" on a
    sample that cannot be read (corrupt, or a :class:`~datapipe.errors.DecodeError`: a field
    decoder, ``decode=`` or ``map=`` function raised on it), or "skip" it and report all
    skipped at the end of the pass (a rank that skips yields fewer samples than the others
    that epoch). Under a
    :class:`~datapipe.loader.StreamingDataLoader`, skips in worker processes are reported in
    the main process (``loader.skipped`` and a warning) and its resume point counts them.
    One pass at a time: a second iterator started while one is live raises PlanError.
    ``batched=True``: yield :class:`~.batch.Batch` es of ``batch_size`` samples (columns cut
    from the shards' layouts with numpy, viewing the shard buffers). ``map_threads=N``: run
    ``decode=``/``map=`` in N threads (in each DataLoader worker too), in stream order: a
    gain where they release the GIL, as PIL and torchvision image decoding does.
    ``telemetry``: a :class:`~datapipe.telemetry.Telemetry` the pass records its decode/map
    time, prefetch depth and reads into (handed to ``cache`` too when it has none); a
    :class:`~datapipe.loader.StreamingDataLoader` adds data wait and step time, and brings
    its workers' counts into this process.

    With a plain ``DataLoader`` and ``persistent_workers=False`` (the default), each pass
    pickles this object into the workers, so ``set_epoch`` and ``load_state_dict`` reach them.
    The workers read copies, though: this object's ``state_dict()`` then raises
    :class:`~datapipe.errors.WorkerStateError` (it would describe an unread pass); take the
    state from a :class:`~datapipe.loader.StreamingDataLoader`, or from torchdata's
    ``StatefulDataLoader``, which keeps one state per worker (see :meth:`state_dict`).

    Every argument is checked when the object is made, before anything is read: a value of
    the wrong kind or out of range is a :class:`~datapipe.errors.LoaderOptionError` (an
    ``OptionError``) naming it, never converted (``window=1.9`` is no window of 1).

    Reading ahead across passes (without a ``cache``): shards are fetched ahead of the
    reader within ``prefetch_bytes``, and from the second pass an object makes in a
    process on (in the main process, or in a worker of a StreamingDataLoader, whose
    workers persist), a pass that ends leaves its prefetcher fetching the first shards of
    the pass it guesses comes next: the next epoch if ``set_epoch`` moved this one on from
    the last, else the same epoch again. A first pass reads nothing ahead: nothing says
    another follows, and its fetches fill fresh memory, which a read ahead beside them
    would double (see :func:`.prefetch.reads_ahead`).
    The next pass uses it if it is that pass (same epoch and worker share, no
    ``load_state_dict`` since), else closes it: a window of shards is then not read at
    each epoch's start while the trainer waits. Those bytes stay held (within
    ``prefetch_bytes``) until the next pass or until this object is collected. With a
    cache, each pass tells the cache its fetches to the end of the next epoch instead
    (its schedule), and reads nothing beyond its own pass.
    """

    def __init__(self, source: str | list[str] | list[Stream], *, cache: Any = None, shuffle: bool = True,
                 seed: int = 0, window: int | None = 16, drop_last: bool = False, decode: Any = None,
                 map: Callable[[dict[str, Any]], Any] | None = None, batch_size: int = 1,
                 rank: int | None = None, world_size: int | None = None,
                 storage_options: dict[str, Any] | None = None, on_error: str = "raise",
                 epoch_size: int | None = None, prefetch_bytes: int = 512 << 20, concurrency: int = 4,
                 chunk_samples: int = 8192, return_position: bool = False, batched: bool = False,
                 map_threads: int = 0, telemetry: Telemetry | None = None) -> None:
        # every argument is checked before anything is read (indexing tar shards, opening indexes)
        E = LoaderOptionError
        sources = _check_source(source)
        on_error = check_choice("on_error", on_error, ("raise", "skip"), error=E)
        shuffle, drop_last = check_bool("shuffle", shuffle, error=E), check_bool("drop_last", drop_last, error=E)
        return_position = check_bool("return_position", return_position, error=E)
        batched = check_bool("batched", batched, error=E)
        seed = check_int("seed", seed, min=0, max=MAX_SEED, error=E)
        if window is not None:
            window = check_int("window", window, min=1, max=ALL_SHARDS, error=E,
                               hint="the shards a sample may be shuffled across, or None for all")
        batch_size = check_int("batch_size", batch_size, min=1, max=MAX_COUNT, error=E,
                               hint="the DataLoader's batch size")
        chunk_samples = check_int("chunk_samples", chunk_samples, min=1, max=MAX_COUNT, error=E)
        prefetch_bytes = check_bytes(
            "prefetch_bytes", prefetch_bytes, min=1, error=E,
            hint="the byte budget for shards fetched ahead of the reader (the default is 512 MiB; a shard the "
                 "reader needs is fetched even when it alone exceeds the budget)")
        concurrency = check_int("concurrency", concurrency, min=1, max=MAX_THREADS, error=E,
                                hint="shards fetched at once (default 4)")
        map_threads = check_int("map_threads", map_threads, min=0, max=MAX_THREADS, error=E,
                                hint="0: decode and map in the reading thread")
        if epoch_size is not None:
            epoch_size = check_int("epoch_size", epoch_size, min=0, max=ALL_SHARDS, error=E,
                                   hint="the samples of an epoch of a weighted mix, or None")
        if rank is not None or world_size is not None:
            rank, world_size = resolve_topology(rank, world_size)
        if storage_options is not None:
            storage_options = check_mapping("storage_options", storage_options, error=E)
        if cache is not None and not callable(getattr(cache, "read", None)):
            raise E(f"cache={show(cache)}: expected a TieredCache (an object with read(url, checksum=...)) or None")
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise E(f"telemetry={show(telemetry)}: expected a datapipe.telemetry.Telemetry or None")
        self._decode = make_decoder(decode, map)  # a package the decoders need is imported here
        streams = resolve_source(sources, storage_options, cache)  # tar shard URLs: indexed on first use
        self.streams = [s if isinstance(s, Stream) else Stream(s) for s in streams]
        # idle shard buffers kept for reuse stay within the prefetch budget too
        if storage_options is None and cache is not None:
            # a dataset read through a cache opens its index with the cache's options: one
            # place to give them (or set them once per URL prefix: datapipe.set_storage_options)
            storage_options = dict(getattr(cache, "storage_options", None) or {}) or None
        self.source = ShardSource([s.url for s in self.streams],
                                  [s.storage_options or storage_options for s in self.streams],
                                  max_pooled_bytes=prefetch_bytes)
        self.cache = cache
        self.telemetry = telemetry
        self.shuffle = shuffle
        self.seed = seed
        #: shards a sample may move across; None (every shard) is stored as 2**62
        self.window = ALL_SHARDS if window is None else window
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.on_error = on_error
        self.epoch_size = epoch_size
        self.prefetch_bytes = prefetch_bytes
        self.concurrency = concurrency
        self.chunk_samples = chunk_samples
        self.return_position = return_position
        #: yield :class:`~.batch.Batch` es of ``batch_size`` samples instead of samples
        self.batched = batched
        #: threads that run decode= and map= (0: the reading thread does)
        self.map_threads = map_threads
        self._map_pool = MapPool()  # made on first use, in each process
        sizes = [int(ix.num_samples) for ix in self.source.indexes]
        self._targets = stream_targets(self.streams, sizes, epoch_size)
        check_layout_size(self._targets, sizes, [len(ix.sample_counts) for ix in self.source.indexes],
                          "epoch_size" if epoch_size is not None else "the streams' repeat")
        self._stream_counts = [ix.sample_counts for ix in self.source.indexes]
        mix = [s.describe() for s in self.streams] + [epoch_size]
        self.fingerprint = layout_fingerprint(self.source.counts, self.source.identity() + repr(mix))
        self.epoch = 0
        self._resume: dict[str, Any] | None = None
        self._topology: tuple[int, int] | None = None
        self._plan: EpochPlan | None = None
        #: plan steps taken in the running pass (set by the readers as they hand items out)
        self._progress = Progress()
        #: (shard url, sample key or None, reason) of everything skipped in this process
        self.skipped: list[tuple[str, str | None, str]] = []
        #: the running pass (a token), so that a second one is refused while it is live
        self._live: object | None = None
        #: yield a Skipped marker in place of each skipped sample (a StreamingDataLoader sets it:
        #: it takes the markers out of the batches and reports the skips in the main process)
        self.yield_skip_markers = False
        #: a finished pass's prefetcher, fetching the next pass's first shards (see __iter__)
        self._ahead: ReadAhead | None = None
        #: the epoch of the last pass started here (to guess the next pass's epoch)
        self._last_epoch: int | None = None
        #: passes this object started in this process (a first one reads nothing ahead)
        self._passes = PassCount()
        #: set by a StreamingDataLoader with persistent workers: where a worker's copy reads
        #: the epoch and resume state of each pass (see .control)
        self._control: Any = None
        #: passes DataLoader workers started on copies of this object, and the count when this
        #: process last knew its state itself (its own pass, set_epoch, load_state_dict)
        self._worker_passes = WorkerPasses()
        self._passes_seen = 0
        #: in a DataLoader worker resumed from its own state (torchdata's StatefulDataLoader):
        #: the worker's first steps of the pass that it handed out before
        self._worker_skip = 0
        if sum(self._targets) == 0:
            raise PlanError(f"{', '.join(self.source.urls)}: the mix asks for no sample per epoch")

    @property
    def telemetry(self) -> Telemetry | None:
        """Where the pass records decode/map time, prefetch depth, reads and retries (None:
        nowhere); set, it is handed to the cache too when the cache records nowhere."""
        return self.source.telemetry

    @telemetry.setter
    def telemetry(self, telemetry: Telemetry | None) -> None:
        self.source.telemetry = telemetry
        if telemetry is not None and self.cache is not None and getattr(self.cache, "telemetry", telemetry) is None:
            self.cache.telemetry = telemetry

    # -- pickling into DataLoader workers ------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Spawned workers have no process group: pin the topology seen by the parent.
        state["_topology"] = self._topology or resolve_topology(self.rank, self.world_size)
        state["_plan"] = None
        state["_live"] = None  # a worker's copy runs its own pass
        state["_ahead"] = None  # a prefetch thread: a worker runs its own
        return state

    # -- plan ---------------------------------------------------------------------------
    def _layout(self, epoch: int) -> tuple[NDArray[Any], NDArray[Any]]:
        return epoch_layout(self._stream_counts, self._targets, self.seed, epoch)

    def _make_plan(self, world: int, epoch: int | None = None) -> tuple[EpochPlan, NDArray[Any] | None]:
        """The plan of ``epoch`` (default: the current one, from the resume point if the
        pass resumes) for ``world`` ranks, and the real shard of each virtual shard."""
        epoch = self.epoch if epoch is None else epoch
        planner = self._planner()
        if self._resume is not None and self._resume.get("epoch") == epoch:
            return planner.resumed(world, self._resume)
        return planner(world, epoch)

    def _planner(self) -> EpochPlanner:
        """What this dataset's plans depend on (the plan stage's :class:`.chunks.EpochPlanner`)."""
        shuffle = self.shuffle
        return EpochPlanner(partial(epoch_layout, self._stream_counts, self._targets, self.seed), self.seed,
                            self.window if shuffle else 1, "window" if shuffle else "none", self.drop_last,
                            self.fingerprint)

    def future_shards(self, rank: int | None = None, worker: int = 0, num_workers: int = 1, *,
                      epochs: int = 2) -> NDArray[Any]:
        """The shards this rank's ``worker`` (of ``num_workers`` DataLoader workers) fetches
        from now to the end of ``epochs`` epochs, in order: the rest of the current epoch
        (from the resume point, if one is loaded), then the whole of each next one (by
        default one: the schedule a pass hands its cache). One entry per
        fetch (see :func:`datapipe.plan.fetch_order`); shards read outside a cache (Parquet
        tables) are left out. A pass hands exactly this to its cache's ``set_schedule`` (with
        a cache each pass fetches on its own; a read ahead without one hands the next pass
        the fetches its last chunk holds, which it then does not make)."""
        E = LoaderOptionError
        num_workers = check_int("num_workers", num_workers, min=1, max=MAX_COUNT, error=E)
        worker = check_int("worker", worker, min=0, max=num_workers - 1, error=E)
        epochs = check_int("epochs", epochs, min=1, max=MAX_FUTURE_EPOCHS, error=E)
        own_rank, world = self._world()
        rank = own_rank if rank is None else check_int("rank", rank, min=0, max=world - 1, error=E)
        return self._future_fetches(rank, worker, num_workers, epochs, 0)

    def _future_fetches(self, rank: int, worker: int, num_workers: int, epochs: int, skip: int) -> NDArray[Any]:
        """:meth:`future_shards`, the worker's first ``skip`` steps of the current epoch
        left out (a worker resumed from its own state does not read them)."""
        world = self._world()[1]
        parts = []
        for epoch in range(self.epoch, self.epoch + epochs):
            plan, real = self._make_plan(world, epoch)
            parts.append(fetch_order(plan, real, rank, worker, num_workers, self.batch_size, self.chunk_samples,
                                     skip if epoch == self.epoch else 0))
        order = np.concatenate(parts)
        cached = self._through_cache()
        return order if cached is None else order[cached[order]]

    def _through_cache(self) -> NDArray[Any] | None:
        """Which real shards are read through the cache (None: all); Parquet tables are not."""
        if not any(isinstance(ix, ParquetTable) for ix in self.source.indexes):
            return None
        through: NDArray[Any] = np.concatenate([np.full(len(ix.shards), not isinstance(ix, ParquetTable))
                                                for ix in self.source.indexes])
        return through

    set_epoch = set_resumable_epoch

    def shuffle_quality(self, batch_size: int = 256, max_batches: int = 512) -> dict[str, Any]:
        """Mean distinct shards per batch and stored-vs-delivered position correlation of
        the current epoch's order (see :mod:`datapipe.plan.quality`): what a window costs."""
        batch_size = check_int("batch_size", batch_size, min=1, max=MAX_COUNT, error=LoaderOptionError)
        max_batches = check_int("max_batches", max_batches, min=1, max=MAX_COUNT, error=LoaderOptionError)
        plan, _ = self._make_plan(1)
        out = plan.quality(batch_size, max_batches)
        out["window"] = self.window if self.shuffle else 0
        return out

    def __len__(self) -> int:
        """Samples this rank yields in the current epoch (from the resume point on)."""
        plan, _ = self._make_plan(self._world()[1])
        return plan.per_rank - plan.start

    def _world(self) -> tuple[int, int]:
        return self._topology or resolve_topology(self.rank, self.world_size)

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, samples_seen: int | None = None) -> dict[str, Any]:
        """Resume state once this rank has taken ``samples_seen`` samples in the current pass
        (counted from the resume point, if the pass resumed). ``None``: the samples this
        object yielded itself (iterating in this process, without DataLoader workers).

        In the main process of a pass that runs in DataLoader worker processes, ``None`` is
        a :class:`~datapipe.errors.WorkerStateError`: this object yielded nothing, and the
        workers' progress is not visible here. Take the state from the loader:
        :meth:`StreamingDataLoader.state_dict` (torchdata's ``StatefulDataLoader`` works
        too), or pass the samples the trainer took.

        Inside a DataLoader worker (where torchdata's ``StatefulDataLoader`` asks each
        worker's copy), ``None`` gives that worker's own state: the pass's resume state
        plus ``"worker": {"id", "num_workers", "batch_size", "taken"}``, the steps of its
        share it has handed out; :meth:`load_state_dict` in the same worker continues it."""
        info = worker_info()
        if samples_seen is not None:
            samples_seen = check_int("samples_seen", samples_seen, min=0, error=LoaderOptionError)
        elif info is not None:
            return self._worker_state(info)
        elif self._worker_passes.count != self._passes_seen:
            raise WorkerStateError(
                "StreamingDataset.state_dict(): this dataset's pass runs in DataLoader worker processes, on copies "
                "of it, so this object has yielded nothing and cannot see how far they got: its state would "
                "describe an unread pass. Take the state from the loader that hands out the batches: "
                "StreamingDataLoader(ds, batch_size=..., num_workers=...).state_dict() (or torchdata's "
                "StatefulDataLoader.state_dict()), or pass the samples this rank consumed: "
                "ds.state_dict(samples_seen=n)")
        plan = self._plan
        if plan is None:
            plan, _ = self._make_plan(self._world()[1])
        seen = self._progress.steps if samples_seen is None else samples_seen
        if not 0 <= seen <= plan.per_rank - plan.start:
            raise LoaderOptionError(f"samples_seen={show(seen)} is outside [0, {plan.per_rank - plan.start}] for this "
                                    "pass")
        return plan.state_dict(plan.start + seen)

    def _worker_state(self, info: Any) -> dict[str, Any]:
        """This DataLoader worker's state (see :meth:`state_dict`): the pass it runs (or,
        before it starts, the pass it will run) and how much of its share it handed out."""
        plan = self._plan
        if plan is None:
            plan, _ = self._make_plan(self._world()[1])
        return {**plan.state_dict(plan.start),
                "worker": {"id": int(info.id), "num_workers": int(info.num_workers), "batch_size": self.batch_size,
                           "taken": self._progress.steps}}

    def _state_is_here(self) -> None:
        """From now on this process knows the state (its own pass, or one it set): the
        workers' passes seen so far no longer make :meth:`state_dict` refuse."""
        self._passes_seen = self._worker_passes.count

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next pass; the world size may differ (elastic).
        One DataLoader worker's state (see :meth:`state_dict`) loads only in that worker."""
        if not isinstance(state, dict):
            raise LoaderOptionError(f"state={show(state)}: expected the dict a state_dict() returned")
        base = {k: v for k, v in state.items() if k != "worker"} if "worker" in state else state
        if type(base.get("epoch")) is not int or not 0 <= base["epoch"] <= MAX_EPOCH:
            raise StateMismatchError(f"not a StreamingDataset state: {show(state)}")
        keep = (self.epoch, self._resume, self._worker_skip)
        self.epoch, self._resume, self._worker_skip = base["epoch"], base, 0
        try:
            plan, _ = self._make_plan(self._world()[1])  # check it now, not in a worker later
            if "worker" in state:  # one worker's: it continues its own share
                self._worker_skip = check_worker_state(
                    state["worker"], self.batch_size,
                    partial(share_size, plan.start, plan.per_rank, self.batch_size))
        except (StateMismatchError, PlanError) as e:
            self.epoch, self._resume, self._worker_skip = keep
            raise StateMismatchError(str(e)) from None
        self._plan = None
        self._state_is_here()

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        # From here on, state_dict() describes the pass about to start (torchdata's
        # StatefulDataLoader asks a worker's copy between iter() and its first item); a live
        # pass keeps its own, and the new iterator refuses to start (see _pass).
        if self._live is None:
            self._plan, self._progress = None, Progress(self._worker_skip)
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        # One pass at a time: the resume state (plan, samples yielded, skips) is the pass's,
        # and state_dict() must describe the pass the trainer consumes. Keeping state per
        # iterator would leave state_dict() to guess which one; a stray second iterator (a
        # peek with next(iter(ds)) kept alive) would then silently move the resume point.
        # So a second live pass is an error; each DataLoader worker has its own copy, and a
        # parallel pass needs its own StreamingDataset.
        if self._live is not None:
            raise PlanError("this StreamingDataset is already being iterated: finish or close() the first "
                            "iterator (or drop the last reference to it) before starting another pass, or "
                            "create a second StreamingDataset for a pass in parallel; its state_dict() "
                            "describes one pass at a time")
        token = self._live = object()
        try:
            rank, world = self._world()
            worker, num_workers = _worker()
            if worker_info() is not None:
                self._worker_passes.started()  # the main process's object: its state is not here
            else:
                self._state_is_here()
            if self._control is not None and worker_info() is not None:
                told = self._control.read()  # a persistent worker: the main process's epoch and resume point
                if told is not None:
                    self.epoch, self._resume = told
                    self._worker_skip = 0
            key = PassKey(self.epoch, rank, world, worker, num_workers, self.batch_size, self.chunk_samples)
            plan, real = self._make_plan(world)
            progress = self._progress = Progress(self._worker_skip)
            self._plan = plan
            self.skipped = []  # reported at the end of each pass, then started afresh
            on_error = ErrorPolicy(self.on_error == "skip", self.skipped)
            decoder, positions = self._decode, self.return_position
            # The pass: plan -> fetch -> read -> decode/map -> batch, each stage a function of
            # the one before, over chunks. Items pass through the read stage's loop, the
            # decode stage's (if any) and this one: each layer of generators costs about 30 ns
            # per sample (measured here), so the stages hand on one iterator per chunk.
            fetching = self._fetch_stage(plan, real, key)
            # a chunk is read as its shards land, in pieces of whole batches (the batch stage
            # cuts each piece into batches)
            landed = fetching.chunks(align=self.batch_size if self.batched else 1)
            reads = read_chunks(landed, self.source.url, progress, on_error,
                                positions=positions and decoder.is_identity,  # else added after the map
                                columnar=self.batched and decoder.is_identity)
            if not decoder.is_identity:
                reads = decode_chunks(reads, decoder, progress, on_error, positions=positions,
                                      threads=self.map_threads, pool=self._map_pool, telemetry=self.telemetry)
            parts = batch_chunks(reads, progress, batch_size=self.batch_size if self.batched else None,
                                 positions=positions, markers=self.yield_skip_markers, skips=on_error.skip)
            try:
                for part in parts:
                    yield from part
            finally:
                self._ahead = fetching.end(self)
            if not self.yield_skip_markers:  # else the loader reports them, in the main process
                self._report_skipped()
            self.end_resumed_pass()
        finally:
            if self._live is token:
                self._live = None

    def _tell_cache_the_future(self, rank: int, worker: int, num_workers: int) -> None:
        """Hand the cache this worker's fetches to the end of the next epoch, once per pass
        (the cache's position moves with the reads it serves). The loader fetches ahead on
        its own, so the cache prefetches nothing (``lookahead=0``). A cache without
        ``set_schedule`` evicts by its own rule; a hook that fails warns and reads go on."""
        cache = self.cache
        if cache is None or not hasattr(cache, "set_schedule"):
            return
        try:
            fetches = self._future_fetches(rank, worker, num_workers, 2, self._worker_skip)
            urls = [self.source.url(g) for g in fetches.tolist()]
            # reads reach the cache out of order by fewer than `concurrency` places (fetches
            # run in parallel); a wider window would let a late read match a later occurrence
            # of its shard and move the cache's position past reads still to come
            cache.set_schedule(urls, position=0, lookahead=0, window=self.concurrency)
        except Exception as e:
            warnings.warn(f"the cache's set_schedule failed ({type(e).__name__}: {e}); reads go on, but its "
                          "eviction does not know the upcoming shards", RuntimeWarning, stacklevel=3)

    def end_resumed_pass(self) -> None:
        """The resumed pass is over: the next pass starts the epoch afresh (called at the end of
        each pass, and by a :class:`~datapipe.loader.StreamingDataLoader` whose workers read it)."""
        self._resume = None
        self._worker_skip = 0

    def _fetch_stage(self, plan: EpochPlan, real: NDArray[Any] | None, key: PassKey) -> PassFetch:
        """The pass's fetch stage: the read ahead the last pass left running into this pass
        when it guessed this pass right (same epoch and worker share, no resume state), else
        a new prefetcher over this pass's chunks (the plan stage), which run on into the pass
        after this one (see :func:`.chunks.chained_chunks`) where one will come."""
        ahead = take_read_ahead(self._ahead, key, resumed=self._resume is not None)
        self._ahead = None
        last, self._last_epoch = self._last_epoch, key.epoch
        before = self._passes.start()
        if ahead is not None:
            return PassFetch.adopt(ahead)
        self._tell_cache_the_future(key.rank, key.worker, key.num_workers)
        # The next pass's epoch is guessed from this one: the last pass's epoch plus one
        # when set_epoch() moved it on (or on the first pass), the same one when it did not.
        step = 0 if last == key.epoch else 1
        # a StreamingDataLoader's persistent workers have a control; the main process none
        reads_on = reads_ahead(before, self.cache is not None, self._control is not None or worker_info() is None)
        chunks = pass_chunks(plan, real, key, self._worker_skip, self._planner() if reads_on else None, step)
        source = self.source
        # local shards without a cache: a fetch is CPU work, and the first one runs alone
        pre = Prefetcher(chunks, partial(source.fetch, cache=self.cache), source.shard_bytes,
                         max_bytes=self.prefetch_bytes, concurrency=self.concurrency, telemetry=self.telemetry,
                         read_tier="cold" if self.cache is None else None,
                         first_alone=self.cache is None and source.local)
        return PassFetch(pre, key, 0, step)

    def _report_skipped(self) -> None:
        if self.skipped:
            where = ""
            if worker_info() is not None:  # under a plain DataLoader the main process never hears of these
                where = ("; this is a DataLoader worker process: a StreamingDataLoader reports skips in the "
                         "main process and counts them in its resume point")
            warnings.warn(skip_report(self.skipped, where), RuntimeWarning, stacklevel=3)
