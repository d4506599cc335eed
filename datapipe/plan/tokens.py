"""Token sequences as the sample planner sees them: a token dataset is a dataset whose
"shards" are logical chunks of consecutive sequences and whose "samples" are sequences.

A layout computes the sequences per chunk (:attr:`counts`) arithmetically or in one
vectorised pass, so :class:`~datapipe.plan.EpochPlan` over those counts gives the epoch's
windowed shuffle, the exact partition over data-parallel ranks (elastic regrouping
included), the worker split and a resume state of a few integers, as for any dataset.
A sequence id maps back to the tokens it holds, as pieces (part, start, stop) of the
parts' token streams, so a reader fetches one chunk's covering range per part.

- :class:`ConcatLayout` (``packing="concat"``, Megatron's GPTDataset): the parts' tokens
  form one stream (documents already end with EOS); sequence i is tokens
  ``[i*L, (i+1)*L + 1)``: inputs ``[:-1]`` and labels ``[1:]`` overlap by one token. There are
  ``(T - 1) // L`` sequences of a stream of T tokens (Megatron's ``build_sample_idx`` with
  ``add_extra_token_to_sequence`` and ``drop_last_partial_sequence``); with
  ``extra_token=False`` sequence i is ``[i*L, (i+1)*L)`` and there are ``T // L``.
- :class:`DocumentLayout` (``packing="documents"``): documents are cut into pieces of at most
  L tokens (a longer document into L, L, ..., rest) and the pieces packed into sequences by
  next-fit in stored order within blocks of consecutive documents (about ``block_tokens``
  each); a chunk is ``chunk_blocks`` consecutive blocks. Packing depends on the lengths, L
  and the block size only, never on a seed: the epoch shuffle is over sequences. The plan
  keeps per-chunk counts only (O(chunks)); a chunk's packing is recomputed when a reader
  needs it (:meth:`DocumentLayout.chunk`). Counting reads every length once (O(documents),
  seconds at 10^9 documents), so it is done once per (dataset, seq_len): the result is a
  :class:`DocumentTable` (O(chunks)), stored as bytes (:meth:`DocumentTable.to_bytes`,
  checksummed and bound to the dataset's identity) and given back to later processes'
  layouts (``DocumentLayout(..., table=)``), which then cost O(chunks) and read no length
  until a chunk is repacked; repacking checks the chunk's lengths against the table's
  checksum of them, and the chunk against the table. With a table a part's lengths need
  not be held at all: a :class:`LengthReader` reads a chunk's when it is repacked (a
  reader's range of an ``.idx``), so a process holds O(parts + chunks).
- :func:`data_parallel`: the ranks of a tensor/context/pipeline-parallel group read the same
  sequences: (rank, world size) -> (data-parallel rank, data-parallel size).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeGuard, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..checksum import canonical_json, checksum
from ..errors import CorruptIndexError, OptionError, PlanError, TopologyError
from .arrays import ArrayLike, Bools, Int64s
from .epoch import EpochPlan
from .resume import layout_fingerprint

__all__ = [
    "CHUNK_TOKENS",
    "Pieces",
    "ConcatLayout",
    "DocumentLayout",
    "PackedChunk",
    "DocumentTable",
    "LengthReader",
    "TABLE_MAGIC",
    "lengths_sum",
    "cu_seqlens",
    "position_ids",
    "data_parallel",
]

#: tokens per logical chunk (concat) or per block of documents: one reader fetch
CHUNK_TOKENS = 1 << 22
#: documents read from the length arrays at a time while planning: bounds the plan's memory
_DOC_CHUNK = 1 << 18


def _int_arg(name: str, v: object, lo: int, hi: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or not lo <= int(v) <= hi:
        raise OptionError(f"{name}={v!r}: expected an integer in [{lo}, {hi}]")
    return int(v)


def _lengths_arg(name: str, v: ArrayLike, scan: bool = True) -> npt.NDArray[Any]:
    """``v`` as a 1-d integer array; ``scan``: every entry checked (O(entries)) to be >= 0."""
    arr = np.asarray(v)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise OptionError(f"{name} must be a 1-d integer array, got shape {arr.shape} of {arr.dtype}")
    for a in range(0, arr.size if scan else 0, _DOC_CHUNK):
        if arr[a:a + _DOC_CHUNK].min() < 0:
            raise OptionError(f"{name}: entry {a + int(np.argmin(arr[a:a + _DOC_CHUNK]))} is negative")
    return arr


class Pieces(NamedTuple):
    """Token ranges of several items (sequences or chunks), item j's pieces being
    ``[offsets[j], offsets[j+1])``: ``part``, and ``[start, stop)`` within that part's tokens."""

    offsets: Int64s
    part: Int64s
    start: Int64s
    stop: Int64s


def _range_pieces(part_starts: Int64s, starts: Int64s, stops: Int64s) -> Pieces:
    """Each global token range ``[starts[j], stops[j])`` cut at part boundaries (empty parts
    leave no piece)."""
    n = starts.size
    nonempty = stops > starts
    p0 = np.searchsorted(part_starts, starts, side="right") - 1
    p1 = np.searchsorted(part_starts, np.maximum(stops - 1, starts), side="right") - 1
    per = np.where(nonempty, p1 - p0 + 1, 0)
    item = np.repeat(np.arange(n), per)
    first = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(per, out=first[1:])
    part = p0[item] + (np.arange(item.size) - first[item])
    base = part_starts[part]
    start = np.maximum(starts[item], base) - base
    stop = np.minimum(stops[item], part_starts[part + 1]) - base
    keep = stop > start
    if not keep.all():
        item, part, start, stop = item[keep], part[keep], start[keep], stop[keep]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(item, minlength=n), out=offsets[1:])
    return Pieces(offsets, part.astype(np.int64), start.astype(np.int64), stop.astype(np.int64))


def _check_ids(name: str, ids: ArrayLike, n: int) -> Int64s:
    a = np.asarray(ids, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= n):
        raise PlanError(f"{name} must lie in [0, {n}), got [{a.min()}, {a.max()}]")
    return a


class _Layout:
    """What both layouts share: chunks of sequences, ids, plans."""

    kind = ""
    counts: Int64s
    _chunk_starts: Int64s
    fingerprint: str

    @property
    def num_chunks(self) -> int:
        return int(self.counts.size)

    @property
    def num_sequences(self) -> int:
        return int(self._chunk_starts[-1])

    def sequence_ids(self, chunk: ArrayLike, sample: ArrayLike) -> Int64s:
        """Global sequence ids of (chunk, sequence within chunk): what
        :meth:`EpochPlan.rank_samples` returns as (shard, sample)."""
        c = _check_ids("chunk", chunk, self.num_chunks)
        s = np.asarray(sample, dtype=np.int64)
        if s.size and (s.min() < 0 or (s >= self.counts[c]).any()):
            raise PlanError("a sequence index lies outside its chunk")
        out: Int64s = self._chunk_starts[c] + s
        return out

    def chunk_of(self, seq_ids: ArrayLike) -> tuple[Int64s, Int64s]:
        """(chunk, sequence within chunk) of global sequence ids."""
        q = _check_ids("sequence ids", seq_ids, self.num_sequences)
        c = np.searchsorted(self._chunk_starts, q, side="right") - 1
        return c, q - self._chunk_starts[c]

    def epoch_plan(self, *, seed: int = 0, epoch: int = 0, window: int = 1 << 62, world: int = 1,
                   drop_last: bool = False, identity: str = "", state: dict[str, Any] | None = None) -> EpochPlan:
        """The :class:`~datapipe.plan.EpochPlan` of this layout's chunks for ``world``
        data-parallel ranks (from ``state`` when resuming, regrouped if ``world`` changed).
        ``identity`` (e.g. the manifest checksum) goes into the state's fingerprint."""
        fp = layout_fingerprint(self.counts, f"{self.fingerprint}|{identity}")
        if state is not None:
            return EpochPlan.from_state(self.counts, state, seed=seed, window=window, world=world,
                                        drop_last=drop_last, fingerprint=fp)
        return EpochPlan(self.counts, seed=seed, epoch=epoch, window=window, world=world,
                         drop_last=drop_last, fingerprint=fp)


def _finish_counts(counts: Int64s) -> tuple[Int64s, Int64s]:
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    counts.flags.writeable = False
    starts = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return counts, starts


class ConcatLayout(_Layout):
    """Megatron GPTDataset sequences over the concatenated parts: ``part_tokens[p]`` tokens in
    part p, ``seq_len`` L, ``chunk_sequences`` consecutive sequences per chunk (default: about
    :data:`CHUNK_TOKENS` tokens). Everything is O(parts + chunks)."""

    kind = "concat"

    def __init__(self, part_tokens: ArrayLike, seq_len: int, *, chunk_sequences: int | None = None,
                 extra_token: bool = True) -> None:
        tokens = _lengths_arg("part_tokens", part_tokens).astype(np.int64)
        self.seq_len = L = _int_arg("seq_len", seq_len, 1, 1 << 31)
        self.extra = int(bool(extra_token))
        self.part_starts = np.zeros(tokens.size + 1, dtype=np.int64)
        np.cumsum(tokens, out=self.part_starts[1:])
        self.num_tokens = T = int(self.part_starts[-1])
        n = max(T - self.extra, 0) // L
        k = max(1, CHUNK_TOKENS // L) if chunk_sequences is None else _int_arg("chunk_sequences", chunk_sequences, 1)
        self.chunk_sequences = k
        nchunks = -(-n // k)
        counts = np.full(nchunks, k, dtype=np.int64)
        if nchunks:
            counts[-1] = n - (nchunks - 1) * k
        self.counts, self._chunk_starts = _finish_counts(counts)
        ident = {"kind": self.kind, "seq_len": L, "extra": self.extra, "chunk": k,
                 "parts": checksum(np.ascontiguousarray(tokens, dtype="<i8").tobytes())}
        self.fingerprint = json.dumps(ident, sort_keys=True)

    def chunk_of(self, seq_ids: ArrayLike) -> tuple[Int64s, Int64s]:
        q = _check_ids("sequence ids", seq_ids, self.num_sequences)
        return q // self.chunk_sequences, q % self.chunk_sequences

    def token_range(self, seq_ids: ArrayLike) -> tuple[Int64s, Int64s]:
        """[start, stop) of each sequence in the concatenated stream: L tokens, plus the one
        that ends the labels with ``extra_token``."""
        q = _check_ids("sequence ids", seq_ids, self.num_sequences)
        start = q * self.seq_len
        return start, start + self.seq_len + self.extra

    def pieces(self, seq_ids: ArrayLike) -> Pieces:
        """Each sequence's tokens as pieces of parts (a sequence may straddle parts)."""
        start, stop = self.token_range(seq_ids)
        return _range_pieces(self.part_starts, start, stop)

    def chunk_token_range(self, chunk: int) -> tuple[int, int]:
        """[start, stop) of the stream that covers every sequence of ``chunk``."""
        c = int(_check_ids("chunk", [chunk], self.num_chunks)[0])
        first = c * self.chunk_sequences
        return first * self.seq_len, (first + int(self.counts[c])) * self.seq_len + self.extra

    def largest_chunk_tokens(self) -> int:
        """The most tokens one chunk's :meth:`chunk_token_range` spans."""
        return int(self.counts.max()) * self.seq_len + self.extra if self.num_chunks else 0

    def chunk_pieces(self, chunk: int) -> Pieces:
        """:meth:`chunk_token_range` cut at part boundaries: the reads of one chunk."""
        a, b = self.chunk_token_range(chunk)
        return _range_pieces(self.part_starts, np.array([a]), np.array([b]))


@dataclass(frozen=True)
class PackedChunk:
    """One chunk's packing: sequence j (0-based within the chunk; global id
    ``first_sequence + j``) holds pieces ``[offsets[j], offsets[j+1])``, in order. A piece is
    ``length`` tokens of document ``doc`` at token ``start`` of ``part``; ``continued`` marks a
    piece followed by another piece of its (long) document, in the next sequence."""

    chunk: int
    seq_len: int
    first_sequence: int
    offsets: Int64s
    part: Int64s
    start: Int64s
    length: Int64s
    doc: Int64s
    continued: Bools

    @property
    def num_sequences(self) -> int:
        return int(self.offsets.size) - 1

    def tokens(self) -> Int64s:
        """Tokens in each of the chunk's sequences."""
        cum = np.concatenate(([0], np.cumsum(self.length)))
        out: Int64s = cum[self.offsets[1:]] - cum[self.offsets[:-1]]
        return out

    def padding(self) -> Int64s:
        """Padding each sequence needs to reach ``seq_len`` tokens."""
        out: Int64s = self.seq_len - self.tokens()
        return out

    def pieces(self, local: ArrayLike) -> Pieces:
        """The pieces of sequences ``local`` (indices within the chunk), as token ranges."""
        j = _check_ids("sequences", local, self.num_sequences)
        per = self.offsets[j + 1] - self.offsets[j]
        offsets = np.zeros(j.size + 1, dtype=np.int64)
        np.cumsum(per, out=offsets[1:])
        idx = np.repeat(self.offsets[j] - offsets[:-1], per) + np.arange(int(offsets[-1]))
        return Pieces(offsets, self.part[idx], self.start[idx], self.start[idx] + self.length[idx])

    def segment_lengths(self, local: ArrayLike) -> tuple[Int64s, Int64s]:
        """(lengths, per-sequence counts) of the attention segments of sequences ``local``:
        one per piece, then one for the padding where there is any, so the segments of a
        sequence add up to exactly ``seq_len``. Feed them to :func:`cu_seqlens` and
        :func:`position_ids` (after concatenating those of a batch's chunks, in batch order)."""
        p = self.pieces(local)
        lengths = p.stop - p.start
        per = np.diff(p.offsets)
        cum = np.concatenate(([0], np.cumsum(lengths)))
        pad = self.seq_len - (cum[p.offsets[1:]] - cum[p.offsets[:-1]])
        has_pad = pad > 0
        # the padding segment goes after each sequence's last piece
        at = p.offsets[1:][has_pad]
        out = np.insert(lengths, at, pad[has_pad])
        return out.astype(np.int64), per + has_pad


def cu_seqlens(segment_lengths: ArrayLike) -> npt.NDArray[np.int32]:
    """flash-attn's varlen ``cu_seqlens`` (int32, a leading 0) of a batch whose sequences,
    each padded to L and laid end to end, are made of ``segment_lengths``
    (:meth:`PackedChunk.segment_lengths`)."""
    seg = np.asarray(segment_lengths, dtype=np.int64)
    out = np.zeros(seg.size + 1, dtype=np.int64)
    np.cumsum(seg, out=out[1:])
    if out[-1] > np.iinfo(np.int32).max:
        raise PlanError(f"a batch of {int(out[-1])} tokens does not fit int32 cu_seqlens")
    return out.astype(np.int32)


def position_ids(segment_lengths: ArrayLike, seq_len: int) -> Int64s:
    """Position ids, shape (sequences, ``seq_len``): each segment counts from 0 (a piece of a
    long document too: its positions restart, as Megatron's do for a sequence that starts
    inside a document, and stay below ``seq_len``)."""
    seg = np.asarray(segment_lengths, dtype=np.int64)
    total = int(seg.sum())
    if total % seq_len:
        raise PlanError(f"segments of {total} tokens are not whole sequences of {seq_len}")
    starts = np.cumsum(seg) - seg
    out: Int64s = (np.arange(total, dtype=np.int64) - np.repeat(starts, seg)).reshape(-1, seq_len)
    return out


def _pieces(lengths: Int64s, L: int) -> tuple[Int64s, Int64s]:
    """(piece lengths, first piece of each document and the end: D+1 entries) of documents
    of ``lengths`` cut into pieces of at most L: L, L, ..., the rest (none for an empty one)."""
    per = -(-lengths // L)
    first = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(per, out=first[1:])
    plen = np.full(int(first[-1]), L, dtype=np.int64)
    nz = per > 0
    plen[first[1:][nz] - 1] = lengths[nz] - (per[nz] - 1) * L
    return plen, first


#: pieces a sequence is probed for before a binary search: most sequences hold a few
_PROBE = 4


def _count_pieces(lengths: Int64s, L: int) -> tuple[Int64s, Int64s, Int64s]:
    """What next-fit counting needs, one piece per document. A document of n <= L tokens is
    its piece. A longer one, cut into k pieces L, ..., L, r, packs as k - 1 sequences of one
    full piece each and then r, which starts a sequence: it is counted as k - 1 extra
    sequences and the piece r, placed after a gap of L so no sequence before it reaches
    it. Returns (start, end) of each piece on that line (``end`` padded with ``_PROBE``
    entries that nothing reaches) and the extra sequences."""
    n = lengths.size
    plen = np.minimum(lengths, L)
    long = np.flatnonzero(lengths > L)
    rest = lengths[long] - 1
    plen[long] = rest % L + 1
    end = np.empty(n + _PROBE, dtype=np.int64)
    end[:n] = plen
    end[long] += L
    np.cumsum(end[:n], out=end[:n])
    end[n:] = np.iinfo(np.int64).max
    extra = np.zeros(n, dtype=np.int64)
    extra[long] = rest // L
    start = end[:n] - plen
    return start, end, extra


def _next_fit_counts(start: Int64s, end: Int64s, block_first: Int64s, L: int) -> Int64s:
    """Sequences each block packs to by next-fit, piece j lying at ``[start[j], end[j])`` of a
    line (``end`` padded as :func:`_count_pieces` pads it), block b owning pieces
    ``[block_first[b], block_first[b+1])``: a sequence that starts at piece k takes every
    piece j with ``end[j] <= start[k] + L``. One iteration per sequence slot advances every
    unfinished block by one sequence, so the loop runs as often as a block has sequences
    and each pass is numpy-wide over blocks. A sequence's end is found by probing its next
    few pieces (neighbouring memory), or by a binary search for the few that hold more."""
    n = start.size
    # a block's first sequence starts at its first piece that holds tokens (empty ones
    # before it would start an empty sequence); a block with none packs to nothing
    full = np.flatnonzero(end[:n] > start)
    at = np.searchsorted(full, block_first[:-1])
    first = full[np.minimum(at, full.size - 1)] if full.size else at
    stop_all = block_first[1:]
    counts = np.zeros(stop_all.size, dtype=np.int64)
    active = np.flatnonzero((at < full.size) & (first < stop_all))
    ptr, stop = first[active], stop_all[active]
    while active.size:
        limit = start[ptr] + L
        # pieces ptr, ptr+1, ... fit while their end is within limit (the first always does)
        nxt = ptr + 1
        for j in range(1, _PROBE):
            nxt += end[ptr + j] <= limit
        more = np.flatnonzero(nxt == ptr + _PROBE)
        if more.size:
            nxt[more] = np.searchsorted(end[:n], limit[more], side="right")
        counts[active] += 1
        keep = nxt < stop
        active, ptr, stop = active[keep], nxt[keep], stop[keep]
    return counts


#: the first bytes of a stored :class:`DocumentTable`: a file at a table's path that does
#: not start with them is no table of datapipe's (a reader leaves it alone)
TABLE_MAGIC = b"DPDOCTAB"
#: the longest header a stored table may have (it names sizes and checksums only)
_MAX_TABLE_HEADER = 1 << 16
#: version 2 added each part's ``part_ranged`` and each chunk's ``chunk_sums``
_TABLE_FORMAT, _TABLE_VERSION = "datapipe-document-table", 2


def lengths_sum(lengths: ArrayLike) -> int:
    """The checksum a :class:`DocumentTable` keeps of one chunk's document lengths: xxh3-64
    of them as little-endian int64, as a signed int64 (how the table stores it)."""
    raw = np.ascontiguousarray(lengths, dtype="<i8")
    v = int(checksum(raw.data.cast("B")).partition(":")[2], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass(frozen=True)
class DocumentTable:
    """What :class:`DocumentLayout` computes from every document length, O(parts + chunks):
    the packing's parameters, each part's documents and tokens, each chunk's first document
    and first token (and the ends), its sequences and the checksum of its documents'
    lengths (:func:`lengths_sum`), so that a reader may take a chunk's lengths from a range
    of a file and check them before it repacks the chunk. ``part_ranged[p]`` (0 or 1) is
    the reader's to set: 1 where part p's document lengths are a plain slice of its
    ``.idx`` sizes (one sequence per document), so they can be range-read. Stored once
    per (dataset, seq_len) with :meth:`to_bytes`, read back with :meth:`from_bytes` and
    given to ``DocumentLayout(..., table=)``, so no later process counts again."""

    seq_len: int
    block_tokens: int
    chunk_blocks: int
    part_docs: Int64s
    part_tokens: Int64s
    part_ranged: Int64s
    chunk_doc_start: Int64s
    chunk_token_start: Int64s
    counts: Int64s
    chunk_sums: Int64s

    def _arrays(self) -> tuple[Int64s, ...]:
        return (self.part_docs, self.part_tokens, self.part_ranged, self.chunk_doc_start, self.chunk_token_start,
                self.counts, self.chunk_sums)

    def to_bytes(self, identity: str = "") -> bytes:
        """The table as a file: :data:`TABLE_MAGIC`, the header's length (8 bytes, little
        endian), a self-checksummed JSON header (sizes, parameters, ``identity``: what the
        table was computed from, e.g. the token manifest's checksum; the payload's checksum),
        then the arrays as raw little-endian int64. The same table gives the same bytes."""
        payload = b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes() for a in self._arrays())
        doc: dict[str, Any] = {"format": _TABLE_FORMAT, "version": _TABLE_VERSION, "identity": identity,
                               "seq_len": self.seq_len, "block_tokens": self.block_tokens,
                               "chunk_blocks": self.chunk_blocks, "parts": int(self.part_docs.size),
                               "chunks": int(self.counts.size), "payload_checksum": checksum(payload)}
        doc["header_checksum"] = checksum(canonical_json(doc))
        header = canonical_json(doc)
        return TABLE_MAGIC + len(header).to_bytes(8, "little") + header + payload

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, where: str, *, identity: str | None = None) -> DocumentTable:
        """The table ``data`` holds (read from ``where``), checked: its header's and payload's
        checksums, its sizes, and that its arrays describe a partition of the documents and
        tokens into chunks (O(chunks)); ``identity``: the one it must have been stored with.
        :class:`~datapipe.errors.CorruptIndexError` naming ``where`` for bytes that are no
        such table (or a table of another version), :class:`~datapipe.errors.PlanError` for
        a table of another dataset."""
        view = memoryview(data).cast("B")
        redo = "remove it and the next reader counts the documents again"

        def bad(why: str) -> CorruptIndexError:
            return CorruptIndexError(f"{where}: not a document packing table ({why}); {redo}")

        head = len(TABLE_MAGIC) + 8
        if view.nbytes < head or bytes(view[:len(TABLE_MAGIC)]) != TABLE_MAGIC:
            raise bad("it does not start with the table's magic bytes")
        n = int.from_bytes(view[len(TABLE_MAGIC):head], "little")
        if n > min(_MAX_TABLE_HEADER, view.nbytes - head):
            raise bad(f"a header of {n} bytes in a file of {view.nbytes}")
        try:
            doc = json.loads(bytes(view[head:head + n]))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise bad("its header is not JSON") from None
        if not isinstance(doc, dict) or doc.get("format") != _TABLE_FORMAT:
            raise bad(f"format is not {_TABLE_FORMAT!r}")
        if doc.get("version") != _TABLE_VERSION:
            raise bad(f"version {doc.get('version')!r}; this datapipe reads version {_TABLE_VERSION}")
        stored = doc.pop("header_checksum", None)
        try:
            ok = checksum(canonical_json(doc)) == stored
        except ValueError:  # a non-finite number does not canonicalise
            ok = False
        if not ok:
            raise CorruptIndexError(f"{where}: the document packing table's header checksum does not match; {redo}")
        sizes = {}
        for name in ("seq_len", "block_tokens", "chunk_blocks", "parts", "chunks"):
            v = doc.get(name)
            if type(v) is not int or not (0 if name in ("parts", "chunks") else 1) <= v < 1 << 62:
                raise bad(f"{name}={v!r}")
            sizes[name] = v
        parts, chunks = sizes["parts"], sizes["chunks"]
        want = 8 * (3 * parts + 4 * chunks + 2)
        if view.nbytes - head - n != want:
            raise bad(f"{view.nbytes - head - n} payload bytes where {parts} parts and {chunks} chunks take {want}")
        payload = view[head + n:]
        if checksum(payload) != doc.get("payload_checksum"):
            raise CorruptIndexError(f"{where}: the document packing table's payload checksum does not match "
                                    f"(the file was damaged); {redo}")
        if identity is not None and doc.get("identity") != identity:
            raise PlanError(f"{where}: the document packing table was computed for {doc.get('identity')!r}, "
                            f"not {identity!r} (the dataset changed since); {redo}")
        flat = np.frombuffer(payload, dtype="<i8").astype(np.int64, copy=False)  # a view where int64 is "<i8"
        cut = np.cumsum([parts, parts, parts, chunks + 1, chunks + 1, chunks])
        arrays = np.split(flat, cut)
        for a in arrays:
            a.flags.writeable = False
        table = cls(sizes["seq_len"], sizes["block_tokens"], sizes["chunk_blocks"], *arrays)
        defect = table.defect()
        if defect:
            raise bad(defect)
        return table

    def defect(self) -> str:
        """Why the arrays are no partition of the parts' documents and tokens into chunks
        (O(parts + chunks)), or "" when they are one."""
        arrays = self._arrays()
        if any(not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.int64 for a in arrays):
            return "its arrays are not 1-d int64 arrays"
        part_docs, part_tokens, ranged, doc_start, tok_start, counts, sums = arrays
        if not part_docs.size == part_tokens.size == ranged.size \
                or not doc_start.size == tok_start.size == counts.size + 1 == sums.size + 1:
            return "its arrays' sizes do not match"
        if (part_docs < 0).any() or (part_tokens < 0).any() or (counts < 0).any():
            return "a negative size"
        if ((ranged != 0) & (ranged != 1)).any():
            return "a part_ranged flag that is neither 0 nor 1"
        if counts.size:
            wide = np.diff(tok_start)
            if doc_start[0] != 0 or tok_start[0] != 0 or (np.diff(doc_start) <= 0).any() or (wide < 0).any():
                return "its chunks do not start at document 0 and token 0 in order"
            if (counts > wide).any():
                return "a chunk with more sequences than tokens"
        # sums in Python ints: int64 sums of hostile sizes could wrap around to the right total
        if int(doc_start[-1]) != sum(part_docs.tolist()) or int(tok_start[-1]) != sum(part_tokens.tolist()):
            return "its chunks do not end where the parts' documents and tokens end"
        return ""


@runtime_checkable
class LengthReader(Protocol):
    """A part's document lengths that a :class:`DocumentLayout` does not hold: ``size``
    documents; ``read(start, stop)``: the lengths of documents ``[start, stop)`` (the
    reader's I/O, e.g. a range of an ``.idx``, not checked: the layout checks them);
    ``where(start, stop)``: what such a read reads, for errors (a URL and byte range)."""

    @property
    def size(self) -> int: ...

    def read(self, start: int, stop: int) -> ArrayLike: ...

    def where(self, start: int, stop: int) -> str: ...


def _is_reader(x: object) -> TypeGuard[LengthReader]:
    """``x`` is a :class:`LengthReader` (an array, the common case, is told apart cheaply)."""
    return not isinstance(x, np.ndarray) and isinstance(x, LengthReader)


class DocumentLayout(_Layout):
    """Whole documents packed into sequences of at most ``seq_len`` tokens (see the module
    docstring). ``doc_lengths[p]``: tokens per document of part p (e.g. an ``np.memmap`` view
    of an ``.idx``, :meth:`TokenIndex.document_lengths`); it is kept, not copied, to repack a
    chunk on demand.

    Packing block b holds the documents whose first token lies in ``[b, b+1) *
    block_tokens`` of the stream (blocks a long document leaves empty are dropped); next-fit
    never carries a sequence across a block. A chunk (the planner's shard, one reader
    fetch) is ``chunk_blocks`` consecutive blocks. Defaults: blocks of 64 sequences' worth of
    tokens (so a block's last, partly filled sequence costs little padding) and chunks of
    about :data:`CHUNK_TOKENS`. Planning reads the lengths once, in slices: O(documents)
    time; memory O(chunks) kept plus a bounded working set. ``table``: what an earlier
    layout over the same lengths counted (its :attr:`table`, stored and read back with
    :meth:`DocumentTable.from_bytes`): O(chunks), no length read until a chunk is repacked.
    With a table, a part's lengths may be a :class:`LengthReader` instead of an array (not
    held at all: e.g. ranges of an ``.idx`` read when a chunk is repacked); what it reads
    is checked against the table's checksum of that chunk's lengths before it is used."""

    kind = "documents"

    def __init__(self, doc_lengths: Sequence[ArrayLike | LengthReader], seq_len: int, *,
                 block_tokens: int | None = None,
                 chunk_blocks: int | None = None, table: DocumentTable | None = None) -> None:
        if isinstance(doc_lengths, np.ndarray) and doc_lengths.ndim == 1:
            raise OptionError("doc_lengths is one array per part: pass [lengths] for a single part")
        if table is not None and not isinstance(table, DocumentTable):
            raise OptionError(f"table={table!r}: expected a DocumentTable (DocumentTable.from_bytes) or None")
        if table is not None and table.defect():
            raise OptionError(f"table: not a document packing table ({table.defect()})")
        if table is None and any(_is_reader(x) for x in doc_lengths):
            raise OptionError("doc_lengths: a part's lengths may be a LengthReader (not held) only with a table=; "
                              "counting reads every length")
        # with a table no length is read now: a chunk's are checked when it is repacked.
        #: each part's document lengths: an array, or a :class:`LengthReader` of them
        self.doc_lengths: list[npt.NDArray[Any] | LengthReader] = [
            x if _is_reader(x) else _lengths_arg(f"doc_lengths[{i}]", cast(ArrayLike, x), scan=table is None)
            for i, x in enumerate(doc_lengths)]
        self.seq_len = L = _int_arg("seq_len", seq_len, 1, 1 << 31)
        self.block_tokens = 64 * L if block_tokens is None else _int_arg("block_tokens", block_tokens, 1)
        self.chunk_blocks = max(1, CHUNK_TOKENS // self.block_tokens) if chunk_blocks is None \
            else _int_arg("chunk_blocks", chunk_blocks, 1)
        if table is not None and table.part_docs.size != len(self.doc_lengths):
            raise PlanError(f"the document packing table counts {table.part_docs.size} parts, the lengths given "
                            f"are of {len(self.doc_lengths)}: count the documents again (DocumentLayout without "
                            "table=)")
        docs = np.array([int(x.size) for x in self.doc_lengths], dtype=np.int64)
        self.part_doc_starts = np.concatenate(([0], np.cumsum(docs)))
        self.num_documents = int(self.part_doc_starts[-1])
        if table is None:
            part_tokens = np.array([int(x.sum(dtype=np.int64)) for x in self.held()], dtype=np.int64)
        else:
            self._check_table(table, docs)
            part_tokens = table.part_tokens
        self.part_token_starts = np.concatenate(([0], np.cumsum(part_tokens)))
        self.num_tokens = int(self.part_token_starts[-1])
        #: first document (global id) and its first token (in the stream) of each chunk, and
        #: the end; the planner's counts: sequences per chunk
        if table is None:
            self.chunk_doc_start, self.chunk_token_start, counts = self._plan()
        else:
            self.chunk_doc_start, self.chunk_token_start, counts = \
                table.chunk_doc_start, table.chunk_token_start, table.counts
        self.counts, self._chunk_starts = _finish_counts(counts)
        #: what was counted, to store (:meth:`DocumentTable.to_bytes`) for later processes
        #: (``part_ranged`` all 0: the reader that knows its files sets it)
        self.table = table if table is not None else DocumentTable(
            L, self.block_tokens, self.chunk_blocks, docs, part_tokens, np.zeros(docs.size, dtype=np.int64),
            self.chunk_doc_start, self.chunk_token_start, self.counts, self._chunk_sums())
        ident = {"kind": self.kind, "seq_len": L, "block_tokens": self.block_tokens,
                 "chunk_blocks": self.chunk_blocks,
                 "parts": checksum(np.ascontiguousarray(part_tokens, dtype="<i8").tobytes()
                                   + docs.astype("<i8").tobytes() + self.chunk_doc_start.astype("<i8").tobytes())}
        self.fingerprint = json.dumps(ident, sort_keys=True)

    def _check_table(self, table: DocumentTable, docs: Int64s) -> None:
        """:class:`~datapipe.errors.PlanError` unless ``table`` was counted with these
        parameters over parts of these sizes."""
        mine = (self.seq_len, self.block_tokens, self.chunk_blocks)
        theirs = (table.seq_len, table.block_tokens, table.chunk_blocks)
        if mine != theirs:
            raise PlanError(f"the document packing table is for (seq_len, block_tokens, chunk_blocks) = {theirs}, "
                            f"this layout's are {mine}: count the documents again (DocumentLayout without table=)")
        if not np.array_equal(table.part_docs, docs):
            raise PlanError(f"the document packing table counts {table.part_docs.size} parts of "
                            f"{int(table.part_docs.sum())} documents, the lengths given hold {docs.size} parts of "
                            f"{int(docs.sum())}: count the documents again (DocumentLayout without table=)")

    def held(self) -> list[npt.NDArray[Any]]:
        """Every part's lengths (all held: a layout that counts is given arrays only)."""
        return [x for x in self.doc_lengths if isinstance(x, np.ndarray)]

    def _slices(self) -> Iterator[Int64s]:
        for x in self.held():
            for a in range(0, x.size, _DOC_CHUNK):
                yield x[a:a + _DOC_CHUNK].astype(np.int64)

    def _plan(self) -> tuple[Int64s, Int64s, Int64s]:
        """(first document, first token, sequences) of every chunk, in one pass over the
        lengths; the blocks' own counts are summed into their chunk's as they are found.
        The documents of the block still open at the end of a slice go on into the next."""
        L, bt, k = self.seq_len, self.block_tokens, self.chunk_blocks
        chunk_doc: list[Int64s] = []
        chunk_tok: list[Int64s] = []
        finished: list[Int64s] = []  # sequences of every chunk but the open one
        open_total, nblocks = 0, 0
        pending = np.empty(0, dtype=np.int64)  # lengths of the open block's documents
        pending_doc = pending_tok = 0  # global id and stream offset of its first document
        slices = self._slices()
        done = False
        while not done:
            more = next(slices, None)
            done = more is None
            lengths = pending if more is None else np.concatenate((pending, more))
            if not lengths.size:
                continue
            starts = np.cumsum(lengths)
            starts -= lengths
            starts += pending_tok
            key = starts // bt
            # a block is a run of documents whose first tokens share a key; pending starts one
            first = np.concatenate(([0], np.flatnonzero(key[1:] != key[:-1]) + 1))
            del key
            closed, cut = (first, lengths.size) if done else (first[:-1], int(first[-1]))
            if closed.size:
                pstart, pend, extra = _count_pieces(lengths[:cut], L)
                cnt = _next_fit_counts(pstart, pend, np.append(closed, cut), L)
                cnt += np.add.reduceat(extra, closed)
                del pstart, pend, extra
                heads = np.flatnonzero((nblocks + np.arange(closed.size)) % k == 0)
                chunk_doc.append(pending_doc + closed[heads])
                chunk_tok.append(starts[closed[heads]])
                if not heads.size:
                    open_total += int(cnt.sum())
                else:
                    open_total += int(cnt[:heads[0]].sum())
                    if nblocks:  # the chunk open before this slice is complete
                        finished.append(np.array([open_total]))
                    sums = np.add.reduceat(cnt, heads)
                    finished.append(sums[:-1])
                    open_total = int(sums[-1])
                nblocks += closed.size
            del starts
            pending_doc += cut
            pending_tok += int(lengths[:cut].sum())
            pending = lengths[cut:]
        if nblocks:
            finished.append(np.array([open_total]))
        return (np.concatenate([*chunk_doc, [self.num_documents]]).astype(np.int64),
                np.concatenate([*chunk_tok, [self.num_tokens]]).astype(np.int64),
                np.concatenate([*finished, np.empty(0, np.int64)]).astype(np.int64))

    def _chunk_sums(self) -> Int64s:
        """:func:`lengths_sum` of every chunk's document lengths, read in groups of chunks
        of about ``_DOC_CHUNK`` documents (O(documents) time, bounded memory)."""
        n, starts = self.num_chunks, self.chunk_doc_start
        out = np.empty(n, dtype=np.int64)
        c = 0
        while c < n:
            e = min(n, max(c + 1, int(np.searchsorted(starts, starts[c] + _DOC_CHUNK, side="right")) - 1))
            base = int(starts[c])
            lengths, _ = self._lengths_of(base, int(starts[e]))
            for j in range(c, e):
                out[j] = lengths_sum(lengths[int(starts[j]) - base:int(starts[j + 1]) - base])
            c = e
        return out

    def _lengths_of(self, d0: int, d1: int) -> tuple[Int64s, list[str]]:
        """(lengths of global documents ``[d0, d1)``, which may lie in several parts; what
        was read for them, where a part's are a :class:`LengthReader`'s)."""
        p = _range_pieces(self.part_doc_starts, np.array([d0]), np.array([d1]))
        out, read = [], []
        for i, a, z in zip(p.part.tolist(), p.start.tolist(), p.stop.tolist()):
            x = self.doc_lengths[i]
            if _is_reader(x):
                out.append(np.asarray(x.read(a, z), dtype=np.int64))
                read.append(x.where(a, z))
            else:
                out.append(np.asarray(x[a:z], dtype=np.int64))
        return np.concatenate([*out, np.empty(0, np.int64)]), read

    def lengths_match(self, chunk: int, lengths: ArrayLike) -> bool:
        """Whether ``lengths`` are chunk ``chunk``'s documents' lengths as they were counted
        (their number and the table's checksum of them)."""
        c = int(_check_ids("chunk", [chunk], self.num_chunks)[0])
        arr = np.asarray(lengths)
        return bool(arr.ndim == 1 and arr.size == int(self.chunk_doc_start[c + 1] - self.chunk_doc_start[c])
                    and lengths_sum(arr) == int(self.table.chunk_sums[c]))

    def chunk(self, c: int) -> PackedChunk:
        """Chunk ``c``'s packing, recomputed from its documents' lengths (O(documents of the
        chunk); a :class:`LengthReader` reads them now), which must be what was counted
        (:meth:`lengths_match`): else :class:`CorruptIndexError` naming what was read, or
        :class:`PlanError` for lengths given as arrays."""
        c = int(_check_ids("chunk", [c], self.num_chunks)[0])
        L = self.seq_len
        d0, d1 = int(self.chunk_doc_start[c]), int(self.chunk_doc_start[c + 1])
        lengths, read = self._lengths_of(d0, d1)
        if not self.lengths_match(c, lengths):
            if read:
                raise CorruptIndexError(
                    f"{', '.join(read)}: chunk {c}'s document lengths do not match the checksum the document "
                    "packing table recorded when it counted them: the file was damaged or replaced since. Index or "
                    "pack the dataset again (if the file is right, remove the table, plans/ beside the manifest: "
                    "it is counted again)")
            raise PlanError(f"chunk {c}'s documents [{d0}, {d1}): their lengths do not match the checksum counted "
                            "of them: the document lengths changed since the plan was made")
        t0, t1 = int(self.chunk_token_start[c]), int(self.chunk_token_start[c + 1])
        if lengths.size and (lengths.min() < 0 or int(lengths.sum()) != t1 - t0):
            raise PlanError(f"chunk {c}'s documents [{d0}, {d1}) hold {int(lengths.sum())} tokens (smallest "
                            f"{int(lengths.min())}), the plan says {t1 - t0}: the document lengths changed since "
                            "the plan was made")
        doc_tok = np.cumsum(lengths) - lengths + t0
        key = doc_tok // self.block_tokens
        block_docs = np.concatenate(([0], np.flatnonzero(key[1:] != key[:-1]) + 1, [lengths.size]))
        plen, doc_first = _pieces(lengths, L)
        n = plen.size
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(plen, out=cum[1:])
        block_first = doc_first[block_docs]
        # next-fit: the sequence that starts at piece k ends before hop[k] (capped at k's
        # block's end, so the chain from piece 0 passes through every block start)
        hop = np.searchsorted(cum, cum[:-1] + L, side="right") - 1
        hop = np.append(np.minimum(hop, np.repeat(block_first[1:], np.diff(block_first))), n)
        # the chain 0, hop[0], hop[hop[0]], ... by doubling: log2(sequences) numpy steps
        chain = np.zeros(1, dtype=np.int64)
        while chain[-1] < n:
            chain = np.concatenate((chain, hop[chain]))
            hop = hop[hop]
        seq_first = chain[chain < n]
        if seq_first.size != self.counts[c]:
            raise PlanError(f"chunk {c} packs into {seq_first.size} sequences, the plan says {int(self.counts[c])}: "
                            "the document lengths changed since the plan was made")
        doc = np.repeat(np.arange(lengths.size, dtype=np.int64), np.diff(doc_first))
        off = (np.arange(n, dtype=np.int64) - doc_first[doc]) * L
        g = doc + d0
        part = np.searchsorted(self.part_doc_starts, g, side="right") - 1
        start = doc_tok[doc] + off - self.part_token_starts[part]
        return PackedChunk(c, L, int(self._chunk_starts[c]), np.append(seq_first, n).astype(np.int64),
                           part.astype(np.int64), start.astype(np.int64), plen, g, off + plen < lengths[doc])

    def chunk_token_range(self, chunk: int) -> tuple[int, int]:
        """[start, stop) of the stream that chunk ``chunk``'s documents occupy."""
        c = int(_check_ids("chunk", [chunk], self.num_chunks)[0])
        return int(self.chunk_token_start[c]), int(self.chunk_token_start[c + 1])

    def largest_chunk_tokens(self) -> int:
        """The most tokens one chunk's :meth:`chunk_token_range` spans."""
        return int(np.diff(self.chunk_token_start).max()) if self.num_chunks else 0

    def chunk_pieces(self, chunk: int) -> Pieces:
        """:meth:`chunk_token_range` cut at part boundaries: the reads of one chunk."""
        a, z = self.chunk_token_range(chunk)
        return _range_pieces(self.part_token_starts, np.array([a]), np.array([z]))

    def pieces(self, seq_ids: ArrayLike) -> Pieces:
        """The pieces of global sequence ids, in the order given (each chunk is repacked
        once per call)."""
        q = np.asarray(seq_ids, dtype=np.int64)
        c, s = self.chunk_of(q)
        per = np.zeros(q.size, dtype=np.int64)
        found = []
        for ch in np.unique(c).tolist():
            sel = np.flatnonzero(c == ch)
            p = self.chunk(ch).pieces(s[sel])
            per[sel] = np.diff(p.offsets)
            found.append((sel, p))
        offsets = np.zeros(q.size + 1, dtype=np.int64)
        np.cumsum(per, out=offsets[1:])
        part = np.empty(int(offsets[-1]), dtype=np.int64)
        start, stop = np.empty_like(part), np.empty_like(part)
        for sel, p in found:
            idx = np.repeat(offsets[sel] - p.offsets[:-1], np.diff(p.offsets)) + np.arange(p.part.size)
            part[idx], start[idx], stop[idx] = p.part, p.start, p.stop
        return Pieces(offsets, part, start, stop)


def data_parallel(rank: int | None = None, world_size: int | None = None, replication: int = 1, *,
                  pipeline: int = 1, dp_rank: int | None = None, dp_size: int | None = None) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of a global ``rank``. The ``replication``
    ranks of one tensor (x context) parallel group are consecutive and read the same
    sequences; ``pipeline`` stages are outermost (Megatron's default order
    tp-cp-dp-pp): ``dp_rank = (rank // replication) % dp_size`` with ``dp_size = world_size
    // (replication * pipeline)``. An explicit ``dp_rank``/``dp_size`` is taken as is
    (checked). :class:`TopologyError` when the sizes do not divide."""
    if dp_rank is not None or dp_size is not None:
        if dp_rank is None or dp_size is None:
            raise TopologyError("give both dp_rank and dp_size, or neither")
        size = _topo_int("dp_size", dp_size, 1)
        r = _topo_int("dp_rank", dp_rank, 0)
        if r >= size:
            raise TopologyError(f"dp_rank={r} is not inside dp_size={size}")
        return r, size
    if rank is None or world_size is None:
        raise TopologyError("give rank and world_size (or dp_rank and dp_size)")
    world = _topo_int("world_size", world_size, 1)
    rk = _topo_int("rank", rank, 0)
    rep = _topo_int("replication", replication, 1)
    pp = _topo_int("pipeline", pipeline, 1)
    if rk >= world:
        raise TopologyError(f"rank={rk} is not inside world_size={world}")
    if world % (rep * pp):
        raise TopologyError(
            f"world_size={world} is not a multiple of replication={rep} x pipeline={pp}: the "
            "data-parallel groups would not be whole"
        )
    size = world // (rep * pp)
    return (rk // rep) % size, size


def _topo_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or int(v) < lo:
        raise TopologyError(f"{name}={v!r}: expected an integer >= {lo}")
    return int(v)
