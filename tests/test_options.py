"""Public arguments are checked by datapipe.options: a bad value of any argument of
StreamingDataset, Stream, StreamingDataLoader, open_dataset/Dataset, TieredCache,
set_epoch/load_state_dict/state_dict and decode= is an OptionError naming the argument and
the value, never a raw TypeError/ValueError/OverflowError and never silently coerced
(window=1.9 is not window 1, rank=0.5 is not rank 0, shuffle="no" is not True)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datapipe
from datapipe import ShardWriter, Stream, StreamingDataLoader, StreamingDataset, TieredCache, open_dataset
from datapipe.cache import CacheTier as Tier
from datapipe.decode import DECODER_NAMES, make_decoder
from datapipe.errors import (
    CacheBudgetError,
    DatapipeError,
    LoaderOptionError,
    OptionError,
    PlanError,
    StateMismatchError,
)
from datapipe.options import (
    check_bool,
    check_bytes,
    check_callable,
    check_choice,
    check_float,
    check_int,
    check_mapping,
    check_path,
    show,
)
from datapipe.storage import RetryPolicy

N = 40


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "ds"
    with ShardWriter(str(path), max_samples=8) as w:
        for i in range(N):
            w.write({"__key__": f"k{i:03d}", "cls": str(i)})
    return str(path)


# -- the helpers themselves ------------------------------------------------------------------


def test_the_helpers_take_plain_values_and_refuse_every_other_kind():
    assert check_int("n", 3, min=1) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_bytes("b", 512 << 20) == 512 << 20
    assert check_float("t", 2) == 2.0 and check_float("t", np.float32(0.5)) == 0.5
    assert check_bool("f", True) is True and check_bool("f", np.bool_(False)) is False
    assert check_choice("e", "skip", ("raise", "skip")) == "skip"
    assert check_callable("f", len) is len
    assert check_path("p", os.curdir) == "." and check_mapping("o", {"a": 1}) == {"a": 1}
    for bad in (True, 1.0, 1.9, "1", None, float("nan"), [1], b"1"):
        with pytest.raises(OptionError, match=r"^n="):
            check_int("n", bad)
    with pytest.raises(OptionError, match=r"n=0: expected an int >= 1 and <= 5"):
        check_int("n", 0, min=1, max=5)
    for bad in (float("nan"), float("inf"), -float("inf"), True, "1.5", None, 10 ** 400, complex(1, 0)):
        with pytest.raises(OptionError):
            check_float("t", bad)
    with pytest.raises(OptionError, match="> 0"):
        check_float("t", 0, min=0, min_open=True)
    for bad in (1, 0, "no", None, "True"):
        with pytest.raises(OptionError, match="True or False"):
            check_bool("f", bad)
    with pytest.raises(OptionError, match="one of 'raise', 'skip'"):
        check_choice("e", "ignore", ("raise", "skip"))
    with pytest.raises(OptionError, match="one of"):
        check_choice("e", ["raise"], ("raise", "skip"))  # unhashable: compared, never hashed
    for bad in ("", 3, None, "a\0b", b"/tmp"):
        with pytest.raises(OptionError):
            check_path("p", bad)
    with pytest.raises(OptionError, match="str keys"):
        check_mapping("o", {1: 2})


def test_the_error_class_is_the_callers_and_messages_stay_bounded():
    with pytest.raises(LoaderOptionError) as e:
        check_int("window", 1.9, error=LoaderOptionError)
    assert isinstance(e.value, PlanError) and isinstance(e.value, ValueError)
    huge = 10 ** 5000  # its repr alone is refused by Python (over 4300 digits)
    with pytest.raises(OptionError) as e:
        check_int("n", huge, max=10)
    assert "an int of 16610 bits" in str(e.value) and len(str(e.value)) < 200
    assert len(show("x" * 10 ** 6)) <= 80

    class Hostile:
        def __repr__(self):
            raise RuntimeError("no")

    assert "Hostile" in show(Hostile())
    with pytest.raises(OptionError, match="Hostile"):
        check_int("n", Hostile())


def test_bounds_are_written_as_powers_of_two():
    with pytest.raises(OptionError, match=r"<= 2\*\*64 - 1"):
        check_int("seed", -1, min=0, max=(1 << 64) - 1)
    with pytest.raises(OptionError, match=r"<= 2\*\*62"):
        check_bytes("b", -1)


def test_the_helper_module_is_public_and_a_leaf():
    import subprocess
    import sys

    assert datapipe.options.check_int is check_int  # reachable as an attribute of the package
    probe = "import sys, datapipe.options; print(sorted(m for m in sys.modules if m.startswith('datapipe')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert eval(out) == ["datapipe", "datapipe._lazy", "datapipe._version", "datapipe.errors", "datapipe.options"]


# -- the user's reproductions ----------------------------------------------------------------


def test_the_reported_arguments_are_named_errors(url):
    # before: ValueError "cannot convert float NaN to integer", ValueError "invalid literal
    # for int()", ValueError "batch_size and chunk_samples must be at least 1", TypeError
    # from int(None); window=1.9 became 1, rank=0.5 became rank 0, set_epoch(1.5) epoch 1
    cases = [
        (dict(window=float("nan")), r"window=nan"),
        (dict(seed="abc"), r"seed='abc'"),
        (dict(batch_size=0), r"batch_size=0"),
        (dict(window=1.9), r"window=1\.9"),
        (dict(rank=0.5, world_size=2), r"rank=0\.5"),
        (dict(seed=float("inf")), r"seed=inf"),
        (dict(shuffle="no"), r"shuffle='no'"),
    ]
    for kw, message in cases:
        with pytest.raises(LoaderOptionError, match=message):
            StreamingDataset(url, **kw)
    ds = StreamingDataset(url)
    for epoch in (None, 1.5, -1, "2", True):
        with pytest.raises(LoaderOptionError, match=r"^epoch="):
            ds.set_epoch(epoch)
    assert ds.epoch == 0
    with pytest.raises(LoaderOptionError, match=r"batch_size=0"):
        StreamingDataLoader(ds, batch_size=0)
    with pytest.raises(LoaderOptionError, match=r"batch_size=2\.5"):
        StreamingDataLoader(ds, batch_size=2.5)
    with pytest.raises(LoaderOptionError, match="needs a StreamingDataset"):
        StreamingDataLoader([1, 2, 3])
    with pytest.raises(OptionError, match=r"decode=42"):
        open_dataset(url, decode=42)
    with pytest.raises(OptionError, match=r"pin_wait_s=nan"):
        TieredCache(pin_wait_s=float("nan"))


def test_numpy_integers_are_the_ints_they_hold(url):
    ds = StreamingDataset(url, seed=np.int64(3), window=np.int32(2), batch_size=np.uint8(4), rank=np.int64(1),
                          world_size=np.int64(2))
    assert (ds.seed, ds.window, ds.batch_size, ds.rank, ds.world_size) == (3, 2, 4, 1, 2)
    assert all(type(v) is int for v in (ds.seed, ds.window, ds.batch_size, ds.rank, ds.world_size))
    assert len(list(ds)) == N // 2
    ds.set_epoch(np.int64(1))
    assert ds.epoch == 1 and type(ds.epoch) is int


def test_dataloader_options_that_do_not_apply_are_named(url):
    ds = StreamingDataset(url)
    with pytest.raises(LoaderOptionError, match="samplers do not apply"):
        StreamingDataLoader(ds, sampler=[0, 1])
    with pytest.raises(LoaderOptionError, match="shuffles itself"):
        StreamingDataLoader(ds, shuffle=True)
    with pytest.raises(LoaderOptionError, match="num_workers > 0"):
        StreamingDataLoader(ds, prefetch_factor=2)
    with pytest.raises(LoaderOptionError, match="not an argument"):
        StreamingDataLoader(ds, num_worker=2)
    with pytest.raises(LoaderOptionError, match="multiprocessing_context='threads'"):
        StreamingDataLoader(ds, num_workers=1, multiprocessing_context="threads")
    assert len([k for b in StreamingDataLoader(ds, batch_size=8, num_workers=0) for k in b["__key__"]]) == N


def test_state_arguments(url):
    ds = StreamingDataset(url, seed=1)
    for junk in (None, 42, "state", [1]):
        with pytest.raises(LoaderOptionError, match=r"^state="):
            ds.load_state_dict(junk)
    with pytest.raises(StateMismatchError):  # a dict, but not a state: its content is named
        ds.load_state_dict({"epoch": "x"})
    for seen in (-1, 1.0, "3", N + 1):
        with pytest.raises(LoaderOptionError, match="samples_seen"):
            ds.state_dict(seen)
    for kw in (dict(epochs=0), dict(worker=2, num_workers=2), dict(rank=1), dict(num_workers=0.5)):
        with pytest.raises(LoaderOptionError):
            ds.future_shards(**kw)
    with pytest.raises(LoaderOptionError, match="max_batches"):
        ds.shuffle_quality(max_batches=0)


def test_a_mix_that_would_list_too_many_shards_is_refused_before_it_is_built(url):
    with pytest.raises(LoaderOptionError, match=r"Stream\(repeat\)"):
        Stream(url, repeat=1e12)
    with pytest.raises(LoaderOptionError, match=r"epoch_size.*would list"):
        StreamingDataset([Stream(url, weight=1)], epoch_size=1 << 40)


def test_random_access_arguments(url):
    ds = open_dataset(url)
    for junk in ("0", 1.0, None, True):
        with pytest.raises(OptionError, match=r"^i="):
            ds[junk]
    with pytest.raises(IndexError):  # out of range stays an IndexError, as for any sequence
        ds[N]
    with pytest.raises(OptionError, match="key="):
        ds.get(3)
    with pytest.raises(OptionError, match="DatasetIndex"):
        datapipe.Dataset(url)
    with pytest.raises(OptionError, match="storage_options"):
        open_dataset(url, storage_options=[("anon", True)])


def test_cache_budget_errors_stay_cache_budget_errors():
    with pytest.raises(CacheBudgetError, match="hot_bytes") as e:
        TieredCache(hot_bytes=-1)
    assert isinstance(e.value, OptionError)
    with pytest.raises(OptionError, match="local_tiers"):
        TieredCache(local_tiers="/tmp/x")


# -- the property: junk at every argument ----------------------------------------------------

JUNK = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.5, 1.9, 2.0, -1.0, True, False, None, "", "abc",
                     "1", b"1", 2 ** 64, 2 ** 70, 10 ** 30, -(2 ** 100), 10 ** 5000, -1, 0, [], [1], {}, {1: 2},
                     (1,), object(), complex(1, 1), np.float64(1.0), np.nan, np.int64(-5)]),
    st.integers(min_value=-(2 ** 80), max_value=2 ** 80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
)


def _int(v, lo, hi):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and lo <= v <= hi


def _bool(v):
    return isinstance(v, bool)


def _number(v, lo=0.0, hi=math.inf, open_low=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        return False
    try:
        x = float(v)
    except OverflowError:
        return False
    return math.isfinite(x) and (x > lo if open_low else x >= lo) and x <= hi


def _decode_ok(v):
    return v is None or (isinstance(v, str) and v in DECODER_NAMES) or (isinstance(v, (dict, list, tuple)) and not v) \
        or callable(v)


def _mapping_ok(v):
    return v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v))


# (what is called, the argument, which values are fine) for every public argument
def _cases(url):
    big = 1 << 24
    sd = {
        "shuffle": _bool, "drop_last": _bool, "return_position": _bool, "batched": _bool,
        "seed": lambda v: _int(v, 0, (1 << 64) - 1),
        "window": lambda v: v is None or _int(v, 1, 1 << 62),
        "batch_size": lambda v: _int(v, 1, big), "chunk_samples": lambda v: _int(v, 1, big),
        "prefetch_bytes": lambda v: _int(v, 1, 1 << 62),
        "concurrency": lambda v: _int(v, 1, 256), "map_threads": lambda v: _int(v, 0, 256),
        "epoch_size": lambda v: v is None or _int(v, 0, 1 << 62),
        "on_error": lambda v: v in ("raise", "skip") and isinstance(v, str),
        "decode": _decode_ok, "map": lambda v: v is None or callable(v),
        "storage_options": _mapping_ok, "cache": lambda v: v is None,
    }
    cases = [(f"StreamingDataset({k}=)", lambda v, k=k: StreamingDataset(url, **{k: v}), ok) for k, ok in sd.items()]
    cases += [
        ("StreamingDataset(source)", lambda v: StreamingDataset(v),  # a str is a path: not junk
         lambda v: isinstance(v, str) or (isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v))),
        ("StreamingDataset(rank=)", lambda v: StreamingDataset(url, rank=v, world_size=2),
         lambda v: _int(v, 0, 1)),
        ("StreamingDataset(world_size=)", lambda v: StreamingDataset(url, rank=0, world_size=v),
         lambda v: _int(v, 1, math.inf)),
        ("Stream(url)", lambda v: Stream(v), lambda v: isinstance(v, str) and v and "\0" not in v),
        ("Stream(weight=)", lambda v: Stream(url, weight=v), lambda v: v is None or _number(v)),
        ("Stream(repeat=)", lambda v: Stream(url, repeat=v), lambda v: v is None or _number(v, hi=2.0 ** 20)),
        ("Stream(storage_options=)", lambda v: Stream(url, storage_options=v), _mapping_ok),
        ("set_epoch", lambda v: StreamingDataset(url).set_epoch(v), lambda v: _int(v, 0, (1 << 63) - 1)),
        ("load_state_dict", lambda v: StreamingDataset(url).load_state_dict(v), lambda v: isinstance(v, dict)),
        ("state_dict(samples_seen=)", lambda v: StreamingDataset(url).state_dict(v),
         lambda v: v is None or _int(v, 0, N)),
        ("make_decoder(decode)", lambda v: make_decoder(v), _decode_ok),
        ("make_decoder(map)", lambda v: make_decoder(None, v), lambda v: v is None or callable(v)),
        ("open_dataset(decode=)", lambda v: open_dataset(url, decode=v), _decode_ok),
        ("open_dataset(storage_options=)", lambda v: open_dataset(url, storage_options=v), _mapping_ok),
        ("Dataset[i]", lambda v: open_dataset(url)[v], lambda v: _int(v, -math.inf, math.inf)),  # else IndexError
    ]
    dl = {
        "batch_size": lambda v: v is None or _int(v, 1, big),
        "num_workers": lambda v: _int(v, 0, 1024),
        "timeout": lambda v: _number(v),
        "pin_memory": _bool, "drop_last": _bool, "in_order": _bool,
        "collate_fn": lambda v: v is None or callable(v),
        "worker_init_fn": lambda v: v is None or callable(v),
        "multiprocessing_context": lambda v: v is None or v in ("fork", "spawn", "forkserver"),
        "generator": lambda v: v is None,
        "sampler": lambda v: v is None, "batch_sampler": lambda v: v is None,
        "shuffle": lambda v: v is None or v is False,
        "pin_memory_device": lambda v: isinstance(v, str),
    }
    cases += [(f"StreamingDataLoader({k}=)", lambda v, k=k: StreamingDataLoader(StreamingDataset(url), **{k: v}), ok)
              for k, ok in dl.items()]
    cases += [
        ("StreamingDataLoader(prefetch_factor=)",
         lambda v: StreamingDataLoader(StreamingDataset(url), num_workers=1, prefetch_factor=v),
         lambda v: v is None or _int(v, 1, 1024)),
        ("StreamingDataLoader(persistent_workers=)",
         lambda v: StreamingDataLoader(StreamingDataset(url), num_workers=1, persistent_workers=v), _bool),
    ]
    tc = {
        "hot_bytes": lambda v: _int(v, 0, 1 << 62), "shared_bytes": lambda v: _int(v, 0, 0),
        "warm_bytes": lambda v: _int(v, 0, 0), "max_inflight_bytes": lambda v: _int(v, 1, 1 << 62),
        "prefetch_threads": lambda v: _int(v, 1, 256), "cold_concurrency": lambda v: _int(v, 1, big),
        "pin_wait_s": lambda v: _number(v), "stats_interval_s": lambda v: _number(v, open_low=True),
        "lease_timeout_s": lambda v: _number(v, open_low=True), "shared_wait_s": lambda v: _number(v, open_low=True),
        "storage_options": _mapping_ok, "retry": lambda v: v is None or isinstance(v, RetryPolicy),
        "cold_wrapper": lambda v: v is None or callable(v),
        "local_tiers": lambda v: isinstance(v, (list, tuple)) and not v,
        "warm_dir": lambda v: v is None, "shared_dir": lambda v: v is None,
    }
    cases += [(f"TieredCache({k}=)", lambda v, k=k: TieredCache(**{k: v}), ok) for k, ok in tc.items()]
    cases += [("Tier(bytes) in local_tiers",
               lambda v: TieredCache(warm_dir="/nonexistent-never-made/w", warm_bytes=1,
                                     local_tiers=[Tier("/nonexistent-never-made/t", v)]),
               lambda v: _int(v, 1, math.inf))]
    return cases


_NAMES = [name for name, _, _ in _cases("u")]


@pytest.mark.parametrize("name", _NAMES)
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=JUNK)
def test_junk_at_any_public_argument_is_an_option_error(url, name, value):
    _, call, ok = next(c for c in _cases(url) if c[0] == name)
    if ok(value):  # a value that is fine for this argument is not junk here
        return
    try:
        out = call(value)
    except OptionError as e:
        assert str(e) and len(str(e)) < 2000
        return
    except DatapipeError as e:  # a named error of another kind is a failure here: it should be an OptionError
        pytest.fail(f"{name}: {show(value)} raised {type(e).__name__}: {e}")
    pytest.fail(f"{name}: {show(value)} was taken (silently coerced?): {show(out)}")


STATE_KEYS = ("version", "fingerprint", "num_samples", "algorithm", "seed", "window", "epoch", "splits", "worker")


@settings(max_examples=150)
@given(key=st.sampled_from(STATE_KEYS), value=JUNK | st.lists(st.lists(JUNK, max_size=5), max_size=3),
       seen=st.integers(0, N))
def test_a_damaged_state_is_a_named_error(url, key, value, seen):
    # a state's content is data, not an argument: StateMismatchError names what is wrong
    # (a dict that is not a state at all is a LoaderOptionError), never a raw error
    state = StreamingDataset(url, seed=1).state_dict(seen)
    state[key] = value
    ds = StreamingDataset(url, seed=1)
    try:
        ds.load_state_dict(state)
    except (StateMismatchError, LoaderOptionError) as e:
        assert len(str(e)) < 2000
    else:  # taken: the value was the state's own, or another epoch (each epoch is a state of its own)
        assert value == StreamingDataset(url, seed=1).state_dict(seen)[key] or (
            key == "epoch" and type(value) is int and 0 <= value < 2 ** 63), (key, value)
