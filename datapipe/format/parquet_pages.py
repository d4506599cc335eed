"""The page headers of a Parquet column chunk, read from its bytes before pyarrow decodes
them: what each page says it decompresses to, and how many values it holds.

A file's footer states each column chunk's uncompressed size, and pyarrow trusts each page
header instead: a footer that understates them lets a few kilobytes of zstd pages claim
gigabytes. Summing the page headers (the sizes pyarrow allocates and decodes into) bounds
what a chunk decodes to, and a dictionary page the footer does not announce is seen. A
page header is a Thrift compact-protocol struct (``PageHeader`` of parquet-format): field
1 the page type, 2 ``uncompressed_page_size``, 3 ``compressed_page_size``, and
``num_values`` as field 1 of the data page header (field 5, or 8 in version 2; a
dictionary page's header, field 7, counts the dictionary's entries, not the column's
values). Every other field is skipped by its Thrift type. No I/O here.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import FormatError

__all__ = ["ChunkPages", "chunk_pages"]

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_MAX_DEPTH = 16  # parquet-format's structs nest a few levels; more is not a page header
_DICTIONARY_PAGE = 2  # PageType.DICTIONARY_PAGE


class _Reader:
    def __init__(self, buf: bytes | memoryview, pos: int, where: str) -> None:
        self.buf, self.pos, self.where = buf, pos, where

    def fail(self, why: str) -> FormatError:
        return FormatError(f"{self.where}: the page header at byte {self.pos} of its column chunk {why}")

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise self.fail("runs past the end of the chunk")
        b = self.buf[self.pos]
        self.pos += 1
        return int(b)

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise self.fail("holds a varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, kind: int, depth: int) -> None:
        if kind in (_TRUE, _FALSE):
            return
        if kind == _BYTE:
            self.byte()
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.pos += 8
        elif kind == _BINARY:
            length = self.varint()  # read before pos is: it moves pos
            self.pos += length
        elif kind in (_LIST, _SET):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):  # each element takes a byte at least: bounded by the chunk
                self.skip(_BYTE if element in (_TRUE, _FALSE) else element, depth + 1)
                if self.pos > len(self.buf):
                    break
        elif kind == _MAP:
            size = self.varint()
            if size:
                kinds = self.byte()
                for _ in range(size):
                    self.skip(kinds >> 4, depth + 1)
                    self.skip(kinds & 0x0F, depth + 1)
                    if self.pos > len(self.buf):
                        break
        elif kind == _STRUCT:
            self.struct(depth + 1, {})
        else:
            raise self.fail(f"holds an unknown Thrift type {kind}")
        if self.pos > len(self.buf):
            raise self.fail("runs past the end of the chunk")

    def struct(self, depth: int, want: dict[int, int]) -> dict[int, int]:
        """Read a struct, keeping the i32/i64 fields whose ids are in ``want`` (their values
        replace want's defaults); a nested struct field whose id is negated in ``want`` is
        read the same way, its wanted fields stored under the negated id."""
        if depth > _MAX_DEPTH:
            raise self.fail(f"nests structs deeper than {_MAX_DEPTH}")
        out: dict[int, int] = {}
        field = 0
        while True:
            head = self.byte()
            if head == _STOP:
                return out
            kind, delta = head & 0x0F, head >> 4
            field = field + delta if delta else self.zigzag()
            if kind in (_I32, _I64) and field in want:
                out[field] = self.zigzag()
            elif kind == _STRUCT and -field in want:
                inner = self.struct(depth + 1, {1: 0})
                out[-field] = inner.get(1, 0)
            else:
                self.skip(kind, depth)


class ChunkPages(NamedTuple):
    """What the page headers of a column chunk say."""

    #: what its pages decode to at least: each page's uncompressed size, or its values at
    #: the column's width where more (run-length encoding stores many in a few bytes)
    decoded: int
    #: whether one is a dictionary page
    dictionary: bool
    #: where the pages read end (a chunk as written ends there)
    end: int


def chunk_pages(chunk: bytes | memoryview, values: int, width: int, where: str) -> ChunkPages:
    """The page headers of one column chunk (its bytes as stored, ``chunk``; ``width``: the
    bytes of one decoded value) read as a Parquet reader reads them, until the chunk's
    ``values`` (the footer's count) are reached or its bytes end. A header that does not
    parse, or a size below zero, is a :class:`FormatError` naming ``where``."""
    decoded = seen = pos = 0
    dictionary = False
    view = chunk if isinstance(chunk, bytes) else memoryview(chunk).cast("B")
    while pos < len(view) and seen < values:
        reader = _Reader(view, pos, where)
        # 1 the page's type (2: a dictionary page, whose entries are not the column's
        # values), 2 its uncompressed size, 3 its compressed size; 5 and 8: a data page
        # header (version 1, 2), whose field 1, num_values, is kept under -5 or -8
        fields = reader.struct(0, {1: -1, 2: -1, 3: -1, -5: 0, -8: 0})
        uncompressed, compressed = fields.get(2, -1), fields.get(3, -1)
        if uncompressed < 0 or compressed < 0:
            raise reader.fail(f"states no size, or one below zero (uncompressed {uncompressed}, "
                              f"compressed {compressed})")
        page_values = max(fields.get(-5, 0), fields.get(-8, 0), 0)
        dictionary = dictionary or fields.get(1) == _DICTIONARY_PAGE
        seen += page_values
        decoded += max(uncompressed, page_values * width)
        pos = reader.pos + compressed
    return ChunkPages(decoded, dictionary, pos)
