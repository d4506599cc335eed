"""Checkpoint tiers: where a save goes, how often, and how much history each place keeps.

A :class:`Tier` is a URL with its own cadence (``every``) and retention (``keep_last``,
``keep_every``). A tier is either *shared* (every rank sees the same URL: an object store,
a parallel filesystem; rank 0 commits one manifest for all ranks, the version-1 layout) or
*node-local* (each node has its own disk at that URL: every rank commits its own part as a
one-part checkpoint in ``rank-RRRRR/`` of the tier, and with ``replicate=1`` also keeps a
copy of one peer rank's part in ``replica-of-rank-QQQQQ/``; docs/CHECKPOINT_FORMAT.md,
"Tiers"). The peer of rank ``r`` is ``(r + ranks_per_node) % world_size``: the same local
rank on the next node, so the copy lives in another failure domain.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointOptionError
from ..storage import is_local_url

__all__ = ["Tier", "check_tiers", "writer_tiers", "own_dir", "replica_dir", "peer_of", "source_of",
           "resolve_ranks_per_node", "TiersOut"]


@dataclass(frozen=True)
class Tier:
    """One place checkpoints go.

    ``every``: a save of step ``s`` reaches this tier when ``s % every == 0``.
    ``keep_last``/``keep_every``: retention, as for a single-URL writer. ``replicate``: 0,
    or 1 to also write each rank's part to its peer on the next node (node-local tiers
    only). ``node_local``: each node has its own storage at ``url`` (default: True when
    ``replicate`` is set, else False). ``storage_options``: for fsspec URLs.
    """

    url: str
    every: int = 1
    keep_last: int = 3
    keep_every: int | None = None
    replicate: int = 0
    node_local: bool | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise CheckpointOptionError(f"Tier url must be a non-empty string, got {self.url!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise CheckpointOptionError(f"Tier({self.url!r}): every must be an int >= 1, got {self.every!r}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise CheckpointOptionError(
                f"Tier({self.url!r}): keep_last must be an int >= 1 (the last good checkpoint is always "
                f"kept), got {self.keep_last!r}"
            )
        if self.keep_every is not None and (isinstance(self.keep_every, bool)
                                            or not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise CheckpointOptionError(f"Tier({self.url!r}): keep_every must be None or an int >= 1, "
                                  f"got {self.keep_every!r}")
        if self.replicate not in (0, 1) or isinstance(self.replicate, bool):
            raise CheckpointOptionError(f"Tier({self.url!r}): replicate must be 0 or 1, got {self.replicate!r}")
        if self.node_local is None:
            object.__setattr__(self, "node_local", self.replicate > 0)
        if self.replicate and not self.node_local:
            raise CheckpointOptionError(
                f"Tier({self.url!r}): replicate=1 copies a node's part to another node's local tier; "
                "a shared tier (node_local=False) is one copy already seen by every rank"
            )

    def due(self, step: int) -> bool:
        return step % self.every == 0


def check_tiers(tiers: Any) -> list[Tier]:
    """``tiers`` as a list, checked: a non-empty list (or tuple) of :class:`Tier`."""
    if not (isinstance(tiers, (list, tuple)) and tiers and all(isinstance(t, Tier) for t in tiers)):
        raise CheckpointOptionError(f"tiers must be a non-empty list of Tier, got {tiers!r:.200}")
    return list(tiers)


def writer_tiers(url: str | None, tiers: list[Tier] | None, *, keep_last: int | None, keep_every: int | None,
                 storage_options: dict[str, Any] | None) -> list[Tier]:
    """The tiers a writer writes: ``tiers``, or the one shared tier ``url`` stands for:
    ``url``, ``keep_last`` (default 3), ``keep_every`` and ``storage_options`` are the
    shorthand of ``[Tier(url, keep_last=..., keep_every=..., storage_options=...)]``, and
    are refused beside ``tiers=`` (each Tier has its own)."""
    if tiers is None:
        if url is None:
            raise CheckpointOptionError("CheckpointWriter needs a url or tiers=[Tier(...), ...]")
        return [Tier(url, every=1, keep_last=3 if keep_last is None else keep_last, keep_every=keep_every,
                     storage_options=storage_options)]
    if url is not None:
        raise CheckpointOptionError("CheckpointWriter takes a url or tiers=, not both: a url is one Tier(url)")
    given = [name for name, v in (("keep_last", keep_last), ("keep_every", keep_every),
                                  ("storage_options", storage_options)) if v is not None]
    if given:
        raise CheckpointOptionError(
            f"CheckpointWriter(tiers=...) takes no {', '.join(given)}: with a url they describe its one tier; "
            "give them to each Tier(url, ...) instead"
        )
    tiers = check_tiers(tiers)
    if len({t.url for t in tiers}) != len(tiers):
        raise CheckpointOptionError(f"two tiers share a URL: {[t.url for t in tiers]}")
    return tiers


def own_dir(rank: int) -> str:
    """The folder of a node-local tier holding ``rank``'s own parts (a one-part checkpoint URL)."""
    return f"rank-{rank:05d}"


def replica_dir(rank: int) -> str:
    """The folder of a node-local tier holding the copy of ``rank``'s parts kept for it by its peer."""
    return f"replica-of-rank-{rank:05d}"


def peer_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank that keeps ``rank``'s replica: the same local rank on the next node."""
    return (rank + ranks_per_node) % world_size


def source_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank whose replica ``rank`` keeps (the inverse of :func:`peer_of`)."""
    return (rank - ranks_per_node) % world_size


def resolve_ranks_per_node(ranks_per_node: int | None, world_size: int, where: str) -> int:
    """``ranks_per_node`` if given, else ``LOCAL_WORLD_SIZE`` (torchrun, Slurm wrappers),
    checked to divide ``world_size`` into at least two nodes (a replica on the same node
    would die with it)."""
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise CheckpointOptionError(
                f"{where}: replicate=1 needs the number of ranks per node: pass ranks_per_node= "
                "or set LOCAL_WORLD_SIZE (torchrun sets it)"
            )
        try:
            ranks_per_node = int(env)
        except ValueError:
            raise CheckpointOptionError(f"{where}: LOCAL_WORLD_SIZE={env!r} is not an integer") from None
    if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
            or world_size % ranks_per_node != 0 or world_size // ranks_per_node < 2):
        raise CheckpointOptionError(
            f"{where}: replicate=1 needs at least two nodes of equal size: ranks_per_node="
            f"{ranks_per_node!r} does not split world_size={world_size} into two or more nodes"
        )
    return ranks_per_node


class TiersOut:
    """The tiers of one writer's background that are out of the path. A tier whose save
    fails with a storage error (unwritable, deleted, full, its writer lease lost) while
    another due tier commits the step goes out, with one warning naming it and the error;
    each later save it is due for probes it first (``probe``: a small object written, read
    back and deleted, the writer lease taken again if it was lost) and skips it while the
    probe fails; the first probe that passes takes it back, with one message. A save that
    no due tier committed is never taken for a success (the background raises)."""

    def __init__(self) -> None:
        self.out: dict[str, str] = {}  # url -> why it is out
        self._warned: set[str] = set()
        # what the check at start found, said as the first save begins: a writer process's
        # warnings reach the trainer with its saves' replies
        self._at_start: list[str] = []

    def check_at_start(self, tiers: list[Tier]) -> None:
        """The doctor's check of a folder (``datapipe.cache.check_folder_within``), cheap,
        of each tier on a local folder that exists (one to be created is checked by its
        creation): ``START_PROBE_BYTES`` (16 KiB) written, fsync'd, read back and removed,
        within 10 s (``START_CHECK_DEADLINE_S``). A tier below the first that fails is out of the
        path from the start, with one warning naming it and the fix (given as the first save
        begins), and probed before each save it is due for; the first tier is warned about and
        kept (its saves fail as they
        would, naming it: a writer whose first tier is gone must not look healthy)."""
        from ..cache import check_folder_within  # the folder check alone, not the cache

        for i, tier in enumerate(tiers):
            if not is_local_url(tier.url):
                continue
            path = tier.url[len("file://"):] if tier.url.startswith("file://") else tier.url
            if not os.path.isdir(path):
                continue
            check = check_folder_within(path)
            if not check.failed:
                continue
            if i == 0:
                self._at_start.append(f"checkpoint tier {tier.url} fails the check at start ({check.problem}); it "
                                      "is the first tier, so saves to it fail until it is fixed")
                continue
            self.out_at_start(tier.url, f"it fails the check at start: {check.problem}")

    def out_at_start(self, url: str, why: str) -> None:
        """``url`` cannot be written as the writer starts (``why``): out of the path, said
        once (as the first save begins); probed before each save it is due for, as a tier
        that failed a save is."""
        self.out[url] = why
        if url in self._warned:
            return
        self._warned.add(url)
        self._at_start.append(f"checkpoint tier {url} is out of the path from the start ({why}): saves go to the "
                              "other tiers; it is probed before each save it is due for and taken back when it "
                              "answers")

    def skip(self, url: str, probe: Callable[[], str], step: int) -> str | None:
        """None when ``url`` is to be written at ``step`` (in the path, or back now: its
        probe passed); else why it is skipped. The first call says what the check at start
        found."""
        said, self._at_start = self._at_start, []
        for message in said:
            warnings.warn(message, stacklevel=2)
        why = self.out.get(url)
        if why is None:
            return None
        try:
            how = probe()
        except Exception as e:
            return f"out of the path ({why}); its probe at step {step} failed too ({type(e).__name__}: {e})"
        del self.out[url]
        warnings.warn(f"checkpoint tier {url} answers again ({how}): back in the path from step {step}",
                      stacklevel=2)
        return None

    def failed(self, url: str, e: BaseException, step: int, written: list[str]) -> None:
        """``url`` failed at ``step`` with ``e``: out of the path, said once per tier (by
        the save's own error instead when no tier took the step: ``written`` empty)."""
        self.out[url] = f"{type(e).__name__}: {e}"
        if url in self._warned or not written:
            return
        self._warned.add(url)
        warnings.warn(f"checkpoint tier {url} failed at step {step} ({type(e).__name__}: {e}): taken out of the "
                      f"path; step {step} is committed on {', '.join(written)}; the tier is probed before each "
                      "save it is due for and taken back when it answers", stacklevel=2)
