"""Where every field of every sample of an uncompressed shard lies.

The layout is recorded when a shard is written (version 2 of the index: ``member_fields``
and ``member_bounds`` of each sample row, see :mod:`.index`) and read back as a
:class:`StoredLayout`; older indexes hold none, and the reader finds it. Either way the
shard's bytes must bear it out before it is used, and three functions do that, the strict
one the judge of the other two:

- :func:`shard_members` (and :func:`sample_members` for one sample), the strict one: every
  sample's byte range (as the index cuts it) parsed by the one tar parser,
  :func:`datapipe.format.tar.walk_members` (header checksums, PAX, GNU long names,
  typeflags), each member checked to name the index's key. It raises
  :class:`CorruptShardError` naming the shard and offset for a range that is not exactly
  that sample's members.
- :func:`check_layout`, the fast structural check of a stored layout: every member a plain
  ustar header (name ``key.field`` of at most 100 bytes, no prefix, a regular file, the
  size in 11 octal digits) exactly where the layout says, each right after the one before,
  the last ending the sample; all members of all samples at once with numpy. A sample it
  does not vouch for (a PAX header, say) is parsed strictly, and a layout the strict parse
  does not give is a :class:`CorruptShardError`.
- :func:`fast_layout`, the same structural check for a shard without a stored layout, when
  every sample is the same plain ustar members: their headers are read for all samples at
  once with numpy, field by field.

The fast checks skip the header checksums, so they are only used on bytes verified
against the index's xxh3 checksum of the whole shard (a stronger check), and whatever
they accept, the strict parse lays out the same way (``tests/loader/test_readers.py`` and
``tests/format/test_stored_layout.py`` check it).

:func:`find_layout` tries :func:`fast_layout`, then the strict parse. The result is a
:class:`ShardLayout` (every sample has the same fields: the common case) or a
:class:`MemberTable` (samples with different fields).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from numpy.typing import NDArray

from ..errors import CorruptShardError
from .tar import BLOCK, padding, split_member_name, walk_members

__all__ = ["ShardLayout", "MemberTable", "StoredLayout", "check_layout", "find_layout", "fast_layout",
           "sample_members", "shard_members"]


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


class StoredLayout(NamedTuple):
    """A shard's member layout as its index records it, not yet borne out by the shard's
    bytes (:func:`check_layout` does that): sample j has the fields ``shapes[shape[j]]`` in
    stored order, the data of its member k at ``bounds[first[j] + 2k] : bounds[first[j] +
    2k + 1]``, relative to the sample's first byte. ``first`` has one entry more than there
    are samples (the end of the last)."""

    shapes: list[tuple[str, ...]]
    shape: NDArray[Any]
    first: NDArray[Any]
    bounds: NDArray[Any]

    def sample(self, j: int) -> tuple[tuple[str, ...], list[int]]:
        """(fields, relative bounds) of sample ``j``."""
        bounds: list[int] = self.bounds[self.first[j] : self.first[j + 1]].tolist()
        return self.shapes[int(self.shape[j])], bounds

    def placed(self, offs: NDArray[Any]) -> ShardLayout | MemberTable:
        """This layout placed in its shard (sample j starts at ``offs[j]``), as the reader
        uses it; only once :func:`check_layout` has found the shard's bytes bear it out."""
        counts = (self.first[1:] - self.first[:-1]) // 2
        bounds = self.bounds + np.repeat(np.asarray(offs, dtype=np.int64), 2 * counts)
        twice = np.array([len(set(f)) != len(f) for f in self.shapes])
        if len(self.shapes) == 1 and not twice[0]:
            return ShardLayout(self.shapes[0], bounds.reshape(len(offs), -1))
        # a field held twice: read strictly when asked for, which names it (as shard_members marks it)
        renumber = np.where(twice, -1, np.cumsum(~twice) - 1)
        return MemberTable([f for f, t in zip(self.shapes, twice) if not t], renumber[self.shape],
                           self.first[:-1].astype(np.int64), bounds)


def sample_members(src: Any, off: int, end: int, key: str, where: str) -> tuple[tuple[str, ...], list[int]]:
    """(fields in stored order, [start, stop, ...] of each member's data in ``src``) of the
    sample in ``src[off:end]``, by the strict parser: the range must be consumed exactly by
    members named ``key.field``; else :class:`CorruptShardError` naming ``where``."""
    at = f"{where} sample {key!r} (bytes {off}..{end})"
    pos = 0
    fields: list[str] = []
    row: list[int] = []
    for name, start, stop, header in walk_members(memoryview(src)[off:end], at):
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
    return tuple(fields), row


def shard_members(src: Any, offs: list[int], ends: list[int], keys: list[str],
                  where: str) -> ShardLayout | MemberTable:
    """Every sample's range parsed by the strict tar parser (:func:`sample_members`). A
    :class:`ShardLayout` when all samples have the same fields, else a :class:`MemberTable`."""
    shape_ids: dict[tuple[str, ...], int] = {}
    shape: list[int] = []
    first: list[int] = []
    bounds: list[int] = []
    for off, end, key in zip(offs, ends, keys):
        names, row = sample_members(src, off, end, key, where)
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


def check_layout(src: Any, stored: StoredLayout, offs: NDArray[Any], ends: NDArray[Any], key_data: NDArray[Any],
                 key_offsets: NDArray[Any], keys: list[str], where: str) -> ShardLayout | MemberTable:
    """The layout of a verified uncompressed shard (``src``: bytes or an mmap) as its index
    records it (``stored``), once the shard's bytes bear it out; its rows ``offs``/``ends``
    /``keys`` tile it, key j's UTF-8 is ``key_data[key_offsets[j]:key_offsets[j + 1]]``.

    Every member of every sample is checked at once (see the module docstring); a sample
    the fast check does not vouch for is parsed by the strict parser, which must find the
    members the index records, else :class:`CorruptShardError` names the shard, the
    sample and what each says."""
    arr = np.frombuffer(src, dtype=np.uint8)
    try:
        vouched = _vouched(arr, stored, offs, ends, key_data, key_offsets)
    finally:
        del arr  # a view of an mmap keeps its buffer from being refilled
    for j in np.flatnonzero(~vouched).tolist():  # a Python step only where the fast check cannot vouch
        off, end = int(offs[j]), int(ends[j])
        fields, row = sample_members(src, off, end, keys[j], where)
        want, rel = stored.sample(j)
        if fields != want or row != [off + b for b in rel]:
            raise CorruptShardError(
                f"{where} sample {keys[j]!r} (#{j}, bytes {off}..{end}): its tar members ({'/'.join(fields)[:200]} "
                f"with data at {row[:6]}) are not the ones the index records ({'/'.join(want)[:200]} at "
                f"{[off + b for b in rel[:6]]}): the index and the shard disagree (re-run the pack or index that "
                "wrote them)")
    return stored.placed(offs)


def _vouched(arr: NDArray[Any], stored: StoredLayout, offs: NDArray[Any], ends: NDArray[Any],
             key_data: NDArray[Any], key_offsets: NDArray[Any]) -> NDArray[np.bool_]:
    """Per sample: whether its members are plain ustar members exactly where ``stored``
    puts them (see the module docstring). Headers lie on 512-byte blocks of the shard, so
    the shard is viewed as a table of blocks and each check reads one column of the
    members' header rows, for all members of all samples at once."""
    n = len(offs)
    offs, ends = np.asarray(offs, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    counts = (stored.first[1:] - stored.first[:-1]) // 2  # at least one member each (stored_layout)
    sample = np.repeat(np.arange(n), counts)
    start = stored.bounds[0::2] + offs[sample]
    stop = stored.bounds[1::2] + offs[sample]
    size = stop - start
    head = start - BLOCK
    after = stop + (-size % BLOCK)
    # the first member's header at the sample's first byte, each next one where the one
    # before ends, the last one's padding ending the sample
    firsts = stored.first[:-1] // 2
    expect = np.empty_like(head)
    expect[1:] = after[:-1]
    expect[firsts] = offs
    good = (head == expect) & (head % BLOCK == 0) & (head >= 0) & (size >= 0) & (size < 8**11) & (after <= arr.size)
    ok: NDArray[np.bool_] = after[np.cumsum(counts) - 1] == ends
    # the members' headers' name and size fields (their first 136 bytes: 17 eight-byte
    # words), gathered in one step from the shard viewed as rows of 512-byte blocks; the
    # type flag and the name prefix's first byte one by one
    idx = np.flatnonzero(good)
    at_head = head[idx]
    whole = arr.size // BLOCK * BLOCK
    hdr = arr[:whole].view(np.uint64).reshape(-1, BLOCK // 8)[at_head // BLOCK, :17].view(np.uint8)
    # the size: 11 octal digits (anything else wraps above 7), then NUL or space
    digits = hdr[:, 124:135] - np.uint8(48)
    fine = (digits.max(axis=1) <= 7) & ((hdr[:, 135] == 0) | (hdr[:, 135] == 32))
    value = digits[:, 0].astype(np.int64)
    for k in range(1, 11):
        value <<= 3
        value |= digits[:, k]
    fine &= value == size[idx]
    fine &= (arr[at_head + 156] == 48) & (arr[at_head + 345] == 0)  # a regular file, no name prefix
    # the name field: the key, "." and the field, then NULs to its 100 bytes; a longer name
    # needs a PAX header or a prefix, the strict parse's
    klen = key_offsets[1:] - key_offsets[:-1]
    names = sorted({f for shape in stored.shapes for f in shape})
    suffixes = [np.frombuffer(("." + f).encode("utf-8"), dtype=np.uint8) for f in names]
    table = np.full((len(stored.shapes), max(len(f) for f in stored.shapes)), -1, dtype=np.int64)
    for s, fields in enumerate(stored.shapes):
        table[s, : len(fields)] = [names.index(f) for f in fields]
    js = sample[idx]
    field = table[stored.shape[js], idx - firsts[js]]
    kl = klen[js]
    fine &= kl + np.array([x.size for x in suffixes], dtype=np.int64)[field] <= 100
    # the names each member should have, made whole for the members of one key length at a
    # time (a table of each field's suffix at that length, the keys' bytes over it), and
    # compared four bytes at a time: a gathered row is contiguous, its 100 name bytes 25 words
    lengths = np.flatnonzero(np.bincount(kl[fine], minlength=1)).tolist()  # (np.unique imports numpy.ma)
    for k in lengths:
        rows: Any = np.flatnonzero(fine & (kl == k)) if len(lengths) > 1 else slice(None)
        tails = np.zeros((len(suffixes), 100), dtype=np.uint8)
        for f, suffix in enumerate(suffixes):
            tails[f, k : k + suffix.size] = suffix[: 100 - k]
        want = np.take(tails, field[rows], axis=0)
        if k:  # the keys of this length, a row a sample, then a row a member
            keys = sliding_window_view(key_data, k)[key_offsets[:-1][klen == k]]
            want[:, :k] = np.take(keys, (np.cumsum(klen == k) - 1)[js[rows]], axis=0)
        same = (hdr[rows].view(np.uint32)[:, :25] == want.view(np.uint32)).all(axis=1)
        fine[rows] &= same
    good[idx] = fine
    ok[sample[~good]] = False
    return ok


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
