"""datapipe: pack small files into shards, cache them in tiers, stream them into training,
and checkpoint without stalling."""

from typing import TYPE_CHECKING

from . import errors as errors  # `except datapipe.errors.DatapipeError` after `import datapipe`
from ._lazy import lazy_exports
from ._version import __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time each comes on first use
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
    from .loader import Stream, StreamingDataset
    from .loader.dataloader import StreamingDataLoader  # the loader's face gives it untyped (__getattr__)
    from .packing import PackResult, ShardWriter, join_parts, pack
    from .storage import set_storage_options
    from .tarindex import IndexResult, index_shards, open_dataset
    from .tokens import TokenDataset, TokenMix, index_tokens, pack_tokens
    from .verify import VerifyReport, verify_dataset

#: public name -> the submodule that defines it, imported on first use (see _lazy.py)
_WHERE = {
    "CheckpointInfo": "checkpoint",
    "CheckpointWriter": "checkpoint",
    "Dataset": "dataset",
    "DatasetIndex": "dataset",
    "IndexResult": "tarindex",
    "LocalShard": "checkpoint",
    "PackResult": "packing",
    "Replicated": "checkpoint",
    "SaveHandle": "checkpoint",
    "ShardWriter": "packing",
    "Stream": "loader",
    "StreamingDataLoader": "loader",
    "StreamingDataset": "loader",
    "TieredCache": "cache",
    "TokenDataset": "tokens",
    "TokenMix": "tokens",
    "VerifyReport": "verify",
    "index_shards": "tarindex",
    "index_tokens": "tokens",
    "join_parts": "packing",
    "list_checkpoints": "checkpoint",
    "load_checkpoint": "checkpoint",
    "open_dataset": "tarindex",
    "open_index": "dataset",
    "pack": "packing",
    "pack_tokens": "tokens",
    "set_storage_options": "storage",
    "verify_dataset": "verify",
}

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
    "TokenDataset",
    "TokenMix",
    "VerifyReport",
    "index_shards",
    "index_tokens",
    "join_parts",
    "list_checkpoints",
    "load_checkpoint",
    "open_dataset",
    "open_index",
    "pack",
    "pack_tokens",
    "set_storage_options",
    "verify_dataset",
]


#: the submodules that `import datapipe` bound when it imported its parts eagerly: code that
#: reaches them as attributes (`datapipe.cache.Tier`) imports them on first use
_SUBMODULES = frozenset({"cache", "checkpoint", "checksum", "dataset", "decode", "format", "options", "packing",
                         "progress", "publish", "storage", "tarindex", "topology", "verify"})

__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE, _SUBMODULES)

