"""The run id that names one writer's attempts, agreed by all ranks once at construction
(never in the background): given, drawn locally for a single rank, or drawn by rank 0 and
broadcast over torch.distributed."""

from __future__ import annotations

import re
import sys
import uuid

from ..errors import CheckpointError

__all__ = ["agree_run_id"]

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def agree_run_id(world_size: int, run_id: str | None) -> str:
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
