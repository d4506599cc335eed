"""Index columns as numpy, and the index's rules checked over a whole column at once.

A reader opens ``shards.parquet`` (one row per shard) and a shard's slice of
``samples.parquet`` in every fresh process, so their checks must not cost a Python step
per row: the rules that :mod:`.index` states for one value (``check_relative_name``, the
key and checksum patterns) are applied here to the bytes of a whole Arrow column,
vectorised. ``tests/format/test_index_columns.py`` checks that both spellings of each rule agree.

The columns are read from Arrow's buffers, never through ``Array.to_numpy()`` or
``np.asarray(array)``: those import pandas (half a second) on first use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

__all__ = ["array_of", "bad_checksums", "bad_paths", "int_column", "list_column", "string_column"]

_SLASH, _DOT, _NUL, _BACKSLASH, _COLON = (ord(c) for c in "/.\0\\:")
_PREFIX = np.frombuffer(b"xxh3_64:", dtype=np.uint8)
_HEX = np.zeros(256, dtype=bool)
_HEX[list(b"0123456789abcdef")] = True


def array_of(column: Any) -> Any:
    """One Arrow array of a column (a table's column is chunked): its one chunk as it is
    (combining copies even one), else the chunks joined."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def int_column(column: Any, dtype: Any) -> NDArray[Any]:
    """A column of integers without nulls as a numpy array (a copy: it outlives the table)."""
    arr = array_of(column)
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=dtype)
    values = np.frombuffer(arr.buffers()[1], dtype=dtype)
    out: NDArray[Any] = values[arr.offset : arr.offset + n].copy()
    return out


def string_column(column: Any) -> tuple[Any, NDArray[np.uint8], NDArray[np.int64]]:
    """(the Arrow string array, its bytes, where each row starts in them): row j is
    ``data[offsets[j]:offsets[j + 1]]``. Views of the array's buffers, no copy."""
    arr = array_of(column)
    n = len(arr)
    if n == 0:
        return arr, np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    bufs = arr.buffers()
    wide = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if wide else np.int32)[arr.offset : arr.offset + n + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, dtype=np.uint8)
    return arr, data, offsets.astype(np.int64)


def list_column(column: Any) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(values, offsets) of a list<int64> column without nulls: row j holds
    ``values[offsets[j]:offsets[j + 1]]`` (offsets start at 0)."""
    arr = array_of(column)
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    child = arr.values  # the whole child array: a slice keeps its parent's values
    values = np.frombuffer(child.buffers()[1], dtype=np.int64)[child.offset : child.offset + len(child)]
    lo, hi = int(offsets[0]), int(offsets[-1])
    return values[lo:hi].copy(), offsets - lo


def _rows_of(flags: NDArray[np.bool_], offsets: NDArray[np.int64], lo: int) -> NDArray[np.bool_]:
    """Per row: whether any of its bytes is flagged (``flags`` covers bytes from ``lo``)."""
    n = len(offsets) - 1
    hit = np.flatnonzero(flags) + lo
    out = np.zeros(n, dtype=bool)
    if hit.size:
        out[np.searchsorted(offsets, hit, side="right") - 1] = True
    return out


def bad_paths(data: NDArray[np.uint8], offsets: NDArray[np.int64], *, dot_in_last: bool,
              colon_in_first: bool = True) -> NDArray[np.bool_]:
    """Per row (row j is ``data[offsets[j]:offsets[j + 1]]``, UTF-8): whether it breaks the
    rule of a relative path inside a folder: empty, a NUL or a backslash, an empty, ``.``
    or ``..`` component (a leading or trailing ``/`` makes an empty one); unless
    ``dot_in_last``, a dot in the last component (a sample key: WebDataset cuts a key at
    that dot); unless ``colon_in_first``, a colon in the first component (``s3:x``)."""
    n = len(offsets) - 1
    bad = np.zeros(n, dtype=bool)
    if n == 0:
        return bad
    lens = offsets[1:] - offsets[:-1]
    bad |= lens <= 0
    lo, hi = int(offsets[0]), int(offsets[-1])
    s = data[lo:hi]
    if s.size == 0:
        return bad
    full = lens > 0
    starts, ends = offsets[:-1][full] - lo, offsets[1:][full] - lo  # rows with bytes
    first = np.zeros(s.size, dtype=bool)
    first[starts] = True
    last = np.zeros(s.size, dtype=bool)
    last[ends - 1] = True
    slash, dot = s == _SLASH, s == _DOT
    # a component starts at a row's first byte or after a slash of the same row, and ends at
    # a row's last byte or before a slash of the same row
    comp_start = first.copy()
    comp_start[1:] |= slash[:-1] & ~first[1:]
    comp_end = last.copy()
    comp_end[:-1] |= slash[1:] & ~last[:-1]
    flags = (s == _NUL) | (s == _BACKSLASH)
    flags |= slash & (comp_start | last)  # an empty component: "/x", "a//b", "a/"
    flags |= dot & comp_start & comp_end & ~slash  # "."
    dot_end = dot & comp_end & ~slash
    two = np.zeros(s.size, dtype=bool)
    two[:-1] = dot[:-1] & comp_start[:-1] & ~last[:-1] & dot_end[1:]  # ".."
    flags |= two
    bad |= _rows_of(flags, offsets, lo)
    at = np.arange(s.size, dtype=np.int64)
    if not dot_in_last:
        last_slash = np.maximum.reduceat(np.where(slash, at, -1), starts)
        last_dot = np.maximum.reduceat(np.where(dot, at, -1), starts)
        bad[np.flatnonzero(full)[last_dot > last_slash]] = True
    if not colon_in_first:
        first_slash = np.minimum.reduceat(np.where(slash, at, s.size), starts)
        first_colon = np.minimum.reduceat(np.where(s == _COLON, at, s.size), starts)
        bad[np.flatnonzero(full)[first_colon < first_slash]] = True
    return bad


def bad_checksums(data: NDArray[np.uint8], offsets: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Per row: whether it is not ``xxh3_64:`` and 16 lower-case hex digits."""
    n = len(offsets) - 1
    lens = offsets[1:] - offsets[:-1]
    bad = lens != 24
    good = np.flatnonzero(~bad)
    if good.size:
        rows = data[offsets[good][:, None] + np.arange(24)]
        ok = (rows[:, :8] == _PREFIX).all(axis=1) & _HEX[rows[:, 8:]].all(axis=1)
        bad[good[~ok]] = True
    return bad if n else np.zeros(0, dtype=bool)
