"""Write one shard: samples in, stored bytes out, with offsets and checksums recorded."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, BinaryIO

import zstandard

from ..checksum import Hasher, checksum
from ..errors import FormatError
from .index import SampleRecords, ShardRecord
from .sample import COMPRESSIONS, encode_sample
from .tar import END_OF_ARCHIVE

__all__ = ["ShardBuilder", "shard_name"]

_BATCH_BYTES = 4 << 20
_BATCH_PIECES = 1000  # below IOV_MAX (1024)


def shard_name(index: int, compression: str, prefix: str = "shard") -> str:
    return f"{prefix}-{index:06d}.tar" + (".zst" if compression == "zstd" else "")


class ShardBuilder:
    """Appends samples to a binary sink. Uncompressed: the sink receives a plain tar.
    zstd: each sample's members are one independent zstd frame, and the end-of-archive
    blocks a last frame, so ``zstd -d`` yields a valid tar and each sample is one range."""

    def __init__(self, sink: BinaryIO, name: str, compression: str = "none", level: int = 3) -> None:
        if compression not in COMPRESSIONS:
            raise FormatError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")
        self.sink = sink
        self.name = name
        self.compression = compression
        self._zstd = zstandard.ZstdCompressor(level=level) if compression == "zstd" else None
        self._hash = Hasher()
        self.records = SampleRecords([], [], [], [])
        self.fields: set[str] = set()
        self.stored_bytes = 0
        self.tar_bytes = 0
        self._closed = False
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        try:
            self._fd: int | None = sink.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None

    def _emit(self, data: bytes | memoryview) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        self._hash.update(data)
        self.stored_bytes += len(data)
        if self._pending_bytes >= _BATCH_BYTES or len(self._pending) >= _BATCH_PIECES:
            self.flush()

    def flush(self) -> None:
        """Hand the pending pieces to the sink: one ``writev`` system call for a real file
        (many small members cost one call, not three each), else ``write`` per piece."""
        pieces, self._pending, self._pending_bytes = self._pending, [], 0
        if not pieces:
            return
        if self._fd is not None:
            self.sink.flush()
            view = [memoryview(p) for p in pieces]
            while view:
                n = os.writev(self._fd, view)
                while view and n >= len(view[0]):
                    n -= len(view[0])
                    view.pop(0)
                if n:
                    view[0] = view[0][n:]
        else:
            for p in pieces:
                self.sink.write(p)

    def add(self, sample: Mapping[str, Any]) -> int:
        """Append one sample; returns its stored size in bytes."""
        key, parts = encode_sample(sample)
        return self.add_encoded(key, parts, [k for k in sample if not k.startswith("__")])

    def add_encoded(self, key: str, parts: list[bytes | memoryview], fields: list[str]) -> int:
        """Append a sample already cut into tar pieces by ``encode_sample``."""
        offset = self.stored_bytes
        if self._zstd is not None:
            raw = b"".join(parts)
            self.tar_bytes += len(raw)
            stored = self._zstd.compress(raw)
            self._emit(stored)
            digest = checksum(stored)
        else:
            h = Hasher()
            for p in parts:
                self._emit(p)
                h.update(p)
            self.tar_bytes = self.stored_bytes
            digest = h.hexdigest()
        length = self.stored_bytes - offset
        self.records.keys.append(key)
        self.records.offsets.append(offset)
        self.records.lengths.append(length)
        self.records.checksums.append(digest)
        self.fields.update(fields)
        return length

    def finish(self) -> ShardRecord:
        if self._closed:
            raise FormatError(f"shard {self.name} is already finished")
        self._closed = True
        tail = self._zstd.compress(END_OF_ARCHIVE) if self._zstd is not None else END_OF_ARCHIVE
        self.tar_bytes += len(END_OF_ARCHIVE)
        self._emit(tail)
        self.flush()
        return ShardRecord(
            name=self.name,
            bytes=self.stored_bytes,
            samples=len(self.records),
            checksum=self._hash.hexdigest(),
            tar_bytes=self.tar_bytes,
        )
