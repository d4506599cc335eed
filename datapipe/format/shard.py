"""Write one shard: samples in, stored bytes out, with offsets and checksums recorded.

Samples are laid out in a reused staging buffer (fresh memory is expensive: page faults
cost more than the copy), hashed there, and written to the sink a few MB at a time.
File contents can be read straight into their place in that buffer (`add_members`), so
packing small files costs one read per file and no intermediate bytes objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, BinaryIO

import zstandard

from ..checksum import Hasher, checksum
from ..errors import FormatError
from .index import SampleRecords, ShardRecord
from .sample import COMPRESSIONS, encode_sample
from .tar import BLOCK, END_OF_ARCHIVE, member_header, member_name, padding

__all__ = ["ShardBuilder", "shard_name", "members_tar_bytes", "Fill"]

STAGING_BYTES = 4 << 20
_ZEROS = bytes(BLOCK)
_ZERO_VIEW = memoryview(_ZEROS)

#: writes a member's data into the view it is given and returns the byte count
Fill = Callable[[memoryview], int]


def members_tar_bytes(key: str, members: Iterable[tuple[str, int]]) -> int:
    """The bytes that the members ``(field, size)`` of sample ``key`` take in an
    uncompressed shard (headers, data, padding), exactly as :meth:`ShardBuilder.add_members`
    lays them out: what a piece of a shard written at a known offset needs."""
    total = 0
    for field, size in members:
        name = f"{key}.{field}"
        header = BLOCK if len(name) <= 100 and name.isascii() else len(member_header(name, size))
        total += header + size + padding(size)
    return total


def shard_name(index: int, compression: str, prefix: str = "shard") -> str:
    return f"{prefix}-{index:06d}.tar" + (".zst" if compression == "zstd" else "")


class ShardBuilder:
    """Appends samples to a binary sink. Uncompressed: the sink receives a plain tar.
    zstd: each sample's members are one independent zstd frame, and the end-of-archive
    blocks a last frame, so ``zstd -d`` yields a valid tar and each sample is one range."""

    def __init__(self, sink: BinaryIO, name: str, compression: str = "none", level: int = 3,
                 staging: bytearray | None = None, piece_at: int | None = None) -> None:
        if compression not in COMPRESSIONS:
            raise FormatError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")
        if piece_at is not None and compression != "none":
            raise FormatError("a piece of a shard is written uncompressed: its offsets are known in advance")
        self.sink = sink
        self.name = name
        self.compression = compression
        self._zstd = zstandard.ZstdCompressor(level=level) if compression == "zstd" else None
        # a piece (of a shard that several processes write at once, each from ``piece_at``,
        # its first byte in the shard) records shard offsets and no whole-shard checksum:
        # the one process that assembles the shard hashes it whole (and writes its end)
        self._hash: Hasher | None = None if piece_at is not None else Hasher()
        self._member_fields: list[str] = []
        self._member_bounds: list[int] = []
        self.records = SampleRecords([], [], [], [], self._member_fields, self._member_bounds)
        self._field_lists: dict[tuple[str, ...], str] = {}  # one str per distinct field list, shared by its samples
        self.fields: set[str] = set()
        self.stored_bytes = piece_at or 0  # written to the sink or staged (in the shard, from its start)
        self.tar_bytes = 0
        self._closed = False
        self._buf = staging if staging is not None else bytearray(STAGING_BYTES)
        self._mv = memoryview(self._buf)
        self._fill = 0
        self._scratch: bytearray | None = None  # zstd: a sample's raw tar before compression
        try:
            self._fd: int | None = sink.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None

    # -- staging ------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the staged bytes to the sink."""
        n, self._fill = self._fill, 0
        if not n:
            return
        view = self._mv[:n]
        if self._hash is not None:
            self._hash.update(view)
        if self._fd is not None:
            self.sink.flush()
            while view:
                view = view[os.write(self._fd, view) :]
        else:
            self.sink.write(view)

    def _reserve(self, n: int) -> int:
        """Room for ``n`` more bytes in the staging buffer; returns where they start."""
        if self._fill + n > len(self._buf):
            self.flush()
            if n > len(self._buf):
                self._buf = bytearray(n)
                self._mv = memoryview(self._buf)
        return self._fill

    def _lay_out(self, fields: Sequence[str], heads: Sequence[int], sizes: Sequence[int]) -> None:
        """Record where each member's data lies in the sample (the index's member layout)."""
        names = tuple(fields)
        joined = self._field_lists.get(names)
        if joined is None:
            joined = self._field_lists[names] = "/".join(names)
        bounds = self._member_bounds
        p = 0
        for head, size in zip(heads, sizes):
            p += head
            bounds += (p, p + size)
            p += size + padding(size)
        self._member_fields.append(joined)

    def _record(self, key: str, start: int, length: int, fields: Sequence[str]) -> int:
        self.records.keys.append(key)
        self.records.offsets.append(self.stored_bytes)
        self.records.lengths.append(length)
        self.records.checksums.append(checksum(self._mv[start : start + length]))
        self.stored_bytes += length
        self._fill = start + length
        self.fields.update(fields)
        return length

    def _store_raw(self, key: str, raw: memoryview, fields: Sequence[str]) -> int:
        """A sample's raw tar bytes (outside the staging buffer) into the shard."""
        self.tar_bytes += len(raw)
        data = self._zstd.compress(raw) if self._zstd is not None else raw
        start = self._reserve(len(data))
        self._mv[start : start + len(data)] = data
        return self._record(key, start, len(data), fields)

    # -- samples ------------------------------------------------------------------------
    def add(self, sample: Mapping[str, Any]) -> int:
        """Append one sample; returns its stored size in bytes."""
        key, parts = encode_sample(sample)
        return self.add_encoded(key, parts, [k for k in sample if not k.startswith("__")])

    def add_encoded(self, key: str, parts: list[bytes | bytearray | memoryview], fields: Sequence[str]) -> int:
        """Append a sample already cut into tar pieces by ``encode_sample``: for each field
        in sorted order its header, its data and, unless the data fills whole blocks, its
        padding."""
        names = sorted(fields)
        heads, sizes, i = [], [], 0
        for _ in names:
            heads.append(len(parts[i]))
            sizes.append(len(parts[i + 1]))
            i += 3 if padding(sizes[-1]) else 2
        if i != len(parts):
            raise FormatError(f"sample {key!r}: {len(parts)} tar pieces for fields {names} (a datapipe bug: "
                              "please report it)")
        stored = self._store_raw(key, memoryview(b"".join(parts)), fields)
        self._lay_out(names, heads, sizes)
        return stored

    def add_members(self, key: str, members: Sequence[tuple[str, int, Fill]]) -> int:
        """Append a sample whose fields are ``(field, size, fill)``: ``fill(view)`` writes the
        data into ``view`` (``size + 1`` bytes long, so that a source that grew is noticed)
        and returns the count; anything but ``size`` raises ``ValueError`` and the sample is
        not added. The key must already have passed ``check_key``."""
        # one pass for the headers (the room to reserve), one to fill: a few Python
        # operations per member, beside the member's own reads (packing small files is
        # bound by the per-file cost)
        headers = []
        total = 0
        for field, size, _ in members:
            header = member_header(member_name(key, field), size)
            headers.append(header)
            total += len(header) + size + (-size % BLOCK)
        if self._zstd is None:
            start = self._reserve(total + 1)
            mv = self._mv
        else:
            if self._scratch is None or len(self._scratch) < total + 1:
                self._scratch = bytearray(max(total + 1, 1 << 20))
            start, mv = 0, memoryview(self._scratch)
        p = start
        for header, (field, size, fill) in zip(headers, members):
            q = p + len(header)
            mv[p:q] = header
            p = q + size
            got = fill(mv[q : p + 1])
            if got != size:
                raise ValueError(f"field {field!r} of sample {key!r} has {got} bytes, expected {size}")
            pad = -size % BLOCK
            if pad:
                mv[p : p + pad] = _ZERO_VIEW[:pad]
                p += pad
        fields = [f for f, _, _ in members]
        if self._zstd is not None:
            stored = self._store_raw(key, mv[:total], fields)
        else:
            self.tar_bytes += total
            stored = self._record(key, start, total, fields)
        self._lay_out(fields, [len(h) for h in headers], [size for _, size, _ in members])
        return stored

    def finish(self) -> ShardRecord:
        if self._closed:
            raise FormatError(f"shard {self.name} is already finished")
        if self._hash is None:
            raise FormatError(f"a piece of shard {self.name} has no end of its own: flush() it")
        self._closed = True
        tail = self._zstd.compress(END_OF_ARCHIVE) if self._zstd is not None else END_OF_ARCHIVE
        self.tar_bytes += len(END_OF_ARCHIVE)
        start = self._reserve(len(tail))
        self._mv[start : start + len(tail)] = tail
        self._fill += len(tail)
        self.stored_bytes += len(tail)
        self.flush()
        return ShardRecord(
            name=self.name,
            bytes=self.stored_bytes,
            samples=len(self.records),
            checksum=self._hash.hexdigest(),
            tar_bytes=self.tar_bytes,
        )
