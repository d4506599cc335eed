"""Write one shard: samples in, stored bytes out, with offsets and checksums recorded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, BinaryIO

import zstandard

from ..checksum import Hasher, checksum
from ..errors import FormatError
from .index import SampleRecords, ShardRecord
from .sample import COMPRESSIONS, encode_sample
from .tar import END_OF_ARCHIVE

__all__ = ["ShardBuilder", "shard_name"]


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

    def _emit(self, data: bytes | memoryview) -> None:
        self.sink.write(data)
        self._hash.update(data)
        self.stored_bytes += len(data)

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
        return ShardRecord(
            name=self.name,
            bytes=self.stored_bytes,
            samples=len(self.records),
            checksum=self._hash.hexdigest(),
            tar_bytes=self.tar_bytes,
        )
