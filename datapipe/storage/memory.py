"""`MemoryStore`: objects in a dict of this process."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import ObjectNotFoundError
from .store import Store, check_range

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """Objects in a dict of this process (tests, throwaway data); nothing is durable."""

    def __init__(self, root: str = "mem://") -> None:
        super().__init__(root)
        self._objects: dict[str, bytes] = {}
        self._generation: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        try:
            return self._objects[key]
        except KeyError:
            raise ObjectNotFoundError(f"no object at {self.url(key)}") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.get(key)
        check_range(self.url(key), start, end, len(data))
        return data[start:end]

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self._objects[key] = bytes(data)
            self._generation[key] = self._generation.get(key, 0) + 1

    def stat(self, key: str) -> tuple[int, str | None]:
        with self._lock:
            data, gen = self._objects.get(key), self._generation.get(key)
        if data is None:
            raise ObjectNotFoundError(f"no object at {self.url(key)}")
        return len(data), str(gen)

    @contextmanager
    def open_writer(self, key: str) -> Iterator[BinaryIO]:
        buf = io.BytesIO()
        yield buf
        self.put(key, buf.getvalue())

    def exists(self, key: str) -> bool:
        return key in self._objects

    def size(self, key: str) -> int:
        return len(self.get(key))

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k in list(self._objects) if k.startswith(prefix))
