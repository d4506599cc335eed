"""Token datasets on disk: Megatron-LM's indexed dataset (``.bin``/``.idx``), datapipe's block
checksums (``.xxh``) and the token manifest. Layout and rules: docs/TOKEN_FORMAT.md.

A part is Megatron's pair, read by Megatron-LM and NeMo as is:

- ``<prefix>.bin``: the token ids of every document, back to back, in the part's dtype;
- ``<prefix>.idx``: ``MMIDIDX\\x00\\x00``, ``<Q`` version 1, ``<B`` dtype code, ``<Q`` sequence
  count S, ``<Q`` document-index count D+1, then S int32 sequence lengths, S int64 sequence
  pointers (byte offsets into ``.bin``) and D+1 int64 document indices (the first sequence of
  each document, then S); multimodal files add S int8 sequence modes, which token datasets
  do not use;

and datapipe adds ``<prefix>.xxh`` (the xxh3-64 of every ``block_bytes`` block of ``.bin``, raw
little-endian uint64; Megatron never opens it) and the manifest, which carries its own
checksum and those of every ``.idx`` and ``.xxh``. So every byte a reader uses is checked:
the manifest by itself, an ``.idx`` and ``.xxh`` as a whole, the ``.bin`` block by block as
it is read (:func:`block_span`, :func:`verify_blocks`).

Everything here is pure (bytes in, bytes or arrays out) except :class:`TokenPartWriter`,
which writes its part's three files under temporary names through plain file objects and
leaves the renames to its caller.
"""

from __future__ import annotations

import io
import os
import struct
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from .._version import __version__
from ..checksum import Hasher, checksum, digest64
from ..errors import ChecksumError, CorruptIndexError, FormatError, OptionError
from .envelope import check_manifest_checksum, open_manifest, seal_manifest
from .index import FileDigest, check_relative_name, check_shard_location, is_checksum

__all__ = [
    "MAGIC",
    "IDX_VERSION",
    "HEADER_BYTES",
    "DTYPE_CODES",
    "BLOCK_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_SEQUENCE_TOKENS",
    "optimal_dtype",
    "dtype_code",
    "token_dtype",
    "TokenIndex",
    "idx_size",
    "idx_bytes",
    "write_idx",
    "read_idx",
    "idx_header",
    "check_idx_header",
    "idx_sizes_range",
    "flat_index",
    "read_flat",
    "block_count",
    "block_sums",
    "xxh_bytes",
    "read_xxh",
    "block_span",
    "verify_blocks",
    "TokenPart",
    "TokenManifest",
    "PartIndex",
    "make_token_manifest",
    "parse_token_manifest",
    "check_part",
    "check_index",
    "check_block_sums",
    "TokenPartWriter",
]

MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
#: magic (9) + version (8) + dtype code (1) + sequence count (8) + document-index count (8)
HEADER_BYTES = 34
#: Megatron's ``DType`` enum: code -> numpy dtype (as stored: little-endian)
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
_FLOAT_CODES = (6, 7)
BLOCK_BYTES = 1 << 20
_MIN_BLOCK, _MAX_BLOCK = 4096, 1 << 30
FORMAT_NAME = "datapipe-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: a sequence length is an int32 in ``.idx``: a longer document is stored as several
#: sequences of one document (Megatron's sentence split), as its preprocessing would
MAX_SEQUENCE_TOKENS = (1 << 31) - 1
_MAX_INT = 1 << 62
_MAX_MANIFEST = 1 << 28
_MAX_PARTS = 1 << 20
#: validation walks the index arrays this many entries at a time: its own memory stays
#: a few tens of MB whatever the index holds
_CHECK_CHUNK = 1 << 20

IntArray = npt.NDArray[np.integer[Any]]
Int64s = npt.NDArray[np.int64]
UInt64s = npt.NDArray[np.uint64]
Buffer = bytes | bytearray | memoryview | Any  # anything with the buffer protocol (mmap, ndarray)


# --- dtypes --------------------------------------------------------------------------


def optimal_dtype(vocab_size: int | None) -> np.dtype[Any]:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65,500 tokens of vocabulary, else
    int32 (also when the vocabulary size is unknown)."""
    if vocab_size is not None:
        _check_vocab(vocab_size)
        if vocab_size < 65500:
            return DTYPE_CODES[8]
    return DTYPE_CODES[4]


def _check_vocab(vocab_size: object) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer) \
            or not 1 <= int(vocab_size) <= 1 << 40:
        raise OptionError(f"vocab_size={vocab_size!r}: expected an integer in [1, 2**40] (or None)")
    return int(vocab_size)


def token_dtype(dtype: Any) -> np.dtype[Any]:
    """``dtype`` as the little-endian integer dtype of a Megatron code, or :class:`OptionError`
    (token ids are integers: Megatron's float codes are refused)."""
    try:
        dt = np.dtype(dtype).newbyteorder("<")
    except TypeError:
        raise OptionError(f"dtype={dtype!r} is not a numpy dtype") from None
    for code, known in DTYPE_CODES.items():
        if known == dt and code not in _FLOAT_CODES:
            return known
    raise OptionError(f"dtype={dtype!r}: token ids are stored as one of "
                      f"{sorted(str(DTYPE_CODES[c]) for c in DTYPE_CODES if c not in _FLOAT_CODES)}")


def dtype_code(dtype: Any) -> int:
    """Megatron's code of a token dtype (uint16 -> 8, int32 -> 4, ...)."""
    dt = token_dtype(dtype)
    return next(c for c, known in DTYPE_CODES.items() if known == dt)


def _dtype_from_code(code: int, where: str) -> np.dtype[Any]:
    if code not in DTYPE_CODES:
        raise CorruptIndexError(f"{where}: unknown dtype code {code} (Megatron's codes are 1-8)")
    if code in _FLOAT_CODES:
        raise FormatError(f"{where}: dtype code {code} ({DTYPE_CODES[code]}) holds floats, not token ids")
    return DTYPE_CODES[code]


# --- .idx ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenIndex:
    """One part's ``.idx``: ``lengths[i]`` tokens of sequence i start at byte ``pointers[i]``
    of ``.bin``; document j is sequences ``[doc_index[j], doc_index[j+1])``. Arrays are
    read-only views of the bytes they were read from wherever possible."""

    dtype: np.dtype[Any]
    lengths: npt.NDArray[np.int32]
    pointers: Int64s
    doc_index: Int64s
    modes: npt.NDArray[np.int8] | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.doc_index.size) - 1

    @property
    def num_tokens(self) -> int:
        if not self.lengths.size:
            return 0
        return int(self.pointers[-1]) // self.dtype.itemsize + int(self.lengths[-1])

    @property
    def bin_bytes(self) -> int:
        return self.num_tokens * self.dtype.itemsize

    @property
    def one_sequence_per_document(self) -> bool:
        """Whether document j is sequence j for every j (``doc_index`` is 0, 1, ..., S):
        then the documents' lengths are a slice of the sizes (:func:`idx_sizes_range`)."""
        d = self.doc_index
        return bool(d.size == self.lengths.size + 1 and not (np.diff(d) != 1).any())

    def document_lengths(self) -> IntArray:
        """Tokens per document: ``lengths`` itself (a view) when every document is one
        sequence, else summed over each document's sequences."""
        d = self.doc_index
        if self.one_sequence_per_document:
            return self.lengths
        cum = np.concatenate(([0], np.cumsum(self.lengths, dtype=np.int64)))
        out: Int64s = cum[d[1:]] - cum[d[:-1]]
        return out

    def document_starts(self) -> Int64s:
        """Token offset in ``.bin`` of each document's first token (D+1 entries: the last
        is the token count)."""
        ptr = np.append(self.pointers, self.bin_bytes) // self.dtype.itemsize
        out: Int64s = ptr[self.doc_index]
        return out


def idx_size(sequences: int, documents: int, multimodal: bool = False) -> int:
    """Bytes of an ``.idx`` of ``sequences`` sequences in ``documents`` documents."""
    return HEADER_BYTES + sequences * (4 + 8 + (1 if multimodal else 0)) + 8 * (documents + 1)


def _idx_pieces(lengths: IntArray, doc_index: IntArray, dtype: np.dtype[Any]) -> list[Any]:
    lengths32 = np.ascontiguousarray(lengths, dtype="<i4")
    pointers = np.zeros(lengths32.size, dtype="<i8")
    np.cumsum(lengths32[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    header = MAGIC + struct.pack("<Q", IDX_VERSION) + struct.pack("<B", dtype_code(dtype)) \
        + struct.pack("<Q", lengths32.size) + struct.pack("<Q", len(doc_index))
    return [header, lengths32, pointers, np.ascontiguousarray(doc_index, dtype="<i8")]


def write_idx(f: BinaryIO, lengths: IntArray, doc_index: IntArray, dtype: Any) -> tuple[int, str]:
    """Write the ``.idx`` of sequences of ``lengths`` grouped into documents by ``doc_index``
    (D+1 entries from 0 to S) to ``f``, exactly as Megatron's ``_IndexWriter`` does; returns
    (bytes written, checksum)."""
    dt = token_dtype(dtype)
    h, size = Hasher(), 0
    for piece in _idx_pieces(lengths, doc_index, dt):
        mv = memoryview(piece).cast("B")
        f.write(mv)
        h.update(mv)
        size += len(mv)
    return size, h.hexdigest()


def idx_bytes(lengths: IntArray, doc_index: IntArray, dtype: Any) -> bytes:
    """The ``.idx`` of :func:`write_idx`, as bytes."""
    buf = io.BytesIO()
    write_idx(buf, lengths, doc_index, dtype)
    return buf.getvalue()


def _u8(data: Buffer, where: str) -> memoryview:
    try:
        mv = memoryview(data)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError) as e:
        raise OptionError(f"{where}: expected bytes or a contiguous buffer, got {type(data).__name__} ({e})") from None


def read_idx(data: Buffer, *, bin_size: int | None = None, where: str = "<.idx>",
             multimodal: bool = False) -> TokenIndex:
    """Parse and check an ``.idx``: magic, version, a known integer dtype code, counts that
    match the byte size (checked before anything is read), lengths >= 0, pointers equal to
    the running sum of lengths x itemsize, document indices from 0 to S and non-decreasing,
    and (given ``bin_size``) exactly ``bin_size`` bytes of ``.bin`` described. Time is linear
    in the file and memory beyond the views is bounded. Any violation is a
    :class:`CorruptIndexError` (or :class:`FormatError` for a float dtype) naming ``where``."""
    mv = _u8(data, where)
    n = len(mv)
    dt, seqs, docs = idx_header(mv, where)
    docs1 = docs + 1
    expect = idx_size(seqs, docs, multimodal)
    if expect != n:
        hint = ""
        if not multimodal and idx_size(seqs, docs, True) == n:
            hint = " (it holds sequence modes: a multimodal index, which a token dataset does not read)"
        raise CorruptIndexError(
            f"{where}: the header counts {seqs} sequences and {docs1} document indices, which take "
            f"{expect} bytes; the file has {n}{hint}"
        )
    off = HEADER_BYTES
    lengths = np.frombuffer(mv, dtype="<i4", count=seqs, offset=off)
    off += 4 * seqs
    pointers = np.frombuffer(mv, dtype="<i8", count=seqs, offset=off)
    off += 8 * seqs
    doc_index = np.frombuffer(mv, dtype="<i8", count=docs1, offset=off)
    off += 8 * docs1
    modes = np.frombuffer(mv, dtype="i1", count=seqs, offset=off) if multimodal else None
    total = 0  # tokens before the current chunk
    for a in range(0, seqs, _CHECK_CHUNK):
        ln = lengths[a:a + _CHECK_CHUNK].astype(np.int64)
        if ln.min() < 0:
            i = a + int(np.argmin(ln))
            raise CorruptIndexError(f"{where}: sequence {i} has a negative length {int(lengths[i])}")
        run = np.cumsum(ln)
        expected = (run - ln + total) * dt.itemsize
        bad = np.flatnonzero(pointers[a:a + _CHECK_CHUNK] != expected)
        if bad.size:
            i = a + int(bad[0])
            raise CorruptIndexError(
                f"{where}: sequence {i} points at byte {int(pointers[i])}, but the lengths before it "
                f"end at byte {int(expected[bad[0]])}"
            )
        total += int(run[-1])
    for a in range(0, docs1, _CHECK_CHUNK):
        d = doc_index[a:a + _CHECK_CHUNK + 1]
        if (np.diff(d) < 0).any():
            i = a + int(np.flatnonzero(np.diff(d) < 0)[0]) + 1
            raise CorruptIndexError(f"{where}: document index {i} ({int(doc_index[i])}) is below the one before it")
    if doc_index[0] != 0 or doc_index[-1] != seqs:
        raise CorruptIndexError(
            f"{where}: document indices run from {int(doc_index[0])} to {int(doc_index[-1])}; "
            f"they must run from 0 to the sequence count {seqs}"
        )
    if bin_size is not None and total * dt.itemsize != bin_size:
        raise CorruptIndexError(
            f"{where}: the index describes {total} tokens ({total * dt.itemsize} bytes of {dt}), "
            f"the .bin holds {bin_size} bytes"
        )
    return TokenIndex(dt, lengths, pointers, doc_index, modes)


def idx_header(data: Buffer, where: str) -> tuple[np.dtype[Any], int, int]:
    """(dtype, sequences, documents) of an ``.idx``'s first :data:`HEADER_BYTES` bytes:
    magic, version and a known integer dtype code checked (:class:`CorruptIndexError`
    naming ``where``)."""
    mv = _u8(data, where)
    if len(mv) < HEADER_BYTES:
        raise CorruptIndexError(f"{where}: {len(mv)} bytes is shorter than the {HEADER_BYTES}-byte .idx header")
    if bytes(mv[:9]) != MAGIC:
        raise CorruptIndexError(f"{where}: not a Megatron .idx (magic {bytes(mv[:9])!r}, expected {MAGIC!r})")
    version, code, seqs, docs1 = struct.unpack_from("<QBQQ", mv, 9)
    if version != IDX_VERSION:
        raise CorruptIndexError(f"{where}: .idx version {version}; only version {IDX_VERSION} exists")
    if docs1 < 1:
        raise CorruptIndexError(f"{where}: the header counts {docs1} document indices; there is always one more "
                                "than the documents")
    return _dtype_from_code(code, where), int(seqs), int(docs1) - 1


def check_idx_header(manifest: TokenManifest, i: int, data: Buffer, *, where: str = "") -> None:
    """Part ``i``'s ``.idx`` header (its first :data:`HEADER_BYTES` bytes) must name the
    manifest's dtype, sequences and documents, so that the file has the size the manifest
    records (:func:`idx_size`) and its sizes lie where :func:`idx_sizes_range` says; else
    :class:`CorruptIndexError` naming the file. What a reader checks before it range-reads
    sizes from an ``.idx`` it does not read whole."""
    part = manifest.parts[i]
    pre = f"{where}: " if where else ""
    dt, seqs, docs = idx_header(bytes(_u8(data, part.idx)[:HEADER_BYTES]), f"{pre}{part.idx}")
    got, expect = (dt, seqs, docs), (manifest.dtype, part.sequences, part.documents)
    if got != expect or idx_size(seqs, docs) != part.idx_bytes:
        raise CorruptIndexError(f"{pre}{part.idx}: the header names (dtype, sequences, documents) = {got}, the "
                                f"manifest records {expect} in {part.idx_bytes} bytes; the file was replaced since "
                                "it was indexed (index or pack the dataset again)")


def idx_sizes_range(start: int, stop: int) -> tuple[int, int]:
    """The bytes ``[a, b)`` of an ``.idx`` that hold sequences ``[start, stop)``'s sizes
    (int32, right after the header)."""
    return HEADER_BYTES + 4 * start, HEADER_BYTES + 4 * stop


def _split_long(doc_lengths: Int64s) -> tuple[npt.NDArray[np.int32], Int64s]:
    """(sequence lengths, document index) with one sequence per document, except that a
    document longer than MAX_SEQUENCE_TOKENS becomes several sequences."""
    n = np.asarray(doc_lengths, dtype=np.int64)
    per = np.maximum(-(-n // MAX_SEQUENCE_TOKENS), 1)
    doc_index = np.zeros(n.size + 1, dtype=np.int64)
    np.cumsum(per, out=doc_index[1:])
    if n.size and int(per.max()) == 1:
        return n.astype(np.int32), doc_index
    lengths = np.full(int(doc_index[-1]), MAX_SEQUENCE_TOKENS, dtype=np.int64)
    last = doc_index[1:] - 1
    lengths[last] = n - (per - 1) * MAX_SEQUENCE_TOKENS
    return lengths.astype(np.int32), doc_index


def flat_index(tokens: IntArray, *, eos_id: int | None = None, dtype: Any = None) -> TokenIndex:
    """The index of a flat token file (nanoGPT's ``train.bin``: raw ids, no ``.idx``): a
    document ends after each ``eos_id`` (the last one also at the end of the file), or
    the whole file is one document when ``eos_id`` is None. ``tokens`` may be an
    ``np.memmap``; it is scanned in slices, so memory stays bounded."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise OptionError(f"tokens must be a 1-d integer array, got shape {arr.shape} of {arr.dtype}")
    dt = token_dtype(arr.dtype if dtype is None else dtype)
    n = int(arr.size)
    if eos_id is None:
        ends = np.array([n] if n else [], dtype=np.int64)
    else:
        if isinstance(eos_id, bool) or not isinstance(eos_id, int | np.integer):
            raise OptionError(f"eos_id={eos_id!r}: expected an integer token id or None")
        found = [np.flatnonzero(arr[a:a + (1 << 24)] == eos_id) + (a + 1) for a in range(0, n, 1 << 24)]
        ends = np.concatenate([*found, np.empty(0, np.int64)]).astype(np.int64)
        if n and (not ends.size or ends[-1] != n):
            ends = np.append(ends, n)
    doc_lengths = np.diff(ends, prepend=0)
    lengths, doc_index = _split_long(doc_lengths)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dt.itemsize
    return TokenIndex(dt, lengths, pointers, doc_index)


def read_flat(data: Buffer, *, dtype: Any = np.uint16, eos_id: int | None = None,
              where: str = "<.bin>") -> tuple[IntArray, TokenIndex]:
    """(token view, index) of a flat token file's bytes, raw ``dtype`` ids (nanoGPT writes
    uint16), documents split as :func:`flat_index` splits them."""
    dt = token_dtype(dtype)
    mv = _u8(data, where)
    if len(mv) % dt.itemsize:
        raise FormatError(f"{where}: {len(mv)} bytes is not a whole number of {dt} tokens")
    tokens = np.frombuffer(mv, dtype=dt)
    return tokens, flat_index(tokens, eos_id=eos_id, dtype=dt)


# --- .xxh: block checksums of .bin ---------------------------------------------------


def _check_block_bytes(block_bytes: object) -> int:
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) \
            or not _MIN_BLOCK <= block_bytes <= _MAX_BLOCK:
        raise OptionError(f"block_bytes={block_bytes!r}: expected an integer in [{_MIN_BLOCK}, {_MAX_BLOCK}]")
    return block_bytes


def block_count(bin_bytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` (the last one may be short) in ``bin_bytes`` bytes."""
    return -(-bin_bytes // block_bytes)


def _digest_sums(blocks: list[str]) -> UInt64s:
    return np.array([int(b.partition(":")[2], 16) for b in blocks], dtype="<u8")


def block_sums(data: Buffer, block_bytes: int = BLOCK_BYTES) -> UInt64s:
    """The xxh3-64 of each ``block_bytes`` block of ``data`` (what ``.xxh`` holds)."""
    d = FileDigest(_check_block_bytes(block_bytes))
    d.update(_u8(data, "<.bin>"))
    return _digest_sums(d.finish()["blocks"])


def xxh_bytes(sums: npt.ArrayLike) -> bytes:
    """The ``.xxh`` file of block checksums ``sums``: raw little-endian uint64."""
    return np.ascontiguousarray(sums, dtype="<u8").tobytes()


def read_xxh(data: Buffer, *, bin_bytes: int, block_bytes: int, where: str = "<.xxh>") -> UInt64s:
    """The block checksums of a ``.bin`` of ``bin_bytes`` bytes, from its ``.xxh``: exactly
    one uint64 per block, else :class:`CorruptIndexError`."""
    mv = _u8(data, where)
    want = 8 * block_count(bin_bytes, block_bytes)
    if len(mv) != want:
        raise CorruptIndexError(f"{where}: {len(mv)} bytes; {bin_bytes} bytes of .bin in blocks of "
                                f"{block_bytes} need {want}")
    return np.frombuffer(mv, dtype="<u8")


def block_span(byte_start: int, byte_end: int, block_bytes: int, bin_bytes: int) -> tuple[int, int, int]:
    """(start, end, first block) of the smallest block-aligned range of a ``.bin`` of
    ``bin_bytes`` bytes that covers ``[byte_start, byte_end)``: what a reader fetches to
    check the bytes it needs with :func:`verify_blocks`."""
    if not 0 <= byte_start <= byte_end <= bin_bytes:
        raise OptionError(f"byte range [{byte_start}, {byte_end}) does not lie in a .bin of {bin_bytes} bytes")
    first = byte_start // block_bytes
    if byte_start == byte_end:
        return first * block_bytes, first * block_bytes, first
    end = min(-(-byte_end // block_bytes) * block_bytes, bin_bytes)
    return first * block_bytes, end, first


def verify_blocks(data: Buffer, first_block: int, sums: npt.NDArray[np.uint64], block_bytes: int, *,
                  where: str = "<.bin>", whole: bool = False) -> None:
    """Check ``data``, the bytes of blocks ``first_block, first_block + 1, ...`` of a ``.bin``
    (the part's last block may be short), against the part's block checksums ``sums``.
    ``whole``: ``data`` must be the whole file. A mismatch is a :class:`ChecksumError`
    naming ``where``, the block and its byte offset."""
    mv = _u8(data, where)
    nblocks = int(sums.size)
    k = block_count(len(mv), block_bytes)
    start = first_block * block_bytes
    if first_block < 0 or first_block + k > nblocks or (whole and (first_block != 0 or k != nblocks)):
        raise ChecksumError(
            f"{where}: bytes [{start}, {start + len(mv)}) are not {'the whole file' if whole else 'blocks of it'}: "
            f"it has {nblocks} blocks of {block_bytes} bytes (truncated or extended?)"
        )
    for i in range(k):
        b = first_block + i
        chunk = mv[i * block_bytes:(i + 1) * block_bytes]
        if len(chunk) < block_bytes and b != nblocks - 1:
            raise ChecksumError(f"{where}: block {b} at byte {b * block_bytes} is short ({len(chunk)} bytes) "
                                "but is not the file's last block")
        if digest64(chunk) != int(sums[b]):
            raise ChecksumError(
                f"{where}: block {b} (bytes [{b * block_bytes}, {b * block_bytes + len(chunk)})) fails its "
                "checksum: the file was damaged or changed after it was packed; re-read it, or re-pack it"
            )


# --- the manifest ----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenPart:
    """One part as the manifest records it. ``prefix``: where ``.bin`` lies (``prefix +
    ".bin"``): relative to the dataset folder, or an absolute path or URL for files indexed
    in place; ``idx`` likewise (beside ``.bin`` for Megatron files, in the dataset folder
    for an index datapipe made of a flat file); ``xxh``: always in the dataset folder."""

    prefix: str
    idx: str
    xxh: str
    bin_bytes: int
    idx_bytes: int
    documents: int
    sequences: int
    tokens: int
    idx_checksum: str
    xxh_checksum: str

    @property
    def bin(self) -> str:
        return self.prefix + ".bin"


@dataclass(frozen=True)
class TokenManifest:
    dtype: np.dtype[Any]
    vocab_size: int | None
    eos_id: int | None
    block_bytes: int
    parts: tuple[TokenPart, ...]
    doc: dict[str, Any]

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    @property
    def documents(self) -> int:
        return sum(p.documents for p in self.parts)


_PART_INTS = ("bin_bytes", "idx_bytes", "documents", "sequences", "tokens")
_PART_FIELDS = ("prefix", "idx", "xxh", *_PART_INTS, "idx_checksum", "xxh_checksum")


def make_token_manifest(parts: list[TokenPart], *, dtype: Any, vocab_size: int | None = None,
                        eos_id: int | None = None, block_bytes: int = BLOCK_BYTES,
                        extra: dict[str, Any] | None = None) -> bytes:
    """The manifest of a token dataset of ``parts`` (in stream order); its own checksum covers
    every other field. ``extra`` fields are stored alongside (and covered)."""
    dt = token_dtype(dtype)
    if vocab_size is not None:
        _check_vocab(vocab_size)
    doc: dict[str, Any] = {
        **(extra or {}),
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": str(dt.newbyteorder("=")),
        "dtype_code": dtype_code(dt),
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "block_bytes": _check_block_bytes(block_bytes),
        "num_parts": len(parts),
        "tokens": sum(p.tokens for p in parts),
        "documents": sum(p.documents for p in parts),
        "created_by": f"datapipe {__version__}",
        "parts": [{f: getattr(p, f) for f in _PART_FIELDS} for p in parts],
    }
    return seal_manifest(doc)


def _int(doc: dict[str, Any], k: str, where: str, lo: int = 0, hi: int = _MAX_INT, none: bool = False) -> Any:
    v = doc.get(k)
    if none and v is None:
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptIndexError(f"{where}: manifest field {k!r} is {v!r}, expected an integer in [{lo}, {hi}]"
                                + (" or null" if none else ""))
    return v


def parse_token_manifest(data: bytes, where: str) -> TokenManifest:
    """The token manifest, once its own checksum matches and every field has the type,
    range and consistency a reader relies on; else :class:`CorruptIndexError` (or
    :class:`FormatError` for another format or version) naming ``where``."""
    if len(data) > _MAX_MANIFEST:
        raise CorruptIndexError(f"{where}: a {len(data)}-byte manifest is larger than any token manifest")
    doc = open_manifest(data, where, name=FORMAT_NAME, version=FORMAT_VERSION, what="token")
    check_manifest_checksum(doc, where, "re-run the pack that wrote it")
    code = _int(doc, "dtype_code", where, 1, 8)
    if code not in DTYPE_CODES or code in _FLOAT_CODES or doc.get("dtype") != str(DTYPE_CODES[code].newbyteorder("=")):
        raise CorruptIndexError(f"{where}: dtype {doc.get('dtype')!r} with code {code} is not a token dtype")
    dt = DTYPE_CODES[code]
    vocab = _int(doc, "vocab_size", where, 1, 1 << 40, none=True)
    top = int(np.iinfo(dt).max)
    if vocab is not None and vocab - 1 > top:
        raise CorruptIndexError(f"{where}: vocab_size {vocab} does not fit dtype {dt}")
    eos = _int(doc, "eos_id", where, 0, (vocab or top + 1) - 1, none=True)
    block = _int(doc, "block_bytes", where, _MIN_BLOCK, _MAX_BLOCK)
    raw = doc.get("parts")
    nparts = _int(doc, "num_parts", where, 0, _MAX_PARTS)
    if not isinstance(raw, list) or len(raw) != nparts:
        raise CorruptIndexError(f"{where}: manifest 'parts' is not a list of num_parts={nparts} entries")
    parts: list[TokenPart] = []
    seen: set[str] = set()
    for i, p in enumerate(raw):
        w = f"{where}: part #{i}"
        if not isinstance(p, dict) or set(p) != set(_PART_FIELDS):
            raise CorruptIndexError(f"{w} is not an object with exactly the fields {sorted(_PART_FIELDS)}")
        prefix = check_shard_location(p["prefix"], "prefix", w)
        idx = check_shard_location(p["idx"], "idx", w)
        xxh = check_relative_name(p["xxh"], "xxh", w)
        ints = {k: _int(p, k, w) for k in _PART_INTS}
        for k in ("idx_checksum", "xxh_checksum"):
            if not is_checksum(p[k]):
                raise CorruptIndexError(f"{w}: {k} {p[k]!r} is not an xxh3_64 checksum")
        bad = None
        if ints["bin_bytes"] != ints["tokens"] * dt.itemsize:
            bad = f"bin_bytes={ints['bin_bytes']} is not tokens={ints['tokens']} x {dt.itemsize}"
        elif ints["idx_bytes"] != idx_size(ints["sequences"], ints["documents"]):
            bad = (f"idx_bytes={ints['idx_bytes']} does not fit {ints['sequences']} sequences in "
                   f"{ints['documents']} documents")
        elif prefix in seen or xxh in seen:
            bad = f"prefix {prefix!r} or xxh {xxh!r} repeats an earlier part's"
        if bad:
            raise CorruptIndexError(f"{w}: {bad}")
        seen.update((prefix, xxh))
        parts.append(TokenPart(prefix, idx, xxh, **ints, idx_checksum=p["idx_checksum"],
                               xxh_checksum=p["xxh_checksum"]))
    for k, total in (("tokens", sum(p.tokens for p in parts)), ("documents", sum(p.documents for p in parts))):
        if _int(doc, k, where) != total:
            raise CorruptIndexError(f"{where}: manifest {k}={doc[k]} but its parts hold {total}")
    return TokenManifest(dt, vocab, eos, block, tuple(parts), doc)


@dataclass(frozen=True)
class PartIndex:
    """A part whose ``.idx`` and ``.xxh`` passed :func:`check_part`: offsets from ``index`` are
    safe to use, ``sums`` check its ``.bin`` block by block."""

    part: TokenPart
    index: TokenIndex
    sums: UInt64s


def _check_recorded(name: str, data: Buffer, size: int, want: str, pre: str) -> None:
    """``data`` (the file ``name``) has the size and checksum the manifest records."""
    mv = _u8(data, name)
    if len(mv) != size:
        raise CorruptIndexError(f"{pre}{name}: {len(mv)} bytes, the manifest records {size}; "
                                "the file was truncated, extended or replaced")
    got = checksum(mv)
    if got != want:
        raise CorruptIndexError(f"{pre}{name}: checksum {got}, the manifest records {want}; "
                                "the file was damaged or replaced (re-pack the dataset)")


def check_block_sums(manifest: TokenManifest, i: int, xxh_data: Buffer, *, where: str = "") -> UInt64s:
    """The block checksums of part ``i``'s ``.bin`` from its ``.xxh``, which must have the size
    and checksum the manifest records (:class:`CorruptIndexError` naming the file). What a
    reader needs that takes no offset from the ``.idx`` (concatenated sequences need only
    the manifest's token counts)."""
    part = manifest.parts[i]
    pre = f"{where}: " if where else ""
    _check_recorded(part.xxh, xxh_data, 8 * block_count(part.bin_bytes, manifest.block_bytes), part.xxh_checksum,
                    pre)
    return read_xxh(xxh_data, bin_bytes=part.bin_bytes, block_bytes=manifest.block_bytes, where=f"{pre}{part.xxh}")


def check_part(manifest: TokenManifest, i: int, idx_data: Buffer, xxh_data: Buffer, *,
               where: str = "") -> PartIndex:
    """Part ``i`` of ``manifest`` from the bytes of its ``.idx`` and ``.xxh``: both must have
    the size and checksum the manifest records and the index must describe the part's
    counts and dtype exactly, else :class:`CorruptIndexError` naming the file."""
    part = manifest.parts[i]
    pre = f"{where}: " if where else ""
    _check_recorded(part.idx, idx_data, part.idx_bytes, part.idx_checksum, pre)
    sums = check_block_sums(manifest, i, xxh_data, where=where)
    return PartIndex(part, _checked_index(manifest, i, idx_data, pre), sums)


def check_index(manifest: TokenManifest, i: int, idx_data: Buffer, *, where: str = "") -> TokenIndex:
    """Part ``i``'s ``.idx`` from its bytes, checked as :func:`check_part` checks it (size and
    checksum the manifest records, an index of the part's counts and dtype), without its
    ``.xxh``: what a reader that has the block sums already needs of the ``.idx``."""
    part = manifest.parts[i]
    pre = f"{where}: " if where else ""
    _check_recorded(part.idx, idx_data, part.idx_bytes, part.idx_checksum, pre)
    return _checked_index(manifest, i, idx_data, pre)


def _checked_index(manifest: TokenManifest, i: int, idx_data: Buffer, pre: str) -> TokenIndex:
    part = manifest.parts[i]
    index = read_idx(idx_data, bin_size=part.bin_bytes, where=f"{pre}{part.idx}")
    counts = (index.dtype, index.num_sequences, index.num_documents, index.num_tokens)
    expect = (manifest.dtype, part.sequences, part.documents, part.tokens)
    if counts != expect:
        raise CorruptIndexError(f"{pre}{part.idx}: (dtype, sequences, documents, tokens) = {counts}, "
                                f"the manifest records {expect}")
    return index


# --- writing one part ---------------------------------------------------------------------


class TokenPartWriter:
    """Writes one part, ``<path>.bin`` then ``<path>.idx`` and ``<path>.xxh``, each under a
    temporary name of its own (:attr:`renames`); the caller publishes them by renaming once
    :meth:`close` has returned (and writes the manifest last). ``.bin`` is written as
    documents arrive, in order; lengths are kept in memory (12 bytes per document).

        with TokenPartWriter("out/part-00000", vocab_size=50257) as w:
            w.add_document(np.array([5, 7, 50256]))
            w.add_documents(flat_ids, lengths)      # many at once
        part = w.part                               # the manifest entry
        for tmp, final in w.renames: os.replace(tmp, final)
    """

    def __init__(self, path: str | os.PathLike[str], *, vocab_size: int | None = None, dtype: Any = None,
                 block_bytes: int = BLOCK_BYTES, name: str | None = None, fsync: bool = True) -> None:
        self.vocab_size = None if vocab_size is None else _check_vocab(vocab_size)
        self.dtype = optimal_dtype(vocab_size) if dtype is None else token_dtype(dtype)
        top = int(np.iinfo(self.dtype).max)
        if self.vocab_size is not None and self.vocab_size - 1 > top:
            raise OptionError(f"vocab_size={vocab_size} does not fit dtype={self.dtype} (largest id {top})")
        self._lo = 0 if self.vocab_size is not None else int(np.iinfo(self.dtype).min)
        self._hi = self.vocab_size - 1 if self.vocab_size is not None else top
        self.block_bytes = _check_block_bytes(block_bytes)
        path = os.fspath(path)
        self.name = os.path.basename(path) if name is None else name
        tag = f".tmp-{uuid.uuid4().hex[:16]}"
        self.final = {ext: path + ext for ext in (".bin", ".idx", ".xxh")}
        self.temporary = {ext: p + tag for ext, p in self.final.items()}
        self._fsync = fsync
        self._digest = FileDigest(self.block_bytes)
        self._doc_lengths: list[Int64s] = []
        self._documents = 0
        self._tokens = 0
        self._created: list[str] = []
        self._bin: BinaryIO | None = open(self.temporary[".bin"], "xb")  # closed by close() or abort()
        self._created.append(self.temporary[".bin"])
        self.part: TokenPart | None = None

    @property
    def renames(self) -> list[tuple[str, str]]:
        """(temporary path, final path) of each file written, once :meth:`close` returned."""
        if self.part is None:
            return []
        return [(self.temporary[e], self.final[e]) for e in (".bin", ".xxh", ".idx")]

    @property
    def documents(self) -> int:
        return self._documents

    @property
    def tokens(self) -> int:
        return self._tokens

    def _checked(self, tokens: npt.ArrayLike) -> npt.NDArray[Any]:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise OptionError(f"{self.name}: tokens must be a 1-d integer array, got shape {arr.shape} of {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._lo or hi > self._hi:
                raise OptionError(f"{self.name}: token id {lo if lo < self._lo else hi} lies outside "
                                  f"[{self._lo}, {self._hi}] (vocab_size={self.vocab_size}, dtype={self.dtype})")
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Append one document (its token ids, an EOS included if the dataset uses one)."""
        arr = self._checked(tokens)
        self._write(arr, np.array([arr.size], dtype=np.int64))

    def add_documents(self, tokens: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
        """Append ``len(lengths)`` documents whose ids lie back to back in ``tokens``."""
        arr = self._checked(tokens)
        ln = np.asarray(lengths)
        if ln.ndim != 1 or (ln.size and (not np.issubdtype(ln.dtype, np.integer) or ln.min() < 0)) \
                or int(ln.sum(dtype=np.int64)) != arr.size:
            raise OptionError(f"{self.name}: lengths must be non-negative integers summing to the {arr.size} "
                              "tokens given")
        self._write(arr, ln.astype(np.int64))

    def _write(self, arr: npt.NDArray[Any], lengths: Int64s) -> None:
        if self._bin is None:
            raise OptionError(f"{self.name}: the writer is closed")
        mv = _u8(arr, self.name)
        self._bin.write(mv)
        self._digest.update(mv)
        self._doc_lengths.append(lengths)
        self._documents += int(lengths.size)
        self._tokens += int(arr.size)

    def close(self) -> TokenPart:
        """Finish ``.bin`` and write ``.idx`` and ``.xxh`` (flushed to disk with ``fsync``);
        returns the part's manifest entry (also :attr:`part`)."""
        if self.part is not None:
            return self.part
        if self._bin is None:
            raise OptionError(f"{self.name}: the writer was aborted")
        try:
            self._finish_file(self._bin)
            self._bin = None
            doc_lengths = np.concatenate([*self._doc_lengths, np.empty(0, np.int64)])
            lengths, doc_index = _split_long(doc_lengths)
            with open(self.temporary[".idx"], "xb") as f:
                self._created.append(self.temporary[".idx"])
                idx_n, idx_sum = write_idx(f, lengths, doc_index, self.dtype)
                self._finish_file(f)
            sums = xxh_bytes(_digest_sums(self._digest.finish()["blocks"]))
            with open(self.temporary[".xxh"], "xb") as f:
                self._created.append(self.temporary[".xxh"])
                f.write(sums)
                self._finish_file(f)
        except BaseException:
            self.abort()
            raise
        self.part = TokenPart(
            prefix=self.name, idx=self.name + ".idx", xxh=self.name + ".xxh",
            bin_bytes=self._tokens * self.dtype.itemsize, idx_bytes=idx_n, documents=self._documents,
            sequences=int(lengths.size), tokens=self._tokens, idx_checksum=idx_sum, xxh_checksum=checksum(sums),
        )
        return self.part

    def _finish_file(self, f: BinaryIO) -> None:
        f.flush()
        if self._fsync:
            os.fsync(f.fileno())
        f.close()

    def abort(self) -> None:
        """Close and remove this writer's own temporary files (never anything else)."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        for p in self._created:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self._created.clear()
        self.part = None

    def __enter__(self) -> TokenPartWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
