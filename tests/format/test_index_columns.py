"""The index's rules checked a whole column at a time (datapipe.format.columns) say what the
rules for one value say: a sample key as the writer's ``check_key`` allows it, a shard name
as ``check_relative_name`` allows it, a checksum as ``is_checksum`` does. Hypothesis draws
the values from the characters the rules are about."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from datapipe.errors import DatapipeError
from datapipe.format import check_key, check_relative_name, is_checksum
from datapipe.format.columns import bad_checksums, bad_paths, int_column, list_column, string_column

_PATH_CHARS = st.sampled_from(["a", "b", ".", "/", "\0", "\\", ":", "é", "\n", " ", "%"])
paths = st.lists(st.text(_PATH_CHARS, max_size=9), min_size=1, max_size=12)


def _column(values):
    _, data, offsets = string_column(pa.array(values, pa.string()))
    return data, offsets


def _refused(check, value) -> bool:
    try:
        check(value)
    except DatapipeError:
        return True
    return False


@given(paths)
def test_key_column_check_is_check_key(keys):
    got = bad_paths(*_column(keys), dot_in_last=False)
    assert got.tolist() == [_refused(check_key, k) for k in keys]


@given(paths)
def test_shard_name_column_check_is_check_relative_name(names):
    got = bad_paths(*_column(names), dot_in_last=True, colon_in_first=False)
    assert got.tolist() == [_refused(lambda n: check_relative_name(n, "shard", "here"), n) for n in names]


_SUM_CHARS = st.sampled_from(list("0123456789abcdefABx:_3h"))


@given(st.lists(st.one_of(st.text(_SUM_CHARS, max_size=26).map(lambda t: "xxh3_64:" + t[:16]),
                          st.text(_SUM_CHARS, max_size=26)), min_size=1, max_size=12))
def test_checksum_column_check_is_is_checksum(sums):
    assert bad_checksums(*_column(sums)).tolist() == [not is_checksum(s) for s in sums]


def test_columns_of_a_slice_are_the_slice_rows():
    keys = pa.array(["zero", "one", "two", "three"], pa.string()).slice(1, 2)
    _, data, offsets = string_column(keys)
    assert [bytes(data[offsets[i] : offsets[i + 1]]).decode() for i in range(2)] == ["one", "two"]
    nums = pa.chunked_array([pa.array(np.arange(5, dtype=np.int64)), pa.array(np.arange(5, 8, dtype=np.int64))])
    assert int_column(nums, np.int64).tolist() == list(range(8))
    lists = pa.array([[1, 2], [3], [4, 5, 6], []], pa.list_(pa.int64())).slice(1, 3)
    values, starts = list_column(lists)
    assert values.tolist() == [3, 4, 5, 6] and starts.tolist() == [0, 1, 4, 4]
