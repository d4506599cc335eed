"""Where this process stands among the ranks of a job: the one resolver of rank and world
size that the loader and the checkpoint writer and loader share.

A leaf: imports only :mod:`datapipe.errors` and :mod:`datapipe.options`. It never imports
torch; it asks ``torch.distributed`` only when the caller has already imported torch.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from .errors import TopologyError
from .options import show

__all__ = ["Topology"]


class Topology(NamedTuple):
    """This process's ``rank`` in ``[0, world_size)``."""

    rank: int
    world_size: int

    @classmethod
    def checked(cls, rank: object, world_size: object) -> Topology:
        """``(rank, world_size)`` as a Topology; :class:`TopologyError` unless both are ints
        with ``0 <= rank < world_size``."""
        if (isinstance(rank, bool) or isinstance(world_size, bool)  # True is an int to Python
                or not (isinstance(rank, int) and isinstance(world_size, int) and world_size >= 1
                        and 0 <= rank < world_size)):
            raise TopologyError(f"rank {show(rank)} is not inside world size {show(world_size)}")
        return cls(rank, world_size)

    @classmethod
    def distributed(cls) -> Topology | None:
        """torch.distributed's rank and world size when torch is imported and a process
        group is initialised, else None."""
        dist = getattr(sys.modules.get("torch"), "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return cls.checked(dist.get_rank(), dist.get_world_size())

    @classmethod
    def from_environment(cls) -> Topology | None:
        """``RANK``/``WORLD_SIZE`` (as torchrun, Slurm wrappers and Kubernetes operators set
        them; a missing one defaults to 0 or 1) when either is set, else None."""
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            return None
        try:
            rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise TopologyError(
                f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not integers"
            ) from None
        return cls.checked(rank, world_size)

    @classmethod
    def resolve(cls, rank: int | None = None, world_size: int | None = None, *, environment: bool) -> Topology:
        """Explicit arguments win, each on its own; what is not given comes from
        torch.distributed when a process group is initialised, else (with ``environment``)
        from ``RANK``/``WORLD_SIZE``, else from a single rank ``(0, 1)``."""
        if rank is None or world_size is None:
            found = cls.distributed() or (cls.from_environment() if environment else None) or cls(0, 1)
            rank = found.rank if rank is None else rank
            world_size = found.world_size if world_size is None else world_size
        return cls.checked(rank, world_size)
