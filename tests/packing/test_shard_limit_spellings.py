"""The shard limits have one spelling everywhere, ``shard_bytes``/``shard_samples`` as in
``pack()`` and ``datapipe pack``; ``ShardWriter`` also takes webdataset's ``maxsize``/
``maxcount`` and the older ``max_bytes``/``max_samples`` for them (one spelling per limit),
and the Ray sink the older ones. Every spelling cuts the same shards."""

from __future__ import annotations

import inspect
import os

import pytest

import datapipe
from datapipe.errors import PackOptionError

SAMPLES = [{"__key__": f"k{i:03d}", "txt": "x" * (300 + 17 * i)} for i in range(40)]
LIMIT = 8192


def _shards(dest, **limits):
    with datapipe.ShardWriter(str(dest), **limits) as w:
        for s in SAMPLES:
            w.write(s)
    ix = datapipe.open_index(str(dest))
    return [(s.name, s.samples, s.tar_bytes) for s in ix.shards]


@pytest.mark.parametrize("bytes_name, samples_name", [("shard_bytes", "shard_samples"), ("maxsize", "maxcount"),
                                                      ("max_bytes", "max_samples"), ("maxsize", "shard_samples")])
def test_every_spelling_cuts_the_same_shards(tmp_path, bytes_name, samples_name):
    want = _shards(tmp_path / "want", shard_bytes=LIMIT, shard_samples=7)
    got = _shards(tmp_path / "got", **{bytes_name: LIMIT, samples_name: 7})
    assert got == want
    assert len(want) > 2 and max(n for _, n, _ in want) == 7 and max(b for _, _, b in want) <= LIMIT
    w = datapipe.ShardWriter(str(tmp_path / "limits"), **{bytes_name: LIMIT, samples_name: 7})
    assert (w.limits.shard_bytes, w.limits.shard_samples) == (LIMIT, 7)
    w.abort()


def test_the_default_applies_when_no_spelling_is_given(tmp_path):
    w = datapipe.ShardWriter(str(tmp_path / "d"), maxcount=3)
    assert (w.limits.shard_bytes, w.limits.shard_samples) == (datapipe.packing.DEFAULT_SHARD_BYTES, 3)
    w.abort()
    # the default passed by hand is a spelling given: with another, refused
    with pytest.raises(PackOptionError, match="shard_bytes=134217728 and maxsize=4096"):
        datapipe.ShardWriter(str(tmp_path / "e"), shard_bytes=datapipe.packing.DEFAULT_SHARD_BYTES, maxsize=4096)


@pytest.mark.parametrize("limits, named", [
    ({"shard_bytes": LIMIT, "maxsize": LIMIT}, "shard_bytes=8192 and maxsize=8192"),
    ({"max_samples": 3, "maxcount": 3}, "maxcount=3 and max_samples=3"),
    ({"shard_samples": 3, "max_samples": 4}, "shard_samples=3 and max_samples=4"),
])
def test_two_spellings_of_one_limit_are_refused_naming_both(tmp_path, limits, named):
    dest = tmp_path / "ds"
    with pytest.raises(PackOptionError) as e:
        datapipe.ShardWriter(str(dest), **limits)
    assert named in str(e.value) and "give one of them" in str(e.value)
    assert not os.path.exists(dest)  # checked before anything was written


@pytest.mark.parametrize("name, value", [("maxsize", 3e9), ("maxsize", 100), ("maxcount", 0), ("max_bytes", "1G"),
                                         ("shard_samples", 2.0), ("maxcount", None)])
def test_a_bad_limit_is_named_by_the_spelling_it_was_given_as(tmp_path, name, value):
    with pytest.raises(PackOptionError) as e:
        datapipe.ShardWriter(str(tmp_path / "ds"), **{name: value})
    assert str(e.value).startswith(f"{name}") and "must be an integer from" in str(e.value)


def test_pack_and_shardwriter_spell_the_limits_alike():
    pack = inspect.signature(datapipe.pack).parameters
    writer = inspect.signature(datapipe.ShardWriter).parameters
    for name in ("shard_bytes", "shard_samples"):
        assert name in pack and name in writer
        assert pack[name].default == writer[name].default  # the signature shows the default


@pytest.mark.ray
def test_the_ray_sink_takes_shard_bytes_and_shard_samples_and_the_older_spelling(tmp_path):
    pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install -e '.[tests,ray]'")
    import datapipe.ray as dr

    sink = dr.DatapipeDatasink(str(tmp_path / "a"), shard_bytes=LIMIT, shard_samples=5)
    assert (sink.limits.shard_bytes, sink.limits.shard_samples, sink.min_bytes_per_write) == (LIMIT, 5, LIMIT)
    old = dr.DatapipeDatasink(str(tmp_path / "b"), max_bytes=LIMIT, max_samples=5)
    assert (old.limits.shard_bytes, old.limits.shard_samples) == (LIMIT, 5)
    with pytest.raises(PackOptionError, match="shard_bytes=8192 and max_bytes=8192"):
        dr.DatapipeDatasink(str(tmp_path / "c"), shard_bytes=LIMIT, max_bytes=LIMIT)
    with pytest.raises(PackOptionError, match="shard_byte: not an option of a shard writer"):
        dr.DatapipeDatasink(str(tmp_path / "d"), shard_byte=LIMIT)
    with pytest.raises(PackOptionError, match=r"overwrite \(--overwrite\)='yes'"):
        dr.DatapipeDatasink(str(tmp_path / "e"), overwrite="yes")
    with pytest.raises(PackOptionError, match="workers: options of a local pack"):
        dr.pack(str(tmp_path), str(tmp_path / "f"), workers=2)
    with pytest.raises(PackOptionError, match=r"progress='no': must be True or False"):
        dr.pack(str(tmp_path), str(tmp_path / "g"), progress="no")
