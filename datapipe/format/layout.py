"""Where every field of every sample of an uncompressed shard lies, found once per shard.

Two ways to find it, one the judge of the other:

- :func:`shard_members`, the strict one: every sample's byte range (as the index cuts
  it) parsed by the one tar parser, :func:`datapipe.format.tar.walk_members` (header
  checksums, PAX, GNU long names, typeflags), each member checked to name the index's key.
  It raises :class:`CorruptShardError` naming the shard and offset for a range that is not
  exactly that sample's members.
- :func:`fast_layout`, the one fast structural check: when every sample is the same
  plain ustar members (names up to 100 bytes, no PAX, no prefix), their headers are read
  for all samples at once with numpy. It skips the header checksums, so it is only used
  on bytes verified against the index's xxh3 checksum of the whole shard (a stronger
  check), and it returns ``None`` for anything it does not vouch for. Whatever it accepts,
  the strict parse lays out the same way (``tests/test_loader_laid.py`` checks it).

:func:`find_layout` tries the fast check, then the strict parse. The result is a
:class:`ShardLayout` (every sample has the same fields: the common case) or a
:class:`MemberTable` (samples with different fields).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import CorruptShardError
from .tar import BLOCK, padding, split_member_name, walk_members

__all__ = ["ShardLayout", "MemberTable", "find_layout", "fast_layout", "shard_members"]


class ShardLayout:
    """Every sample of a shard has ``fields``; field k of sample j is
    ``src[table[j, 2k] : table[j, 2k + 1]]``."""

    __slots__ = ("fields", "table")

    def __init__(self, fields: tuple[str, ...], table: NDArray[Any]) -> None:
        self.fields = fields
        self.table = table  # (samples, 2 * fields) int64: kept compact in the cache

    @property
    def samples(self) -> int:
        return int(self.table.shape[0])


class MemberTable:
    """The members of each sample of a shard whose samples differ in their fields: sample j
    has fields ``shapes[shape[j]]``, field k of it at ``src[bounds[first[j] + 2k] :
    bounds[first[j] + 2k + 1]]``. ``shape[j] == -1``: the sample holds a field twice, and
    reading it raises (its strict decode names the problem)."""

    __slots__ = ("bounds", "first", "shape", "shapes")

    def __init__(self, shapes: list[tuple[str, ...]], shape: NDArray[Any], first: NDArray[Any],
                 bounds: NDArray[Any]) -> None:
        self.shapes, self.shape, self.first, self.bounds = shapes, shape, first, bounds

    @property
    def samples(self) -> int:
        return int(self.shape.shape[0])


def find_layout(src: Any, offs: list[int], ends: list[int], keys: list[str], where: str) -> ShardLayout | MemberTable:
    """The layout of a verified uncompressed shard (``src``: bytes or an mmap) whose index
    rows ``offs``/``ends``/``keys`` tile it: :func:`fast_layout`, else :func:`shard_members`
    (which raises :class:`CorruptShardError` for a range that is not its sample's members)."""
    fast = fast_layout(src, offs, ends, keys)
    return fast if fast is not None else shard_members(src, offs, ends, keys, where)


def shard_members(src: Any, offs: list[int], ends: list[int], keys: list[str],
                  where: str) -> ShardLayout | MemberTable:
    """Every sample's range parsed by the strict tar parser: it must be consumed exactly by
    members named ``key.field`` for that sample's key. A :class:`ShardLayout` when all
    samples have the same fields, else a :class:`MemberTable`."""
    mv = memoryview(src)
    shape_ids: dict[tuple[str, ...], int] = {}
    shape: list[int] = []
    first: list[int] = []
    bounds: list[int] = []
    for off, end, key in zip(offs, ends, keys):
        at = f"{where} sample {key!r} (bytes {off}..{end})"
        pos = 0
        fields: list[str] = []
        row: list[int] = []
        for name, start, stop, header in walk_members(mv[off:end], at):
            cut = split_member_name(name)
            if cut is None or cut[0] != key:
                raise CorruptShardError(
                    f"{at}: the member {name[:200]!r} at byte {off + header} names another key than the index"
                )
            fields.append(cut[1])
            row += (off + start, off + stop)
            pos = stop + padding(stop)
        if pos != end - off:
            raise CorruptShardError(f"{at}: a zero block at byte {off + pos} ends the sample's members early")
        names = tuple(fields)
        first.append(len(bounds))
        if len(set(names)) != len(names):
            shape.append(-1)  # read strictly when asked for, which names the field held twice
            continue
        shape.append(shape_ids.setdefault(names, len(shape_ids)))
        bounds += row
    shapes = list(shape_ids)
    if len(shapes) == 1 and -1 not in shape:
        return ShardLayout(shapes[0], np.array(bounds, dtype=np.int64).reshape(len(offs), -1))
    return MemberTable(shapes, np.array(shape, dtype=np.int64), np.array(first, dtype=np.int64),
                       np.array(bounds, dtype=np.int64))


_POW8 = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_NAME = np.arange(100, dtype=np.int64)


def _plain_fields(src: Any, off: int, end: int, key: str) -> tuple[str, ...] | None:
    """The fields of the sample in ``src[off:end]`` if it is only plain ustar members
    (regular files, no name prefix) named ``key.field``, distinct, else ``None``."""
    keydot = (key + ".").encode("utf-8")
    fields: list[str] = []
    pos = off
    while pos < end:
        if pos + BLOCK > end:
            return None
        header = bytes(src[pos : pos + BLOCK])
        name = header[:100].split(b"\0", 1)[0]
        digits = header[124:135]
        if header[156] != 48 or header[345] != 0 or not name.startswith(keydot) or b"/" in name[len(keydot):] \
                or header[len(name) : 100].strip(b"\0") or not all(48 <= c <= 55 for c in digits) \
                or header[135] not in (0, 32):  # 12 digits (libarchive, star): the strict parse reads them
            return None
        try:
            fields.append(name[len(keydot):].decode("utf-8"))
        except UnicodeDecodeError:
            return None
        size = int(digits, 8)
        pos += BLOCK + size + padding(size)
    if pos != end or not fields or not all(fields) or len(set(fields)) != len(fields):
        return None
    return tuple(fields)


def fast_layout(src: Any, offs: list[int], ends: list[int], keys: list[str]) -> ShardLayout | None:
    """The layout when every sample is exactly ``F`` plain ustar members named
    ``key.field`` for the fields of the first sample, else ``None``. ``F`` numpy passes
    over all samples instead of a dozen Python steps per member. Header checksums are not
    read: use it on verified bytes only."""
    if not offs:
        return None
    fields = _plain_fields(src, offs[0], ends[0], keys[0])
    if fields is None:
        return None
    n = len(offs)
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
            if np.any(pos + BLOCK > end):
                return None
            if np.any(arr[pos + 156] != 48) or np.any(arr[pos + 345] != 0):
                return None
            # the whole 100-byte name field: the expected name, then NULs only
            want = expect.astype("S100").view(np.uint8).reshape(n, 100)
            if not np.array_equal(arr[pos[:, None] + _NAME], want):
                return None
            digits = arr[pos[:, None] + (124 + np.arange(11))].astype(np.int64) - 48
            # 11 digits and a terminator; a 12th digit (libarchive, star) is the strict parse's
            if np.any((digits < 0) | (digits > 7)) or np.any((arr[pos + 135] != 0) & (arr[pos + 135] != 32)):
                return None
            size = digits @ _POW8
            table[:, 2 * m] = pos + BLOCK
            table[:, 2 * m + 1] = pos + BLOCK + size
            if np.any(pos + BLOCK + size > end):
                return None
            pos = pos + BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK
        if np.any(pos != end):  # another member, a zero block or stray bytes: the strict parse decides
            return None
    finally:
        del arr
    return ShardLayout(fields, table)
