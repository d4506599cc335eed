"""The read window behind the rule against slow tiers (cache/rates.py) and the deadline on a
tier's calls (cache/deadline.py), on any sequence of reads and any call."""

from __future__ import annotations

import errno
import threading

from hypothesis import given
from hypothesis import strategies as st

from datapipe.cache.deadline import Deadline, timed_out
from datapipe.cache.rates import MIN_READ_BYTES, WINDOW_MIN_READS, ReadRate

reads = st.lists(st.tuples(st.integers(0, 8 * MIN_READ_BYTES), st.floats(0, 10, allow_nan=False)), max_size=60)


@given(reads=reads, window=st.integers(1, 16 * MIN_READ_BYTES))
def test_a_window_closes_exactly_when_it_holds_enough_and_its_rate_is_bytes_over_seconds(reads, window):
    rate = ReadRate(window)
    held_bytes, held_seconds, held_reads = 0, 0.0, 0
    for nbytes, seconds in reads:
        got = rate.add(nbytes, seconds)
        if nbytes < MIN_READ_BYTES:  # latency, not rate: left out
            assert got is None
            continue
        held_bytes, held_seconds, held_reads = held_bytes + nbytes, held_seconds + seconds, held_reads + 1
        if held_bytes >= window and held_reads >= WINDOW_MIN_READS:
            assert got is not None and abs(got - held_bytes / max(held_seconds, 1e-9)) <= 1e-6 * got
            assert rate.last == got and rate.last_reads == held_reads
            held_bytes, held_seconds, held_reads = 0, 0.0, 0
        else:
            assert got is None


@given(value=st.one_of(st.integers(), st.text(max_size=20), st.none()), fails=st.booleans())
def test_a_call_within_the_deadline_gives_its_result_or_its_error(value, fails):
    d = Deadline(60.0)
    try:
        def fn():
            if fails:
                raise KeyError(value)
            return value

        if fails:
            try:
                d.call(fn, what="x")
            except KeyError as e:
                assert e.args == (value,)
            else:
                raise AssertionError("the call's error was lost")
        else:
            assert d.call(fn, what="x") == value
    finally:
        d.close()


def test_a_call_past_the_deadline_is_abandoned_and_its_result_handed_on():
    d = Deadline(0.05)
    release, handed = threading.Event(), []
    done = threading.Event()

    def abandon(result):
        handed.append(result)
        done.set()

    try:
        try:
            d.call(lambda: release.wait() and "late", what="a read of /mnt/x", abandon=abandon)
        except OSError as e:
            assert timed_out(e) and e.errno == errno.ETIMEDOUT and "a read of /mnt/x" in str(e)
        else:
            raise AssertionError("not abandoned")
        assert d.call(lambda: 7, what="y") == 7  # another thread serves meanwhile
        release.set()
        assert done.wait(30) and handed == ["late"]
    finally:
        release.set()
        d.close()
