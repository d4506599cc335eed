"""datapipe: pack small files into shards, cache them in tiers, stream them into training,
and checkpoint without stalling."""

from typing import Any

from ._version import __version__
from .cache import TieredCache
from .checkpoint import (
    CheckpointInfo,
    CheckpointWriter,
    LocalShard,
    Replicated,
    SaveHandle,
    list_checkpoints,
    load_checkpoint,
)
from .dataset import Dataset, DatasetIndex, open_index
from .pack import PackResult, ShardWriter, join_parts, pack
from .storage import set_storage_options
from .tarindex import IndexResult, index_shards, open_dataset
from .verify import VerifyReport, verify_dataset

__all__ = [
    "__version__",
    "CheckpointInfo",
    "CheckpointWriter",
    "Dataset",
    "DatasetIndex",
    "IndexResult",
    "LocalShard",
    "PackResult",
    "Replicated",
    "SaveHandle",
    "ShardWriter",
    "Stream",
    "StreamingDataLoader",
    "StreamingDataset",
    "TieredCache",
    "VerifyReport",
    "index_shards",
    "join_parts",
    "list_checkpoints",
    "load_checkpoint",
    "open_dataset",
    "open_index",
    "pack",
    "set_storage_options",
    "verify_dataset",
]


def __getattr__(name: str) -> Any:
    # The loader imports torch when it is installed: load it on first use, so that
    # `datapipe pack` and friends start fast and torch stays optional.
    if name in ("StreamingDataset", "Stream"):
        from . import loader

        return getattr(loader, name)
    if name == "StreamingDataLoader":
        from .loader.dataloader import StreamingDataLoader

        return StreamingDataLoader
    raise AttributeError(f"module 'datapipe' has no attribute {name!r}")
