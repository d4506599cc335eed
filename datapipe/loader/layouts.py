"""Where each field of each sample of a shard lies, found once per shard and kept.

Parsing a sample's tar headers costs a dozen Python operations per member, every epoch.
The layout of a shard (:func:`datapipe.format.layout.find_layout`) is found when the shard
is first fetched, on the prefetch thread, and kept here in a bounded cache across epochs;
the reader then cuts each sample with lookups. A layout is only ever computed from, and
used on, bytes verified against the index.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..format import MemberTable, ShardLayout

Layout = ShardLayout | MemberTable

__all__ = ["LayoutCache"]


class LayoutCache:
    """Layouts by shard, least recently used first out, holding at most ``max_samples``
    samples' positions (16 bytes per field per sample); ``max_samples=0`` keeps none."""

    def __init__(self, max_samples: int = 1 << 20) -> None:
        self._start(max_samples)

    def _start(self, max_samples: int) -> None:
        self.max_samples = int(max_samples)
        self._items: OrderedDict[Any, Layout] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # a worker process builds its own; shipping the positions would cost more
        return {"max_samples": self.max_samples}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._start(state["max_samples"])

    def __len__(self) -> int:
        """Layouts held."""
        with self._lock:
            return len(self._items)

    def get(self, key: Any) -> Layout | None:
        with self._lock:
            lay = self._items.get(key)
            if lay is not None:
                self._items.move_to_end(key)
            return lay

    def put(self, key: Any, layout: Layout) -> None:
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
