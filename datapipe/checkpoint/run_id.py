"""The ids that name one writer's attempts, agreed by all ranks once at construction (never
in the background).

``run_id`` is the caller's (``run_id=``) or drawn; the lease names it. ``attempt_id`` is the
``<run_id>`` part of every attempt folder this writer instance writes (``<attempt_id>-<n>``,
docs/CHECKPOINT_FORMAT.md): it is drawn for this instance, so that no other writer, not even
an earlier run given the same ``run_id``, writes into the folders of its saves, and rank 0
never mistakes another run's part for one of this save. Ranks draw it together where they
can: a single rank draws it alone; several ranks draw it on rank 0 and broadcast it over
torch.distributed (the one collective, at construction). Ranks with no process group between
them (several ranks, none initialised) agree only on the ``run_id`` they are given, which is
then the attempt id itself (``fresh`` False) and must be fresh for each run: the writer
refuses one whose attempts it finds (persist.py).
"""

from __future__ import annotations

import re
import secrets
import sys
import uuid
from dataclasses import dataclass

from ..errors import CheckpointOptionError
from ..topology import Topology

__all__ = ["WriterIds", "agree_writer_ids"]

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
#: hex digits of the instance's nonce appended to a given run_id: ``<run_id>_<nonce>`` is at
#: most 64 characters, the attempt name's limit (format.py)
_NONCE_HEX = 12


@dataclass(frozen=True)
class WriterIds:
    run_id: str  # the caller's, or drawn: the lease names it
    attempt_id: str  # the <run_id> of this writer instance's attempt names
    fresh: bool  # attempt_id was drawn for this writer instance (False: the given run_id itself)


def _broadcast_random() -> int:
    """A random int drawn by rank 0 and broadcast over torch.distributed's default group.
    Drawn from the OS, not torch's generator: that one starts from the same seed in every
    process (and from the trainer's own after ``manual_seed``), so each run would draw the
    same id, and drawing would move rank 0's random stream away from the other ranks'."""
    import torch

    dist = torch.distributed
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0], dtype=torch.int64, device=dev)
    dist.broadcast(t, src=0)
    return int(t.item())


def _with_nonce(run_id: str, nonce: int) -> str:
    digits = f"{nonce:016x}"[-_NONCE_HEX:]
    return f"{run_id[: 64 - 1 - _NONCE_HEX]}_{digits}"


def agree_writer_ids(rank: int, world_size: int, run_id: str | None) -> WriterIds:
    if run_id is not None and not (isinstance(run_id, str) and _RUN_ID_RE.match(run_id)):
        raise CheckpointOptionError(f"run_id must match {_RUN_ID_RE.pattern}, got {run_id!r}")
    if world_size == 1:
        drawn = uuid.uuid4().hex[:_NONCE_HEX]
        if run_id is None:
            return WriterIds(drawn, drawn, True)
        return WriterIds(run_id, _with_nonce(run_id, int(drawn, 16)), True)
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    live = dist is not None and dist.is_available() and dist.is_initialized()
    if run_id is None:
        if not live:
            raise CheckpointOptionError(
                "world_size > 1 without an initialized torch.distributed: pass run_id=<the same fresh "
                "string on every rank> so that the ranks' parts of one save can be matched"
            )
        drawn = f"{_broadcast_random():016x}"
        return WriterIds(drawn, drawn, True)
    # A given run_id and a process group of this writer's ranks: draw the nonce together.
    # Without one (or with a group of other ranks: a broadcast there would pair this writer
    # with ranks that may never construct one) the run_id is all the ranks share.
    if live and Topology.distributed() == (rank, world_size):
        return WriterIds(run_id, _with_nonce(run_id, _broadcast_random()), True)
    return WriterIds(run_id, run_id, False)
