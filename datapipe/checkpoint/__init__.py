"""Nonblocking checkpoints: stage into reused host memory, stream chunks with checksums in
the background, commit with a manifest written last, keep a bounded history, load the
newest checkpoint that verifies. Layout: docs/CHECKPOINT_FORMAT.md."""

from .loader import CheckpointInfo, list_checkpoints, load_checkpoint
from .writer import CheckpointWriter, SaveHandle

__all__ = ["CheckpointWriter", "SaveHandle", "CheckpointInfo", "load_checkpoint", "list_checkpoints"]
