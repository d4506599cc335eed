"""Exact mixtures of sources, by weight, per global batch; weights may change mid-run.

Every global batch of B sequences holds exactly ``counts[s]`` sequences of source s: the
largest-remainder rounding of ``w_s / sum(w) * B`` (exact rational arithmetic; ties go to the
lower source index), the same for every batch while the weights hold. Source s serves its
own draws in order: its j-th draw is position ``j % N_s`` of its epoch ``j // N_s`` (a small
source is upsampled by whole epochs), and an epoch's order is the source's own windowed
shuffle over its chunks (:func:`~datapipe.plan.epoch_order`), so the draws of a source stay
within a few chunks at a time.

Global batch k: its B slots are given to the sources (``counts[s]`` each) in an order
shuffled by a Feistel permutation keyed by (seed, k); data-parallel rank r of ``dp_size``
takes slots ``[r*B/dp, (r+1)*B/dp)``, and DataLoader worker w of W takes the rank's batches
k = start + w, start + w + W, ... (:func:`worker_steps`: torch's round-robin order; in groups
of consecutive steps when a worker sends several batches as one message), so a
rank's loader yields its share of global batches in step order. A batch's content depends
on (sources, seed, window, the weights in force, k) only, never on ``dp_size``: a state
counted in global steps resumes exactly on any data-parallel size.

Resume state: the step, each source's draws consumed before it, the counts in force and
any weight change scheduled for later: a few integers per source, however many changes
came before (each is folded into the consumed counts). A weight change at step S lets
each source go on from its own draw counter, so no sequence a source served before S is
served again in that source's epoch.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, cast

import numpy as np

from ..errors import OptionError, PlanError, StateMismatchError
from .arrays import ArrayLike, Int64s
from .permutation import derive_key, feistel_permute
from .resume import layout_fingerprint
from .shuffle import EpochOrder, check_counts, epoch_order

__all__ = ["MIXTURE_STATE_VERSION", "MixtureBatch", "MixturePlan", "mixture_counts", "worker_steps", "WorkerSteps"]

MIXTURE_STATE_VERSION = 1
#: key part that sets a batch's slot permutation apart from the sources' own orders
_SLOTS = 0x534C4F54
_ORDERS_KEPT = 16


def _weights(weights: Any, n: int) -> tuple[float, ...]:
    try:
        ws = list(weights)
    except TypeError:
        raise OptionError(f"weights={weights!r}: expected one number per source ({n})") from None
    if len(ws) != n:
        raise OptionError(f"weights has {len(ws)} entries for {n} sources")
    out = []
    for i, w in enumerate(ws):
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating) \
                or not math.isfinite(float(w)) or float(w) < 0:
            raise OptionError(f"weights[{i}]={w!r}: a weight is a finite number >= 0")
        out.append(float(w))
    if not any(out):
        raise OptionError("weights are all zero: at least one source must have a positive weight")
    return tuple(out)


def mixture_counts(weights: Sequence[float], global_batch: int) -> tuple[int, ...]:
    """Sequences of each source in a global batch of ``global_batch``: largest-remainder
    rounding of ``w_s / sum(w) * B`` in exact arithmetic, ties to the lower index. A source
    with a positive weight whose count rounds to 0 is refused (:class:`OptionError`): it
    would never be drawn."""
    ws = _weights(weights, len(weights))
    B = _pos_int("global_batch", global_batch)
    fr = [Fraction(w) for w in ws]
    total = sum(fr)
    quota = [f * B / total for f in fr]
    base = [q.numerator // q.denominator for q in quota]
    left = B - sum(base)
    order = sorted(range(len(ws)), key=lambda s: (-(quota[s] - base[s]), s))
    for s in order[:left]:
        base[s] += 1
    for s, (w, c) in enumerate(zip(ws, base)):
        if w > 0 and c == 0:
            raise OptionError(
                f"weights[{s}]={w!r} gives source {s} {float(quota[s]):.3g} of the {B} sequences of a global "
                "batch, which rounds to 0: it would never be drawn. Give it weight 0 to leave it out, or a "
                f"weight of at least {float(total) / (2 * B):.3g} (or a larger global batch)"
            )
    return tuple(base)


def _pos_int(name: str, v: object, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or int(v) < lo:
        raise OptionError(f"{name}={v!r}: expected an integer >= {lo}")
    return int(v)


@dataclass(frozen=True)
class WorkerSteps:
    """The global steps of ``[start, stop)`` that DataLoader ``worker`` of ``num_workers``
    builds when workers take groups of ``group`` consecutive steps in turn (group 1: torch's
    round-robin order), from its ``offset``-th on; ``len`` and slices
    without listing them (an endless mix has 2**62)."""

    start: int
    worker: int
    num_workers: int
    stop: int
    group: int = 1
    offset: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.worker < self.num_workers:
            raise OptionError(f"worker={self.worker} is not inside num_workers={self.num_workers}")
        if self.group < 1 or self.offset < 0:
            raise OptionError(f"group={self.group}, offset={self.offset}: group must be >= 1 and offset >= 0")

    def _step(self, k: int) -> int:
        g = self.group
        return self.start + (self.worker + (k // g) * self.num_workers) * g + k % g

    def _total(self) -> int:
        n = max(self.stop - self.start, 0)
        groups = -(-n // self.group)
        mine = len(range(self.worker, groups, self.num_workers))
        count = mine * self.group
        if mine and (groups - 1 - self.worker) % self.num_workers == 0:  # the last group, maybe short, is mine
            count -= groups * self.group - n
        return count

    def __len__(self) -> int:
        return max(self._total() - self.offset, 0)

    def __getitem__(self, part: int | slice) -> Any:
        if not isinstance(part, slice):
            i = operator.index(part)
            n = len(self)
            if not -n <= i < n:
                raise IndexError(f"step {i} of a worker's {n} steps")
            return self._step(self.offset + (i % n))
        a, b, step = part.indices(len(self))
        if step != 1:
            raise OptionError(f"a worker's steps are sliced in order only (step {part.step!r})")
        if part.stop is None:  # the rest: still not listed
            return WorkerSteps(self.start, self.worker, self.num_workers, self.stop, self.group, self.offset + a)
        k = np.arange(self.offset + a, self.offset + max(a, b), dtype=np.int64)
        return (self.start + (self.worker + (k // self.group) * self.num_workers) * self.group
                + k % self.group).tolist()

    def __iter__(self) -> Iterator[int]:
        for k in range(self.offset, self._total()):
            yield self._step(k)


def worker_steps(start: int, worker: int, num_workers: int, stop: int, group: int = 1) -> WorkerSteps:
    """Global steps in ``[start, stop)`` that DataLoader ``worker`` of ``num_workers`` builds
    after a (re)start at ``start``, workers taking groups of ``group`` steps in turn."""
    return WorkerSteps(start, worker, num_workers, stop, group)


@dataclass(frozen=True)
class MixtureBatch:
    """A rank's slots of one global batch: the ``source`` of each slot, the ``chunk`` and
    ``sample`` (sequence within chunk) the source serves there (its layout's ids), and the
    source's ``draw`` number (``epoch = draw // N_s``)."""

    step: int
    source: Int64s
    chunk: Int64s
    sample: Int64s
    draw: Int64s


@dataclass(frozen=True)
class _Segment:
    """Steps from ``start`` on, until the next segment: ``counts`` per batch, each source
    having made ``consumed[s]`` draws before ``start``."""

    start: int
    consumed: tuple[int, ...]
    counts: tuple[int, ...]
    weights: tuple[float, ...]


class MixturePlan:
    """Sources mixed by weight with exact per-batch counts (see the module docstring).

    ``sources[s]``: source s's sequences per chunk (its layout's ``counts``), or one integer
    (its sequence count, as one chunk). ``weights``: one number >= 0 per source.
    ``global_batch`` B: sequences per global step over all ranks; ``dp_size`` must divide it.
    ``window``: chunks per shuffle window of each source's epoch order. ``identity``: more
    that the state's fingerprint should pin (e.g. the sources' manifest checksums)."""

    def __init__(self, sources: Sequence[int | ArrayLike], weights: Sequence[float], global_batch: int, *,
                 seed: int = 0, dp_size: int = 1, window: int = 1 << 62, identity: str = "") -> None:
        if isinstance(sources, str | bytes) or not isinstance(sources, Sequence) or not sources:
            raise OptionError("sources must be a non-empty list (one entry per source)")
        self.sources = [check_counts(np.array([s]) if isinstance(s, int | np.integer) and not isinstance(s, bool)
                                     else s) for s in sources]
        self.sizes = tuple(int(c.sum()) for c in self.sources)
        self.global_batch = _pos_int("global_batch", global_batch)
        self.dp_size = _pos_int("dp_size", dp_size)
        if self.global_batch % self.dp_size:
            raise OptionError(f"global_batch={self.global_batch} is not a multiple of dp_size={self.dp_size}: "
                              "every rank takes the same share of a global batch")
        self.seed = _pos_int("seed", seed, 0)
        self.window = _pos_int("window", window)
        lens = np.array([c.size for c in self.sources], dtype=np.int64)
        self.fingerprint = layout_fingerprint(
            np.concatenate([lens, *self.sources]), f"mixture|seed={self.seed}|window={self.window}|{identity}")
        self.start_step = 0
        ws = _weights(weights, len(self.sources))
        self._segments = [_Segment(0, (0,) * len(self.sources), self._counts(ws), ws)]
        self._orders: OrderedDict[tuple[int, int], EpochOrder] = OrderedDict()

    @property
    def per_rank(self) -> int:
        """Sequences of a global batch each data-parallel rank takes."""
        return self.global_batch // self.dp_size

    def _counts(self, weights: tuple[float, ...]) -> tuple[int, ...]:
        counts = mixture_counts(weights, self.global_batch)
        for s, c in enumerate(counts):
            if c and not self.sizes[s]:
                raise OptionError(f"source {s} holds no sequence but has weight {weights[s]!r}")
        return counts

    def _segment(self, step: int) -> _Segment:
        for seg in reversed(self._segments):
            if seg.start <= step:
                return seg
        raise PlanError(f"step {step} lies before this plan's start {self.start_step}")

    def counts(self, step: int) -> tuple[int, ...]:
        """Sequences of each source in global batch ``step``."""
        return self._segment(_pos_int("step", step, 0)).counts

    def consumed(self, step: int) -> Int64s:
        """Draws each source made in the global batches before ``step``."""
        step = _pos_int("step", step, 0)
        seg = self._segment(step)
        out: Int64s = np.array(seg.consumed, dtype=np.int64) + (step - seg.start) * np.array(seg.counts, np.int64)
        return out

    def set_weights(self, weights: Sequence[float], *, from_step: int) -> None:
        """From global step ``from_step`` on, batches hold the counts of ``weights``; every
        source goes on from its own draw counter. ``from_step`` may not lie before this
        plan's start (a resumed plan cannot rewrite what was served) or before a change
        already set."""
        step = _pos_int("from_step", from_step, 0)
        last = self._segments[-1]
        if step < max(self.start_step, last.start):
            raise OptionError(f"from_step={step} lies before step {max(self.start_step, last.start)}, "
                              "from which the plan's batches are already fixed")
        ws = _weights(weights, len(self.sources))
        seg = _Segment(step, tuple(int(x) for x in self.consumed(step)), self._counts(ws), ws)
        if step == last.start:
            self._segments[-1] = seg
        else:
            self._segments.append(seg)

    def _order(self, source: int, epoch: int) -> EpochOrder:
        key = (source, epoch)
        order = self._orders.get(key)
        if order is None:
            order = epoch_order(self.sources[source], derive_key(self.seed, source), epoch, self.window)
            self._orders[key] = order
            if len(self._orders) > _ORDERS_KEPT:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return order

    def batch(self, step: int, dp_rank: int | None = None) -> MixtureBatch:
        """The slots of global batch ``step`` that ``dp_rank`` takes (all B slots when None)."""
        step = _pos_int("step", step, 0)
        B = self.global_batch
        if dp_rank is None:
            slots = np.arange(B, dtype=np.int64)
        else:
            if isinstance(dp_rank, bool) or not isinstance(dp_rank, int | np.integer) \
                    or not 0 <= int(dp_rank) < self.dp_size:
                raise OptionError(f"dp_rank={dp_rank!r} is not inside dp_size={self.dp_size}")
            slots = np.arange(int(dp_rank) * self.per_rank, (int(dp_rank) + 1) * self.per_rank, dtype=np.int64)
        seg = self._segment(step)
        cum = np.concatenate(([0], np.cumsum(seg.counts))).astype(np.int64)
        u = feistel_permute(slots, B, derive_key(self.seed, _SLOTS, step))
        src = np.searchsorted(cum, u, side="right") - 1
        draw = self.consumed(step)[src] + (u - cum[src])
        sizes = np.array(self.sizes, dtype=np.int64)[src]
        epoch, pos = draw // sizes, draw % sizes
        chunk = np.empty_like(draw)
        sample = np.empty_like(draw)
        groups = np.unique(np.stack([src, epoch]), axis=1) if src.size else np.empty((2, 0), np.int64)
        for s, e in groups.T.tolist():
            sel = (src == s) & (epoch == e)
            chunk[sel], sample[sel] = self._order(s, e).locate(pos[sel])
        return MixtureBatch(step, src, chunk, sample, draw)

    # --- resume -------------------------------------------------------------------------

    def state_dict(self, step: int) -> dict[str, Any]:
        """The state after global batches ``[0, step)`` were consumed: JSON-able, a few
        integers per source (plus the weight changes set for later steps)."""
        step = _pos_int("step", step, 0)
        seg = self._segment(step)
        return {
            "version": MIXTURE_STATE_VERSION,
            "kind": "mixture",
            "fingerprint": self.fingerprint,
            "global_batch": self.global_batch,
            "step": step,
            "consumed": [int(x) for x in self.consumed(step)],
            "counts": list(seg.counts),
            "weights": list(seg.weights),
            "pending": [[s.start, list(s.weights)] for s in self._segments if s.start > step],
        }

    @classmethod
    def from_state(cls, sources: Sequence[int | ArrayLike], state: dict[str, Any], *, global_batch: int,
                   seed: int = 0, dp_size: int = 1, window: int = 1 << 62, identity: str = "",
                   weights: Sequence[float] | None = None) -> MixturePlan:
        """The plan ``state`` was saved under, continuing at its step, for any ``dp_size``.
        ``weights``: a new mixture from the resume step on (as :meth:`set_weights`; changes
        the state had scheduled for later are dropped). Another ``global_batch`` rounds the
        state's weights afresh from its step on. The sources, seed, window and identity must
        match (:class:`StateMismatchError`)."""
        sizes = [int(check_counts(np.array([x]) if isinstance(x, int | np.integer) else x).sum()) for x in sources]
        # any valid weights: the state's own replace them below
        first = [1.0 if i == next((j for j, n in enumerate(sizes) if n), 0) else 0.0 for i in range(len(sizes))]
        plan = cls(sources, first, global_batch, seed=seed, dp_size=dp_size, window=window, identity=identity)
        step, consumed, counts, ws, pending, batch = _read_state(state, plan.fingerprint, len(plan.sources))
        try:
            if batch == plan.global_batch:
                if sum(counts) != batch:
                    raise StateMismatchError(f"mixture state counts {counts} do not add up to its batch {batch}")
                seg = _Segment(step, tuple(consumed), tuple(counts), tuple(ws))
            else:
                seg = _Segment(step, tuple(consumed), plan._counts(_weights(ws, len(ws))), tuple(ws))
            plan._segments = [seg]
            plan.start_step = step
            for at, later in pending:
                plan.set_weights(later, from_step=at)
        except OptionError as e:
            raise StateMismatchError(f"mixture state does not fit these sources: {e}") from None
        if weights is not None:
            plan._segments = plan._segments[:1]
            plan.set_weights(weights, from_step=step)
        return plan


def _read_state(state: object, fingerprint: str, n: int
                ) -> tuple[int, list[int], list[int], list[float], list[tuple[int, list[float]]], int]:
    """(step, consumed, counts, weights, pending changes, global batch) of a mixture state, or
    :class:`StateMismatchError` naming what is wrong."""
    if not isinstance(state, dict) or state.get("kind") != "mixture":
        raise StateMismatchError("not a mixture state (no 'kind': 'mixture')")
    if state.get("version") != MIXTURE_STATE_VERSION:
        raise StateMismatchError(f"mixture state version {state.get('version')!r} is not {MIXTURE_STATE_VERSION}")
    if state.get("fingerprint") != fingerprint:
        raise StateMismatchError(
            "mixture state belongs to other sources, seed or window: its fingerprint is "
            f"{state.get('fingerprint')!r}, this plan's is {fingerprint!r}"
        )

    def ints(v: object) -> bool:
        return isinstance(v, list) and len(v) == n and all(type(x) is int and x >= 0 for x in v)

    def floats(v: object) -> bool:
        return isinstance(v, list) and len(v) == n and all(type(x) in (int, float) and math.isfinite(x) and x >= 0
                                                           for x in v)

    step, consumed, counts, ws = state.get("step"), state.get("consumed"), state.get("counts"), state.get("weights")
    batch, pending = state.get("global_batch"), state.get("pending")
    if not (type(step) is int and step >= 0 and type(batch) is int and batch >= 1 and ints(consumed)
            and ints(counts) and floats(ws) and isinstance(pending, list)):
        raise StateMismatchError(f"mixture state is malformed: {state!r:.300}")
    changes = []
    for p in pending:
        if not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] > step and floats(p[1])):
            raise StateMismatchError(f"mixture state has a malformed pending change {p!r:.200}")
        changes.append((p[0], [float(w) for w in p[1]]))
    return (step, cast(list[int], consumed), cast(list[int], counts), [float(w) for w in cast(list[float], ws)],
            changes, batch)
