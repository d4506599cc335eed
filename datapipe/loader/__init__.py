"""Runtime: the prefetching, decoding StreamingDataset and its torch adapter."""

from typing import Any

from .dataset import StreamingDataset, resolve_topology
from .decode import DEFAULT_DECODERS, make_decoder
from .mixing import Stream

__all__ = ["DEFAULT_DECODERS", "Stream", "StreamingDataLoader", "StreamingDataset", "make_decoder",
           "resolve_topology"]


def __getattr__(name: str) -> Any:  # torch is optional: import the DataLoader subclass on demand
    if name == "StreamingDataLoader":
        from .dataloader import StreamingDataLoader

        return StreamingDataLoader
    raise AttributeError(name)
