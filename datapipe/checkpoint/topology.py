"""Who this writer is among the ranks, agreed once at construction (never in the
background), and a lower CPU priority for background threads."""

from __future__ import annotations

import os
import re
import sys
import threading
import uuid

from ..errors import CheckpointError

__all__ = ["agree_run_id", "topology", "lower_thread_priority"]

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def agree_run_id(rank: int, world_size: int, run_id: str | None) -> str:
    if run_id is not None:
        if not _RUN_ID_RE.match(run_id):
            raise CheckpointError(f"run_id must match {_RUN_ID_RE.pattern}, got {run_id!r}")
        return run_id
    if world_size == 1:
        return uuid.uuid4().hex[:12]
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        # One collective at construction, never in the background: rank 0 draws the id.
        import torch as _torch

        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = _torch.randint(0, 2**62, (1,), dtype=_torch.int64, device=dev)
        dist.broadcast(t, src=0)
        return f"{int(t.item()):016x}"
    raise CheckpointError(
        "world_size > 1 without an initialized torch.distributed: pass run_id=<the same fresh "
        "string on every rank> so that the ranks' parts of one save can be matched"
    )


def topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    live = dist is not None and dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if live else 0
    if world_size is None:
        world_size = dist.get_world_size() if live else 1
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise CheckpointError(f"invalid rank {rank!r} for world_size {world_size!r}")
    return rank, world_size



def lower_thread_priority(increment: int = 10) -> None:
    """Raise the nice value of the calling thread only (Linux treats a thread id as a
    process id here), so that the training threads win the cores from checkpoint I/O."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:
        pass  # not permitted or not supported: run at normal priority
