"""What :class:`~datapipe.tokens.dataset.TokenDataset` and :class:`~datapipe.tokens.mix.TokenMix`
share: where the process stands (rank, data-parallel group, DataLoader worker), one pass at
a time, and whose resume state it is, by the rules :class:`~datapipe.StreamingDataset` keeps:

- the topology: explicit ``rank``/``world_size``, else torch.distributed, else
  ``RANK``/``WORLD_SIZE`` (:func:`datapipe.loader.resolve_topology`), made a data-parallel
  rank and size by :func:`datapipe.plan.data_parallel` (``replication`` consecutive ranks of
  a tensor/context-parallel group read the same sequences; or an explicit
  ``dp_rank``/``dp_size``), pinned when the object is pickled into spawned workers;
- one pass at a time (a second live iterator is a :class:`~datapipe.errors.PlanError`);
- a pass run by DataLoader workers on copies of the object: this object's ``state_dict()``
  then raises :class:`~datapipe.errors.WorkerStateError` (:class:`datapipe.loader.control.WorkerPasses`);
  inside a worker, ``state_dict()``/``load_state_dict()`` are the worker's own (torchdata's
  ``StatefulDataLoader``): the pass's state plus the steps of its share it handed out;
- persistent workers of a :class:`~datapipe.StreamingDataLoader` read each pass's epoch and
  resume state from its :class:`~datapipe.loader.control.PassControl`.

A subclass says what its state is (:meth:`TokenStream._state_at`, :meth:`_load`) and how
large a worker's share is (:meth:`_share`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import LoaderOptionError, PlanError, StateMismatchError, WorkerStateError
from ..loader import Progress, WorkerPasses, check_worker_state, resolve_topology, worker_info
from ..options import check_int, check_mapping, show
from ..plan import data_parallel

try:  # torch is optional: without it the loaders are plain iterables
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover - torch is installed in the test environment
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["TokenStream", "check_reading", "check_topology"]

#: the largest epoch a state holds (a JSON integer readers hold as int64)
MAX_EPOCH = (1 << 63) - 1


def check_topology(rank: Any, world_size: Any, replication: Any, pipeline: Any, dp_rank: Any,
                   dp_size: Any) -> tuple[int | None, int | None]:
    """Checks the topology arguments now (before anything is read); (rank, world_size)."""
    E = LoaderOptionError
    check_int("replication", replication, min=1, error=E, hint="ranks of one tensor/context-parallel group")
    check_int("pipeline", pipeline, min=1, error=E, hint="pipeline stages")
    if dp_rank is not None or dp_size is not None:
        if rank is not None or world_size is not None:
            raise E(f"dp_rank={show(dp_rank)}, dp_size={show(dp_size)} with rank={show(rank)}, "
                    f"world_size={show(world_size)}: give the data-parallel rank and size, or the global rank and "
                    "world size (with replication=/pipeline=), not both")
        data_parallel(dp_rank=dp_rank, dp_size=dp_size)
        return None, None
    if rank is not None or world_size is not None:
        r, w = resolve_topology(rank, world_size)
        data_parallel(r, w, replication, pipeline=pipeline)
        return r, w
    return None, None


def check_reading(storage_options: Any, cache: Any) -> dict[str, Any] | None:
    """Checks ``storage_options`` and ``cache`` (a TieredCache or None) now; the storage
    options the sources are read with (without any, the cache's)."""
    E = LoaderOptionError
    if storage_options is not None:
        storage_options = check_mapping("storage_options", storage_options, error=E)
    if cache is not None and not callable(getattr(cache, "read_range", None)):
        raise E(f"cache={show(cache)}: expected a TieredCache (an object with read_range(url, start, end)) or None")
    if storage_options is None and cache is not None:
        storage_options = dict(getattr(cache, "storage_options", None) or {}) or None
    result: dict[str, Any] | None = storage_options
    return result


class TokenStream(_Base):  # type: ignore[type-arg]  # torch's IterableDataset is generic in its item type
    """The base of the token loaders (see the module docstring)."""

    #: :class:`~datapipe.StreamingDataLoader` takes a dataset that keeps its protocol
    #: (``batch_size``, ``batched``, ``epoch``, ``state_dict(samples_seen)``, ...)
    feeds_streaming_loader = True

    def _init_stream(self, rank: int | None, world_size: int | None, replication: int, pipeline: int,
                     dp_rank: int | None, dp_size: int | None) -> None:
        self.rank, self.world_size = rank, world_size
        self.replication, self.pipeline = replication, pipeline
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch = 0
        #: the state the next pass resumes from (None: the epoch from its start)
        self._resume: dict[str, Any] | None = None
        self._topology: tuple[int, int] | None = None
        #: plan steps handed out in the running pass (set just before each is handed out)
        self._progress = Progress()
        self._live: object | None = None
        #: a StreamingDataLoader sets these for its passes; token loaders skip nothing
        self.yield_skip_markers = False
        self.batched = False
        self.skipped: list[tuple[str, str | None, str]] = []
        #: set by a StreamingDataLoader whose workers run the passes: a worker may send groups
        #: of consecutive batches (``BatchGroup``), one message each (a subclass decides)
        self.grouped = False
        #: a StreamingDataLoader's PassControl while its persistent workers start
        self._control: Any = None
        self._worker_passes = WorkerPasses()
        self._passes_seen = 0
        #: in a worker resumed from its own state: the steps of its share handed out before
        self._worker_skip = 0

    # -- where this process stands --------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        return self._topology or resolve_topology(self.rank, self.world_size)

    def data_parallel(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of this process."""
        if self.dp_rank is not None or self.dp_size is not None:
            return data_parallel(dp_rank=self.dp_rank, dp_size=self.dp_size)
        rank, world = self._world()
        return data_parallel(rank, world, self.replication, pipeline=self.pipeline)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.dp_rank is None and self.dp_size is None:  # spawned workers have no process group
            state["_topology"] = self._world()
        state["_live"] = None  # a worker's copy runs its own pass
        return state

    # -- a pass -----------------------------------------------------------------------------
    def _enter_pass(self) -> object:
        """Start a pass (one at a time): returns its token. In a DataLoader worker, tells
        the main process's object that its state is not here, and a persistent worker takes
        the epoch and resume state the main process wrote for this pass."""
        if self._live is not None:
            raise PlanError(f"this {type(self).__name__} is already being iterated: finish or close() the first "
                            "iterator before starting another pass, or make a second object for a pass in parallel; "
                            "its state_dict() describes one pass at a time")
        token = self._live = object()
        if worker_info() is not None:
            self._worker_passes.started()
            told = self._control.read() if self._control is not None else None
            if told is not None:
                self._told(*told)
                self._worker_skip = 0
        else:
            self._state_is_here()
        return token

    def _exit_pass(self, token: object) -> None:
        if self._live is token:
            self._live = None

    def _pass(self) -> Iterator[Any]:
        """A pass: :meth:`_batches` from where this process stands, from the steps its
        resume state handed out on; the resumed pass is over when they run out."""
        token = self._enter_pass()
        try:
            dp_rank, dp_size = self.data_parallel()
            info = worker_info()
            worker, num_workers = (0, 1) if info is None else (int(info.id), int(info.num_workers))
            self._progress.steps = self._worker_skip
            yield from self._batches(dp_rank, dp_size, worker, num_workers, info is not None)
            self.end_resumed_pass()
        finally:
            self._exit_pass(token)

    def _batches(self, dp_rank: int, dp_size: int, worker: int, num_workers: int, in_worker: bool) -> Iterator[Any]:
        """The pass's items (or batches), counting the plan steps handed out in ``self._progress``."""
        raise NotImplementedError

    def _told(self, epoch: int, resume: dict[str, Any] | None) -> None:
        """A persistent worker's pass: the main process's epoch and resume state."""
        self.epoch, self._resume = epoch, resume

    def end_resumed_pass(self) -> None:
        """The resumed pass is over: the next pass starts the epoch afresh (called at the end of
        each pass, and by a StreamingDataLoader whose workers read it)."""
        self._resume = None
        self._worker_skip = 0

    def _state_is_here(self) -> None:
        self._passes_seen = self._worker_passes.count

    # -- resume -------------------------------------------------------------------------------
    def _state_at(self, seen: int | None) -> dict[str, Any]:
        """The state once ``seen`` steps of the pass were taken (None: this object's own
        progress)."""
        raise NotImplementedError

    def _pass_state(self) -> dict[str, Any]:
        """The state at the start of the running (or next) pass."""
        raise NotImplementedError

    def _load(self, state: dict[str, Any]) -> None:
        """Check ``state`` (:class:`StateMismatchError`) and continue from it on the next pass."""
        raise NotImplementedError

    def _share(self, worker: int, num_workers: int) -> int:
        """Steps of the next pass that DataLoader ``worker`` of ``num_workers`` hands out."""
        raise NotImplementedError

    def state_dict(self, samples_seen: int | None = None) -> dict[str, Any]:
        """Resume state once this rank has taken ``samples_seen`` sequences of the current pass
        (counted from its resume point). ``None``: what this object yielded itself.

        In the main process of a pass that DataLoader workers run, ``None`` is a
        :class:`~datapipe.errors.WorkerStateError`: this object yielded nothing. Take the state
        from a :class:`~datapipe.StreamingDataLoader` (or torchdata's ``StatefulDataLoader``),
        or pass the sequences the trainer took. Inside a worker, ``None`` gives that worker's
        own state (the pass's plus ``"worker": {"id", "num_workers", "batch_size", "taken"}``)."""
        info = worker_info()
        if samples_seen is not None:
            samples_seen = check_int("samples_seen", samples_seen, min=0, error=LoaderOptionError)
        elif info is not None:
            return {**self._pass_state(),
                    "worker": {"id": int(info.id), "num_workers": int(info.num_workers),
                               "batch_size": int(self._batch_steps()), "taken": self._progress.steps}}
        elif self._worker_passes.count != self._passes_seen:
            raise WorkerStateError(
                f"{type(self).__name__}.state_dict(): this object's pass runs in DataLoader worker processes, on "
                "copies of it, so it has yielded nothing and cannot see how far they got. Take the state from the "
                "loader that hands out the batches: StreamingDataLoader(...).state_dict() (or torchdata's "
                "StatefulDataLoader.state_dict()), or pass the sequences this rank consumed: "
                "state_dict(samples_seen=n)")
        return self._state_at(samples_seen)

    def _batch_steps(self) -> int:
        """Steps of the stream in one DataLoader batch (the unit workers take in turn)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next pass; the data-parallel size may differ
        (elastic). One DataLoader worker's state loads only in that worker."""
        if not isinstance(state, dict):
            raise LoaderOptionError(f"state={show(state)}: expected the dict a state_dict() returned")
        base = {k: v for k, v in state.items() if k != "worker"}
        keep = dict(self.__dict__)  # _load assigns, never mutates: this undoes it
        try:
            self._load(base)
            self._worker_skip = (check_worker_state(state["worker"], int(self._batch_steps()), self._share,
                                                     batch_name="batch size") if "worker" in state else 0)
        except (StateMismatchError, PlanError) as e:
            self.__dict__.update(keep)
            raise e if isinstance(e, StateMismatchError) else StateMismatchError(str(e)) from None
        self._state_is_here()
