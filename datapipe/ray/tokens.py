"""``pack_tokens(..., engine="ray")``: each piece of a token pack written by a Ray task.

The driver is :func:`datapipe.tokens.pack_tokens` itself: it plans the pieces, holds the
destination's writer lock, skips the pieces its journal records, journals each piece as
it finishes, checks and commits, exactly as with worker processes. Here each piece that is
left becomes one ``ray.remote`` task running the function the driver hands over (the
process worker's own ``pack_piece``; this module imports nothing of :mod:`datapipe.tokens`,
so no import runs from ``ray`` back to ``tokens``), so a piece's parts (``part-<piece>-<k>``), their
names and their bytes are those of the process path. A task whose worker dies is retried
(``MAX_RETRIES``) and rewrites the same names; a piece that fails is a named error.

Tasks rather than a Ray Data map over the piece list: the driver must journal each piece
as it finishes and stop at the first failure, which ``ray.wait`` over task refs gives as
the process path's ``wait(FIRST_COMPLETED)`` does; a piece is already a whole unit of
work planned by the driver, and what a task returns is a small journal record, so Ray
Data's blocks, batching and streaming between operators have nothing to carry (the
tokens never pass through Ray's object store), and its rows would need each piece
flattened into Arrow columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray

from ..errors import DatapipeError, PackError
from .engine import connect
from .sink import ray_cause

__all__ = ["write_token_pieces", "MAX_RETRIES"]

#: how often Ray runs a piece again whose worker died (a piece rewrites the same names)
MAX_RETRIES = 3
_CANCEL_WAIT_S = 60.0  # a cancelled task removes its unfinished part; the lock waits for that


def _failed(error: BaseException, task: Any, recorded: int) -> BaseException:
    cause = ray_cause(error)
    if isinstance(cause, DatapipeError):
        return cause
    piece = task.piece
    if isinstance(error, ray.exceptions.RayTaskError):
        inner = error.cause if isinstance(getattr(error, "cause", None), BaseException) else error
        why = f"it raised {type(inner).__name__}: {str(inner)[:300]}"
    else:
        why = (f"{type(error).__name__}: Ray lost its worker {MAX_RETRIES + 1} times (killed by a signal, e.g. by "
               "the out-of-memory killer, or its node left the cluster)")
    return PackError(f"the Ray task writing {piece.name} ({piece.file.url}) of {task.store.root} failed ({why}); "
                     f"{recorded} pieces are recorded: run the same command again to resume")


def write_token_pieces(tasks: Sequence[Any], finished: Callable[[dict[str, Any]], None], *,
                       run: Callable[[Any], dict[str, Any]], address: str | None = None,
                       progress: bool = False) -> None:
    """Run ``run(task)`` for each of ``tasks`` (``tokens.PieceTask``) as Ray tasks (joining
    the cluster at ``address``, as :func:`~datapipe.ray.engine.connect`), calling ``finished`` with each piece's record
    as its task ends, in the order they end. The first failure cancels the tasks left and
    is raised: a :class:`~datapipe.errors.DatapipeError` a task raised as itself, anything
    else as :class:`~datapipe.errors.PackError` naming the piece."""
    if not tasks:
        return
    connect(address, progress)
    remote = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(run)
    of = {remote.remote(t): t for t in tasks}
    pending = list(of)
    recorded = 0
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    res = ray.get(ref)
                except Exception as e:
                    raise _failed(e, of[ref], recorded) from None
                finished(res)
                recorded += 1
    finally:
        if pending:  # a failure (or Ctrl-C): what has not started never does, a running one stops
            for ref in pending:
                ray.cancel(ref)
            ray.wait(pending, num_returns=len(pending), timeout=_CANCEL_WAIT_S)
