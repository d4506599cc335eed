"""Every public argument of ``datapipe.pack``, ``ShardWriter`` and ``datapipe pack`` is
checked before anything is read or written: a bad one is a ``PackOptionError`` (a
``PackError`` and a ``ValueError``) naming the argument and the value, never a raw
TypeError/ValueError/OverflowError and never a silent coercion (``workers=1.9`` read as 1)."""

import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.cli import main
from datapipe.errors import DatapipeError, PackError, PackOptionError

INT64 = 2**63 - 1

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-3, 3)), st.integers(), max_size=2),
    st.tuples(st.integers(-3, 3), st.integers(-3, 3)), st.tuples(st.floats(), st.integers()),
    st.sampled_from([float("nan"), 1.9, 0.0, -1, 0, 2048, 2**63, "x", "lz4", "", "none ", "1/2/3", "-1/4", "1_0/20",
                     (1,), (0, 1, 2), (True, 2), object(), np.float64(4096.0), np.int64(-5)]),
)


def _int_in(v, low, high=INT64):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and low <= v <= high


def _part_ok(v):
    if v is None:
        return True
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", v)
        return m is not None and 0 <= int(m.group(1)) < int(m.group(2)) <= INT64
    return (isinstance(v, tuple) and len(v) == 2 and all(_int_in(x, -(10**40), 10**40) for x in v)
            and 0 <= v[0] < v[1] <= INT64)


# what each argument may be (the test's own statement of the rules)
VALID = {
    "shard_bytes": lambda v: _int_in(v, 2049),
    "shard_samples": lambda v: _int_in(v, 1),
    "compression": lambda v: v is None or (isinstance(v, str) and v in ("none", "zstd")),
    "level": lambda v: _int_in(v, -(1 << 17), 22),
    "workers": lambda v: v is None or _int_in(v, 1),
    "part": _part_ok,
    "overwrite": lambda v: isinstance(v, bool),
    "skip_errors": lambda v: isinstance(v, bool),
    "progress": lambda v: isinstance(v, bool),
    "follow_links": lambda v: isinstance(v, bool),
    "tars_as_files": lambda v: isinstance(v, bool),
    "keys": lambda v: isinstance(v, str) and v in ("first-dot", "file"),
    "storage_options": lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    "src": lambda v: isinstance(v, str) and v != "",
    "dest": lambda v: isinstance(v, str) and v != "",
}
WRITER = {"max_bytes": VALID["shard_bytes"], "max_samples": VALID["shard_samples"],
          **{k: VALID[k] for k in ("compression", "level", "storage_options", "overwrite", "dest")}}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    (root / "a.txt").write_bytes(b"a")
    return str(root)


def _refused(call, name, dest):
    with pytest.raises(PackOptionError) as info:
        call()
    assert isinstance(info.value, PackError) and isinstance(info.value, ValueError)
    assert name in str(info.value)
    assert not os.path.exists(dest)  # checked before anything was written
    return str(info.value)


@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(VALID)), value=junk)
def test_pack_refuses_each_bad_argument_by_name(src, tmp_path, name, value):
    if VALID[name](value):
        return  # a value that is allowed: not this test's business
    dest = str(tmp_path / f"ds-{os.urandom(6).hex()}")
    args = {"src": src, "dest": dest, "workers": 1, name: value}
    _refused(lambda: datapipe.pack(args.pop("src"), args.pop("dest"), **args), name, dest)


@settings(max_examples=250, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(WRITER)), value=junk)
def test_shardwriter_refuses_each_bad_argument_by_name(tmp_path, name, value):
    if WRITER[name](value):
        return
    dest = str(tmp_path / f"w-{os.urandom(6).hex()}")
    args = {"dest": dest, name: value}
    _refused(lambda: datapipe.ShardWriter(args.pop("dest"), **args), name, dest)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sample=junk | st.dictionaries(st.one_of(st.just("__key__"), st.text(max_size=4), st.integers(0, 3)),
                                     junk, max_size=4))
def test_shardwriter_write_takes_a_sample_or_names_what_is_wrong(tmp_path, sample):
    dest = str(tmp_path / f"w-{os.urandom(6).hex()}")
    with datapipe.ShardWriter(dest) as w:
        try:
            w.write(sample)
        except DatapipeError:
            pass  # named (a bad key, a field that cannot be stored, not a dict)


@pytest.mark.parametrize("name, value, says", [
    ("workers", 1.9, "must be an integer"),  # not read as 1
    ("workers", 0, "from 1"),
    ("shard_bytes", 0, "from 2,049"),
    ("shard_bytes", math.nan, "must be an integer"),
    ("shard_bytes", -1, "from 2,049"),
    ("shard_bytes", "x", "must be an integer"),
    ("shard_bytes", 4096.0, "must be an integer"),
    ("shard_bytes", 2**63, "to 9,223,372,036,854,775,807"),
    ("compression", "lz4", "none, zstd"),
    ("compression", "", "none, zstd"),  # not read as "none"
    ("compression", 0, "none, zstd"),
    ("level", 23, "from -131,072 to 22"),
    ("level", 3.0, "must be an integer"),
    ("part", (1,), "tuple (I, N)"),
    ("part", (2, 2), "0 <= I < N"),
    ("part", "1_0/20", "I/N"),
    ("overwrite", "no", "True or False"),  # not read as true
    ("keys", ["file"], "first-dot, file"),
    ("storage_options", [("a", 1)], "dict"),
    ("dest", "", "non-empty path"),
])
def test_the_message_names_argument_value_and_what_is_allowed(src, tmp_path, name, value, says):
    dest = str(tmp_path / "ds")
    args = {"src": src, "dest": dest, name: value}
    msg = _refused(lambda: datapipe.pack(args.pop("src"), args.pop("dest"), **args), name, dest)
    assert says in msg and repr(value)[:20] in msg


@pytest.mark.parametrize("options", [
    {"shard_bytes": 2049, "shard_samples": 1}, {"shard_bytes": np.int64(1 << 20)}, {"level": -(1 << 17)},
    {"level": 22, "compression": "zstd"}, {"workers": np.int32(1)}, {"part": (0, 1)}, {"part": " 0 / 1 "},
    {"storage_options": {}},
])
def test_allowed_values_at_the_edges_pack(src, tmp_path, options):
    r = datapipe.pack(src, str(tmp_path / "ds"), **options)
    assert r.samples == 1


def test_a_closed_shardwriter_names_the_misuse(tmp_path):
    with datapipe.ShardWriter(str(tmp_path / "w")) as w:
        w.write({"__key__": "a", "txt": "x"})
    with pytest.raises(PackError, match="closed ShardWriter"):
        w.write({"__key__": "b", "txt": "y"})


@pytest.mark.parametrize("argv, says", [
    (["--workers", "0"], "workers (--workers)=0"),
    (["--shard-bytes", "0"], "shard_bytes (--shard-bytes)=0"),
    (["--shard-bytes", "99999999999T"], "shard_bytes (--shard-bytes)="),
    (["--shard-samples", "0"], "shard_samples (--shard-samples)=0"),
    (["--level", "99"], "level (--level)=99"),
    (["--part", "4/4"], "part (--part)='4/4'"),
    (["--part", "x"], "I/N"),
])
def test_cli_names_the_flag(src, tmp_path, capsys, argv, says):
    dest = str(tmp_path / "ds")
    assert main(["pack", src, dest, "-q", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not os.path.exists(dest)


@pytest.mark.parametrize("size", ["1.5", "0.3K", "1e3", "nan", "-1", "12Q"])
def test_cli_refuses_a_size_that_is_not_a_whole_number_of_bytes(src, tmp_path, capsys, size):
    with pytest.raises(SystemExit) as info:  # argparse's usage error
        main(["pack", src, str(tmp_path / "ds"), "-q", "--shard-bytes", size])
    assert info.value.code == 2
    assert "--shard-bytes" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "ds")


def test_cli_sizes_with_units():
    from datapipe.cli import parse_size

    assert parse_size("128M") == 128 << 20 and parse_size("1.5K") == 1536 and parse_size("65536") == 65536
    assert parse_size("0.5G") == 1 << 29 and parse_size("2 KiB") == 2048
