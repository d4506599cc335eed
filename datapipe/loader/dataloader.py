"""A torch DataLoader that keeps the StreamingDataset's resume state for you.

It sets the dataset's ``batch_size`` to its own (so workers take whole batches in turn and
the output is the rank's stream in order) and counts the samples it hands out, so
``state_dict()`` needs no argument even with worker processes.

With ``on_error="skip"``, a sample skipped in a worker process is not simply left out: the
dataset yields a :class:`~.readers.Skipped` marker in its place, the collate function (run
in the worker) takes the markers out of the batch and sends them along with it, and this
process records them (``skipped``), warns naming shard and sample at the end of the pass,
and counts them as consumed: each batch is still one batch of the plan, so the resume point
stays exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, default_collate, default_convert

from ..errors import PlanError
from .dataset import StreamingDataset, skip_report
from .readers import Skipped

__all__ = ["StreamingDataLoader"]


class _Batch(NamedTuple):
    """What the wrapped collate function returns (a named tuple: pin_memory pins ``batch``
    inside it): the collated batch (None if every sample was skipped), the plan steps it
    covers, and the samples skipped among them."""

    batch: Any
    steps: int
    skipped: tuple[Skipped, ...]


class _CollateSkipped:
    """Wraps a collate function: markers of skipped samples are taken out of the batch
    before it is collated, and returned beside it (picklable, for spawned workers)."""

    def __init__(self, collate: Callable[[Any], Any], batched: bool) -> None:
        self.collate = collate
        self.batched = batched

    def __call__(self, data: Any) -> _Batch:
        if not self.batched:  # one sample at a time
            if isinstance(data, Skipped):
                return _Batch(None, 1, (data,))
            return _Batch(self.collate(data), 1, ())
        items = [x for x in data if not isinstance(x, Skipped)]
        skipped = tuple(x for x in data if isinstance(x, Skipped))
        return _Batch(self.collate(items) if items else None, len(data), skipped)


class StreamingDataLoader(DataLoader):  # type: ignore[type-arg]  # torch's DataLoader is generic in its batch type; ours varies with collate_fn
    def __init__(self, dataset: StreamingDataset, batch_size: int | None = 1, **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}")
        if kwargs.get("persistent_workers"):
            # Persistent workers keep the dataset copy they started with, so set_epoch and
            # load_state_dict would never reach them: every epoch would repeat one order.
            raise ValueError("StreamingDataLoader does not support persistent_workers=True: workers would miss "
                             "set_epoch() and load_state_dict(); leave it False")
        if batch_size is not None:
            dataset.batch_size = int(batch_size)
        collate = kwargs.pop("collate_fn", None)
        if collate is None:
            collate = default_collate if batch_size is not None else default_convert
        super().__init__(dataset, batch_size=batch_size,
                         collate_fn=_CollateSkipped(collate, batch_size is not None), **kwargs)
        self.samples_seen = 0
        #: (shard url, sample key or None, reason) of the samples skipped in the current
        #: or last pass, by whichever process read them
        self.skipped: list[tuple[str, str | None, str]] = []
        self._live: object | None = None
        #: the dataset, typed as what it is (torch types ``self.dataset`` as any Dataset)
        self.stream: StreamingDataset = dataset

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
        try:
            batches = super().__iter__()  # worker processes start here, with a copy of the dataset
            if self.num_workers > 0:
                # this process's copy is not read by the loader: a direct pass over it gets no
                # markers (the single-process iterator reads it lazily: it keeps them)
                dataset.yield_skip_markers = False
            for out in batches:
                batch, steps, skipped = out
                self.samples_seen += steps
                if skipped:
                    self.skipped.extend((s[0], s[1], s[2]) for s in skipped)
                if batch is None:  # every sample of this batch was skipped
                    continue
                yield batch
            dataset.end_resumed_pass()
        finally:
            dataset.yield_skip_markers = False
            if self._live is token:
                self._live = None
            if self.skipped:
                dataset.skipped = list(self.skipped)
                warnings.warn(skip_report(self.skipped), RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict(self.samples_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self.samples_seen = 0
