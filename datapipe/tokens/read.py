"""The fetch and read stages of the token loaders: a token dataset opened for reading, one
logical chunk of sequences fetched and verified, and batches cut from fetched chunks.

- :class:`TokenSource`: a token dataset (docs/TOKEN_FORMAT.md) opened for reading: the
  manifest (its own checksum), every part's ``.xxh`` (size and checksum the manifest
  records) and every ``.bin``'s size are checked when it is opened, before any offset is
  used. No ``.idx`` is read at open.
- :func:`make_layout`: the plan's view of it (:class:`~datapipe.plan.ConcatLayout` or
  :class:`~datapipe.plan.DocumentLayout`), whose chunks are the fetch stage's units.
  Concatenated sequences take no offset from an ``.idx``: it is never read. Document
  packing takes its plan from the stored :class:`~datapipe.plan.DocumentTable`
  (O(parts + chunks)); only where there is none (or it is stale) are the ``.idx`` files
  read whole, checked (:func:`~datapipe.format.tokens.check_index`) and counted, once, and
  the table stored. A part whose documents are not one sequence each (an ``.idx`` indexed
  in place whose ``doc_idx`` is not 0..n) has its lengths read whole and kept; every other
  part's lengths are read per chunk, at fetch: the chunk's slice of the ``.idx`` sizes
  (after the ``.idx``'s header is checked against the manifest,
  :func:`~datapipe.format.tokens.check_idx_header`), checked against the table's checksum
  of that chunk's lengths before the chunk is repacked.
- :class:`ChunkFetch`: the fetch stage's ``fetch(unit)`` for one or more sources: the
  block-aligned byte range of each ``.bin`` a chunk covers (:func:`block_span`), read into a
  private buffer (through the cache's ``read_range`` when there is a cache, else from the
  store), every covered block checked against ``.xxh`` (:func:`verify_blocks`) before a
  token of it is used. A flipped bit is a :class:`~datapipe.errors.ChecksumError` naming the
  file and block, never a wrong token. What it returns (:class:`TokenChunk`) holds the
  chunk's tokens as one array and, for document packing, the chunk's packing (repacked from
  its documents' lengths: for a part read in ranges, one range of the ``.idx`` sizes, read
  then and checked against the table's checksum of them: a flipped bit is a
  :class:`~datapipe.errors.CorruptIndexError` naming the ``.idx`` and the byte range).
- :func:`cut_concat`, :class:`DocumentRows`: the read stage: the rows of a batch cut from
  fetched chunks with numpy (one slice assignment per row, converting the stored dtype as it
  copies; no Python per token), written into the batch's tensors, or straight into a
  loader's shared-memory slot (:class:`~datapipe.loader.batch.LazyTensor`).

Memory: a chunk's bytes live in buffers of a :class:`~datapipe.loader.source.BufferPool`
(reused across chunks, within the loader's prefetch budget) from the fetch until the read
stage is done with the chunk; batches are copies, so nothing handed out views them.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ChecksumError, CorruptIndexError, DatapipeError, ObjectNotFoundError, PlanError, StorageError
from ..format.tokens import (
    HEADER_BYTES,
    MANIFEST,
    TokenManifest,
    block_span,
    check_block_sums,
    check_idx_header,
    check_index,
    idx_sizes_range,
    parse_token_manifest,
    verify_blocks,
)
from ..loader import BufferPool
from ..plan import (
    CHUNK_TOKENS,
    TABLE_MAGIC,
    ConcatLayout,
    DocumentLayout,
    DocumentTable,
    PackedChunk,
    Pieces,
    cu_seqlens,
)
from ..storage import RetryPolicy, Store, call_with_retry, is_local_url, open_store, run_requests, split_url

__all__ = [
    "IGNORE_INDEX",
    "TokenSource",
    "TokenChunk",
    "ChunkFetch",
    "MAX_PREFETCH_BYTES",
    "make_layout",
    "cut_concat",
    "DocumentRows",
]

#: the label of a position no loss is taken at (padding, the token after a document's
#: end): PyTorch's ``cross_entropy`` ``ignore_index`` default
IGNORE_INDEX = -100
#: the folder beside the manifest where document packing tables are kept, one per
#: (seq_len, block, chunk): counted once, read by every later process
DOCUMENT_TABLES = "plans"
#: requests a TokenSource makes at once when it opens (each part's .xxh and .bin size)
OPEN_REQUESTS = 16
#: the most bytes a token loader fetches ahead by default (:meth:`ChunkFetch.read_ahead_bytes`)
MAX_PREFETCH_BYTES = 512 << 20

Layout = ConcatLayout | DocumentLayout
IntArray = npt.NDArray[np.integer[Any]]
Int64s = npt.NDArray[np.int64]


def _is_elsewhere(name: str) -> bool:
    """A part file named by absolute path or URL (indexed in place), not by a key."""
    return name.startswith("/") or "://" in name


class TokenSource:
    """A token dataset at ``url`` opened for reading; everything a reader uses is checked
    first (see the module docstring). ``sums[i]``, ``bin_keys[i]``: part i's block checksums
    and where its ``.bin`` lies. Opening reads the manifest, each ``.xxh`` and each ``.bin``'s
    size: O(parts + blocks), no ``.idx``. A part's ``.idx`` is read whole only by
    :meth:`part_lengths` (counting documents), and in ranges by :meth:`read_sizes`."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None, max_pooled_bytes: int = 512 << 20) -> None:
        self.url = url
        self.storage_options = storage_options
        self.retry = retry or RetryPolicy()
        self.store = open_store(url, storage_options)
        self._stores: dict[str, Store] = {}
        where = self.store.url(MANIFEST)
        try:
            data = self._get(self.store, MANIFEST, where)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(f"{where} does not exist: {url} is no token dataset (write one with "
                                      "datapipe.pack_tokens, or index existing .bin/.idx files with "
                                      "datapipe.index_tokens)") from None
        self.manifest: TokenManifest = parse_token_manifest(data, where)
        m = self.manifest
        if not m.parts or m.tokens == 0:
            raise PlanError(f"{url}: the token dataset holds no token; nothing to read")
        self.dtype = m.dtype
        self.itemsize = int(m.dtype.itemsize)
        self.block_bytes = m.block_bytes
        self.eos_id = m.eos_id
        #: each part's block checksums (its ``.xxh``, checked against the manifest)
        self.sums: list[npt.NDArray[np.uint64]] = []
        #: (store, key, URL) of each part's ``.bin``
        self.bin_keys: list[tuple[Store, str, str]] = []
        located_bins = [self._located(part.bin) for part in m.parts]
        xxhs, sizes = self._open_requests(located_bins)
        for i, part in enumerate(m.parts):
            sums = check_block_sums(m, i, xxhs[i], where=url)
            located, size = located_bins[i], sizes[i]
            if size != part.bin_bytes:
                raise ChecksumError(f"{located[2]}: {size} bytes, the manifest records {part.bin_bytes}; the file was "
                                    "truncated, extended or replaced since it was packed (pack or index it again)")
            self.sums.append(sums)
            self.bin_keys.append(located)
        #: tokens of each part, in stream order
        self.part_tokens = np.array([p.tokens for p in m.parts], dtype=np.int64)
        #: parts whose ``.idx`` header this process checked (:meth:`read_sizes`)
        self._headers: set[int] = set()
        self.pool = BufferPool(max_pooled_bytes)

    def _open_requests(self, bins: list[tuple[Store, str, str]]) -> tuple[list[bytes], list[int]]:
        """Every part's ``.xxh`` and its ``.bin``'s size: two requests a part, each retried,
        up to :data:`OPEN_REQUESTS` at a time (on threads kept for the open, not one started
        per request: at hundreds of parts that was most of a rank's start-up)."""
        parts = self.manifest.parts
        fns: list[Any] = [partial(self.store.get, p.xxh) for p in parts]
        fns += [partial(store.size, key) for store, key, _url in bins]
        whats = [self.store.url(p.xxh) for p in parts] + [u for _s, _k, u in bins]
        if len(fns) <= 2:
            out = [call_with_retry(fn, what, self.retry) for fn, what in zip(fns, whats)]
        else:
            workers = min(OPEN_REQUESTS, len(fns))
            pool = ThreadPoolExecutor(workers, thread_name_prefix="datapipe-token-open")
            try:
                out = run_requests(fns, whats, self.retry, pool=pool, concurrency=workers)
            finally:
                pool.shutdown(wait=False, cancel_futures=True)  # an abandoned attempt is not waited for
        n = len(parts)
        return [bytes(x) for x in out[:n]], [int(x) for x in out[n:]]

    def part_lengths(self, i: int) -> tuple[IntArray, bool]:
        """(document lengths, one sequence per document) of part ``i``, from its whole
        ``.idx`` checked against the manifest (:func:`~datapipe.format.tokens.check_index`):
        O(documents) bytes read; the lengths are an array of their own (4 or 8 bytes a
        document), the ``.idx``'s bytes are not kept."""
        store, key, url = self._located(self.manifest.parts[i].idx)
        index = check_index(self.manifest, i, self._get(store, key, url), where=self.url)
        return np.array(index.document_lengths(), copy=True), index.one_sequence_per_document

    def read_sizes(self, i: int, start: int, stop: int) -> npt.NDArray[np.int32]:
        """Sequences ``[start, stop)``'s sizes (int32) of part ``i``'s ``.idx``: one range
        read, after the file's header was checked against the manifest (once per process,
        :func:`~datapipe.format.tokens.check_idx_header`). The sizes themselves are not
        checked here: the caller checks them (a document table's checksum of them)."""
        part = self.manifest.parts[i]
        if not 0 <= start <= stop <= part.sequences:
            raise PlanError(f"sizes [{start}, {stop}) of part {i}: it holds {part.sequences} sequences")
        store, key, url = self._located(part.idx)
        if i not in self._headers:
            head = self._range(store, key, url, 0, HEADER_BYTES)
            check_idx_header(self.manifest, i, head, where=self.url)
            self._headers.add(i)
        a, b = idx_sizes_range(start, stop)
        data = self._range(store, key, url, a, b)
        return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)

    def idx_url(self, i: int) -> str:
        """The URL of part ``i``'s ``.idx``."""
        return self._located(self.manifest.parts[i].idx)[2]

    def _range(self, store: Store, key: str, url: str, a: int, b: int) -> bytes:
        data = call_with_retry(lambda: store.get_range(key, a, b), url, self.retry)
        if len(data) != b - a:
            raise CorruptIndexError(f"{url}: bytes [{a}, {b}) read {len(data)} bytes; the file is shorter than the "
                                    "manifest records (truncated or replaced since it was indexed: index or pack "
                                    "the dataset again)")
        return data

    def _located(self, name: str) -> tuple[Store, str, str]:
        """(store, key, URL) of a file the manifest names: a key of the dataset's store, or
        a file of a folder elsewhere (indexed in place), opened once per folder."""
        if not _is_elsewhere(name):
            return self.store, name, self.store.url(name)
        folder, key = split_url(name)
        store = self._stores.get(folder)
        if store is None:
            opts = None if is_local_url(folder) else self.storage_options
            store = self._stores[folder] = open_store(folder, opts)
        return store, key, name

    def _size(self, store: Store, key: str, url: str) -> int:
        return call_with_retry(lambda: store.size(key), url, self.retry)

    def _get(self, store: Store, key: str, url: str) -> bytes:
        return call_with_retry(lambda: store.get(key), url, self.retry)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_stores"] = {}
        state["bin_keys"] = [(None, k, u) if s is not self.store else (s, k, u) for s, k, u in self.bin_keys]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.bin_keys = [(s, k, u) if s is not None else self._located(u) for s, k, u in self.bin_keys]

    @property
    def num_tokens(self) -> int:
        return int(self.part_tokens.sum())

    @property
    def identity(self) -> str:
        """What makes this dataset this dataset (for resume checks): its manifest's checksum."""
        return str(self.manifest.doc["manifest_checksum"])

    def read_tokens(self, part: int, start: int, stop: int, cache: Any = None) -> tuple[npt.NDArray[Any], Any]:
        """(tokens ``[start, stop)`` of ``part``, the buffer holding them or None): the
        covering blocks read into a pooled buffer (or through ``cache.read_range``) and
        verified before the view is made. Give the buffer back with :meth:`release`. Bytes
        from the cache that fail their blocks are read again from the store (with a warning:
        the cache's copy is bad); bytes from the store that fail are a ChecksumError."""
        bin_bytes = self.manifest.parts[part].bin_bytes
        store, key, url = self.bin_keys[part]
        isz = self.itemsize
        b0, b1, first = block_span(start * isz, stop * isz, self.block_bytes, bin_bytes)
        if b1 == b0:
            return np.zeros(0, dtype=self.dtype), None
        if cache is not None:
            try:
                data = cache.read_range(url, b0, b1)
            except DatapipeError:
                raise
            except OSError as e:
                raise StorageError(f"{url}: reading bytes [{b0}, {b1}) through the cache failed: {e}") from e
            try:
                self._verify(data, part, b0, b1, first)
                return np.frombuffer(data, dtype=self.dtype, count=stop - start, offset=start * isz - b0), None
            except ChecksumError as e:
                warnings.warn(f"the cache's copy of {url} is damaged ({e}); reading the range from the store",
                              RuntimeWarning, stacklevel=2)
        mm = self.pool.take(b1 - b0)
        try:
            with memoryview(mm) as view:
                got = call_with_retry(lambda: store.readinto(key, view, b0), url, self.retry)
            if got != b1 - b0:
                raise ChecksumError(f"{url}: bytes [{b0}, {b1}) read {got} bytes; the file is shorter than the "
                                    f"manifest's {bin_bytes} (truncated since it was packed?)")
            self._verify(mm, part, b0, b1, first)
            tokens = np.frombuffer(mm, dtype=self.dtype, count=stop - start, offset=start * isz - b0)
        except BaseException:
            self.pool.give(mm)
            raise
        return tokens, mm

    def _verify(self, data: Any, part: int, b0: int, b1: int, first: int) -> None:
        if len(data) != b1 - b0:
            raise ChecksumError(f"{self.bin_keys[part][2]}: bytes [{b0}, {b1}) came back as {len(data)} bytes")
        verify_blocks(data, first, self.sums[part], self.block_bytes, where=self.bin_keys[part][2])

    def release(self, buffer: Any) -> None:
        if buffer is not None:
            self.pool.give(buffer)


def make_layout(source: TokenSource, seq_len: int, packing: str, chunk_tokens: int = CHUNK_TOKENS) -> Layout:
    """The plan's layout of ``source``: Megatron GPTDataset sequences (``"concat"``) or whole
    documents packed (``"documents"``), chunks of about ``chunk_tokens`` tokens."""
    if packing == "concat":
        return ConcatLayout(source.part_tokens, seq_len, chunk_sequences=max(1, chunk_tokens // seq_len))
    block = 64 * seq_len
    return _stored_document_layout(source, seq_len, block, max(1, chunk_tokens // block))


def _stored_document_layout(source: TokenSource, seq_len: int, block: int, chunk_blocks: int) -> DocumentLayout:
    """The document layout from the table stored beside the manifest (checked, bound to the
    manifest's checksum, fitting the manifest's parts: O(parts + chunks)), else counted
    (O(documents)) and stored there, by an atomic put, for every later process. A store
    that refuses the put costs a warning; a file at the table's path that is no table of
    datapipe's is never overwritten (a warning, and every process counts). Either way the
    layout holds only the lengths of the parts that are not one sequence per document."""
    key = f"{DOCUMENT_TABLES}/documents-{seq_len}-{block}-{chunk_blocks}.table"
    url = source.store.url(key)
    table, found = _stored_table(source, key, url)
    held: dict[int, IntArray] = {}
    if table is None:
        lengths, ranged = [], []
        for i in range(len(source.manifest.parts)):
            x, one = source.part_lengths(i)
            lengths.append(x)
            ranged.append(one)
        counted = DocumentLayout(lengths, seq_len, block_tokens=block, chunk_blocks=chunk_blocks)
        table = replace(counted.table, part_ranged=np.array(ranged, dtype=np.int64))
        held = {i: x for i, x in enumerate(lengths) if not ranged[i]}
        del counted, lengths  # the ranged parts' lengths are read per chunk from here on
        if found != "foreign":
            _store_table(source, key, url, table, overwrite=found == "stale")
    kept: list[IntArray | _IdxSizes] = [
        _IdxSizes(source, i) if table.part_ranged[i] else held[i] if i in held else source.part_lengths(i)[0]
        for i in range(len(source.manifest.parts))]
    return DocumentLayout(kept, seq_len, block_tokens=block, chunk_blocks=chunk_blocks, table=table)


def _stored_table(source: TokenSource, key: str, url: str) -> tuple[DocumentTable | None, str]:
    """(the table at ``key``, "") when it is there and fits, else (None, why): "absent",
    "stale" (a table of datapipe's that is damaged, of another version or another
    dataset's: counted again and replaced, with a warning) or "foreign" (a file that is
    no table of datapipe's, or that could not be read: left as it is, with a warning)."""
    try:
        data = source._get(source.store, key, url)
    except ObjectNotFoundError:
        return None, "absent"
    except DatapipeError as e:  # what it holds is unknown: it is not overwritten
        warnings.warn(f"{url}: the document packing table could not be read ({e}); counting the documents, and "
                      "not storing the table there", RuntimeWarning, stacklevel=4)
        return None, "foreign"
    try:
        table = DocumentTable.from_bytes(data, url, identity=source.identity)
        _check_fits(source, table, url)
        return table, ""
    except DatapipeError as e:
        if bytes(data[:len(TABLE_MAGIC)]) != TABLE_MAGIC:
            warnings.warn(f"{url} is not a datapipe document packing table ({e}); it is left as it is and every "
                          "process opening this dataset counts its documents (move that file away so that the "
                          "table can be stored there)", RuntimeWarning, stacklevel=4)
            return None, "foreign"
        warnings.warn(f"{e}; counting the documents again", RuntimeWarning, stacklevel=4)
        return None, "stale"


def _check_fits(source: TokenSource, table: DocumentTable, url: str) -> None:
    """:class:`PlanError` unless ``table`` describes the manifest's parts: their tokens and
    documents (so every chunk's boundaries lie within them), and one sequence per document
    wherever it says a part's lengths are read in ranges."""
    parts = source.manifest.parts
    redo = "remove it and the next reader counts the documents again"
    if not np.array_equal(table.part_tokens, source.part_tokens):
        raise PlanError(f"{url}: its parts' token counts are not the manifest's; {redo}")
    if not np.array_equal(table.part_docs, np.array([p.documents for p in parts], dtype=np.int64)):
        raise PlanError(f"{url}: its parts' document counts are not the manifest's (its chunks would lie past the "
                        f"documents); {redo}")
    bad = [i for i, p in enumerate(parts) if table.part_ranged[i] and p.sequences != p.documents]
    if bad:
        raise PlanError(f"{url}: it reads parts {bad[:5]}'s lengths in ranges, but their documents are not one "
                        f"sequence each; {redo}")


def _store_table(source: TokenSource, key: str, url: str, table: DocumentTable, *, overwrite: bool) -> None:
    try:
        # the ranks of a job count at once: those that finish after the first one stored it
        # do not upload it again
        if overwrite or not source.store.exists(key):
            source.store.put(key, table.to_bytes(source.identity))
    except (DatapipeError, OSError) as e:
        warnings.warn(f"{url}: the document packing table could not be stored ({e}); every process opening "
                      "this dataset counts its documents again", RuntimeWarning, stacklevel=4)


class _IdxSizes:
    """Part ``part``'s document lengths as a :class:`~datapipe.plan.tokens.LengthReader`:
    ranges of its ``.idx`` sizes (one sequence per document), read when a chunk is repacked
    (:meth:`TokenSource.read_sizes`); the layout checks them against its table."""

    def __init__(self, source: TokenSource, part: int) -> None:
        self.source, self.part = source, part
        self.size = source.manifest.parts[part].documents

    def read(self, start: int, stop: int) -> npt.NDArray[np.int32]:
        return self.source.read_sizes(self.part, start, stop)

    def where(self, start: int, stop: int) -> str:
        a, b = idx_sizes_range(start, stop)
        return f"{self.source.idx_url(self.part)} bytes [{a}, {b})"


def layout_identity(source: TokenSource, layout: Layout) -> str:
    """The fingerprint a resume state of ``layout`` over ``source`` carries."""
    return json.dumps({"layout": layout.fingerprint, "dataset": source.identity}, sort_keys=True)


@dataclass
class TokenChunk:
    """One logical chunk, fetched and verified: ``tokens`` of the stream from the chunk's
    first token on (document packing: ``seq_len + 1`` more, zeros, so that every row's
    window lies inside), and for document packing its ``packed`` layout with each
    sequence's first token in ``tokens`` (``seq_start``) and length (``seq_tokens``)."""

    unit: int
    tokens: npt.NDArray[Any]
    packed: PackedChunk | None = None
    seq_start: Int64s | None = None
    seq_tokens: Int64s | None = None
    _buffers: tuple[Any, ...] = ()
    _source: TokenSource | None = None

    def close(self) -> None:
        self.tokens = np.zeros(0, dtype=self.tokens.dtype)  # drop the view before the buffer goes back
        buffers, self._buffers = self._buffers, ()
        if self._source is not None:
            for b in buffers:
                self._source.release(b)


class ChunkFetch:
    """The fetch stage's ``fetch(unit)`` and ``unit_bytes(unit)`` over ``sources`` and their
    ``layouts``: unit ``u`` is chunk ``u - base[s]`` of source ``s``. Runs on the
    prefetcher's threads; picklable (workers fetch with their own copy)."""

    def __init__(self, sources: Sequence[TokenSource], layouts: Sequence[Layout], cache: Any = None) -> None:
        self.sources = list(sources)
        self.layouts = list(layouts)
        self.cache = cache
        self.base = np.concatenate(([0], np.cumsum([lay.num_chunks for lay in layouts]))).astype(np.int64)

    def locate(self, unit: int) -> tuple[int, int]:
        """(source, chunk) of ``unit``."""
        s = int(np.searchsorted(self.base, unit, side="right")) - 1
        return s, int(unit) - int(self.base[s])

    def unit_bytes(self, unit: int) -> int:
        s, c = self.locate(unit)
        a, b = self.layouts[s].chunk_token_range(c)
        return (b - a) * self.sources[s].itemsize + self.sources[s].block_bytes

    def read_ahead_bytes(self, window: int) -> int:
        """The default fetch budget for shuffle windows of ``window`` chunks: per source, two
        windows of its largest chunks and one more (the window being read, the next one
        fetched behind it, and a chunk a batch still views), at most
        :data:`MAX_PREFETCH_BYTES`. Through two DataLoader workers, 4 Mi-token chunks of int32
        in windows of 8 (17 chunks, 289 MiB), the first 60 M tokens after the first 4 M came
        at 395-406 M tokens/s against 230-266 M with a fixed 512 MiB, and fresh workers' whole
        epochs at 188-254 against 194-223 M: a worker's buffers are fresh memory, which the
        larger budget filled ahead of need (2026-12-04, alternating, three rounds)."""
        total = 0
        for source, layout in zip(self.sources, self.layouts):
            chunk = layout.largest_chunk_tokens() * source.itemsize + source.block_bytes
            total += (2 * min(window, layout.num_chunks) + 1) * chunk
        return max(1, min(MAX_PREFETCH_BYTES, total))

    def fetch(self, unit: int) -> TokenChunk:
        s, c = self.locate(unit)
        source, layout = self.sources[s], self.layouts[s]
        pieces: Pieces = layout.chunk_pieces(c)
        if isinstance(layout, ConcatLayout) and pieces.part.size == 1:  # the common case: a view, no copy
            tokens, buf = source.read_tokens(int(pieces.part[0]), int(pieces.start[0]), int(pieces.stop[0]),
                                             self.cache)
            return TokenChunk(unit, tokens, _buffers=(buf,), _source=source)
        # a chunk across parts is joined; a packed one gets L + 1 tokens more, so that every
        # row's window of L + 1 (its tokens and the labels' one more) lies inside
        extra = layout.seq_len + 1 if isinstance(layout, DocumentLayout) else 0
        joined = np.zeros(int((pieces.stop - pieces.start).sum()) + extra, dtype=source.dtype)
        at = 0
        for p, a, b in zip(pieces.part.tolist(), pieces.start.tolist(), pieces.stop.tolist()):
            tokens, buf = source.read_tokens(p, a, b, self.cache)
            joined[at:at + b - a] = tokens
            del tokens  # the view goes before its buffer is given back
            source.release(buf)
            at += b - a
        if isinstance(layout, ConcatLayout):
            return TokenChunk(unit, joined)
        packed = layout.chunk(c)
        first = packed.offsets[:-1]
        start = layout.part_token_starts[packed.part[first]] + packed.start[first] - layout.chunk_token_start[c]
        return TokenChunk(unit, joined, packed, start.astype(np.int64), packed.tokens())


# --- the read stage: batches cut from fetched chunks --------------------------------------
#
# A row is copied by one slice assignment (numpy converts the stored dtype as it copies):
# about 2 us of Python a row against 18 us for a whole batch of 8 rows of 2,049 tokens, where
# gathering rows through a strided view with fancy indexing took 850 us (measured here).


def cut_concat(units: Int64s, samples: Int64s, tokens: dict[int, npt.NDArray[Any]], seq_len: int,
               out: npt.NDArray[Any]) -> None:
    """Fill ``out`` (rows x width: ``seq_len + 1``, or ``seq_len`` without the extra token)
    with the sequences (``units[i]``, ``samples[i]``): sequence j of a chunk is its tokens
    ``[j*L, j*L + width)`` (``tokens[unit]``: the chunk's tokens)."""
    width = out.shape[1]
    for i, (u, j) in enumerate(zip(units.tolist(), samples.tolist())):
        a = j * seq_len
        out[i] = tokens[u][a:a + width]


def _gathered_pieces(rows: list[tuple[PackedChunk, int]]) -> tuple[Int64s, Int64s, npt.NDArray[np.bool_]]:
    """(pieces per row, piece lengths, continued) of a batch's rows (each a chunk's packing
    and the row's sequence in it), in row order, each row's pieces in order."""
    per = np.fromiter((int(p.offsets[j + 1] - p.offsets[j]) for p, j in rows), dtype=np.int64, count=len(rows))
    if len({id(p) for p, _ in rows}) == 1:  # one chunk serves the batch: one gather
        packed = rows[0][0]
        local = np.fromiter((j for _, j in rows), dtype=np.int64, count=len(rows))
        within = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
        src = np.repeat(packed.offsets[local], per) + within
        return per, packed.length[src], packed.continued[src]
    lengths = [p.length[p.offsets[j]:p.offsets[j + 1]] for p, j in rows]
    continued = [p.continued[p.offsets[j]:p.offsets[j + 1]] for p, j in rows]
    return per, np.concatenate(lengths), np.concatenate(continued)


_COUNTING = np.arange(0, dtype=np.int64)


def _counting(n: int) -> Int64s:
    """``np.arange(n)``, from one array kept and grown (positions of every batch start from it)."""
    global _COUNTING
    if _COUNTING.size < n:
        _COUNTING = np.arange(max(n, 2 * _COUNTING.size), dtype=np.int64)
    return _COUNTING[:n]


class DocumentRows:
    """A batch of packed sequences (docs/TOKEN_FORMAT.md, "packing=documents"), planned from
    the chunks' packing (cheap: per piece), its big fields written by the ``fill_*``
    methods: ``input_ids`` (rows x L: the sequence's tokens, then ``pad_id``), ``labels``
    (the next token; :data:`IGNORE_INDEX` after a document's last token, and at padding),
    ``position_ids`` (restarting at 0 at every piece and for the padding). ``padding``: per
    row; ``cu_seqlens`` (int32, flash-attn's varlen convention: one segment per piece, one
    for each row's padding, ending at rows x L). It holds the chunks' token arrays it reads."""

    def __init__(self, units: Int64s, samples: Int64s, chunks: dict[int, TokenChunk], seq_len: int,
                 pad_id: int) -> None:
        L = self.seq_len = seq_len
        self.pad_id = pad_id
        n = self.rows = int(units.size)
        count = np.empty(n, dtype=np.int64)
        rows: list[tuple[PackedChunk, int]] = []
        #: (the chunk's tokens, the row's first token there) of each row
        self.where: list[tuple[npt.NDArray[Any], int]] = []
        for i, (u, j) in enumerate(zip(units.tolist(), samples.tolist())):
            chunk = chunks[u]
            if chunk.packed is None or chunk.seq_start is None or chunk.seq_tokens is None:
                raise PlanError(f"chunk {u} was fetched for concatenated sequences, not packed documents")
            count[i] = chunk.seq_tokens[j]
            self.where.append((chunk.tokens, int(chunk.seq_start[j])))
            rows.append((chunk.packed, j))
        self.count = count
        per, length, continued = _gathered_pieces(rows)
        self.padding = L - count
        # a piece's last label is the next token only when the next piece continues its document
        done = ~continued
        ends = np.cumsum(length) - 1  # in the rows' tokens laid end to end, without padding
        row_of = np.repeat(_counting(n), per)[done]
        self.ignored = row_of * L + (ends[done] - (np.cumsum(count) - count)[row_of])
        # segments: each row's pieces, then its padding where there is any
        has_pad = self.padding > 0
        self.segments = np.insert(length, np.cumsum(per)[has_pad], self.padding[has_pad])
        self.cu_seqlens = cu_seqlens(self.segments)

    def fill_input_ids(self, out: npt.NDArray[Any]) -> None:
        for i, ((tokens, a), k) in enumerate(zip(self.where, self.count.tolist())):
            # a row's tokens are consecutive in the stream: its pieces are consecutive pieces
            out[i, :k] = tokens[a:a + k]
            out[i, k:] = self.pad_id

    def fill_labels(self, out: npt.NDArray[Any]) -> None:
        for i, ((tokens, a), k) in enumerate(zip(self.where, self.count.tolist())):
            out[i, :k] = tokens[a + 1:a + k + 1]  # the chunk holds L + 1 tokens more: always inside
            out[i, k:] = IGNORE_INDEX
        out.reshape(-1)[self.ignored] = IGNORE_INDEX

    def fill_position_ids(self, out: npt.NDArray[Any]) -> None:
        starts = np.cumsum(self.segments) - self.segments
        np.subtract(_counting(self.rows * self.seq_len), np.repeat(starts, self.segments), out=out.reshape(-1),
                    casting="unsafe")
