"""Where each field of each sample of a shard lies, found once per shard and kept.

Parsing a sample's tar headers costs a dozen Python operations per member, every epoch.
For a shard whose samples all carry the same fields (the common case: every sample has
e.g. ``cls``, ``jpg``, ``json``) the positions are found in one walk when the shard is
first fetched, on the prefetch thread, and kept in a bounded cache; the reader then cuts
each sample with two list lookups per field. Shards with mixed or unusual samples (other
fields, PAX or long names, anything the walk does not vouch for) get no layout and their
samples take the per-sample path.

A layout is only ever computed from, and used on, bytes verified against the index.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["ShardLayout", "LayoutCache", "walk_layout"]


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


class LayoutCache:
    """Layouts by shard, least recently used first out, holding at most ``max_samples``
    samples' positions (16 bytes per field per sample)."""

    def __init__(self, max_samples: int = 1 << 20) -> None:
        self.max_samples = int(max_samples)
        self._items: OrderedDict[Any, ShardLayout] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # a worker process builds its own; shipping the positions would cost more
        return {"max_samples": self.max_samples}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_samples"])

    def get(self, key: Any) -> ShardLayout | None:
        with self._lock:
            lay = self._items.get(key)
            if lay is not None:
                self._items.move_to_end(key)
            return lay

    def put(self, key: Any, layout: ShardLayout) -> None:
        if layout.samples > self.max_samples:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._held -= old.samples
            self._items[key] = layout
            self._held += layout.samples
            while self._held > self.max_samples:
                _, out = self._items.popitem(last=False)
                self._held -= out.samples
