"""Resume state: a few integers that pin an epoch's order and how far it was read.

    {"version": 1, "fingerprint": "xxh3_64:...", "num_samples": N, "algorithm": "window",
     "seed": 0, "epoch": 3, "window": 16, "splits": [[space, world, per_rank, consumed], ...]}

``splits`` usually holds one entry; each change of world size in the middle of an epoch
adds one (see :class:`.partition.Partition`). Loading checks that the state belongs to the
same layout and order and raises :class:`StateMismatchError` naming what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checksum import checksum
from ..errors import PlanError, StateMismatchError
from ..options import show
from .arrays import ArrayLike
from .partition import Partition, Split

__all__ = ["STATE_VERSION", "OrderKey", "layout_fingerprint", "make_state", "read_state"]

STATE_VERSION = 1


def layout_fingerprint(counts: ArrayLike, extra: str = "") -> str:
    """A checksum of the per-shard sample counts (and any ``extra`` identity, such as the
    dataset's index checksum): two layouts with the same fingerprint plan the same order."""
    arr = np.ascontiguousarray(np.asarray(counts, dtype="<i8"))
    return checksum(arr.tobytes() + extra.encode())


@dataclass(frozen=True)
class OrderKey:
    """Everything the order of an epoch depends on."""

    fingerprint: str
    num_samples: int
    algorithm: str
    seed: int
    window: int


def make_state(key: OrderKey, epoch: int, partition: Partition) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "fingerprint": key.fingerprint,
        "num_samples": key.num_samples,
        "algorithm": key.algorithm,
        "seed": key.seed,
        "window": key.window,
        "epoch": int(epoch),
        "splits": [[s.space, s.world, s.per_rank, s.consumed] for s in partition.splits],
    }


def read_state(state: Any, key: OrderKey) -> tuple[int, Partition]:
    """(epoch, partition) from a state made by :func:`make_state` for the same ``key``."""
    if not isinstance(state, dict):
        raise StateMismatchError(f"a loader state must be a dict, got {type(state).__name__}")
    if type(state.get("version")) is not int or state.get("version") != STATE_VERSION:  # True == 1 too
        raise StateMismatchError(
            f"loader state version {show(state.get('version'))} is not {STATE_VERSION}; "
            "it was not written by this loader"
        )
    for name, mine in (
        ("fingerprint", key.fingerprint),
        ("num_samples", key.num_samples),
        ("algorithm", key.algorithm),
        ("seed", key.seed),
        ("window", key.window),
    ):
        theirs = state.get(name)
        if type(theirs) is not type(mine) or theirs != mine:
            what = ("another dataset (or the same data cut otherwise: for a token dataset, another seq_len, packing "
                    "or chunk_tokens)") if name in ("fingerprint", "num_samples") else f"another {name}"
            raise StateMismatchError(
                f"loader state belongs to {what}: its {name} is {show(theirs)}, this loader's is {show(mine)}"
            )
    epoch = state.get("epoch")
    splits = state.get("splits")
    if type(epoch) is not int or epoch < 0:
        raise StateMismatchError(f"loader state has an invalid epoch {show(epoch)}")
    if not isinstance(splits, list) or not splits:
        raise StateMismatchError(f"loader state has invalid splits {show(splits)}")
    try:
        parsed = []
        for s in splits:
            if not (isinstance(s, (list, tuple)) and len(s) == 4 and all(type(x) is int for x in s)):
                raise PlanError(f"split {show(s)} is not four integers")
            parsed.append(Split(*s))
        part = Partition(key.num_samples, tuple(parsed))
    except PlanError as e:
        raise StateMismatchError(f"loader state is inconsistent: {e}") from None
    return epoch, part
