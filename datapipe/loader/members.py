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
    """The shared layout of a shard's samples (``src``: bytes or mmap), or ``None``."""
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
