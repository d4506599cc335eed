"""``RetryPolicy``'s arguments are checked with a named error, and its backoff stays
bounded however many times a throttled request is retried."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datapipe.errors import OptionError
from datapipe.storage import RetryPolicy


@pytest.mark.parametrize("kwargs", [
    {"attempts": 0}, {"attempts": 1.5}, {"attempts": True}, {"attempts": "3"},
    {"part_bytes": 0}, {"max_parts": 2.0},
    {"base_delay_s": -1}, {"max_delay_s": math.nan}, {"base_delay_s": math.inf},
    {"attempt_timeout_s": 0}, {"attempt_timeout_s": math.nan},
    {"deadline_s": 0}, {"deadline_s": math.nan}, {"deadline_s": -5}, {"deadline_s": "600"},
])
def test_bad_arguments_are_named(kwargs):
    (name,) = kwargs
    with pytest.raises(OptionError, match=rf"RetryPolicy\({name}="):
        RetryPolicy(**kwargs)


def test_the_default_deadline_is_generous():
    assert RetryPolicy().deadline_s == 600.0 and RetryPolicy(deadline_s=None).deadline_s is None


@given(attempt=st.integers(0, 10**6))
def test_the_backoff_is_bounded_for_any_retry_count(attempt):
    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=5.0)
    assert 0.0 <= policy.delay(attempt) <= 5.0


@given(n=st.integers(1, 300), concurrency=st.integers(1, 16), fail_every=st.integers(2, 7))
def test_run_requests_returns_every_answer_in_order_through_failures(n, concurrency, fail_every):
    """Many requests through a pool, some failing once (retried after their backoff):
    each answer lands at its own index, each request runs until it answered, and no more
    than ``concurrency`` run at once."""
    import concurrent.futures as cf
    import threading

    from datapipe.storage import run_requests

    lock = threading.Lock()
    calls = [0] * n
    now_running, most = [0], [0]

    def request(i):
        with lock:
            calls[i] += 1
            first = calls[i] == 1
            now_running[0] += 1
            most[0] = max(most[0], now_running[0])
        try:
            if first and i % fail_every == 0:
                raise ConnectionResetError(f"request {i}: reset")
            return i * 3
        finally:
            with lock:
                now_running[0] -= 1

    policy = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.002)
    with cf.ThreadPoolExecutor(16) as pool:
        got = run_requests([lambda i=i: request(i) for i in range(n)], [f"r{i}" for i in range(n)], policy,
                           pool=pool, concurrency=concurrency)
    assert got == [i * 3 for i in range(n)]
    assert calls == [2 if i % fail_every == 0 else 1 for i in range(n)]
    assert most[0] <= concurrency
