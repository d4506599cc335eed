"""Calls on a tier's folder that give up after a deadline: a read of a hung mount (an NFS
server gone, a lock that is never released) must cost the reader a bounded stall, not the
rest of the job. A call runs on a thread of :class:`Deadline`'s own and the caller waits at
most ``seconds`` for it; past that the call is abandoned: the caller gets an ``OSError``
(``ETIMEDOUT``) naming what did not answer, and the thread finishes the call whenever the
filesystem answers, hands what it got to ``abandon`` (which closes a descriptor it opened)
and goes back to serve further calls. Threads are kept between calls (a call costs a
hand-over, about ten microseconds, not a thread start)."""

from __future__ import annotations

import errno
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Deadline", "DEFAULT_TIER_DEADLINE_S", "timed_out"]

T = TypeVar("T")

#: how long a read of a directory tier may take before it is abandoned (``tier_deadline_s``):
#: far above a healthy read of a shard (a 1 GB shard at 100 MB/s takes 10 s)
DEFAULT_TIER_DEADLINE_S = 30.0
_IDLE_KEPT = 16  # threads kept waiting for calls; more are started while as many calls run at once


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a call :class:`Deadline` abandoned."""
    return isinstance(e, OSError) and e.errno == errno.ETIMEDOUT


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[], T], abandon: Callable[[T], None] | None) -> None:
        self.fn, self.abandon = fn, abandon
        self.reply: queue.SimpleQueue[bool] = queue.SimpleQueue()  # C-level: the cheapest hand-back
        self.lock = threading.Lock()
        self.done = False
        self.abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = self.fn()
        except BaseException as e:  # handed to the caller, who raises it
            error = e
        with self.lock:
            self.result, self.error, self.done = result, error, True
            abandoned = self.abandoned
        if not abandoned:
            self.reply.put(True)
        elif error is None and self.abandon is not None:
            try:
                self.abandon(result)
            except Exception:  # nobody waits for this call any more
                pass


class Deadline:
    """Calls waited for at most ``seconds`` (None: made in the caller's thread, no
    deadline); see the module docstring."""

    def __init__(self, seconds: float | None, name: str = "datapipe-tier-io") -> None:
        self.seconds = seconds
        self.name = name
        self._idle: list[queue.SimpleQueue[_Call[Any] | None]] = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, fn: Callable[[], T], *, what: str, abandon: Callable[[T], None] | None = None) -> T:
        """``fn()``, or an ``OSError(ETIMEDOUT)`` naming ``what`` once ``seconds`` pass
        without its answer (``abandon`` then gets its result when it comes)."""
        if self.seconds is None or self._closed:
            return fn()
        c: _Call[T] = _Call(fn, abandon)
        self._inbox().put(c)
        try:
            c.reply.get(timeout=self.seconds)
        except queue.Empty:
            pass
        with c.lock:
            if not c.done:
                c.abandoned = True
                raise OSError(errno.ETIMEDOUT, f"{what}: no answer within {self.seconds:g} s (a hung mount or a "
                                               "lock never released?); abandoned")
        if c.error is not None:
            raise c.error
        result: T = c.result
        return result

    def _inbox(self) -> queue.SimpleQueue[_Call[Any] | None]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        inbox: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True).start()
        return inbox

    def _serve(self, inbox: queue.SimpleQueue[_Call[Any] | None]) -> None:
        while True:
            c = inbox.get()
            if c is None:
                return
            c.run()
            with self._lock:
                if self._closed or len(self._idle) >= _IDLE_KEPT:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        """Let the kept threads end (a call under way finishes first)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)
