"""TokenDataset: fixed-length or document-packed sequences of a token dataset, for
language-model pretraining.

    ds = TokenDataset("s3://bucket/tokens", seq_len=2048, seed=0)          # Megatron GPTDataset's sequences
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2)
    for epoch in range(start, n):
        ds.set_epoch(epoch)
        for batch in loader:
            x, y = batch["input_ids"][:, :-1], batch["input_ids"][:, 1:]
        state = loader.state_dict()          # a few integers; ds.load_state_dict(state)

A pass is the loader's stages over logical chunks of sequences (docs/TOKEN_FORMAT.md,
"Sequences"): the plan (:class:`~datapipe.loader.EpochPlanner` over the layout's sequences
per chunk: the epoch's windowed shuffle at sequence level, the exact partition over
data-parallel ranks, elastic regrouping, the worker split, a resume state of a few
integers) -> the fetch (:class:`~datapipe.loader.Prefetcher` with
:class:`~.read.ChunkFetch`: each chunk's covering blocks read and verified, within the
prefetch budget, ahead of the reader) -> read and batch (:func:`~.read.cut_concat`,
:func:`~.read.cut_documents`: each batch's rows cut with numpy into its tensors).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import LoaderOptionError, PlanError, StateMismatchError
from ..loader import (
    Batch,
    BatchGroup,
    Chunk,
    EpochPlanner,
    LazyTensor,
    PassCount,
    PassFetch,
    PassKey,
    Prefetcher,
    ReadAhead,
    pass_chunks,
    reads_ahead,
    set_resumable_epoch,
    share_size,
    take_read_ahead,
)
from ..options import MAX_COUNT, check_bool, check_bytes, check_choice, check_int, check_path, show
from ..plan import CHUNK_TOKENS, ConcatLayout, EpochPlan, layout_fingerprint
from .read import (
    MAX_PREFETCH_BYTES,
    ChunkFetch,
    DocumentRows,
    Layout,
    TokenChunk,
    TokenSource,
    cut_concat,
    layout_identity,
    make_layout,
)
from .stream import MAX_EPOCH, TokenStream, check_reading, check_topology

__all__ = ["TokenDataset", "MAX_SEQ_LEN", "GroupCut", "cut_batch", "fetched_units", "group_batches", "message_batches",
           "torch_dtype"]

#: ``window=None``: every chunk (a full global shuffle)
ALL_CHUNKS = 1 << 62
MAX_SEED = (1 << 64) - 1
#: the longest sequence (a sequence length is an int32 in ``.idx``; flash-attn's cu_seqlens too)
MAX_SEQ_LEN = 1 << 24
MAX_THREADS = 256
_DTYPES = ("int64", "int32")
#: a DataLoader worker's message (``grouped``): batches of up to this many bytes together, at
#: most GROUP_BATCHES of them (a batch of more goes alone). torch's worker queue costs about
#: 0.3 ms of the main process's CPU a message, against a few microseconds a batch: 1 MiB
#: groups of 8 x 2,049 int64 tokens held the loader at 129-165 M tokens/s through two
#: workers, 4 MiB groups gave 178-202 M; batches of 8 x 8,193 sent alone 131-137 M, in
#: groups 211-259 M (measured here, 2026-12-02; a group's batches are cut in one pass, see
#: GroupCut)
GROUP_BYTES = 4 << 20
GROUP_BATCHES = 64


def message_batches(batch_bytes: int) -> int:
    """Batches of ``batch_bytes`` a DataLoader worker sends in one message (``grouped``)."""
    return max(1, min(GROUP_BATCHES, GROUP_BYTES // max(batch_bytes, 1)))


def group_batches(batch: int, seq_len: int, packing: str, dtype: str, extra: int = 1) -> int:
    """Batches of ``batch`` sequences a DataLoader worker sends in one message: a concat
    batch is one tensor of ``seq_len + extra`` columns, a documents batch three of
    ``seq_len`` (``input_ids``, ``position_ids``, the labels)."""
    width = seq_len + extra if packing == "concat" else 3 * seq_len
    return message_batches(batch * width * int(torch_dtype(dtype).itemsize))


def _counts_of(counts: NDArray[Any], _epoch: int) -> tuple[NDArray[Any], None]:
    """The plan stage's layout function: the same chunks every epoch (module level: it pickles)."""
    return counts, None


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of ``dtype`` ("int64" or "int32")."""
    import torch

    return torch.int64 if dtype == "int64" else torch.int32


def cut_batch(layout: Layout, units: NDArray[Any], samples: NDArray[Any], chunks: dict[int, TokenChunk],
              dtype: Any, pad_id: int, lazy: bool = False) -> dict[str, Any]:
    """One batch's fields: the sequences (``units[i]``, ``samples[i]``) of fetched ``chunks``.
    ``lazy``: the big fields as :class:`~datapipe.loader.batch.LazyTensor` s, which a
    loader's ring writes straight into shared memory (in a DataLoader worker); else tensors."""
    import torch

    n, L = int(units.size), layout.seq_len
    fields: dict[str, Any]
    if isinstance(layout, ConcatLayout):
        tokens = {u: chunks[u].tokens for u in set(units.tolist())}  # held: their buffers stay unfilled
        fields = {"input_ids": LazyTensor((n, L + layout.extra), dtype,
                                          partial(cut_concat, units, samples, tokens, L))}
    else:
        rows = DocumentRows(units, samples, chunks, L, pad_id)
        fields = {"input_ids": LazyTensor((n, L), dtype, rows.fill_input_ids),
                  "labels": LazyTensor((n, L), dtype, rows.fill_labels),
                  "position_ids": LazyTensor((n, L), dtype, rows.fill_position_ids),
                  "padding": torch.from_numpy(rows.padding), "cu_seqlens": torch.from_numpy(rows.cu_seqlens)}
    if not lazy:
        fields = {k: v.tensor() if isinstance(v, LazyTensor) else v for k, v in fields.items()}
    return fields


class GroupCut:
    """A DataLoader worker's groups of ``of`` batches, each cut as its batches' rows come
    (:meth:`add`, while their chunks are fetched: a chunk's buffer goes back to the pool
    once the pass moves on, and what is cut holds the arrays it reads) and handed out whole
    by :meth:`take`. A concat group's ``input_ids`` are rows of one tensor cut in one pass
    (:class:`~datapipe.loader.batch.LazyRows`, written once into the ring's slot: cutting
    batch by batch cost more in Python than the rows took to copy); document batches,
    whose ``cu_seqlens`` and ``padding`` are each batch's own, are cut one by one. Fields
    are lazy: only a worker's ring writes them."""

    def __init__(self, layout: Layout, dtype: Any, pad_id: int, of: int) -> None:
        self.layout, self.dtype, self.pad_id, self.of = layout, dtype, pad_id, of
        self._start()

    def _start(self) -> None:
        self.units: list[NDArray[Any]] = []
        self.samples: list[NDArray[Any]] = []
        self.rows = 0
        self.tokens: dict[int, NDArray[Any]] = {}  # concat: the tokens of each unit its rows read, held
        self.fields: list[dict[str, Any]] = []  # each batch's (a concat group's but its input_ids)

    @property
    def full(self) -> bool:
        return len(self.units) == self.of

    def add(self, units: NDArray[Any], samples: NDArray[Any], chunks: dict[int, TokenChunk],
            **more: Any) -> None:
        """A batch's rows (the sequences (``units[i]``, ``samples[i]``) of ``chunks``), and
        ``more`` fields of its own."""
        self.units.append(units)
        self.samples.append(samples)
        self.rows += int(units.size)
        if not isinstance(self.layout, ConcatLayout):
            self.fields.append({**cut_batch(self.layout, units, samples, chunks, self.dtype, self.pad_id, lazy=True),
                                **more})
            return
        self.fields.append(more)
        tokens = self.tokens
        for u in units.tolist():
            if u not in tokens:
                tokens[u] = chunks[u].tokens

    def take(self) -> tuple[BatchGroup, int]:
        """(the group cut so far, its rows), and a new group begun."""
        layout, fields = self.layout, self.fields
        if isinstance(layout, ConcatLayout):
            units, samples = np.concatenate(self.units), np.concatenate(self.samples)
            whole = LazyTensor((units.size, layout.seq_len + layout.extra), self.dtype,
                               partial(cut_concat, units, samples, self.tokens, layout.seq_len))
            fields, a = [], 0
            for u, more in zip(self.units, self.fields):
                fields.append({"input_ids": whole.rows(a, a + u.size), **more})
                a += u.size
        group = BatchGroup([Batch(f, int(u.size)) for f, u in zip(fields, self.units)], self.of)
        rows = self.rows
        self._start()
        return group, rows


def fetched_units(chunk: Chunk) -> dict[int, TokenChunk]:
    """The pass chunk's fetched units by number; a fetch that failed raises its error here,
    where the first sequence of that unit would be read."""
    out: dict[int, TokenChunk] = {}
    for unit, got in zip(chunk.shards, chunk.fetched):
        if isinstance(got, BaseException):
            raise got
        out[int(unit)] = got
    return out


class TokenDataset(TokenStream):
    """Sequences of ``seq_len`` tokens of the token dataset at ``source`` (a folder or URL
    written by :func:`~datapipe.pack_tokens` or :func:`~datapipe.index_tokens`), in a
    deterministic, resumable, shuffled order; an ``IterableDataset`` for
    :class:`~datapipe.StreamingDataLoader` (batches cross worker processes through its
    shared-memory ring as one tensor per field, a worker's consecutive batches together, up
    to 4 MiB or 64 of them, in one slot and one message; a batch the trainer keeps keeps that slot taken, and once
    a worker has no free slot its next batches come pickled: correct, slower) or a plain
    ``DataLoader``.

    ``packing="concat"`` (Megatron GPTDataset): the documents' tokens as one stream (each
    ends with EOS), sequence i its tokens ``[i*L, (i+1)*L + 1)``: an item is
    ``{"input_ids": int64 tensor of L + 1}``, inputs ``[:-1]`` and labels ``[1:]``
    overlapping by one token (``extra_token=False``: L tokens, none shared).
    ``packing="documents"``: whole documents packed into sequences of at most L tokens
    without crossing a document boundary (longer ones split), an item ``{"input_ids",
    "labels", "position_ids": L each, "padding": int}``: labels are the next token,
    :data:`~datapipe.tokens.IGNORE_INDEX` (-100) after a document's last token and at the
    ``padding`` positions at the end (where ``input_ids`` holds ``pad_id``: the dataset's
    EOS id unless given); position ids restart at 0 at every piece. Batches add
    ``cu_seqlens`` (int32, flash-attn's varlen convention over the batch laid end to end:
    one segment per piece and one per row's padding, ending at rows x L).

    Order: sequences shuffled across windows of ``window`` logical chunks (about
    ``chunk_tokens`` tokens each, 8 x 4 Mi by default; ``None``: every chunk, a full shuffle
    that fetches a chunk for almost every sequence), chunk order shuffled by (seed, epoch);
    ``shuffle=False``: stored order. A chunk is one fetch: through two DataLoader workers,
    chunks of 4 Mi tokens in windows of 8 cost 1.12-1.27 s of CPU per 100 M tokens against
    1.67-1.73 s for chunks of 1 Mi in windows of 32, the same span (a chunk's last label
    lies in the next 1 MiB block, so a chunk of 4 MiB is read as 5 MiB and one of 16 MiB as
    17; and there are a quarter of the fetches; measured here, 2026-12-03). Every sequence
    once per epoch, partitioned exactly over data-parallel ranks (``drop_last=True``: each
    rank the same count, fewer than dp_size left out; False: as many repeated) and, within a
    rank, over DataLoader workers by whole batches.

    Topology: ``rank``/``world_size`` (else torch.distributed, else RANK/WORLD_SIZE); the
    ``replication`` consecutive ranks of one tensor/context-parallel group (outermost
    ``pipeline`` stages) read the same sequences; or give ``dp_rank``/``dp_size`` directly.
    ``state_dict()``/``load_state_dict()``: a few integers, loadable on another
    data-parallel size (the rest of the epoch regrouped).

    Reads: each chunk's block-aligned ranges of ``.bin`` (through ``cache.read_range`` when a
    :class:`~datapipe.TieredCache` is given, else the store), fetched ahead within
    ``prefetch_bytes`` (None: two shuffle windows of chunks and one chunk more, at most 512
    MiB, in each DataLoader worker) by ``concurrency`` threads, every block checked against the part's
    ``.xxh`` before a token of it is used (a damaged byte is a ChecksumError naming file and
    block). ``batch_size``: the DataLoader's (a StreamingDataLoader sets it), so workers
    take whole batches in turn; ``batched=True``: yield :class:`~datapipe.loader.Batch` es of
    ``batch_size`` (for ``DataLoader(ds, batch_size=None)``). ``dtype``: of the tensors,
    "int64" (default) or "int32".
    """

    def __init__(self, source: str | os.PathLike[str], seq_len: int, *, packing: str = "concat", seed: int = 0,
                 shuffle: bool = True, window: int | None = 8, drop_last: bool = True, rank: int | None = None,
                 world_size: int | None = None, replication: int = 1, pipeline: int = 1,
                 dp_rank: int | None = None, dp_size: int | None = None, batch_size: int = 1,
                 batched: bool = False, cache: Any = None, storage_options: dict[str, Any] | None = None,
                 prefetch_bytes: int | None = None, concurrency: int = 4, chunk_samples: int = 4096,
                 chunk_tokens: int = CHUNK_TOKENS, extra_token: bool = True, pad_id: int | None = None,
                 dtype: str = "int64") -> None:
        E = LoaderOptionError
        url = check_path("source", source, error=E, hint="a token dataset's folder or URL")
        seq_len = check_int("seq_len", seq_len, min=1, max=MAX_SEQ_LEN, error=E, hint="tokens per sequence")
        packing = check_choice("packing", packing, ("concat", "documents"), error=E)
        seed = check_int("seed", seed, min=0, max=MAX_SEED, error=E)
        shuffle, drop_last = check_bool("shuffle", shuffle, error=E), check_bool("drop_last", drop_last, error=E)
        if window is not None:
            window = check_int("window", window, min=1, max=ALL_CHUNKS, error=E,
                               hint="the logical chunks a sequence may be shuffled across, or None for all")
        self.rank, self.world_size = check_topology(rank, world_size, replication, pipeline, dp_rank, dp_size)
        batch_size = check_int("batch_size", batch_size, min=1, max=MAX_COUNT, error=E)
        batched = check_bool("batched", batched, error=E)
        if prefetch_bytes is not None:
            prefetch_bytes = check_bytes("prefetch_bytes", prefetch_bytes, min=1, error=E,
                                         hint="bytes of chunks fetched ahead of the reader, or None")
        concurrency = check_int("concurrency", concurrency, min=1, max=MAX_THREADS, error=E)
        chunk_samples = check_int("chunk_samples", chunk_samples, min=1, max=MAX_COUNT, error=E)
        chunk_tokens = check_int("chunk_tokens", chunk_tokens, min=1, max=1 << 34, error=E,
                                 hint="tokens of one fetch (a logical chunk)")
        extra_token = check_bool("extra_token", extra_token, error=E)
        if packing == "documents" and not extra_token:
            raise E("extra_token=False: applies to packing='concat' (packed documents carry their labels)")
        if pad_id is not None:
            pad_id = check_int("pad_id", pad_id, min=0, max=(1 << 31) - 1, error=E)
        dtype = check_choice("dtype", dtype, _DTYPES, error=E)
        storage_options = check_reading(storage_options, cache)
        self._init_stream(self.rank, self.world_size, replication, pipeline, dp_rank, dp_size)
        self.url = url
        self.source = TokenSource(url, storage_options, max_pooled_bytes=prefetch_bytes or MAX_PREFETCH_BYTES)
        self.seq_len, self.packing = seq_len, packing
        if packing == "concat" and not extra_token:
            self.layout: Layout = ConcatLayout(self.source.part_tokens, seq_len,
                                               chunk_sequences=max(1, chunk_tokens // seq_len), extra_token=False)
        else:
            self.layout = make_layout(self.source, seq_len, packing, chunk_tokens)
        if self.layout.num_sequences == 0:
            raise PlanError(f"{url}: {self.source.num_tokens} tokens make no sequence of {seq_len} tokens"
                            + (" (and one more for the labels)" if packing == "concat" and extra_token else ""))
        self.cache = cache
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        #: logical chunks a sequence may move across; None (every chunk) is stored as 2**62
        self.window = ALL_CHUNKS if window is None else window
        self.batch_size, self.batched = batch_size, batched
        self.concurrency, self.chunk_samples = concurrency, chunk_samples
        self.pad_id = pad_id if pad_id is not None else (self.source.eos_id or 0)
        self.dtype = dtype
        self.fingerprint = layout_fingerprint(self.layout.counts, layout_identity(self.source, self.layout))
        self._fetch = ChunkFetch([self.source], [self.layout], cache)
        #: the fetch budget: as given, else two windows and a chunk (ChunkFetch.read_ahead_bytes)
        self.prefetch_bytes = prefetch_bytes or self._fetch.read_ahead_bytes(self.window)
        self.source.pool.max_bytes = self.prefetch_bytes
        self._plan: EpochPlan | None = None
        self._ahead: ReadAhead | None = None
        self._last_epoch: int | None = None
        #: passes this object started in this process (a first one reads nothing ahead)
        self._passes = PassCount()

    @property
    def num_sequences(self) -> int:
        """Sequences of an epoch over all ranks (before ``drop_last``)."""
        return self.layout.num_sequences

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_plan"] = None
        state["_ahead"] = None  # a prefetch thread: a worker runs its own
        return state

    # -- plan ---------------------------------------------------------------------------------
    def _planner(self) -> EpochPlanner:
        return EpochPlanner(partial(_counts_of, self.layout.counts), self.seed, self.window if self.shuffle else 1,
                            "window" if self.shuffle else "none", self.drop_last, self.fingerprint)

    def _make_plan(self, dp_size: int, epoch: int | None = None) -> EpochPlan:
        epoch = self.epoch if epoch is None else epoch
        planner = self._planner()
        if self._resume is not None and self._resume.get("epoch") == epoch:
            return planner.resumed(dp_size, self._resume)[0]
        return planner(dp_size, epoch)[0]

    set_epoch = set_resumable_epoch

    def __len__(self) -> int:
        """Sequences this rank yields in the current epoch (from the resume point on)."""
        plan = self._make_plan(self.data_parallel()[1])
        return plan.per_rank - plan.start

    # -- resume -------------------------------------------------------------------------------
    def _current_plan(self) -> EpochPlan:
        return self._plan if self._plan is not None else self._make_plan(self.data_parallel()[1])

    def _state_at(self, seen: int | None) -> dict[str, Any]:
        plan = self._current_plan()
        taken = self._progress.steps if seen is None else seen
        if not 0 <= taken <= plan.per_rank - plan.start:
            raise LoaderOptionError(f"samples_seen={show(taken)} is outside [0, {plan.per_rank - plan.start}] for "
                                    "this pass")
        return plan.state_dict(plan.start + taken)

    def _pass_state(self) -> dict[str, Any]:
        plan = self._current_plan()
        return plan.state_dict(plan.start)

    def _batch_steps(self) -> int:
        return self.batch_size * self._group()

    def _group(self) -> int:
        """Batches a DataLoader worker sends in one message: 1, or, when a StreamingDataLoader
        runs the passes in workers (``grouped``), as many as fit GROUP_BYTES. Workers then
        take groups of consecutive batches in turn, so the loader's stream is the same."""
        if not (self.grouped and self.batched):
            return 1
        extra = self.layout.extra if isinstance(self.layout, ConcatLayout) else 0
        return group_batches(self.batch_size, self.layout.seq_len, self.packing, self.dtype, extra)

    def _share(self, worker: int, num_workers: int) -> int:
        plan = self._current_plan()
        return share_size(plan.start, plan.per_rank, self._batch_steps(), worker, num_workers)

    def _load(self, state: dict[str, Any]) -> None:
        if type(state.get("epoch")) is not int or not 0 <= state["epoch"] <= MAX_EPOCH:
            raise StateMismatchError(f"not a TokenDataset state: {show(state)}")
        self.epoch, self._resume = state["epoch"], state
        self._plan = None
        self._make_plan(self.data_parallel()[1])  # checked now, not in a worker later

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self._live is None:  # state_dict() now describes the pass about to start
            self._plan = None
            self._progress.steps = self._worker_skip
        return self._pass()

    def _batches(self, dp_rank: int, dp_size: int, worker: int, num_workers: int, in_worker: bool) -> Iterator[Any]:
        group = self._group() if in_worker else 1
        key = PassKey(self.epoch, dp_rank, dp_size, worker, num_workers, self.batch_size * group, self.chunk_samples)
        plan = self._plan = self._make_plan(dp_size)
        progress = self._progress
        dtype = torch_dtype(self.dtype)
        fetching = self._fetch_stage(plan, key, in_worker)
        # in a worker, a batch's tensors are written where the loader's ring puts them
        lazy = in_worker and self.batched
        pending = GroupCut(self.layout, dtype, self.pad_id, group)  # the group being cut (one may span chunks)
        try:
            for chunk in fetching.chunks():
                units = fetched_units(chunk)
                for a in range(0, chunk.steps.size, self.batch_size):
                    b = min(a + self.batch_size, chunk.steps.size)
                    if group > 1:
                        pending.add(chunk.shard[a:b], chunk.sample[a:b], units)
                        if pending.full:
                            done, rows = pending.take()
                            progress.steps += rows
                            yield done
                        continue
                    fields = cut_batch(self.layout, chunk.shard[a:b], chunk.sample[a:b], units, dtype,
                                       self.pad_id, lazy)
                    if not self.batched:
                        yield from self._items(fields, b - a)
                    else:
                        progress.steps += b - a
                        yield Batch(fields, b - a)
            if pending.rows:  # the worker's last group of the pass
                done, rows = pending.take()
                progress.steps += rows
                yield done
        finally:
            self._ahead = fetching.end(self)

    def _items(self, fields: dict[str, Any], rows: int) -> Iterator[dict[str, Any]]:
        """A batch's sequences one by one (views of its tensors; a batch's ``cu_seqlens`` is
        the batch's, so an item has its ``position_ids``, which restart at every segment)."""
        progress = self._progress
        tensors = [(k, v) for k, v in fields.items() if k not in ("cu_seqlens", "padding")]
        padding = fields["padding"].tolist() if "padding" in fields else None
        for i in range(rows):
            item = {k: v[i] for k, v in tensors}
            if padding is not None:
                item["padding"] = padding[i]
            progress.steps += 1
            yield item

    def _fetch_stage(self, plan: EpochPlan, key: PassKey, in_worker: bool) -> PassFetch:
        """The read ahead the last pass left running into this one when it guessed it right,
        else a new prefetcher over this pass's chunks (which run on into the next pass's
        where one will come in this process, after its first pass, as
        :class:`~datapipe.StreamingDataset`'s do: :func:`~datapipe.loader.prefetch.reads_ahead`)."""
        ahead = take_read_ahead(self._ahead, key, resumed=self._resume is not None)
        self._ahead = None
        last, self._last_epoch = self._last_epoch, key.epoch
        before = self._passes.start()
        if ahead is not None:
            return PassFetch.adopt(ahead)
        step = 0 if last == key.epoch else 1
        reads_on = reads_ahead(before, self.cache is not None, self._control is not None or not in_worker)
        chunks = pass_chunks(plan, None, key, self._worker_skip, self._planner() if reads_on else None, step)
        fetch = self._fetch
        pre = Prefetcher(chunks, fetch.fetch, fetch.unit_bytes, max_bytes=self.prefetch_bytes,
                         concurrency=self.concurrency)
        return PassFetch(pre, key, 0, step)

    def sequences(self, epoch: int | None = None, dp_rank: int | None = None) -> NDArray[np.int64]:
        """The global ids of the sequences this rank (or ``dp_rank``) yields in ``epoch`` (the
        current one, from its resume point), in order: what a pass reads, from the plan alone."""
        own, dp_size = self.data_parallel()
        rank = own if dp_rank is None else check_int("dp_rank", dp_rank, min=0, max=dp_size - 1,
                                                     error=LoaderOptionError)
        plan = self._make_plan(dp_size, epoch)
        steps = np.arange(plan.start, plan.per_rank, dtype=np.int64)
        chunk, sample, _pad = plan.rank_samples(rank, steps)
        ids: NDArray[np.int64] = self.layout.sequence_ids(chunk, sample)
        return ids
