"""The format's fast structural check agrees with its strict decoder, or declines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.decode import make_decoder
from datapipe.errors import DecodeError
from datapipe.format import decode_sample, encode_sample
from datapipe.format.layout import fast_layout

segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=60)
fields = st.dictionaries(
    st.text(alphabet="abcxyz", min_size=1, max_size=5).map(lambda s: s) | st.sampled_from(["seg.png", "a.b.c"]),
    st.binary(max_size=2000), min_size=1, max_size=4)


def fast_cut(raw):
    """The one-sample shard ``raw`` cut by :func:`fast_layout`, or None where it declines."""
    key = raw[:100].split(b"\0", 1)[0].decode("utf-8", "replace").rpartition("/")
    key = key[0] + key[1] + key[2].split(".", 1)[0]
    lay = fast_layout(raw, [0], [len(raw)], [key]) if raw else None
    if lay is None:
        return None
    row = lay.table[0].tolist()
    return {"__key__": key, **{f: raw[row[2 * k] : row[2 * k + 1]] for k, f in enumerate(lay.fields)}}


@given(dirs=st.lists(segment, max_size=3), base=segment, fields=fields)
@settings(max_examples=80, deadline=None)
def test_fast_layout_cuts_as_decode_sample_does(dirs, base, fields):
    key = "/".join([*dirs, base])
    sample = {"__key__": key, **fields}
    _, parts = encode_sample(sample)
    raw = b"".join(bytes(p) for p in parts)
    fast = fast_cut(raw)
    slow = decode_sample(raw)
    if fast is not None:  # long names (prefix or PAX) decline and take the general path
        assert fast == slow
        assert next(iter(fast)) == "__key__"
    else:
        assert len(key) + max(len(f) for f in fields) + 1 > 99
    assert slow == {"__key__": key, **fields}


def test_fast_layout_declines_what_it_cannot_vouch_for():
    _, parts = encode_sample({"__key__": "k", "txt": b"hello"})
    raw = bytearray(b"".join(bytes(p) for p in parts))
    assert fast_cut(bytes(raw))["txt"] == b"hello"
    bad = bytearray(raw)
    bad[156] = ord("5")  # a directory member
    assert fast_cut(bytes(bad)) is None
    assert fast_cut(bytes(raw[:515])) is None  # cut inside the data
    assert fast_cut(b"") is None


def test_decoder_errors_name_the_sample():
    dec = make_decoder("auto")
    with pytest.raises(DecodeError, match=r"shard-1.tar sample 'k7': field 'json'"):
        dec({"__key__": "k7", "json": b"{not json"}, "shard-1.tar")
    assert dec({"__key__": "k", "cls": b" 12\n", "txt": b"h\xc3\xa9"}, "x") == {"__key__": "k", "cls": 12, "txt": "hé"}


def _dataset(path, mixed):
    from datapipe import ShardWriter

    with ShardWriter(str(path), max_samples=13) as w:
        for i in range(40):
            s = {"__key__": f"d/{i:03d}", "txt": f"t{i}", "bin": bytes([i]) * (i * 37 % 700)}
            if mixed and i % 5 == 0:
                s["extra.json"] = {"i": i}
            w.write(s)
    return str(path)


@pytest.mark.parametrize("mixed", [False, True])
def test_kept_layouts_cut_samples_as_the_tar_parser_does(tmp_path, mixed):
    from datapipe.loader import StreamingDataset
    from datapipe.loader.readers import reader_for

    url = _dataset(tmp_path / "ds", mixed)
    plain = StreamingDataset(url, shuffle=False, decode="raw")
    plain.source.find_layouts = False  # no layouts: every sample parsed on its own
    expected = list(plain)
    ds = StreamingDataset(url, shuffle=False, decode="raw")
    assert list(ds) == expected
    assert len(ds.source.layouts) == 4  # every shard's layout (or member table) is kept
    assert list(ds) == expected  # second epoch: layouts come from the cache
    kinds = []
    for g in range(4):
        data = ds.source.fetch(g)
        kinds.append(type(reader_for(data)).__name__)
        data.close()
    # mixed shards have no shared layout; only the last (#39 alone) is uniform
    assert kinds == (["MemberWalkReader"] * 3 if mixed else ["LaidOutShardReader"] * 3) + ["LaidOutShardReader"]


def _fails_on_7(sample):
    if sample["__key__"] == "d/007":
        raise KeyError("no such label")
    return sample


@pytest.mark.parametrize("where", ["decode", "map"])
def test_a_user_function_that_raises_is_a_decode_error_not_corruption(tmp_path, where):
    from datapipe.errors import CorruptShardError
    from datapipe.loader import StreamingDataset

    url = _dataset(tmp_path / "ds", False)
    kw = {"decode": _fails_on_7} if where == "decode" else {"decode": "raw", "map": _fails_on_7}
    message = rf"shard-000000.tar sample 'd/007': the {where}= function raised KeyError"
    with pytest.raises(DecodeError, match=message) as e:
        list(StreamingDataset(url, shuffle=False, **kw))
    assert not isinstance(e.value, CorruptShardError) and isinstance(e.value.__cause__, KeyError)
    ds = StreamingDataset(url, shuffle=False, on_error="skip", **kw)
    with pytest.warns(RuntimeWarning, match="skipped 1 unreadable"):
        got = [s["__key__"] for s in ds]
    assert len(got) == 39 and "d/007" not in got and [k for _, k, _ in ds.skipped] == ["d/007"]


def test_a_failing_schedule_hook_is_reported_once_and_reads_go_on(tmp_path):
    from datapipe import TieredCache
    from datapipe.loader import StreamingDataset

    class GoneCache(TieredCache):
        def set_schedule(self, urls, **kw):
            raise OSError("cache gone")

    url = _dataset(tmp_path / "ds", False)
    ds = StreamingDataset(url, cache=GoneCache(), seed=1, chunk_samples=4)
    with pytest.warns(RuntimeWarning, match="set_schedule failed.*cache gone") as seen:
        got = [x["__key__"] for x in ds]
    assert sorted(got) == [f"d/{i:03d}" for i in range(40)]
    assert len([w for w in seen if "set_schedule" in str(w.message)]) == 1  # once per pass, not per chunk
