"""Bad arguments to the plan's and the loader's building blocks are OptionErrors (a
DatapipeError and a ValueError) naming what is wrong, never a bare ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from datapipe.errors import DatapipeError, LoaderOptionError, OptionError
from datapipe.loader import Chunk, Prefetcher
from datapipe.loader.control import PassControl
from datapipe.plan import derive_key, feistel_permute


def test_a_negative_key_part_is_an_option_error():
    with pytest.raises(OptionError, match="non-negative, got -1"):
        derive_key(3, -1)


def test_an_index_outside_the_permutation_is_an_option_error():
    with pytest.raises(OptionError, match=r"outside \[0, m\)"):
        feistel_permute(np.array([1000]), 1000, 1)


@pytest.mark.parametrize("kw", [dict(max_bytes=0), dict(concurrency=0), dict(lookahead_chunks=0),
                                dict(close_timeout_s=0.0)])
def test_prefetcher_budgets_are_checked(kw):
    chunks = iter([Chunk.make(0, np.arange(1), np.array([0]), np.zeros(1, np.int64))])
    with pytest.raises(OptionError, match="must be positive") as e:
        Prefetcher(chunks, lambda g: None, lambda g: 1, **kw)
    name, value = next(iter(kw.items()))
    assert f"{name}={value!r}" in str(e.value)


def test_a_resume_state_too_large_for_persistent_workers_says_what_to_do():
    control = PassControl()
    with pytest.raises(LoaderOptionError, match="persistent_workers=False") as e:
        control.write(0, {"splits": [[1, 2, 3, 4]] * 10_000})
    assert isinstance(e.value, DatapipeError) and isinstance(e.value, ValueError)
    control.write(1, {"splits": [[1, 2, 3, 4]]})  # a state that fits still goes through
    assert control.read() == (1, {"splits": [[1, 2, 3, 4]]})
