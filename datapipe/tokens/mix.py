"""TokenMix: token datasets mixed by weight, every global batch holding each source's share
exactly; weights that change mid-run; resume on another data-parallel size.

    mix = TokenMix({"data/web": 0.7, "data/code": 0.3}, seq_len=2048, global_batch=512, seed=0)
    loader = StreamingDataLoader(mix, batch_size=mix.per_rank_batch(), num_workers=2)
    for step, batch in enumerate(loader, start=mix.step):
        batch["input_ids"], batch["source"]        # this rank's share of global batch `step`
        state = loader.state_dict()                # a few integers per source
    mix.set_weights({"data/web": 0.5, "data/code": 0.5}, from_step=10_000)

The plan is :class:`datapipe.plan.MixturePlan` (docs/TOKEN_FORMAT.md, "Mixtures"): global
batch k's slots given to the sources by (seed, k), data-parallel rank r taking slots
``[r*B/dp, (r+1)*B/dp)``, DataLoader worker w of W building global steps ``start + w,
start + w + W, ...`` (torch's round-robin order), so each worker produces whole per-rank
batches and the loader's output is the rank's batches in step order. Under a
:class:`~datapipe.StreamingDataLoader` (``grouped``) a worker builds groups of consecutive
steps in turn instead (:class:`WorkerSteps`) and sends each group as one message. The fetch stage is
the loader's :class:`~datapipe.loader.Prefetcher` over every source's logical chunks
(:class:`~.read.ChunkFetch`), the read stage :mod:`.read`'s batch cutters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import LoaderOptionError, OptionError, PlanError, StateMismatchError, WorkerStateError
from ..loader import Batch, BatchGroup, Chunk, PassFetch, PassKey, Prefetcher
from ..options import (
    MAX_COUNT,
    check_bytes,
    check_choice,
    check_float,
    check_int,
    check_path,
    show,
)
from ..plan import CHUNK_TOKENS, MixturePlan, WorkerSteps, worker_steps
from .dataset import (
    ALL_CHUNKS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_THREADS,
    GroupCut,
    cut_batch,
    fetched_units,
    group_batches,
    torch_dtype,
)
from .read import MAX_PREFETCH_BYTES, ChunkFetch, Layout, TokenSource, layout_identity, make_layout
from .stream import TokenStream, check_reading, check_topology

__all__ = ["TokenMix"]

#: the stop of an endless mix (``steps=None``): no run gets there
ENDLESS = 1 << 62


def _weights_of(name: str, weights: Any, names: Sequence[str] | None) -> tuple[list[str], list[float]]:
    """(source names, weights) of ``{source: weight}``; with ``names``, the weights of those
    sources in that order (a mapping must name exactly them), or a sequence of one weight each."""
    E = LoaderOptionError
    if isinstance(weights, Mapping):
        keys = [check_path(f"{name} key", k, error=E) for k in weights]
        values = list(weights.values())
        if names is not None:
            if sorted(keys) != sorted(names):
                missing, extra = sorted(set(names) - set(keys)), sorted(set(keys) - set(names))
                raise E(f"{name}={show(weights)}: expected a weight for each source of the mix, {list(names)}"
                        + (f"; missing {missing}" if missing else "") + (f"; not in the mix {extra}" if extra else ""))
            by = dict(zip(keys, values))
            keys, values = list(names), [by[k] for k in names]
    elif names is not None and isinstance(weights, Sequence) and not isinstance(weights, str | bytes):
        keys, values = list(names), list(weights)
        if len(values) != len(keys):
            raise E(f"{name}={show(weights)}: {len(values)} weights for the {len(keys)} sources {keys}")
    else:
        raise E(f"{name}={show(weights)}: expected {{source: weight}}" + (" or one weight per source"
                                                                         if names is not None else ""))
    if not keys:
        raise E(f"{name}={{}}: a mix needs at least one source")
    if len(set(keys)) != len(keys):
        raise E(f"{name}={show(weights)}: a source is named twice")
    out = [check_float(f"{name}[{k!r}]", w, min=0, error=E, hint="a weight >= 0") for k, w in zip(keys, values)]
    return keys, out


class TokenMix(TokenStream):
    """Sources (token dataset folders or URLs) mixed by weight: ``{source: weight}``.

    Every global batch of ``global_batch`` sequences holds exactly ``counts[s]`` of source s
    (largest-remainder rounding of ``w_s / sum(w) * global_batch``; a positive weight that
    rounds to 0 is refused, weight 0 leaves a source out); a source serves its sequences in
    its own epochs' windowed shuffle (``window`` logical chunks), repeating by whole epochs
    when it runs out. Each data-parallel rank yields its share of every global batch,
    ``global_batch / dp_size`` sequences, as one :class:`~datapipe.loader.Batch`:
    ``input_ids`` (and for ``packing="documents"`` ``labels``, ``position_ids``, ``padding``,
    ``cu_seqlens``: see :class:`~datapipe.TokenDataset`) and ``source`` (each row's source, its
    index in the mix's order). A pass yields global steps ``[step, steps)`` (``steps=None``:
    endless) from :attr:`step`, the step of the state last loaded (0 for a fresh mix).

    ``set_weights(new, from_step=S)``: from global step S the new counts apply, each source
    going on from its own draw counter (nothing it served before S is served again in its
    epoch). ``state_dict()``/``load_state_dict()``: JSON, a few integers per source however
    many changes came before, loadable on any data-parallel size. Topology, reads and the
    rest of the arguments as :class:`~datapipe.TokenDataset`'s; ``chunk_steps``: global steps
    planned (and fetched) together at most.
    """

    def __init__(self, sources: Mapping[str | os.PathLike[str], float], seq_len: int, *, global_batch: int,
                 packing: str = "concat", seed: int = 0, window: int | None = 8, steps: int | None = None,
                 rank: int | None = None, world_size: int | None = None, replication: int = 1, pipeline: int = 1,
                 dp_rank: int | None = None, dp_size: int | None = None, cache: Any = None,
                 storage_options: dict[str, Any] | None = None, prefetch_bytes: int | None = None,
                 concurrency: int = 4, chunk_tokens: int = CHUNK_TOKENS, chunk_steps: int = 64,
                 pad_id: int | None = None, dtype: str = "int64") -> None:
        E = LoaderOptionError
        names, weights = _weights_of("sources", sources, None)
        seq_len = check_int("seq_len", seq_len, min=1, max=MAX_SEQ_LEN, error=E, hint="tokens per sequence")
        global_batch = check_int("global_batch", global_batch, min=1, max=MAX_COUNT, error=E,
                                 hint="sequences of one step over all data-parallel ranks")
        packing = check_choice("packing", packing, ("concat", "documents"), error=E)
        seed = check_int("seed", seed, min=0, max=MAX_SEED, error=E)
        if window is not None:
            window = check_int("window", window, min=1, max=ALL_CHUNKS, error=E,
                               hint="the logical chunks of a source a sequence may be shuffled across, or None")
        if steps is not None:
            steps = check_int("steps", steps, min=0, max=ENDLESS, error=E, hint="global steps of a pass, or None")
        rank, world_size = check_topology(rank, world_size, replication, pipeline, dp_rank, dp_size)
        if prefetch_bytes is not None:
            prefetch_bytes = check_bytes("prefetch_bytes", prefetch_bytes, min=1, error=E)
        concurrency = check_int("concurrency", concurrency, min=1, max=MAX_THREADS, error=E)
        chunk_tokens = check_int("chunk_tokens", chunk_tokens, min=1, max=1 << 34, error=E)
        chunk_steps = check_int("chunk_steps", chunk_steps, min=1, max=MAX_COUNT, error=E)
        if pad_id is not None:
            pad_id = check_int("pad_id", pad_id, min=0, max=(1 << 31) - 1, error=E)
        dtype = check_choice("dtype", dtype, ("int64", "int32"), error=E)
        storage_options = check_reading(storage_options, cache)
        self._init_stream(rank, world_size, replication, pipeline, dp_rank, dp_size)
        #: the sources' names (as given), in the mix's order: ``source`` values index it
        self.names = names
        self.sources = [TokenSource(u, storage_options, max_pooled_bytes=prefetch_bytes or MAX_PREFETCH_BYTES)
                        for u in names]
        self.layouts: list[Layout] = [make_layout(s, seq_len, packing, chunk_tokens) for s in self.sources]
        self.seq_len, self.packing, self.global_batch, self.seed = seq_len, packing, global_batch, seed
        self.window = ALL_CHUNKS if window is None else window
        self.steps = steps
        self.cache = cache
        self.concurrency, self.chunk_steps = concurrency, chunk_steps
        self.dtype = dtype
        eos = self.sources[0].eos_id
        self.pad_id = pad_id if pad_id is not None else (eos or 0)
        self.identity = json.dumps([layout_identity(s, lay) for s, lay in zip(self.sources, self.layouts)])
        try:
            self._plan = MixturePlan(self._counts(), weights, global_batch, seed=seed, window=self.window,
                                     identity=self.identity)
        except (OptionError, PlanError) as e:  # a weight that rounds to 0, a source of no sequence, ...
            raise E(f"sources={show(sources)}: {e}") from None
        self._fetch = ChunkFetch(self.sources, self.layouts, cache)
        #: the fetch budget: as given, else two windows and a chunk of every source
        self.prefetch_bytes = prefetch_bytes or self._fetch.read_ahead_bytes(self.window)
        for s in self.sources:
            s.pool.max_bytes = self.prefetch_bytes
        #: the global step the next pass starts at
        self._start = 0
        self._set_state(self._plan.state_dict(0))

    def _counts(self) -> list[NDArray[Any]]:
        return [lay.counts for lay in self.layouts]

    @property
    def step(self) -> int:
        """The global step the next pass starts at (the loaded state's)."""
        return self._start

    def counts(self, step: int | None = None) -> tuple[int, ...]:
        """Sequences of each source in global batch ``step`` (default: :attr:`step`)."""
        return self._plan.counts(self._start if step is None else check_int("step", step, min=self._plan.start_step,
                                                                            error=LoaderOptionError))

    def per_rank_batch(self) -> int:
        """Sequences this data-parallel rank takes of each global batch: the batch size to
        give a :class:`~datapipe.StreamingDataLoader`."""
        dp_size = self.data_parallel()[1]
        if self.global_batch % dp_size:
            raise LoaderOptionError(f"global_batch={self.global_batch} is not a multiple of the data-parallel size "
                                    f"{dp_size}: every rank takes the same share of a global batch")
        return self.global_batch // dp_size

    @property
    def batch_size(self) -> int:
        return self.per_rank_batch()

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        # a StreamingDataLoader sets its batch size: it must be this rank's share
        if value != self.per_rank_batch():
            raise LoaderOptionError(f"batch_size={show(value)}: a TokenMix yields this rank's share of each global "
                                    f"batch, global_batch={self.global_batch} / the data-parallel size = "
                                    f"{self.per_rank_batch()} sequences; give the loader "
                                    "batch_size=mix.per_rank_batch()")

    # -- weights and state -------------------------------------------------------------------
    def set_weights(self, weights: Mapping[str | os.PathLike[str], float] | Sequence[float], *, from_step: int) -> None:
        """From global step ``from_step`` on, batches hold the counts of ``weights`` (``{source:
        weight}`` naming every source, or one weight per source in the mix's order). Takes
        effect in the passes that start after it (a StreamingDataLoader's persistent workers
        take it with their next pass); refused during a pass in this process, and for a step
        before :attr:`step` (those batches are fixed)."""
        E = LoaderOptionError
        _names, ws = _weights_of("weights", weights, self.names)
        from_step = check_int("from_step", from_step, min=0, error=E)
        if self._live is not None:
            raise PlanError("TokenMix.set_weights() during a pass of this object: its batches are planned ahead; "
                            "set the weights between passes (or before the first)")
        if self._worker_passes.count != self._passes_seen:
            raise WorkerStateError(
                "TokenMix.set_weights(): DataLoader workers ran a pass of copies of this mix, and this object cannot "
                "see how far they got (they may have served past from_step with the old weights). Load the loader's "
                "state first, mix.load_state_dict(loader.state_dict()), then set the weights from mix.step on")
        if from_step < self._start:
            raise E(f"from_step={from_step} lies before step {self._start}, from which this mix's batches are fixed "
                    "(its resume point)")
        state = self._plan.state_dict(self._start)
        # changes set earlier stay where they come before this one; later ones give way to it
        state["pending"] = [p for p in state["pending"] if p[0] < from_step]
        plan = MixturePlan.from_state(self._counts(), state, global_batch=self.global_batch, seed=self.seed,
                                      window=self.window, identity=self.identity)
        try:
            plan.set_weights(ws, from_step=from_step)
        except OptionError as e:
            raise E(f"weights={show(weights)}: {e}") from None
        self._plan = plan
        self._set_state(plan.state_dict(self._start))

    def _set_state(self, state: dict[str, Any]) -> None:
        """The mixture state the next pass starts from (a StreamingDataLoader hands the
        loader's ``_resume`` to persistent workers: it is always this state)."""
        self._mix_state = state
        self._resume = state

    def _state_at(self, seen: int | None) -> dict[str, Any]:
        per = self.per_rank_batch()
        taken = self._progress.steps if seen is None else seen
        if taken % per:
            raise LoaderOptionError(f"samples_seen={show(taken)} is not a whole number of this rank's batches of "
                                    f"{per} sequences")
        step = self._start + taken // per
        if self.steps is not None and step > max(self.steps, self._start):
            raise LoaderOptionError(f"samples_seen={show(taken)} runs past the pass's last step {self.steps}")
        return self._plan.state_dict(step)

    def _pass_state(self) -> dict[str, Any]:
        return dict(self._mix_state)

    def _batch_steps(self) -> int:
        return self.per_rank_batch() * self._group()

    def _group(self) -> int:
        """Global steps a DataLoader worker builds and sends together (see
        :meth:`datapipe.TokenDataset._group`)."""
        if not self.grouped:
            return 1
        return group_batches(self.per_rank_batch(), self.seq_len, self.packing, self.dtype)

    def _worker_steps(self, worker: int, num_workers: int) -> WorkerSteps:
        return worker_steps(self._start, worker, num_workers, self._stop(), self._group())

    def _stop(self) -> int:
        return ENDLESS if self.steps is None else max(self.steps, self._start)

    def _share(self, worker: int, num_workers: int) -> int:
        return len(self._worker_steps(worker, num_workers)) * self.per_rank_batch()

    def _load(self, state: dict[str, Any]) -> None:
        plan = MixturePlan.from_state(self._counts(), state, global_batch=self.global_batch, seed=self.seed,
                                      window=self.window, identity=self.identity)
        self._plan, self._start = plan, plan.start_step
        self._set_state(plan.state_dict(plan.start_step))

    def _told(self, epoch: int, resume: dict[str, Any] | None) -> None:
        if resume is None:
            raise StateMismatchError("a TokenMix's pass needs its mixture state; the loader sent none")
        self._load(resume)

    def end_resumed_pass(self) -> None:
        """The next pass starts again at :attr:`step` (load a state to move it on)."""
        self._worker_skip = 0

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self._live is None:
            self._progress.steps = self._worker_skip
        return self._pass()

    def _batches(self, dp_rank: int, dp_size: int, worker: int, num_workers: int,
                 in_worker: bool) -> Iterator[Batch | BatchGroup]:
        per = self.per_rank_batch()
        plan = MixturePlan.from_state(self._counts(), self._mix_state, global_batch=self.global_batch,
                                      seed=self.seed, dp_size=dp_size, window=self.window, identity=self.identity)
        progress = self._progress
        steps = self._worker_steps(worker, num_workers)[self._worker_skip // per:]
        group = steps.group if in_worker else 1  # (a group's fields are lazy: a worker's ring writes them)
        key = PassKey(0, dp_rank, dp_size, worker, num_workers, per, self.chunk_steps)
        fetch = self._fetch
        chunks = _mix_chunks(plan, dp_rank, steps, fetch.base, self.chunk_steps)
        pre = Prefetcher(chunks, fetch.fetch, fetch.unit_bytes, max_bytes=self.prefetch_bytes,
                         concurrency=self.concurrency)
        fetching = PassFetch(pre, key)
        dtype = torch_dtype(self.dtype)
        layout = self.layouts[0]
        import torch

        pending = GroupCut(layout, dtype, self.pad_id, group)  # the group being cut (one may span chunks)
        try:
            for chunk in fetching.chunks():
                units = fetched_units(chunk)
                source = np.searchsorted(fetch.base, chunk.shard, side="right") - 1
                for a in range(0, chunk.steps.size, per):
                    of_source = torch.from_numpy(source[a:a + per].astype(np.int64))
                    if group > 1:
                        pending.add(chunk.shard[a:a + per], chunk.sample[a:a + per], units, source=of_source)
                        if pending.full:
                            done, rows = pending.take()
                            progress.steps += rows
                            yield done
                        continue
                    fields = cut_batch(layout, chunk.shard[a:a + per], chunk.sample[a:a + per], units, dtype,
                                       self.pad_id, in_worker)
                    fields["source"] = of_source
                    progress.steps += per
                    yield Batch(fields, per)
            if pending.rows:  # the worker's last group of the pass
                done, rows = pending.take()
                progress.steps += rows
                yield done
        finally:
            fetching.end(self)


def _mix_chunks(plan: MixturePlan, dp_rank: int, steps: WorkerSteps, base: NDArray[np.int64],
                chunk_steps: int) -> Iterator[Chunk]:
    """The plan stage of a mix's pass: the worker's global ``steps`` in chunks (one step,
    then four times as many each time, up to ``chunk_steps``), each naming the unit (a
    source's logical chunk: ``base[source] + chunk``) and sequence of every slot this rank
    takes, in slot order. Runs on the prefetcher's thread."""
    i, size, number = 0, 1, 0
    while i < len(steps):
        group: list[int] = steps[i:i + min(size, chunk_steps)]
        batches = [plan.batch(s, dp_rank) for s in group]
        units = np.concatenate([base[b.source] + b.chunk for b in batches])
        samples = np.concatenate([b.sample for b in batches])
        at = np.repeat(np.asarray(group, dtype=np.int64), plan.per_rank)
        yield Chunk.make(number, at, units, samples)
        number += 1
        i += len(group)
        size *= 4
