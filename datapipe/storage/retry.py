"""Retries with backoff, per-attempt timeouts, and concurrent range requests for cold reads.

Object stores fail in passing: 500 InternalError, connection resets, bodies cut short,
requests that hang. Those are retried with exponential backoff and jitter, ``attempts``
times; everything else (a missing object, a denied request, a bad range) is raised at once,
since asking again cannot help. After the last attempt a :class:`RemoteError` names the URL
and keeps the last failure as its cause.

Throttling (503 SlowDown, 429: :func:`is_throttle`) is not failure: the store is answering,
and asks for fewer requests. A throttled answer uses up no attempt; it is waited out (the
same backoff here, and the cold tier's pacing slows the whole node, cache/pacing.py) until
the request's total deadline, ``deadline_s``, after which a :class:`ThrottledError` says the
store throttled for the whole deadline and how to allow more. Time an attempt spends paced
before its request is sent (:func:`queued`) is not counted against its timeout either.

s3fs turns S3 error codes into ``OSError``s (SlowDown/503 -> EBUSY, InternalError/500 ->
EREMOTEIO, unknown codes -> EIO) and `FsspecStore` wraps those in ``StorageError`` with the
original as ``__cause__``, so the classification walks the cause chain.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import heapq
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from ..errors import (
    ObjectChangedError,
    ObjectNotFoundError,
    OptionError,
    RemoteError,
    StorageError,
    ThrottledError,
    TruncatedReadError,
)
from .store import Store

__all__ = ["RetryPolicy", "is_transient", "is_throttle", "call_with_retry", "run_requests", "fetch_object",
           "fetch_range", "single_layer_options", "queued"]

T = TypeVar("T")
_QUEUED_POLL_S = 0.05

# The attempt running on this thread: [when its request was sent, None while it is queued],
# read by whoever times the attempt (run_requests' loop, _bounded).
_attempt = threading.local()


@contextmanager
def queued() -> Iterator[None]:
    """Around a wait before the request of the attempt running on this thread is sent
    (the cold tier's pacing: a pause after throttling, a wait for a request slot). The
    attempt's timeout does not run meanwhile and counts from the end of the wait: being
    paced is not a failed attempt. The request's total deadline still runs."""
    clock = getattr(_attempt, "clock", None)
    if clock is None:
        yield
        return
    clock[0] = None
    try:
        yield
    finally:
        clock[0] = time.monotonic()


def _timed(fn: Callable[[], T], clock: list[float | None]) -> T:
    """``fn()`` on this thread, its request's start kept in ``clock`` (see :func:`queued`)."""
    clock[0] = time.monotonic()
    _attempt.clock = clock
    try:
        return fn()
    finally:
        _attempt.clock = None

_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EIO,
    getattr(errno, "EREMOTEIO", errno.EIO),
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EPIPE,
}

# Transport errors of aiohttp/botocore/urllib3, matched by name so that this module does not
# import any of them (they are optional, and only fsspec backends bring them in).
_TRANSIENT_NAMES = {
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientConnectionError",
    "ClientConnectorError",
    "ClientOSError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ProtocolError",
    "ContentLengthError",
}

# The store asking us to slow down (S3 503 SlowDown, 429 and the throttling codes of other
# services): waited out until the deadline (no attempt is used up), and what cold pacing
# reacts to.
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                   "TooManyRequests", "TooManyRequestsException", "ServiceUnavailable"}
_THROTTLE_STATUS = {429, 503}

_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                    "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one cold request (``TieredCache(retry=...)``).

    ``attempts``: tries in all for failures (1 = no retry); throttled answers (503
    SlowDown, 429) are not failures and use up none. ``base_delay_s``/``max_delay_s``:
    backoff before retry k is ``min(max, base * 2**k)`` times a random factor in [0.5, 1].
    ``attempt_timeout_s``: one attempt that takes longer is abandoned and retried (None:
    no limit beyond the backend's own); it holds for every kind of request (size probes,
    whole reads, each range part), counted from the moment the request is sent (time it
    waits on the cold tier's pacing first does not count).
    ``deadline_s``: one request with all its attempts, backoff and waits on a throttling
    store (each part of a multipart read on its own) gives up after this many seconds
    (None: no total limit, and a store that throttles for ever is waited on for ever).
    ``part_bytes``: objects larger than this are read as concurrent range requests of
    this size, ``max_parts`` at a time.

    This is the only retry layer: the cache turns the backend's own retries down (see
    :func:`single_layer_options`), so ``attempts`` is the number of failed requests sent."""

    attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    attempt_timeout_s: float | None = 120.0
    part_bytes: int = 16 << 20
    max_parts: int = 4
    #: generous: a prefix S3 is repartitioning can throttle for minutes
    deadline_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("attempts", "part_bytes", "max_parts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise OptionError(f"RetryPolicy({name}={v!r}): must be an integer >= 1")
        for name, optional in (("base_delay_s", False), ("max_delay_s", False),
                               ("attempt_timeout_s", True), ("deadline_s", True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < 0 or (optional and v == 0):
                allowed = "a number of seconds > 0, or None" if optional else "a number of seconds >= 0"
                raise OptionError(f"RetryPolicy({name}={v!r}): must be {allowed}")

    def delay(self, attempt: int) -> float:
        # the exponent is capped: a request waiting out throttling may retry hundreds of times
        return float(min(self.max_delay_s, self.base_delay_s * (2 ** min(attempt, 60))) * random.uniform(0.5, 1.0))


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or anything in its cause chain) is a failure worth retrying, or
    throttling (:func:`is_throttle`: a 429 is no 5xx, and is retried all the same)."""
    if is_throttle(exc):
        return True
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(e, (TruncatedReadError, ConnectionError, TimeoutError, cf.TimeoutError)):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES:
            return True
        resp = getattr(e, "response", None)  # botocore ClientError
        if isinstance(resp, dict):
            err = resp.get("Error", {})
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if err.get("Code") in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500):
                return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


def is_throttle(exc: BaseException) -> bool:
    """True when ``exc`` (or its cause chain) is the store telling us to slow down: a
    botocore error with a throttling code or HTTP 429/503, or the ``EBUSY`` s3fs turns
    SlowDown into. A subset of :func:`is_transient`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        resp = getattr(e, "response", None)  # botocore ClientError
        if isinstance(resp, dict):
            err = resp.get("Error", {})
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if err.get("Code") in _THROTTLE_CODES or status in _THROTTLE_STATUS:
                return True
        if isinstance(e, OSError) and e.errno == errno.EBUSY:
            return True
        e = e.__cause__ or e.__context__
    return False


def single_layer_options(protocol: str, options: dict[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """fsspec options for the cold tier with the backend's own retries turned down and its
    socket timeouts set from ``policy``: s3fs retries each call 5 times and botocore under
    it again, so without this one datapipe attempt could be dozens of requests and minutes.
    Values the caller set explicitly are kept. (s3fs's own loop is turned down through
    ``FsspecStore.backend_retries``: it is not a constructor option.)"""
    if protocol not in ("s3", "s3a"):
        return dict(options)
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    if policy.attempt_timeout_s is not None:
        # a stalled socket frees its thread about when the attempt is abandoned
        config.setdefault("connect_timeout", policy.attempt_timeout_s)
        config.setdefault("read_timeout", policy.attempt_timeout_s)
    out["config_kwargs"] = config
    return out


def _final(e: BaseException) -> bool:
    """Failures that another attempt cannot fix."""
    return isinstance(e, (ObjectNotFoundError, ObjectChangedError)) or not is_transient(e)


def _throttled_out(what: str, policy: RetryPolicy, throttles: int, attempts: int,
                   last: BaseException | None) -> ThrottledError:
    """The error of a request the store throttled (or the node's pacing held back) until
    its deadline."""
    if throttles:
        how = (f"the store answered {throttles} of its {attempts} requests 'slow down' (503 SlowDown / 429), "
               "and the node's requests to it were paced down")
    else:
        how = "its request was held back all along by the node's pacing of a store that throttles its requests"
    tail = f"; last answer: {type(last).__name__}: {last}" if last is not None else ""
    return ThrottledError(
        f"reading {what} was throttled for its whole deadline of {policy.deadline_s:g} s: {how}. The store is "
        "overloaded at this prefix: allow a longer wait with RetryPolicy(deadline_s=...) (e.g. "
        "TieredCache(retry=RetryPolicy(deadline_s=1800))), or spread the reads over more prefixes or fewer "
        f"readers{tail}")


def run_requests(
    fns: Sequence[Callable[[], T]],
    whats: list[str],
    policy: RetryPolicy,
    *,
    pool: cf.Executor | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
    concurrency: int = 1,
) -> list[T]:
    """``[fn() for fn in fns]``, ``concurrency`` at a time, each retried on transient
    failures. With ``pool`` every attempt runs in it and is abandoned (left to finish in
    the background, its result dropped) once it has run ``attempt_timeout_s``; each
    request gives up at ``deadline_s``, even while it waits for a thread of the pool. The
    attempts are scheduled from the caller's thread, never from inside the pool, so a
    pool full of hung requests cannot wait on itself."""
    if pool is None:
        return [_inline(fn, what, policy, on_retry) for fn, what in zip(fns, whats, strict=True)]
    n = len(fns)
    results: list[Any] = [None] * n
    tries = [0] * n  # failed attempts (throttled answers are not counted: they are waited out)
    throttles = [0] * n
    last: list[BaseException | None] = [None] * n
    deadlines: list[float | None] = [None] * n
    not_before = [0.0] * n
    # (not_before, index) of the requests waiting for a thread or their backoff: a heap, so
    # scheduling costs O(log n) a request (a list sorted each round was O(n^2) for n requests)
    waiting = [(0.0, i) for i in range(n)]
    running: dict[cf.Future[T], tuple[int, list[float | None]]] = {}
    remaining = n

    def give_up(i: int, error: BaseException | None, why: str, *, at_deadline: bool = False,
                paced: bool = False) -> RemoteError:
        for fut in running:
            fut.cancel()
        answer = last[i]  # the last answer: ``error``, or the one before an attempt the deadline cut
        if at_deadline and (paced or (answer is not None and is_throttle(answer))):
            return _throttled_out(whats[i], policy, throttles[i], tries[i] + throttles[i] + (error is None), answer)
        tail = f"; last error: {type(error).__name__}: {error}" if error is not None else ""
        return RemoteError(f"reading {whats[i]} failed {why}{tail}")

    def failed(i: int, e: BaseException) -> None:
        if on_retry is not None:
            on_retry(e)
        last[i] = e
        if is_throttle(e):
            throttles[i] += 1
        else:
            tries[i] += 1
            if tries[i] >= policy.attempts:
                raise give_up(i, e, f"after {policy.attempts} attempts") from e
        not_before[i] = time.monotonic() + policy.delay(tries[i] + throttles[i] - 1)
        d = deadlines[i]
        if d is not None and not_before[i] >= d:
            raise give_up(i, e, f"within its deadline of {policy.deadline_s} s "
                          f"({tries[i] + throttles[i]} attempts)", at_deadline=True) from e
        heapq.heappush(waiting, (not_before[i], i))

    while remaining:
        now = time.monotonic()
        while waiting and len(running) < concurrency and waiting[0][0] <= now:
            _at, i = heapq.heappop(waiting)
            if deadlines[i] is None and policy.deadline_s is not None:
                deadlines[i] = now + policy.deadline_s
            started: list[float | None] = [None]
            running[pool.submit(_timed, fns[i], started)] = (i, started)
        # a waiting request wakes the loop only when a thread is free for it (else the next
        # answer frees one: waking for it before would spin)
        wake = [waiting[0][0]] if waiting and len(running) < concurrency else []
        for i, started in running.values():
            d = deadlines[i]
            if d is not None:
                wake.append(d)
            if policy.attempt_timeout_s is not None:
                # not started yet (queued behind other downloads, or paced): look again shortly
                t0 = started[0]
                wake.append(t0 + policy.attempt_timeout_s if t0 is not None
                            else time.monotonic() + _QUEUED_POLL_S)
        timeout = max(0.0, min(wake) - time.monotonic()) if wake else None
        if not running:  # only backoff to wait out (cf.wait returns at once on nothing)
            time.sleep(timeout or 0.0)
            continue
        done, _ = cf.wait(list(running), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            i, _started = running.pop(fut)
            try:
                results[i] = fut.result()
                remaining -= 1
            except Exception as e:
                if _final(e):
                    for other in running:
                        other.cancel()
                    raise
                failed(i, e)
        now = time.monotonic()
        for fut, (i, started) in list(running.items()):
            limit, t0, d = policy.attempt_timeout_s, started[0], deadlines[i]
            if t0 is not None and limit is not None and now - t0 >= limit:
                fut.cancel()
                del running[fut]
                failed(i, TimeoutError(f"no answer from {whats[i]} within {limit} s"))
            elif d is not None and now >= d:
                del running[fut]
                fut.cancel()
                paced = started[0] is None and fut.running()  # sent nothing yet: held back by pacing
                raise give_up(i, None, f"within its deadline of {policy.deadline_s} s "
                              f"({tries[i] + throttles[i] + 1} attempts, the last one unanswered)",
                              at_deadline=True, paced=paced)
    return results


class _AttemptThreads:
    """The daemon threads :func:`_bounded` runs attempts on, reused: starting a thread for
    every read of a local file cost more than the read (the new thread's handshake waits
    for the GIL). A thread that has run an attempt waits ``idle_s`` for the next one, then
    ends; one held by an abandoned attempt is not waiting, so a new one starts beside it.
    After a fork the child has none of them (they are not copied), and starts its own."""

    def __init__(self, idle_s: float = 30.0) -> None:
        self.idle_s = idle_s
        self._reset()
        if hasattr(os, "register_at_fork"):  # POSIX
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting = 0  # threads waiting for a task that no task has been put for yet

    def submit(self, run: Callable[[], None]) -> None:
        with self._lock:
            reuse = self._waiting > 0
            if reuse:
                self._waiting -= 1  # a waiting thread takes it
        if reuse:
            self._tasks.put(run)
        else:  # a new thread, given its first task itself (if it cannot start, nothing is left queued)
            threading.Thread(target=self._serve, args=(self._tasks, run), name="datapipe-attempt",
                             daemon=True).start()

    def _serve(self, tasks: queue.SimpleQueue[Callable[[], None]], run: Callable[[], None] | None) -> None:
        while True:
            if run is not None:
                run()
                run = None
                with self._lock:
                    if tasks is not self._tasks:
                        return
                    self._waiting += 1
            try:
                run = tasks.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if tasks is not self._tasks:
                        return
                    if self._waiting:  # no task is on its way to this thread: it ends
                        self._waiting -= 1
                        return
                # else a task was put for it just now: take it


_threads = _AttemptThreads()


def _bounded(fn: Callable[[], T], what: str, timeout: float | None, end: float | None,
             clock: list[float | None]) -> T:
    """``fn()`` on a daemon thread (:class:`_AttemptThreads`), abandoned (its result dropped) when it has
    not answered within ``timeout`` seconds of sending its request (a wait in
    :func:`queued` does not count; ``clock``, see there) or by ``end`` (a
    ``time.monotonic()`` deadline); a daemon thread does not hold up the exit."""
    box: dict[str, Any] = {}
    done = threading.Event()
    begun = time.monotonic()

    def run() -> None:
        try:
            box["value"] = _timed(fn, clock)
        except BaseException as e:  # handed to the caller's thread below
            box["error"] = e
        finally:
            done.set()

    _threads.submit(run)
    while not done.is_set():
        now, t0 = time.monotonic(), clock[0]
        if end is not None and now >= end:
            raise TimeoutError(f"no answer from {what} within {now - begun:.3g} s")
        if timeout is not None and t0 is not None and now - t0 >= timeout:
            raise TimeoutError(f"no answer from {what} within {timeout:.3g} s")
        wake = [] if end is None else [end]
        if timeout is not None:
            wake.append(t0 + timeout if t0 is not None else now + _QUEUED_POLL_S)
        done.wait(max(0.0, min(wake) - now) if wake else None)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _inline(fn: Callable[[], T], what: str, policy: RetryPolicy,
            on_retry: Callable[[BaseException], None] | None) -> T:
    """Retries without a pool: each attempt runs on a daemon thread (reused) and is abandoned
    after ``attempt_timeout_s`` (or what is left of the deadline); the deadline also stops
    further attempts. Throttled answers use up no attempt (see the module's notes)."""
    last: BaseException | None = None
    end = None if policy.deadline_s is None else time.monotonic() + policy.deadline_s
    made = failures = throttles = 0
    at_deadline = paced = False
    while failures < policy.attempts:
        if made:
            pause = policy.delay(made - 1)
            if end is not None and time.monotonic() + pause >= end:
                at_deadline = True
                break
            time.sleep(pause)
        made += 1
        clock: list[float | None] = [None]
        try:
            if policy.attempt_timeout_s is None and end is None:
                return fn()
            return _bounded(fn, what, policy.attempt_timeout_s, end, clock)
        except Exception as e:
            if _final(e):
                raise
            if isinstance(e, TimeoutError) and end is not None and time.monotonic() >= end:
                paced = clock[0] is None  # held back by pacing until the deadline
                if last is not None or paced:
                    at_deadline = True  # unanswered when the deadline came: the answer before it says why
                    break
            if on_retry is not None:
                on_retry(e)
            last = e
            if is_throttle(e):
                throttles += 1
            else:
                failures += 1
    if at_deadline and (paced or (last is not None and is_throttle(last))):
        raise _throttled_out(what, policy, throttles, made, last) from last
    raise RemoteError(
        f"reading {what} failed after {made} attempts; last error: "
        f"{type(last).__name__}: {last}"
    ) from last


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    pool: cf.Executor | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``fn()`` with retries on transient failures (see :func:`run_requests`)."""
    return run_requests([fn], [what], policy, pool=pool, on_retry=on_retry)[0]


def _range_attempt(store: Store, key: str, start: int, end: int, version: str | None) -> bytes:
    if version is None:
        data = store.get_range(key, start, end)
    else:
        data = store.get_range_at(key, start, end, version)
    if len(data) != end - start:
        raise TruncatedReadError(
            f"range [{start}, {end}) of {store.url(key)} returned {len(data)} bytes"
        )
    return data


def fetch_range(store: Store, key: str, start: int, end: int, policy: RetryPolicy, *,
                pool: cf.Executor | None = None, on_retry: Callable[[BaseException], None] | None = None,
                version: str | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``key``, retried; a short body counts as transient."""
    return call_with_retry(lambda: _range_attempt(store, key, start, end, version),
                           f"{store.url(key)} [{start}, {end})", policy, pool=pool,
                           on_retry=on_retry)


def fetch_object(store: Store, key: str, size: int, policy: RetryPolicy, *, pool: cf.Executor | None = None,
                 on_retry: Callable[[BaseException], None] | None = None, version: str | None = None) -> bytes:
    """The whole object (``size`` bytes, known beforehand), retried; large objects as
    concurrent range requests, each retried on its own, so one reset costs one part.
    With ``version`` (from ``store.stat``) every request reads that version, and a
    rewrite of the object raises ObjectChangedError instead of mixing two versions."""
    url = store.url(key)
    if size < 0:
        raise StorageError(f"negative size {size} for {url}")
    if version is None and (size <= policy.part_bytes or pool is None):

        def whole() -> bytes:
            data = store.get(key)
            if len(data) < size:  # a body cut short: transient, asked again
                raise TruncatedReadError(f"{url} returned {len(data)} bytes, expected {size}")
            if len(data) > size:
                raise ObjectChangedError(f"{url} returned {len(data)} bytes, expected {size}; "
                                         "it was overwritten while being read")
            return data

        return call_with_retry(whole, url, policy, pool=pool, on_retry=on_retry)
    step = max(1, policy.part_bytes)
    bounds = [(s, min(size, s + step)) for s in range(0, size, step)] or [(0, 0)]
    fns = [partial(_range_attempt, store, key, s, e, version) for s, e in bounds]
    whats = [url if len(bounds) == 1 else f"{url} [{s}, {e})" for s, e in bounds]
    parts = run_requests(fns, whats, policy, pool=pool, on_retry=on_retry,
                         concurrency=policy.max_parts)
    return parts[0] if len(parts) == 1 else b"".join(parts)
