"""datapipe: pack small files into shards, cache them in tiers, stream them into training,
and checkpoint without stalling."""

__version__ = "0.1.0"

from .dataset import Dataset, DatasetIndex, open_dataset, open_index  # noqa: E402
from .pack import PackResult, ShardWriter, join_parts, pack  # noqa: E402
from .verify import VerifyReport, verify_dataset  # noqa: E402

__all__ = [
    "__version__",
    "Dataset",
    "DatasetIndex",
    "PackResult",
    "ShardWriter",
    "join_parts",
    "open_dataset",
    "open_index",
    "pack",
    "VerifyReport",
    "verify_dataset",
]
