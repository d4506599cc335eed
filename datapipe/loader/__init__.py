"""Runtime: the prefetching, decoding StreamingDataset and its torch adapter.

A pass is the loader's stages in order, each a function of the stage before, each in its
own module:

- ``chunks`` (plan): the worker's share of an epoch's plan cut into chunks (``Chunk``,
  ``EpochPlanner``, ``pass_chunks``); ``mixing``: the epoch layout of a mix of ``Stream`` s.
- ``prefetch`` (fetch): each chunk's units fetched ahead within a byte budget
  (``Prefetcher``, ``PassFetch``, the read ahead into the next pass); ``source``: what a
  sample loader fetches (one shard's verified bytes, a Parquet row group), ``layouts`` the
  shard layouts kept across epochs.
- ``readers`` (read): each chunk's items, one reader per kind of shard.
- ``decoding`` (decode/map): ``decode=``/``map=`` on each item (samples are decoded by
  :mod:`datapipe.decode`, shared with ``open_dataset``).
- ``batch`` (batch): samples or columnar ``Batch`` es, as the pass hands them out.

Beside them: ``dataset`` (``StreamingDataset``: configuration and state, and the pass
composed of the stages), ``pass_state`` (progress and the error policy every stage shares),
``dataloader`` (``StreamingDataLoader``), ``ring`` (the shared-memory batch ring), ``control``
(what the main process and DataLoader workers tell each other). A token loader plugs its own
planner, fetch and reader into the plan and fetch stages (the face gives it what it reuses:
``LazyTensor``, ``LazyRows``, ``BatchGroup``, ``share_size``, ``WorkerPasses``, ``BufferPool`` beside the
stage parts, and the resume rules: ``set_resumable_epoch`` (their ``set_epoch``), ``check_worker_state``,
``worker_info``).

Imports ``plan``, ``format``, ``storage``, ``tables``, ``tarindex`` (to resolve shard URLs),
``datapipe.dataset``, ``decode`` and the leaves; never ``pack`` or ``checkpoint``. Names load
on first use (torch is optional: ``StreamingDataLoader`` needs it).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..decode import DEFAULT_DECODERS, make_decoder

if TYPE_CHECKING:
    from .batch import Batch, BatchGroup, Column, LazyRows, LazyTensor
    from .chunks import Chunk, EpochPlanner, PassKey, pass_chunks, share_size
    from .control import WorkerPasses
    from .dataloader import StreamingDataLoader
    from .dataset import StreamingDataset, check_worker_state, resolve_topology, set_resumable_epoch, worker_info
    from .mixing import Stream
    from .pass_state import ErrorPolicy, Progress, Skipped
    from .prefetch import PassCount, PassFetch, Prefetcher, ReadAhead, reads_ahead, take_read_ahead
    from .source import BufferPool

__all__ = ["DEFAULT_DECODERS", "Stream", "StreamingDataLoader", "StreamingDataset", "make_decoder",
           "resolve_topology", "Batch", "Column", "Chunk", "EpochPlanner", "PassKey", "pass_chunks", "ErrorPolicy",
           "Progress", "Skipped", "PassCount", "PassFetch", "Prefetcher", "ReadAhead", "reads_ahead",
           "take_read_ahead", "LazyTensor", "LazyRows", "BatchGroup", "share_size", "WorkerPasses", "BufferPool",
           "set_resumable_epoch", "check_worker_state", "worker_info"]

#: public name -> the submodule that defines it, imported on first use
_WHERE = {"Stream": "mixing", "StreamingDataLoader": "dataloader", "StreamingDataset": "dataset",
          "resolve_topology": "dataset", "Batch": "batch", "Column": "batch", "Chunk": "chunks",
          "EpochPlanner": "chunks", "PassKey": "chunks", "pass_chunks": "chunks", "ErrorPolicy": "pass_state",
          "Progress": "pass_state", "Skipped": "pass_state", "PassCount": "prefetch", "PassFetch": "prefetch",
          "Prefetcher": "prefetch", "ReadAhead": "prefetch", "reads_ahead": "prefetch", "take_read_ahead": "prefetch",
          "LazyTensor": "batch", "LazyRows": "batch", "BatchGroup": "batch",
          "share_size": "chunks",
          "WorkerPasses": "control", "BufferPool": "source", "set_resumable_epoch": "dataset",
          "check_worker_state": "dataset", "worker_info": "dataset"}

#: the submodules an eager import of the package used to bind (`datapipe.loader.source`)
_SUBMODULES = frozenset({"batch", "chunks", "control", "dataset", "decoding", "layouts", "mixing", "pass_state",
                         "prefetch", "readers", "source"})

__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE, _SUBMODULES)
