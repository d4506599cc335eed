"""A real Store that delegates to another and injects the faults object stores show:
503 SlowDown, connection resets, bodies cut short, flipped bytes, slow answers.

Test scaffolding, not part of ``datapipe.storage``'s public names: tests and benchmarks of
the cache's robustness import it from this module, e.g. across spawned processes::

    TieredCache(..., cold_wrapper=functools.partial(FaultInjectingStore, errors=2))

Faults are deterministic: for every key, read number n (``get`` and ``get_range`` count
together) suffers the n-th entry of the plan ``errors x 503, resets x reset, truncations
x short body, corruptions x flipped byte, delays x sleep``, and later reads pass through.
Counters are per process (a pickled copy starts from zero).
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from typing import Any

from ..errors import StorageError
from .store import DelegatingStore, Store

__all__ = ["FaultInjectingStore"]


class FaultInjectingStore(DelegatingStore):
    def __init__(self, inner: Store, *, errors: int = 0, resets: int = 0, truncations: int = 0,
                 corruptions: int = 0, delays: int = 0, delay_s: float = 0.0,
                 size_errors: int = 0) -> None:
        super().__init__(inner)
        self.plan = (["503"] * errors + ["reset"] * resets + ["truncate"] * truncations
                     + ["corrupt"] * corruptions + ["delay"] * delays)
        self.delay_s = delay_s
        self.size_errors = size_errors
        self.reads: Counter[str] = Counter()
        self.sizes: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        state["reads"], state["sizes"], state["injected"] = Counter(), Counter(), Counter()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _fault(self, key: str) -> str | None:
        with self._lock:
            n = self.reads[key]
            self.reads[key] += 1
            fault = self.plan[n] if n < len(self.plan) else None
            if fault:
                self.injected[fault] += 1
        if fault == "503":
            # What FsspecStore raises for an S3 503 SlowDown translated by s3fs.
            cause = OSError(errno.EBUSY, "SlowDown: Please reduce your request rate (injected)")
            raise StorageError(f"OSError on {self.url(key)}: {cause}") from cause
        if fault == "reset":
            cause = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)")
            raise StorageError(f"ConnectionResetError on {self.url(key)}: {cause}") from cause
        if fault == "delay":
            time.sleep(self.delay_s)
        return fault

    @staticmethod
    def _damage(data: bytes, fault: str | None) -> bytes:
        if fault == "truncate":
            return data[: len(data) // 2]
        if fault == "corrupt" and data:
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def get(self, key: str) -> bytes:
        fault = self._fault(key)
        return self._damage(self.inner.get(key), fault)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        fault = self._fault(key)
        return self._damage(self.inner.get_range(key, start, end), fault)

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        fault = self._fault(key)
        return self._damage(self.inner.get_range_at(key, start, end, version), fault)

    def _size_fault(self, key: str) -> None:
        with self._lock:
            n = self.sizes[key]
            self.sizes[key] += 1
        if n < self.size_errors:
            cause = OSError(errno.EBUSY, "SlowDown (injected on HEAD)")
            raise StorageError(f"OSError on {self.url(key)}: {cause}") from cause

    def size(self, key: str) -> int:
        self._size_fault(key)
        return self.inner.size(key)

    def stat(self, key: str) -> tuple[int, str | None]:
        self._size_fault(key)
        return self.inner.stat(key)

