"""StreamingDataset: what a trainer iterates.

    ds = StreamingDataset("s3://bucket/ds", cache=TieredCache(...), seed=0, window=16,
                          batch_size=32)
    loader = StreamingDataLoader(ds, batch_size=32, num_workers=4)
    for epoch in range(start, n):
        ds.set_epoch(epoch)
        for batch in loader: ...
        state = loader.state_dict()          # a few integers; ds.load_state_dict(state)

Order, partition and resume come from :mod:`datapipe.plan`; this module resolves the
topology (explicit arguments, else ``torch.distributed`` if initialised, else the
``RANK``/``WORLD_SIZE`` environment, else one rank), cuts the worker's share of the rank's
stream into chunks, fetches their shards through a :class:`.prefetch.Prefetcher` and
decodes samples. Without torch installed it is a plain iterable.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import xxhash

from ..errors import CorruptIndexError, CorruptShardError, DatapipeError, PlanError, StateMismatchError, TopologyError
from ..format import decode_sample
from ..plan import EpochPlan, batch_steps, layout_fingerprint, worker_batches
from ..topology import Topology
from ..format.plain import split_plain_members
from .decode import make_decoder
from .laid import chunk_columns, item_loop
from .mixing import Stream, epoch_layout, stream_targets
from .prefetch import Chunk, Prefetcher
from .source import ShardSource

try:  # torch is optional: without it the dataset is a plain iterable
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover - torch is installed in the test environment
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["StreamingDataset", "resolve_topology"]


class Skipped(NamedTuple):
    """A skipped sample's place in the stream, yielded instead of the sample only while a
    :class:`~datapipe.loader.StreamingDataLoader` iterates (it takes it out of the batch and
    reports it in the main process): batches stay aligned with the plan's batches, so the
    loader's resume count stays exact with worker processes."""

    url: str
    key: str | None
    why: str


_SKIP = object()  # _read_sample's answer for a skipped sample


def resolve_topology(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit (both or neither), else torch.distributed, else
    RANK/WORLD_SIZE, else (0, 1); :class:`PlanError` when they do not fit."""
    if (rank is None) != (world_size is None):
        raise PlanError("give both rank and world_size, or neither")
    try:
        if rank is not None and world_size is not None:
            return Topology.checked(int(rank), int(world_size))
        return Topology.resolve(environment=True)
    except TopologyError as e:
        raise PlanError(str(e)) from None


def _worker() -> tuple[int, int]:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return 0, 1
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _in_worker() -> bool:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return False
    return get_worker_info() is not None


class StreamingDataset(_Base):
    """Samples of one or more packed datasets in a deterministic, resumable, shuffled order.

    ``source``: a dataset URL, a list of URLs (read as one dataset), or a list of
    :class:`Stream` (a mix with weights or repeat counts; ``epoch_size`` sizes a weighted
    mix). ``window``: shards a sample may be shuffled across (``None``: all, a full global
    shuffle). ``drop_last``: every rank yields the same number of samples per epoch by
    dropping the last ``< world`` samples (True) or repeating as many (False).
    ``batch_size``: the DataLoader's, so that workers take whole batches in turn and the
    loader's output is the rank's stream in order (exact resume). ``on_error``: "raise" on a
    corrupt sample, or "skip" it and report all skipped at the end of the pass (a rank that
    skips yields fewer samples than the others that epoch). Under a
    :class:`~datapipe.loader.StreamingDataLoader`, skips in worker processes are reported in
    the main process (``loader.skipped`` and a warning) and its resume point counts them.
    One pass at a time: a second iterator started while one is live raises PlanError.

    With a plain ``DataLoader`` and ``persistent_workers=False`` (the default), each pass
    pickles this object into the workers, so ``set_epoch`` and ``load_state_dict`` reach them.
    """

    def __init__(self, source: str | list[str] | list[Stream], *, cache: Any = None, shuffle: bool = True,
                 seed: int = 0, window: int | None = 16, drop_last: bool = False, decode: Any = "auto",
                 map: Callable[[dict[str, Any]], Any] | None = None, batch_size: int = 1,
                 rank: int | None = None, world_size: int | None = None,
                 storage_options: dict[str, Any] | None = None, on_error: str = "raise",
                 epoch_size: int | None = None, prefetch_bytes: int = 512 << 20, concurrency: int = 4,
                 chunk_samples: int = 8192, return_position: bool = False) -> None:
        streams = [source] if isinstance(source, (str, Stream)) else list(source)
        if not streams:
            raise PlanError("a StreamingDataset needs at least one dataset URL")
        self.streams = [s if isinstance(s, Stream) else Stream(os.fspath(s)) for s in streams]
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if int(seed) < 0:
            raise PlanError(f"seed must be non-negative, got {seed}")
        if window is not None and int(window) < 1:
            raise PlanError(f"window must be at least 1 shard (or None for all), got {window}")
        if int(batch_size) < 1 or int(chunk_samples) < 1:
            raise ValueError("batch_size and chunk_samples must be at least 1")
        if int(prefetch_bytes) < 1:
            raise PlanError(f"prefetch_bytes={prefetch_bytes!r}: the byte budget for shards fetched ahead of the "
                            "reader must be at least 1 (the default is 512 MiB; a shard the reader needs is "
                            "fetched even when it alone exceeds the budget)")
        if int(concurrency) < 1:
            raise PlanError(f"concurrency={concurrency!r}: shards fetched at once must be at least 1 (default 4)")
        # idle shard buffers kept for reuse stay within the prefetch budget too
        self.source = ShardSource([s.url for s in self.streams],
                                  [s.storage_options or storage_options for s in self.streams],
                                  max_pooled_bytes=int(prefetch_bytes))
        self.cache = cache
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        #: shards a sample may move across; None (every shard) is stored as 2**62
        self.window = (1 << 62) if window is None else int(window)
        self.drop_last = bool(drop_last)
        self.batch_size = int(batch_size)
        self.rank, self.world_size = rank, world_size
        self.on_error = on_error
        self.epoch_size = epoch_size
        self.prefetch_bytes = int(prefetch_bytes)
        self.concurrency = int(concurrency)
        self.chunk_samples = int(chunk_samples)
        self.return_position = bool(return_position)
        self._decode = make_decoder(decode, map)
        sizes = [int(ix.num_samples) for ix in self.source.indexes]
        self._targets = stream_targets(self.streams, sizes, epoch_size)
        self._stream_counts = [ix.sample_counts for ix in self.source.indexes]
        mix = [s.describe() for s in self.streams] + [epoch_size]
        self.fingerprint = layout_fingerprint(self.source.counts, self.source.identity() + repr(mix))
        self.epoch = 0
        self._resume: dict[str, Any] | None = None
        self._topology: tuple[int, int] | None = None
        self._plan: EpochPlan | None = None
        self._yielded = 0
        #: (shard url, sample key or None, reason) of everything skipped in this process
        self.skipped: list[tuple[str, str | None, str]] = []
        #: the running pass (a token), so that a second one is refused while it is live
        self._live: object | None = None
        #: yield a Skipped in place of each skipped sample (set by StreamingDataLoader)
        self._holes = False
        if sum(self._targets) == 0:
            raise PlanError(f"{', '.join(self.source.urls)}: the mix asks for no sample per epoch")

    # -- pickling into DataLoader workers ------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Spawned workers have no process group: pin the topology seen by the parent.
        state["_topology"] = self._topology or resolve_topology(self.rank, self.world_size)
        state["_plan"] = None
        state["_live"] = None  # a worker's copy runs its own pass
        return state

    # -- plan ---------------------------------------------------------------------------
    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        return epoch_layout(self._stream_counts, self._targets, self.seed, epoch)

    def _make_plan(self, world: int) -> tuple[EpochPlan, np.ndarray]:
        counts, real = self._layout(self.epoch)
        algo = "window" if self.shuffle else "none"
        window = self.window if self.shuffle else 1
        if self._resume is not None and self._resume.get("epoch") == self.epoch:
            plan = EpochPlan.from_state(counts, self._resume, seed=self.seed, window=window, algorithm=algo,
                                        world=world, drop_last=self.drop_last, fingerprint=self.fingerprint)
        else:
            plan = EpochPlan(counts, seed=self.seed, epoch=self.epoch, window=window, algorithm=algo,
                             world=world, drop_last=self.drop_last, fingerprint=self.fingerprint)
        return plan, real

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) < 0:
            raise PlanError(f"epoch must be non-negative, got {epoch}")
        self.epoch = int(epoch)
        if self._resume is not None and self._resume.get("epoch") != self.epoch:
            self._resume = None
        self._plan = None

    def shuffle_quality(self, batch_size: int = 256, max_batches: int = 512) -> dict[str, Any]:
        """Mean distinct shards per batch and stored-vs-delivered position correlation of
        the current epoch's order (see :mod:`datapipe.plan.quality`): what a window costs."""
        plan, _ = self._make_plan(1)
        out = plan.quality(batch_size, max_batches)
        out["window"] = self.window if self.shuffle else 0
        return out

    def __len__(self) -> int:
        """Samples this rank yields in the current epoch (from the resume point on)."""
        plan, _ = self._make_plan(self._world()[1])
        return plan.per_rank - plan.start

    def _world(self) -> tuple[int, int]:
        return self._topology or resolve_topology(self.rank, self.world_size)

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, samples_seen: int | None = None) -> dict[str, Any]:
        """Resume state once this rank has taken ``samples_seen`` samples in the current pass
        (counted from the resume point, if the pass resumed). ``None``: the samples this
        object yielded itself (iterating in this process, without DataLoader workers)."""
        plan = self._plan
        if plan is None:
            plan, _ = self._make_plan(self._world()[1])
        seen = self._yielded if samples_seen is None else int(samples_seen)
        if not 0 <= seen <= plan.per_rank - plan.start:
            raise PlanError(f"samples_seen={seen} is outside [0, {plan.per_rank - plan.start}] for this pass")
        return plan.state_dict(plan.start + seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next pass; the world size may differ (elastic)."""
        if not isinstance(state, dict) or not isinstance(state.get("epoch"), int) or state["epoch"] < 0:
            raise StateMismatchError(f"not a StreamingDataset state: {state!r:.200}")
        keep = (self.epoch, self._resume)
        self.epoch, self._resume = state["epoch"], state
        try:
            self._make_plan(self._world()[1])  # check it now, not in a worker later
        except (StateMismatchError, PlanError) as e:
            self.epoch, self._resume = keep
            raise StateMismatchError(str(e)) from None
        self._plan = None

    # -- iteration ----------------------------------------------------------------------
    def _chunks(self, plan: EpochPlan, real: np.ndarray, rank: int, worker: int,
                num_workers: int) -> Iterator[Chunk]:
        start, stop = plan.start, plan.per_rank
        batches = worker_batches(start, stop, self.batch_size, worker, num_workers)
        per_chunk = max(1, self.chunk_samples // self.batch_size)
        # The first chunks are small and grow to full size: the reader starts on the first
        # batch while the prefetcher still plans the rest of the window.
        i, size, number = 0, 1, 0
        while i < len(batches):
            steps = batch_steps(start, stop, self.batch_size, batches[i : i + min(size, per_chunk)])
            # padding samples (repeats that even out the ranks) are read like any other
            vshard, sample, _padding = plan.rank_samples(rank, steps)
            yield Chunk.make(number, steps, real[vshard], sample)
            i, size, number = i + min(size, per_chunk), size * 4, number + 1

    def __iter__(self) -> Iterator[Any]:
        # One pass at a time: the resume state (plan, samples yielded, skips) is the pass's,
        # and state_dict() must describe the pass the trainer consumes. Keeping state per
        # iterator would leave state_dict() to guess which one; a stray second iterator (a
        # peek with next(iter(ds)) kept alive) would then silently move the resume point.
        # So a second live pass is an error; each DataLoader worker has its own copy, and a
        # parallel pass needs its own StreamingDataset.
        if self._live is not None:
            raise PlanError("this StreamingDataset is already being iterated: finish or close() the first "
                            "iterator (or drop the last reference to it) before starting another pass, or "
                            "create a second StreamingDataset for a pass in parallel; its state_dict() "
                            "describes one pass at a time")
        token = self._live = object()
        try:
            yield from self._pass()
        finally:
            if self._live is token:
                self._live = None

    def _pass(self) -> Iterator[Any]:
        rank, world = self._world()
        worker, num_workers = _worker()
        plan, real = self._make_plan(world)
        self._plan, self._yielded = plan, 0
        self.skipped = []  # reported at the end of each pass, then started afresh
        cache = self.cache
        source = self.source

        def schedule(order: list[int]) -> None:
            if cache is not None and hasattr(cache, "set_schedule"):
                cache.set_schedule([source.url(g) for g in order], lookahead=0)

        pre = Prefetcher(self._chunks(plan, real, rank, worker, num_workers),
                         lambda g: source.fetch(g, cache), source.shard_bytes,
                         max_bytes=self.prefetch_bytes, concurrency=self.concurrency, schedule=schedule)
        try:
            for chunk in pre:
                laid = self._laid_chunk(pre, chunk)
                yield from (self._read_chunk(pre, chunk) if laid is None else laid)
                pre.done(chunk)
        finally:
            pre.close()
        if not self._holes:  # else the loader reports them, in the main process
            self._report_skipped()
        self._resume = None  # the resumed pass is over; the next pass starts the epoch afresh

    def _open_shard(self, pre: Prefetcher, g: int) -> tuple[Any, Any]:
        """(shard data or None, fast-path tuple or the fetch error, or None)."""
        try:
            data = pre.shard(g)
        except DatapipeError as e:
            if self.on_error != "skip" or isinstance(e, CorruptIndexError):  # not one sample's fault
                raise
            return None, e
        # fast path: the bytes are all there and verified, as a whole or by sample digests
        if data.error is None and data.max_end <= len(data.buf) and data.compression == "none" \
                and (data.verified or data.digests is not None):
            return data, (data.buf, data.src, data.offs, data.ends, None if data.verified else data.digests)
        return data, None

    def _laid_chunk(self, pre: Prefetcher, chunk: Chunk) -> Iterator[Any] | None:
        """The chunk's items cut through its shards' layouts in one vectorised step (see
        :mod:`.laid`), or ``None`` when a shard of the chunk is not verified and laid out
        with the same fields as the others: the per-sample path then reads the chunk, and
        raises or skips what it must at the sample where it happens."""
        datas = []
        fields = None
        for g in chunk.shards:
            try:
                data = pre.shard(g)
            except Exception:  # noqa: BLE001 - the per-sample path raises it at its sample
                return None
            if data.table is None or not data.verified or data.error is not None \
                    or data.compression != "none" or data.max_end > len(data.buf):
                return None
            if fields is None:
                fields = data.fields
            elif data.fields != fields:
                return None
            datas.append(data)
        if not datas:
            return None
        srcs, keys, columns = chunk_columns(datas, chunk.shard, chunk.sample)
        identity = self._decode.is_identity
        # positions go in after decoding, as on the per-sample path: a map sees the sample only
        with_pos = self.return_position and identity
        items = item_loop(fields, with_pos)(self, self._yielded + 1, srcs, keys, columns,
                                             chunk.shard.tolist() if with_pos else None,
                                             chunk.sample.tolist() if with_pos else None)
        return items if identity else self._decoded(items, datas, chunk, keys)

    def _decoded(self, items: Iterator[dict[str, Any]], datas: list[Any], chunk: Chunk,
                 keys: list[str]) -> Iterator[Any]:
        decoder, skip, with_pos = self._decode, self.on_error == "skip", self.return_position
        urls = {d.shard: d.url for d in datas}
        for item, key, g, j in zip(items, keys, chunk.shard.tolist(), chunk.sample.tolist()):
            url = urls[g]
            try:
                item = decoder(item, url)
            except DatapipeError as e:
                if not skip:
                    raise
                self.skipped.append((url, key, str(e)))
                if self._holes:
                    yield Skipped(url, key, str(e))
                continue
            if with_pos and isinstance(item, dict):
                item["__shard__"], item["__sample__"] = g, j
            yield item

    def _read_chunk(self, pre: Prefetcher, chunk: Chunk) -> Iterator[Any]:
        decoder = None if self._decode.is_identity else self._decode
        skip, with_pos = self.on_error == "skip", self.return_position
        hexdigest, split = xxhash.xxh3_64_hexdigest, split_plain_members
        opened: dict[int, tuple[Any, Any]] = {}
        laid: dict[int, tuple[Any, ...]] = {}  # verified shards with a known field layout
        for g, j in zip(chunk.shard.tolist(), chunk.sample.tolist()):
            self._yielded += 1  # a plan step consumed (also when skipped): resume lines up
            lay = laid.get(g)
            if lay is not None:  # the hot path: two list lookups and one copy per field
                src, rows, fields, keys, data = lay
                r, k = rows[j], 0
                item = {"__key__": keys[j]}
                for f in fields:
                    item[f] = src[r[k] : r[k + 1]]
                    k += 2
                if decoder is not None:
                    try:
                        item = decoder(item, data.url)
                    except DatapipeError as e:
                        if not skip:
                            raise
                        self.skipped.append((data.url, keys[j], str(e)))
                        if self._holes:
                            yield Skipped(data.url, keys[j], str(e))
                        continue
            else:
                got = opened.get(g)
                if got is None:
                    got = opened[g] = self._open_shard(pre, g)
                    data = got[0]
                    if data is not None and got[1] is not None and data.rows is not None:
                        laid[g] = (data.src, data.rows, data.fields, data.keys, data)
                item = self._read_sample(got, g, j, decoder, hexdigest, split)
                if item is _SKIP:
                    if self._holes:
                        yield Skipped(*self.skipped[-1])
                    continue
                if item is None:
                    continue
            if with_pos and isinstance(item, dict):
                item["__shard__"], item["__sample__"] = g, j
            yield item

    def _read_sample(self, got: tuple[Any, Any], g: int, j: int, decoder: Any, hexdigest: Any,
                     split: Any) -> Any:
        """Sample ``j`` of shard ``g`` off the hot path; ``_SKIP`` when skipped."""
        data, fast = got
        if data is None:
            self.skipped.append((self.source.url(g), None, f"sample #{j}: {fast}"))
            return _SKIP
        try:
            sample = None
            if fast is not None:
                buf, src, offs, ends, digests = fast
                start, end = offs[j], ends[j]
                if digests is not None and hexdigest(buf[start:end]) != digests[j]:
                    data.sample_bytes(j)  # raises the ChecksumError naming the sample
                sample = split(src, start, end)
            if sample is None:
                sample = decode_sample(data.sample_bytes(j), data.compression, data.where(j), data.tar_bytes)
            if sample["__key__"] != data.keys[j]:  # the tar header must agree with the index
                raise CorruptShardError(f"{data.where(j)}: the tar members name key {sample['__key__']!r}")
            return sample if decoder is None else decoder(sample, data.url)
        except DatapipeError as e:
            if self.on_error != "skip":
                raise
            self.skipped.append((data.url, data.keys[j], str(e)))
            return _SKIP

    def _report_skipped(self) -> None:
        if self.skipped:
            shown = "; ".join(f"{u} {k!r}: {why}" for u, k, why in self.skipped[:5])
            more = f" (and {len(self.skipped) - 5} more)" if len(self.skipped) > 5 else ""
            if _in_worker():  # under a plain DataLoader the main process never hears of these skips
                more += ("; this is a DataLoader worker process: a StreamingDataLoader reports skips in the "
                         "main process and counts them in its resume point")
            warnings.warn(f"StreamingDataset skipped {len(self.skipped)} unreadable samples: {shown}{more}",
                          RuntimeWarning, stacklevel=3)
