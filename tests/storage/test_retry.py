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
