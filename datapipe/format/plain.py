"""Fast paths over the plain ustar members the packer writes (names up to 100 bytes, no
PAX, no prefix): cut one sample into fields, or find where every field of every sample of
a shard lies. They skip tar header checksums and are only ever used on bytes already
verified against the index's xxh3 checksum of the sample or of the whole shard (a
stronger check); anything they do not vouch for returns ``None`` and goes to
:func:`datapipe.format.decode_sample`, which names the problem.

Shards whose samples all carry the same fields (the common case: every sample has e.g.
``cls``, ``jpg``, ``json``) get a :class:`ShardLayout`: the positions of every field of
every sample, found in one walk, so a reader cuts each sample with two lookups per field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptShardError
from .tar import padding, split_member_name, walk_members

__all__ = ["ShardLayout", "walk_layout", "split_plain_members", "check_members"]


class ShardLayout:
    """Every sample of a shard has ``fields``; field k of sample j is
    ``src[rows[j][2k] : rows[j][2k + 1]]``."""

    __slots__ = ("fields", "table")

    def __init__(self, fields: tuple[str, ...], table: np.ndarray) -> None:
        self.fields = fields
        self.table = table  # (samples, 2 * fields) int64: kept compact in the cache

    @property
    def samples(self) -> int:
        return int(self.table.shape[0])


def walk_layout(src: Any, offs: list[int], ends: list[int], keys: list[str]) -> ShardLayout | None:
    """The shared layout of a shard's samples (``src``: bytes or mmap), or ``None``.

    The headers of all samples are read at once with numpy, member by member
    (:func:`_vector_layout`); a shard that does not pass every one of its checks is walked
    sample by sample (:func:`_walk_each`), which decides. Both give the same layout for
    every shard the fast walk accepts."""
    if not offs:
        return None
    fast = _vector_layout(src, offs, ends, keys)
    return fast if fast is not None else _walk_each(src, offs, ends, keys)


_POW8 = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_NAME = np.arange(100, dtype=np.int64)


def _vector_layout(src: Any, offs: list[int], ends: list[int], keys: list[str]) -> ShardLayout | None:
    """The layout when every sample is exactly ``F`` plain ustar members named
    ``key.field`` for the fields of the first sample, else ``None`` (the caller then walks).
    ``F`` numpy passes over all samples instead of a dozen Python steps per member."""
    first = _walk_each(src, offs[:1], ends[:1], keys[:1])
    if first is None:
        return None
    fields = first.fields
    n = len(offs)
    if n == 1:
        return first
    try:
        names = [(k + ".").encode("utf-8") for k in keys]
    except UnicodeEncodeError:
        return None
    arr = np.frombuffer(src, dtype=np.uint8)
    try:
        pos = np.asarray(offs, dtype=np.int64)
        end = np.asarray(ends, dtype=np.int64)
        if int(end.max()) > arr.size or int(pos.min()) < 0:  # every header read below lies inside
            return None
        keydots = np.array(names, dtype="S100")
        table = np.empty((n, 2 * len(fields)), dtype=np.int64)
        for m, field in enumerate(fields):
            expect = np.char.add(keydots, field.encode("utf-8"))
            if np.any(np.char.str_len(expect) > 100):  # longer names need PAX headers
                return None
            if np.any(pos + 512 > end):
                return None
            if np.any(arr[pos + 156] != 48) or np.any(arr[pos + 345] != 0):
                return None
            # the whole 100-byte name field: the expected name, then NULs only
            want = expect.astype("S100").view(np.uint8).reshape(n, 100)
            if not np.array_equal(arr[pos[:, None] + _NAME], want):
                return None
            digits = arr[pos[:, None] + (124 + np.arange(11))].astype(np.int64) - 48
            if np.any((digits < 0) | (digits > 7)):
                return None
            size = digits @ _POW8
            table[:, 2 * m] = pos + 512
            table[:, 2 * m + 1] = pos + 512 + size
            if np.any(pos + 512 + size > end):
                return None
            pos = pos + 512 + (size + 511) // 512 * 512
        if np.any(pos + 512 <= end):  # room for another member: let the walk decide
            return None
    finally:
        del arr
    if not np.array_equal(table[:1], first.table):
        return None
    return ShardLayout(fields, table)


def _walk_each(src: Any, offs: list[int], ends: list[int], keys: list[str]) -> ShardLayout | None:
    if not offs:
        return None
    find = src.find
    fields: tuple[str, ...] | None = None
    rows: list[list[int]] = []
    for off, end, key in zip(offs, ends, keys):
        keydot = key + "."
        pos, row, names = off, [], []
        while pos + 512 <= end:
            if src[pos + 156] != 48 or src[pos + 345] != 0:
                return None
            cut = find(b"\0", pos, pos + 100)
            if cut == pos:
                break
            try:
                name = src[pos : cut if cut > 0 else pos + 100].decode("utf-8")
                size = int(src[pos + 124 : pos + 135], 8)
            except ValueError:
                return None
            if not name.startswith(keydot):
                return None
            names.append(name[len(keydot) :])
            row.append(pos + 512)
            row.append(pos + 512 + size)
            pos += 512 + size + (-size % 512)
            if row[-1] > end:
                return None
        if pos != end:  # a zero block or stray bytes inside the range: let check_members name it
            return None
        if fields is None:
            fields = tuple(names)
            if not fields or len(set(fields)) != len(fields) or any(not f or "/" in f for f in fields):
                return None
        elif len(names) != len(fields) or tuple(names) != fields:
            return None
        rows.append(row)
    if fields is None:
        return None
    return ShardLayout(fields, np.array(rows, dtype=np.int64))


def split_plain_members(src: Any, pos: int = 0, n: int | None = None) -> dict[str, Any] | None:
    """``{"__key__": key, field: bytes}`` of the sample in ``src[pos:n]`` (``src``: bytes or
    an mmap, anything with ``find`` and slicing to bytes) if it is made only of plain ustar
    members without a name prefix (what the packer writes for names up to 100 bytes), else
    ``None``: the caller then hands the bytes to :func:`datapipe.format.decode_sample`.

    This fast path skips the tar header checksums: it is only used on bytes already
    verified against the index's xxh3 checksum of the sample or of the whole shard, which
    is a stronger check.
    Each field is copied once, straight from ``src``.
    """
    out: dict[str, Any] = {"__key__": None}  # first, as decode_sample orders it
    n = len(src) if n is None else n
    keydot = None
    find = src.find
    while pos + 512 <= n:
        if src[pos + 156] != 48 or src[pos + 345] != 0:
            return None  # PAX, GNU long names, prefixed names, non-files: the general path
        cut = find(b"\0", pos, pos + 100)
        if cut == pos:
            return None  # a zero block inside a sample's range: the general path names it
        try:
            size = int(src[pos + 124 : pos + 135], 8)  # 11 octal digits, as the packer writes
            name = src[pos : cut if cut > 0 else pos + 100].decode("utf-8")
        except ValueError:
            return None
        if keydot is None:
            slash = name.rfind("/")
            dot = name.find(".", slash + 1)
            if dot <= slash + 1:
                return None
            keydot = name[: dot + 1]
            out["__key__"] = name[:dot]
        elif not name.startswith(keydot):
            return None  # another sample's member: let the general path name the problem
        field = name[len(keydot) :]
        if not field or "/" in field or field in out:
            return None
        pos += 512
        end = pos + size
        if end > n:
            return None
        out[field] = src[pos:end]
        pos = end + (-size % 512)
    # every byte of the range belongs to a member: nothing a tar reader sees is left out
    return out if keydot is not None and pos == n else None


def check_members(src: Any, offs: list[int], ends: list[int], keys: list[str], where: str) -> None:
    """Check every tar member of a whole uncompressed shard against the index: each
    sample's range is consumed exactly by members named ``key.field`` for that sample's
    key. The index rows tile the shard (checked when they were read), so the ranges then
    cut exactly the samples any tar reader sees. For verified shards :func:`walk_layout`
    does not lay out (it checks the same for the shards it accepts). Plain ustar members
    are read directly (header checksums are covered by the shard's checksum); a range with
    anything else is parsed strictly. A CorruptShardError names the shard and offset."""
    find = src.find
    for off, end, key in zip(offs, ends, keys):
        keydot = key + "."
        pos = off
        while pos < end:
            if pos + 512 > end or src[pos + 156] != 48 or src[pos + 345] != 0:
                _check_range(src, off, end, key, where)
                break
            cut = find(b"\0", pos, pos + 100)
            try:
                name = src[pos : cut if cut >= 0 else pos + 100].decode("utf-8")
                size = int(src[pos + 124 : pos + 135], 8)
            except ValueError:
                _check_range(src, off, end, key, where)
                break
            if not name.startswith(keydot) or len(name) == len(keydot) or "/" in name[len(keydot):]:
                _check_range(src, off, end, key, where)
                break
            pos += 512 + size + (-size % 512)
        if pos > end:
            _check_range(src, off, end, key, where)


def _check_range(src: Any, off: int, end: int, key: str, where: str) -> None:
    """The strict parse of one sample's range (raises what does not fit its key)."""
    at = f"{where} sample {key!r} (bytes {off}..{end})"
    pos = 0
    for name, _, data_end, start in walk_members(bytes(src[off:end]), at):
        cut = split_member_name(name)
        if cut is None or cut[0] != key:
            raise CorruptShardError(
                f"{at}: the member {name[:200]!r} at byte {off + start} names another key than the index"
            )
        pos = data_end + padding(data_end)
    if pos != end - off:
        raise CorruptShardError(f"{at}: a zero block at byte {off + pos} ends the sample's members early")
