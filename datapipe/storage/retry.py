"""Retries with backoff, per-attempt timeouts, and concurrent range requests for cold reads.

Object stores fail in passing: 503 SlowDown, 500 InternalError, connection resets, bodies
cut short, requests that hang. Those are retried with exponential backoff and jitter;
everything else (a missing object, a denied request, a bad range) is raised at once, since
asking again cannot help. After the last attempt a :class:`RemoteError` names the URL and
keeps the last failure as its cause.

s3fs turns S3 error codes into ``OSError``s (SlowDown/503 -> EBUSY, InternalError/500 ->
EREMOTEIO, unknown codes -> EIO) and `FsspecStore` wraps those in ``StorageError`` with the
original as ``__cause__``, so the classification walks the cause chain.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import ObjectNotFoundError, RemoteError, StorageError, TruncatedReadError

__all__ = ["RetryPolicy", "is_transient", "call_with_retry", "fetch_object", "fetch_range"]

T = TypeVar("T")

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

_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                    "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one cold request.

    ``attempts``: tries in all (1 = no retry). ``base_delay_s``/``max_delay_s``: backoff
    before retry k is ``min(max, base * 2**k)`` times a random factor in [0.5, 1].
    ``attempt_timeout_s``: one attempt that takes longer is abandoned and retried (None:
    no limit beyond the backend's own). ``part_bytes``: objects larger than this are read
    as concurrent range requests of this size, ``max_parts`` at a time."""

    attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    attempt_timeout_s: float | None = 120.0
    part_bytes: int = 16 << 20
    max_parts: int = 4

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.part_bytes < 1 or self.max_parts < 1:
            raise ValueError("RetryPolicy.part_bytes and max_parts must be >= 1")
        if self.attempt_timeout_s is not None and self.attempt_timeout_s <= 0:
            raise ValueError("RetryPolicy.attempt_timeout_s must be > 0 or None")

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * (2**attempt)) * random.uniform(0.5, 1.0)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or anything in its cause chain) is a failure worth retrying."""
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


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    pool: cf.Executor | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``fn()`` with retries on transient failures. With ``pool`` and a per-attempt timeout
    each attempt runs in the pool so a hung request can be abandoned (it finishes in the
    background; its result is dropped)."""
    last: BaseException | None = None
    for attempt in range(policy.attempts):
        if attempt:
            time.sleep(policy.delay(attempt - 1))
        try:
            if pool is not None and policy.attempt_timeout_s is not None:
                fut = pool.submit(fn)
                try:
                    return fut.result(timeout=policy.attempt_timeout_s)
                except cf.TimeoutError:
                    fut.cancel()
                    raise TimeoutError(
                        f"no answer from {what} within {policy.attempt_timeout_s} s"
                    ) from None
            return fn()
        except ObjectNotFoundError:
            raise
        except Exception as e:
            if not is_transient(e):
                raise
            last = e
            if on_retry is not None:
                on_retry(e)
    raise RemoteError(
        f"reading {what} failed after {policy.attempts} attempts; last error: "
        f"{type(last).__name__}: {last}"
    ) from last


def fetch_range(store, key: str, start: int, end: int, policy: RetryPolicy, *, pool=None,
                on_retry=None) -> bytes:
    """Bytes ``[start, end)`` of ``key``, retried; a short body counts as transient."""
    url = store.url(key)

    def attempt() -> bytes:
        data = store.get_range(key, start, end)
        if len(data) != end - start:
            raise TruncatedReadError(
                f"range [{start}, {end}) of {url} returned {len(data)} bytes"
            )
        return data

    return call_with_retry(attempt, f"{url} [{start}, {end})", policy, pool=pool, on_retry=on_retry)


def fetch_object(store, key: str, size: int, policy: RetryPolicy, *, pool: cf.Executor | None = None,
                 on_retry=None) -> bytes:
    """The whole object (``size`` bytes, known beforehand), retried; large objects as
    concurrent range requests, each retried on its own, so one reset costs one part."""
    url = store.url(key)
    if size < 0:
        raise StorageError(f"negative size {size} for {url}")
    if size <= policy.part_bytes or pool is None:

        def whole() -> bytes:
            data = store.get(key)
            if len(data) < size:  # a body cut short: transient, asked again
                raise TruncatedReadError(f"{url} returned {len(data)} bytes, expected {size}")
            if len(data) > size:  # the object changed under us: asking again cannot help
                raise StorageError(f"{url} returned {len(data)} bytes, expected {size}; "
                                   "was it overwritten while being read?")
            return data

        return call_with_retry(whole, url, policy, pool=pool, on_retry=on_retry)
    bounds = [(s, min(size, s + policy.part_bytes)) for s in range(0, size, policy.part_bytes)]
    parts: list[bytes] = [b""] * len(bounds)
    # No attempt timeout inside parts: the part tasks already run in the pool, and nesting
    # submissions into one bounded pool could wait on itself.
    part_policy = RetryPolicy(policy.attempts, policy.base_delay_s, policy.max_delay_s, None,
                              policy.part_bytes, policy.max_parts)
    todo = list(enumerate(bounds))
    while todo:
        batch, todo = todo[: policy.max_parts], todo[policy.max_parts :]
        futs = {
            pool.submit(fetch_range, store, key, s, e, part_policy, on_retry=on_retry): i
            for i, (s, e) in batch
        }
        for fut in cf.as_completed(futs):
            parts[futs[fut]] = fut.result()
    return b"".join(parts)
