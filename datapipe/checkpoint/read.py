"""The state of one committed step on this rank: the one place that decides how a step is
read. A part of plain leaves is read whole and its leaves built on its verified bytes
(step.py); a part of a multi-rank step that holds pieces of global tensors gets each of
them whole, read from every part by overlap; ``into=`` targets on any world size or mesh
are filled in place by overlap (both reshard.py).

Python's cyclic garbage collector is paused while a step is read (gcpause.py): the
documents a read parses live until it returns, and the collections they would tip belong
to the whole heap, not to the read.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, TopologyError
from ..storage import Store
from ..topology import Topology
from .gcpause import collections_paused
from .reshard import load_into, load_part_full
from .step import is_sharded, part_state, read_data, read_manifest, read_part

__all__ = ["read_step"]


def read_step(store: Store, step: int, rank: int | None, map_location: Any, into: Any = None,
              doc: dict[str, Any] | None = None) -> Any:
    """Step ``step``'s state in ``store`` for ``rank`` (None: see :func:`_resolve_rank`), or
    ``into`` filled from it; ``doc``: its manifest, if already read and checked."""
    with collections_paused():
        where = f"checkpoint step {step} at {store.root}"
        if doc is None:
            doc = read_manifest(store, step)
        if into is not None:  # any world size: global tensors are read by overlap
            return load_into(store, step, doc, into, rank, map_location)
        r = _resolve_rank(rank, doc["world_size"], where)
        part = read_part(store, doc, r, where)
        if doc["world_size"] > 1 and is_sharded(part):
            # pieces of global tensors (replicas this rank did not store): they come back whole
            return load_part_full(store, step, doc, r, map_location)
        return part_state(part, read_data(store, part, f"{where} rank {r}"), where, map_location)


def _resolve_rank(rank: int | None, world_size: int, where: str) -> int:
    """The part this process reads: ``rank`` if given, else torch.distributed's rank when a
    process group of the checkpoint's world size is initialised, else 0 for a one-rank
    checkpoint."""
    if rank is None:
        live = Topology.distributed()
        if live is not None:
            if live.world_size != world_size:
                raise CheckpointError(
                    f"{where} was saved by {world_size} ranks, this job has {live.world_size}; "
                    "pass rank= to read one rank's part, or into=<this rank's state> to reshard"
                )
            rank = live.rank
        elif world_size == 1:
            rank = 0
        else:
            raise CheckpointError(f"{where} was saved by {world_size} ranks: pass rank=")
    try:
        return Topology.checked(rank, world_size).rank
    except TopologyError:
        raise CheckpointError(f"{where}: rank {rank!r} out of range for world_size {world_size}") from None
