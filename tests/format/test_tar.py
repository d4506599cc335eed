"""Shard format: key cutting, tar members, zstd framing, compatibility with tarfile,
GNU tar, zstd and webdataset."""

import io
import re
import subprocess
import tarfile

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.errors import CorruptShardError, InvalidMemberNameError
from datapipe.format import decode_sample, encode_sample, split_member_name
from datapipe.format.tar import member_header, walk_members


@pytest.mark.parametrize(
    "name, expected",
    [
        ("img001.jpg", ("img001", "jpg")),
        ("a/b/img001.jpg", ("a/b/img001", "jpg")),
        ("dir.v2/x.y/img001.jpg", ("dir.v2/x.y/img001", "jpg")),  # dots in directories stay in the key
        ("img001.seg.png", ("img001", "seg.png")),  # the first dot of the basename ends the key
        ("a.b/c.tar.gz", ("a.b/c", "tar.gz")),
        (".hidden.jpg", None),
        ("a/.hidden.jpg", None),
        ("noext", None),
        ("a.b/noext", None),
        ("trailingdot.", None),
    ],
)
def test_key_cut_follows_webdataset(name, expected):
    assert split_member_name(name) == expected
    from webdataset.tariterators import base_plus_ext

    if expected is not None:
        assert base_plus_ext(name) == expected


@pytest.mark.parametrize("key", ["/abs", "../up", "a/../b", "a//b", "a/./b", "", "a\0b", "x.y", "d/x.y"])
def test_unsafe_keys_are_refused(key):
    with pytest.raises(InvalidMemberNameError):
        encode_sample({"__key__": key, "txt": b"x"})


@pytest.mark.parametrize("field", ["a/b", ".x", ""])
def test_unsafe_fields_are_refused(field):
    with pytest.raises(InvalidMemberNameError):
        encode_sample({"__key__": "k", field: b"x"})


def test_unsupported_value_names_key_and_field():
    with pytest.raises(InvalidMemberNameError, match=r"'k'.*'obj'"):
        encode_sample({"__key__": "k", "obj": object()})


@pytest.mark.parametrize("name_len", [10, 99, 100, 101, 180, 300])
def test_member_header_roundtrips_through_tarfile(name_len):
    key = ("d/" * (name_len // 4))[: max(1, name_len - 8)].strip("/") + "/k" if name_len > 20 else "k" * (name_len - 4)
    key, parts = encode_sample({"__key__": key, "bin": b"\x01" * 700, "txt": "héllo"})
    blob = b"".join(parts) + b"\0" * 1024
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        members = tf.getmembers()
        assert [m.name for m in members] == [f"{key}.bin", f"{key}.txt"]
        assert tf.extractfile(members[0]).read() == b"\x01" * 700
        assert tf.extractfile(members[1]).read() == "héllo".encode()
    expected = {"__key__": key, "bin": b"\x01" * 700, "txt": "héllo".encode()}
    assert decode_sample(blob[: len(b"".join(parts))]) == expected


def test_corrupt_header_is_named():
    h = bytearray(member_header("k.txt", 3)) + b"abc" + b"\0" * 509
    h[0] ^= 0xFF
    with pytest.raises(CorruptShardError, match=r"shard-x.*checksum"):
        list(walk_members(bytes(h), "shard-x"))


def test_truncated_member_is_named():
    blob = member_header("k.txt", 2000) + b"a" * 100
    with pytest.raises(CorruptShardError, match="truncated"):
        list(walk_members(blob, "s"))


def _samples(n):
    return [
        {"__key__": f"dir.v1/s{i:04d}", "bin": bytes([i % 256]) * (i * 37 % 3000), "txt": f"text {i}", "json": {"i": i}}
        for i in range(n)
    ]


def _expected(sample):
    return {
        "__key__": sample["__key__"],
        "bin": sample["bin"],
        "txt": sample["txt"].encode(),
        "json": datapipe.format.sample.field_bytes("", "", sample["json"]),
    }


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_shardwriter_roundtrip_reader_tarfile_webdataset(tmp_path, compression):
    samples = _samples(120)
    dest = str(tmp_path / "ds")
    with datapipe.ShardWriter(dest, max_bytes=64 * 1024, compression=compression) as w:
        for s in samples:
            w.write(s)
    ds = datapipe.open_dataset(dest)
    assert len(ds) == 120
    assert ds.index.num_shards > 3
    for i, s in enumerate(samples):
        assert ds[i] == _expected(s)
    assert ds.get("dir.v1/s0077") == _expected(samples[77])

    # whole shards through tarfile (after zstd -d for .tar.zst) and webdataset
    got_tar, urls = [], []
    for shard in ds.index.shards:
        urls.append(shard.url)
        raw = open(shard.url, "rb").read()
        if compression == "zstd":
            raw = subprocess.run(["zstd", "-dc", shard.url], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
            for m in tf.getmembers():
                got_tar.append((m.name, tf.extractfile(m).read()))
    expected_members = [
        (f"{s['__key__']}.{f}", v) for s in samples for f, v in sorted(_expected(s).items()) if f != "__key__"
    ]
    assert got_tar == expected_members

    import webdataset as wds

    if compression == "none":
        got = [dict(x) for x in wds.WebDataset(urls, shardshuffle=False)]
        assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
        assert all(g["bin"] == s["bin"] and g["txt"] == s["txt"].encode() for g, s in zip(got, samples))


def test_gnu_tar_lists_shards(tmp_path):
    dest = str(tmp_path / "ds")
    with datapipe.ShardWriter(dest) as w:
        for s in _samples(5):
            w.write(s)
    shard = datapipe.open_index(dest).shards[0].url
    out = subprocess.run(["tar", "tf", shard], check=True, capture_output=True, text=True).stdout.split()
    assert out[:3] == ["dir.v1/s0000.bin", "dir.v1/s0000.json", "dir.v1/s0000.txt"]


def test_zstd_frames_are_independent_range_reads(tmp_path):
    dest = str(tmp_path / "ds")
    samples = _samples(40)
    with datapipe.ShardWriter(dest, compression="zstd") as w:
        for s in samples:
            w.write(s)
    ix = datapipe.open_index(dest)
    table = ix.shard_samples(0)
    path = ix.shards[0].url
    data = open(path, "rb").read()
    whole = subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout
    # every sample's frame decompresses alone to exactly its slice of the whole stream
    pos = 0
    for key, off, length in zip(table.keys, table.offsets, table.lengths):
        raw = zstandard.ZstdDecompressor().decompress(data[off : off + length])
        assert whole[pos : pos + len(raw)] == raw
        assert decode_sample(data[off : off + length], "zstd")["__key__"] == key
        pos += len(raw)
    assert whole[pos:] == b"\0" * 1024


def test_header_byte_sum_is_the_plain_sum():
    """The strict parser's fast header sum (Adler-32 halves) equals sum() for any block."""
    from datapipe.format.tar import _byte_sum

    @settings(max_examples=300, deadline=None)
    @given(st.binary(min_size=512, max_size=512))
    def check(block):
        assert _byte_sum(block) == sum(block)

    check()
    assert _byte_sum(b"\xff" * 512) == 512 * 255


#: the first-dot rule as an expression (WebDataset's reader cuts names this way); the
#: leading [^./]: no dot-files
_FIRST_DOT = re.compile(r"^((?:.*/|)[^./][^./]*)\.([^/]*)$")
_NAME_CHARS = st.sampled_from(list("ab./\n\\ é_-0"))


@settings(max_examples=500)
@given(folders=st.lists(st.text(_NAME_CHARS, min_size=1, max_size=4), max_size=3),
       name=st.text(_NAME_CHARS, min_size=0, max_size=8))
def test_a_member_name_is_cut_as_the_first_dot_expression_cuts_it(folders, name):
    """``split_member_name`` cuts without the expression; the key and field are the ones
    the expression gives (dots, newlines and backslashes anywhere, in the folders and the
    name), and None where it gives none or an empty field."""
    path = "".join(f + "/" for f in folders) + name
    m = _FIRST_DOT.match(path)
    assert split_member_name(path) == (None if m is None or not m.group(2) else (m.group(1), m.group(2)))
