"""A torch DataLoader that keeps the StreamingDataset's resume state for you.

It sets the dataset's ``batch_size`` to its own (so workers take whole batches in turn and
the output is the rank's stream in order) and counts the samples it hands out, so
``state_dict()`` needs no argument even with worker processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from .dataset import StreamingDataset

__all__ = ["StreamingDataLoader"]


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), [])
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape):
        return int(shape[0])
    return len(batch)


class StreamingDataLoader(DataLoader):
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
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self.samples_seen = 0
        self._warned_skip = False

    def __iter__(self) -> Iterator[Any]:
        self.samples_seen = 0
        per = 1 if self.batch_size is None else None
        for batch in super().__iter__():
            self.samples_seen += per or _batch_len(batch)
            yield batch
        self.dataset._resume = None  # the resumed pass is over

    def state_dict(self) -> dict[str, Any]:
        if self.dataset.on_error == "skip" and self.num_workers > 0 and not self._warned_skip:
            # Skips happen in the workers; this process counts delivered samples only.
            warnings.warn("on_error='skip' with DataLoader workers: after a skipped sample the resume point "
                          "can be early by the number skipped (those samples are delivered again); use "
                          "num_workers=0 or on_error='raise' for an exact resume", RuntimeWarning, stacklevel=2)
            self._warned_skip = True
        return self.dataset.state_dict(self.samples_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self.samples_seen = 0
