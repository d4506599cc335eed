"""Nonblocking checkpoints: stage into reused host memory, stream chunks with checksums in
the background, commit with a manifest written last, keep a bounded history, load the
newest checkpoint that verifies. Layout: docs/CHECKPOINT_FORMAT.md.

Holds: ``writer`` (``CheckpointWriter``, ``SaveHandle``), ``background`` (where its
background work runs, chosen once: a thread, or ``writer_process``), ``persist`` (that work:
chunks, parts, commit; ``PersistJob``/``PersistConfig`` and their wire form), ``staging``
(the reused host buffer), ``leaf`` (``Leaf``: one array of the state, and what its dtype means), ``flatten``
(state <-> leaves and JSON tree), ``format`` (key names, documents, limits), ``commit``
(parts, manifest, ``latest``, retention), ``lease`` (one writer per URL), ``run_id`` (the
attempt id a writer's ranks draw together), ``tiers`` (``Tier``: cadence, retention,
node-local folders), ``replicate`` (the peer link that copies a node-local part to the next
node); reading: ``load`` (``load_checkpoint``, ``list_checkpoints``), ``read`` (a step's
state: the one place that picks how), ``step`` (the step reader: manifest, parts, chunks,
leaves, all checked; ``SavedStep``), ``overlap`` (the geometry of global tensors, no I/O),
``reshard`` (global tensors read onto any world size or mesh by overlap), ``restore``
(``restore_checkpoint``: the newest step every rank can load, from the best place),
``dtensor`` (pieces of global tensors: DTensor, ``LocalShard``, ``Replicated``). May import
:mod:`datapipe.storage`, :mod:`datapipe.topology`, :mod:`datapipe.errors` and
:mod:`datapipe.checksum`; it sees the data loader only through
``state_dict()``/``load_state_dict()``.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .dtensor import LocalShard, Replicated
    from .load import CheckpointInfo, list_checkpoints, load_checkpoint
    from .restore import RestoreResult, restore_checkpoint
    from .tiers import Tier
    from .writer import CheckpointWriter, SaveHandle

__all__ = ["CheckpointWriter", "SaveHandle", "CheckpointInfo", "load_checkpoint", "list_checkpoints",
           "Tier", "restore_checkpoint", "RestoreResult", "LocalShard", "Replicated"]

#: public name -> the submodule that defines it, imported on first use: the writer process
#: (``python -m datapipe.checkpoint.writer_process``) needs none of the trainer's side
_WHERE = {"CheckpointWriter": "writer", "SaveHandle": "writer", "CheckpointInfo": "load",
          "load_checkpoint": "load", "list_checkpoints": "load", "Tier": "tiers",
          "restore_checkpoint": "restore", "RestoreResult": "restore", "LocalShard": "dtensor",
          "Replicated": "dtensor"}

#: the submodules, reached as attributes (`datapipe.checkpoint.writer.CheckpointWriter`) and
#: imported on first use
_SUBMODULES = frozenset({"background", "commit", "dtensor", "flatten", "format", "gcpause", "leaf", "lease", "load",
                         "overlap", "persist", "read", "replicate", "reshard", "restore", "run_id", "staging", "step",
                         "tiers", "writer", "writer_process"})

__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE, _SUBMODULES)
