"""Hostile shards (issue 9, items 9, 10 and 12): crafted tar headers, path escapes, links,
sizes past the end, zstd decompression bombs. Each shard is installed with an index whose
checksums match it (as a hostile writer would make), so the parsers themselves are what is
tested: every reader (random access, verify, one streaming epoch) must give a named
DatapipeError that names the shard and a byte offset, in bounded time and memory."""

from __future__ import annotations

import json
import tracemalloc
import warnings

import pytest
import xxhash

import datapipe
import datapipe.loader
from benchmarks.fuzz_reader import deadline
from datapipe.errors import DatapipeError
from datapipe.format import SampleRecords, ShardRecord
from datapipe.publish import write_index
from datapipe.storage import open_store

EOA = b"\0" * 1024


def _header(name: bytes, size: int, kind: bytes = b"0", linkname: bytes = b"",
            size_field: bytes | None = None) -> bytes:
    h = bytearray(512)
    h[0 : len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[148:156] = b"        "
    h[156:157] = kind
    h[157 : 157 + len(linkname)] = linkname
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _member(name: bytes, data: bytes, kind: bytes = b"0", **kw) -> bytes:
    return _header(name, len(data), kind, **kw) + data + b"\0" * (-len(data) % 512)


def _pax(records: bytes, then: bytes) -> bytes:
    return _member(b"././@PaxHeader", records, b"x") + then


def _record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body)
    n += len(str(n + len(str(n))))
    return str(n).encode() + body


PLAIN = {
    "pax_length_zero": _pax(b"0 path=k.txt\n", _member(b"k.txt", b"x")),
    "pax_length_negative": _pax(b"-13 path=k.txt\n", _member(b"k.txt", b"x")),
    "pax_length_not_a_number": _pax(b"1x path=k.txt\n", _member(b"k.txt", b"x")),
    "pax_length_past_the_header": _pax(b"900 path=k.txt\n", _member(b"k.txt", b"x")),
    "pax_value_bad_utf8": _pax(_record(b"path", b"k\xff\xfe.txt"), _member(b"k.txt", b"x")),
    "pax_key_bad_utf8": _pax(_record(b"pa\xffth", b"k.txt"), _member(b"k.txt", b"x")),
    "pax_size_differs": _pax(_record(b"size", b"5000"), _member(b"k.txt", b"x")),
    "pax_without_member": _pax(_record(b"path", b"k.txt"), b""),
    "name_bad_utf8": _member(b"k\xff.txt", b"x"),
    "gnu_longname_bad_utf8": _member(b"././@LongLink", b"k\xff\xfe.txt\0", b"L") + _member(b"k.txt", b"x"),
    "pax_path_differs_from_index_key": _pax(_record(b"path", b"other.txt"), _member(b"k.txt", b"x")),
    "pax_path_escapes": _pax(_record(b"path", b"../../etc/k.txt"), _member(b"k.txt", b"x")),
    "name_escapes": _member(b"../k.txt", b"x"),
    "name_absolute": _member(b"/k.txt", b"x"),
    "symlink_member": _member(b"k.txt", b"", b"2", linkname=b"/etc/passwd"),
    "hardlink_member": _member(b"k.txt", b"", b"1", linkname=b"/etc/passwd"),
    "symlink_beside_a_file": _member(b"k.txt", b"x") + _member(b"k.lnk", b"", b"2", linkname=b"/etc/passwd"),
    "hardlink_beside_a_file": _member(b"k.lnk", b"", b"1", linkname=b"k.txt") + _member(b"k.txt", b"x"),
    "directory_member": _member(b"k.txt", b"", b"5"),
    "size_beyond_eof": _header(b"k.txt", 10**9) + b"x" * 512,
    "size_base256_huge": _header(b"k.txt", 0, size_field=b"\x80" + b"\xff" * 11) + b"x" * 512,
    "size_not_octal": _header(b"k.txt", 0, size_field=b"0000000009x\0") + b"x" * 512,
    # int(..., 8) takes a sign, a 0o prefix and underscores: a size of -512 made the parser
    # read the same header forever (a PAX header: a hang; a member: a hang that grows memory)
    "pax_size_negative": _header(b"././@PaxHeader", 0, b"x", size_field=b"-0000001000\0") + _member(b"k.txt", b"x"),
    "size_negative": _header(b"k.txt", 0, size_field=b"-0000001000\0") + _member(b"k.cls", b"1"),
    "size_octal_prefix": _header(b"k.txt", 0, size_field=b"0o000000001\0") + b"x" + b"\0" * 511,
    "second_key_in_range": _member(b"k.txt", b"x") + _member(b"j.txt", b"y"),
    "zero_block_inside_range": _member(b"k.txt", b"x") + b"\0" * 512 + _member(b"k.cls", b"1"),
    "stray_bytes_after_member": _member(b"k.txt", b"x") + b"\x01" * 100,
}


def _rle_frame(blocks: int, content_size: int | None, value: int = 0) -> bytes:
    """A zstd frame of ``blocks`` RLE blocks of 128 KiB (4 bytes each), claiming
    ``content_size`` in its header (None: no size in the header)."""
    if content_size is None:
        head = b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x38])  # no FCS, window 128 KiB
    else:
        head = b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x38]) + content_size.to_bytes(8, "little")
    out = [head]
    for i in range(blocks):
        last = 1 if i == blocks - 1 else 0
        out.append(((131072 << 3) | (1 << 1) | last).to_bytes(3, "little") + bytes([value]))
    return b"".join(out)


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


ZSTD = {
    # ~64 KiB that expand to 2 GiB (a real bomb: every block is there), the size in the header
    "bomb_with_size": _rle_frame(16384, 16384 * 131072),
    # the same without a size in the header: only a bounded decode can stop it
    "bomb_without_size": _rle_frame(16384, None),
    # a frame that claims 1 TB
    "claims_one_terabyte": _rle_frame(4, 1 << 40),
    # a frame whose header understates what its blocks hold
    "understated_size": _rle_frame(64, 1024),
    "two_frames_in_range": _zstd(_member(b"k.txt", b"x")) + _zstd(_member(b"k.cls", b"1")),
    "truncated_frame": _zstd(_member(b"k.txt", b"x" * 5000))[:-7],
    "not_a_frame": b"\x00" * 64,
    "skippable_frame": b"\x50\x2a\x4d\x18" + (8).to_bytes(4, "little") + b"\0" * 8,
    "hostile_tar_inside": _zstd(PLAIN["pax_length_zero"]),
    "symlink_inside": _zstd(PLAIN["symlink_member"]),
}


def _install(dest, compression: str, sample: bytes, tar_bytes: int) -> str:
    """A one-sample dataset at ``dest`` whose shard is ``sample`` + end of archive, with an
    index re-signed to match (key ``k``)."""
    tail = EOA if compression == "none" else _zstd(EOA)
    blob = sample + tail
    name = "shard-000000.tar" + (".zst" if compression == "zstd" else "")
    dest.mkdir()
    (dest / name).write_bytes(blob)
    digest = "xxh3_64:" + xxhash.xxh3_64_hexdigest(blob)
    shard = ShardRecord(name, len(blob), 1, digest, tar_bytes if compression == "zstd" else len(blob))
    rows = SampleRecords(["k"], [0], [len(sample)], ["xxh3_64:" + xxhash.xxh3_64_hexdigest(sample)])
    write_index(open_store(str(dest)), [shard], [rows], compression, ["txt"])
    return str(dest)




def _every_reader_refuses(dest: str, shard: str, max_bytes: int = 128 << 20) -> None:
    """``max_bytes``: a 16th of the 2 GiB bombs; the readers' own buffers stay far below it."""
    def random_access():
        datapipe.open_dataset(dest)[0]

    def verify():
        report = datapipe.verify_dataset(dest)
        if not report.ok:
            raise DatapipeError(str(report.problems[0]))

    def epoch(on_error):
        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a skip report is raised, so it is seen here
                list(datapipe.StreamingDataset(dest, shuffle=False, decode=None, on_error=on_error))
        return run

    for name, read in (("random access", random_access), ("verify", verify), ("epoch", epoch("raise")),
                       ("epoch skip", epoch("skip"))):
        tracemalloc.start()
        try:
            with deadline(20, name):
                with pytest.raises((DatapipeError, RuntimeWarning)) as e:
                    read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        msg = str(e.value)
        assert shard in msg, f"{name}: {msg}"
        assert "byte" in msg or "@" in msg, f"{name}: no offset in {msg}"
        assert peak < max_bytes, f"{name}: peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_crafted_tar_is_a_named_error(tmp_path, case):
    sample = PLAIN[case]
    dest = _install(tmp_path / "ds", "none", sample, 0)
    _every_reader_refuses(dest, "shard-000000.tar")


def test_wrong_header_checksum_in_a_verified_shard(tmp_path):
    """Random access and verify check tar header checksums. The loader's fast path does not:
    it reads a shard only once its bytes matched the index's checksum (a stronger check),
    and then hands out exactly the members the index names."""
    good = _member(b"k.txt", b"x")
    dest = _install(tmp_path / "ds", "none", good[:148] + b"000000\0 " + good[156:], 0)
    with pytest.raises(DatapipeError, match=r"shard-000000.tar.*checksum mismatch at byte 0"):
        datapipe.open_dataset(dest)[0]
    assert "checksum mismatch at byte 0" in str(datapipe.verify_dataset(dest).problems[0])
    got = [dict(g) for g in datapipe.StreamingDataset(dest, shuffle=False, decode=None)]
    assert got == [{"__key__": "k", "txt": b"x"}]


@pytest.mark.parametrize("case", sorted(ZSTD))
def test_crafted_zstd_shard_is_a_named_error_in_bounded_memory(tmp_path, case):
    dest = _install(tmp_path / "ds", "zstd", ZSTD[case], 4096)
    _every_reader_refuses(dest, "shard-000000.tar.zst")


def test_crafted_cases_fit_their_index(tmp_path):
    """The harness itself: an honest sample installed the same way reads back."""
    for compression, sample in (("none", _member(b"k.txt", b"hello")), ("zstd", _zstd(_member(b"k.txt", b"hello")))):
        dest = _install(tmp_path / compression, compression, sample, 1024 + 1024)
        assert datapipe.open_dataset(dest)[0] == {"__key__": "k", "txt": b"hello"}
        assert datapipe.verify_dataset(dest).ok
        got = list(datapipe.StreamingDataset(dest, shuffle=False, decode=None))
        assert [dict(g) for g in got] == [{"__key__": "k", "txt": b"hello"}]
        assert json.loads((tmp_path / compression / "manifest.json").read_text())["num_samples"] == 1


def test_base256_size_is_read_as_other_tar_readers_read_it(tmp_path):
    """A GNU base-256 size whose last byte is zero (512 = 0x80 .. 0x02 0x00) was read with
    its trailing NUL bytes stripped (2): datapipe handed out 2 bytes where tarfile and GNU
    tar see 512."""
    import io
    import tarfile

    data = b"ab" + b"z" * 510
    sample = _header(b"k.txt", 0, size_field=b"\x80" + b"\0" * 9 + b"\x02\x00") + data
    dest = _install(tmp_path / "ds", "none", sample, 0)
    with tarfile.open(fileobj=io.BytesIO(sample + EOA)) as tf:
        (member,) = tf.getmembers()
        assert member.size == 512
    assert datapipe.open_dataset(dest)[0] == {"__key__": "k", "txt": data}
    assert datapipe.verify_dataset(dest).ok
    got = [dict(g) for g in datapipe.StreamingDataset(dest, shuffle=False, decode=None)]
    assert got == [{"__key__": "k", "txt": data}]
