"""Brace patterns: the bound is on the names a pattern expands to, counted without expanding
it, not on each range."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_reader import deadline
from datapipe.errors import PackOptionError
from datapipe.tarindex import expand_braces


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


# --- brace patterns: the bound is on the names a pattern expands to, not on each range --


@pytest.mark.parametrize("pattern", ["s-{0..99999}-{0..99999}.tar", "s" + "{a,b}" * 40 + ".tar"])
def test_a_pattern_of_too_many_names_is_refused_at_once(pattern):
    """Each range was bounded on its own, so two ranges (or 40 two-way lists) multiplied to
    10^10 (10^12) names, built in memory before any check."""
    t0 = time.monotonic()
    with deadline(10, "expand_braces"), pytest.raises(PackOptionError, match="more than"):
        expand_braces(pattern)
    assert time.monotonic() - t0 < 10


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab{},.019", max_size=24))
def test_brace_counts_match_the_expansion(pattern):
    """The bound is checked on a count made without expanding: it must be the number of
    names the expansion makes, for any pattern (nested, unbalanced, literal braces)."""
    from datapipe.storage.patterns import _count_names, _expand

    try:
        names = _expand(pattern)
    except PackOptionError:
        return
    assert _count_names(pattern) == len(names)
