"""Re-read every shard of a dataset and check it against its index: shard checksum, sample
checksums, tar structure, keys, and that samples tile the shard exactly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .checksum import checksum
from .dataset import open_index
from .errors import DatapipeError, FormatError
from .format import END_OF_ARCHIVE, decode_sample, decompress_frame, sample_members
from .progress import progress_iter

__all__ = ["Problem", "VerifyReport", "verify_dataset"]


@dataclass(frozen=True)
class Problem:
    shard: str
    sample: str | None  # the sample key, None for shard-level problems
    message: str

    def __str__(self) -> str:
        where = self.shard + (f" sample {self.sample!r}" if self.sample else "")
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    url: str
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_shard(ix: Any, i: int) -> Iterator[Problem]:
    info = ix.shards[i]
    try:
        store, name = ix.shard_location(info)
        data = store.get(name)
    except DatapipeError as e:
        yield Problem(info.url, None, f"cannot read: {e}")
        return
    try:
        table = ix.shard_samples(i)  # checked to tile the shard
    except DatapipeError as e:
        yield Problem(ix.store.url(ix.manifest["samples_file"]), None, str(e))
        return
    # sample-level problems first, so the first one reported names the sample
    shard_problem = None
    if len(data) != info.bytes:
        shard_problem = Problem(info.url, None,
                                f"has {len(data)} bytes, the index says {info.bytes} (truncated or replaced)")
    elif checksum(data) != info.checksum:
        shard_problem = Problem(info.url, None, f"checksum mismatch: index {info.checksum}, stored {checksum(data)}")
    # a zstd shard decompresses to exactly tar_bytes: each frame is bounded by what is left
    left = info.tar_bytes - len(END_OF_ARCHIVE)
    end = 0
    for j, (key, off, length, digest) in enumerate(zip(table.keys, table.offsets, table.lengths, table.checksums)):
        off, length = int(off), int(length)
        end = off + length
        where = f"{info.url} sample {key!r} (bytes {off}..{off + length})"
        piece = data[off : off + length]
        if len(piece) != length:
            yield Problem(info.url, key, f"byte range {off}..{off + length} runs past the end ({len(data)} bytes)")
            continue
        if checksum(piece) != digest:
            yield Problem(info.url, key, f"checksum mismatch at bytes {off}..{off + length}")
            continue
        try:
            raw = decompress_frame(piece, where, max(left, 0)) if ix.compression == "zstd" else piece
            left -= len(raw)
            sample = decode_sample(raw, "none", where)
        except DatapipeError as e:
            yield Problem(info.url, key, str(e))
            continue
        if sample["__key__"] != key:
            yield Problem(info.url, key, f"bytes {off}..{off + length} hold key {sample['__key__']!r}, "
                          f"the index says {key!r}")
        elif table.layout is not None and sample_members(raw, 0, len(raw), key, where) != table.layout.sample(j):
            fields, bounds = table.layout.sample(j)
            yield Problem(info.url, key, f"the index records its members as {'/'.join(fields)[:200]} with data at "
                          f"{bounds[:6]} (from the sample's first byte), its tar holds others")
    if shard_problem is not None:
        yield shard_problem
        return
    tail = data[end:]
    if ix.compression == "zstd":
        if left != 0:
            yield Problem(info.url, None, f"decompresses to {info.tar_bytes - len(END_OF_ARCHIVE) - left} bytes "
                          f"before its end-of-archive frame, the index says {info.tar_bytes - len(END_OF_ARCHIVE)}")
            return
        try:
            tail = decompress_frame(tail, f"{info.url} end-of-archive frame (bytes {end}..{len(data)})",
                                    len(END_OF_ARCHIVE))
        except DatapipeError as e:
            yield Problem(info.url, None, str(e))
            return
    if ix.tar_index and len(tail) >= len(END_OF_ARCHIVE) and bytes(tail) == bytes(len(tail)):
        return  # an existing tar: end-of-archive blocks padded with zeros to its record size
    if tail != END_OF_ARCHIVE:
        yield Problem(info.url, None, f"does not end with the tar end-of-archive blocks after byte {end}")


def verify_dataset(url: str, *, all_problems: bool = False, storage_options: dict[str, Any] | None = None,
                   progress: bool = False) -> VerifyReport:
    """Check every shard; stop at the first problem unless ``all_problems``."""
    try:
        ix = open_index(url, storage_options)  # checks the manifest and the index files
    except FormatError as e:  # a damaged index is a finding of verify, not a failure to run
        report = VerifyReport(url.rstrip("/"))
        report.problems.append(Problem(report.url, None, str(e)))
        return report
    report = VerifyReport(ix.url)
    try:
        ix.verify_sample_table()
    except DatapipeError as e:
        report.problems.append(Problem(ix.store.url(ix.manifest["samples_file"]), None, str(e)))
        return report
    for i in progress_iter(range(ix.num_shards), progress, desc="verify", unit="shards"):
        for p in _check_shard(ix, i):
            report.problems.append(p)
            if not all_problems:
                return report
        report.shards += 1
        report.samples += ix.shards[i].samples
        report.bytes += ix.shards[i].bytes
    return report
