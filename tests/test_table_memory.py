"""What a Parquet row group may decode to: a few kilobytes of file can claim gigabytes
(zstd pages of zeros, one dictionary entry repeated, run-length encoded integers). The
loader refuses a row group that would take more than its ``prefetch_bytes`` and pack one
above ``$DATAPIPE_PACK_ROW_GROUP_BYTES`` (1 GiB), before decoding it, naming file, row group and limit; the
peak memory of the reading process is measured in a child process (its ``VmHWM``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import FormatError, OptionError
from datapipe.loader import StreamingDataset

MiB = 1 << 20
DECODED = 512 * MiB  # what every bomb below decodes to


def _zeros_binary(rows: int, each: int) -> pa.Array:
    """``rows`` values of ``each`` zero bytes, over untouched zero pages (no memory taken)."""
    offsets = np.arange(rows + 1, dtype=np.int64) * each
    data = np.zeros(rows * each, np.uint8)
    return pa.Array.from_buffers(pa.large_binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _bomb(path: str, kind: str) -> str:
    if kind == "zstd pages":  # the footer says 512 MiB; the file holds 23 kB of zstd frames
        table = pa.table({"x": _zeros_binary(DECODED // MiB, MiB)})
        pq.write_table(table, path, compression="zstd", use_dictionary=False)
    elif kind == "dictionary":  # the footer says 256 kB: one entry, then 2048 indices to it
        entry = pa.array([bytes(256 << 10)], pa.binary())
        table = pa.table({"x": pa.DictionaryArray.from_arrays(pa.array(np.zeros(2048, np.int32)), entry)})
        pq.write_table(table, path, compression="zstd", store_schema=False, row_group_size=2048)
    else:  # "run-length": 64 M int64 zeros in a few kilobytes
        table = pa.table({"x": pa.array(np.zeros(DECODED // 8, np.int64))})
        pq.write_table(table, path, compression="zstd", row_group_size=DECODED // 8)
    assert os.path.getsize(path) < 2 * MiB
    return path


_CHILD = textwrap.dedent("""
    import json, os, sys
    import datapipe
    from datapipe.loader import StreamingDataset

    def peak():  # this process's peak resident memory (not ru_maxrss: that starts at the parent's)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    what, path, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if what == "stream":
        ds = StreamingDataset(path, prefetch_bytes=limit, shuffle=False)
        run = lambda: next(iter(ds))
    else:
        os.environ["DATAPIPE_PACK_ROW_GROUP_BYTES"] = str(limit)
        run = lambda: datapipe.pack(path, sys.argv[4], workers=1)
    before = peak()
    try:
        run()
        error = None
    except Exception as e:
        error = [type(e).__name__, str(e)]
    print(json.dumps({"error": error, "grew": peak() - before}))
""")


def _measure(what: str, path: str, limit: int, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", _CHILD, what, path, str(limit), *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


KINDS = ["zstd pages", "dictionary", "run-length"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_loader_refuses_a_row_group_bomb_within_its_prefetch_budget(tmp_path, kind):
    path = _bomb(str(tmp_path / "bomb.parquet"), kind)
    got = _measure("stream", path, 16 * MiB)
    assert got["error"] is not None and got["error"][0] == "FormatError", got
    message = got["error"][1]
    assert message.startswith(f"{path} row group 0: decodes to ")
    assert "more than the 16777216 bytes" in message and "prefetch_bytes" in message
    assert got["grew"] < 128 * MiB, f"the read took {got['grew'] / MiB:.0f} MiB more: {message}"


@pytest.mark.parametrize("kind", KINDS)
def test_pack_refuses_a_row_group_bomb(tmp_path, kind):
    path = _bomb(str(tmp_path / "bomb.parquet"), kind)
    got = _measure("pack", path, 16 * MiB, str(tmp_path / "out"))
    assert got["error"] is not None and got["error"][0] == "InputFileError", got
    assert got["error"][1].startswith(f"{path} row group 0: decodes to ")
    assert "more than the 16777216 bytes" in got["error"][1] and "set DATAPIPE_PACK_ROW_GROUP_BYTES" in got["error"][1]
    assert got["grew"] < 128 * MiB, f"pack took {got['grew'] / MiB:.0f} MiB more"
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_row_group_within_the_budget_reads_and_a_bomb_is_skipped(tmp_path):
    """The limit is the reader's prefetch_bytes: the same file reads with a larger one, and
    with on_error="skip" the bomb's rows are skipped while another file's rows stream."""
    table = tmp_path / "table"
    table.mkdir()
    entry = pa.array([bytes(4096)], pa.binary())
    bomb = pa.DictionaryArray.from_arrays(pa.array(np.zeros(2048, np.int32)), entry)  # 8 MiB decoded
    pq.write_table(pa.table({"x": bomb}), table / "a.parquet", store_schema=False)
    pq.write_table(pa.table({"x": [b"fine-%d" % i for i in range(5)]}), table / "b.parquet")
    with pytest.raises(FormatError, match=r"a\.parquet row group 0: decodes to \d+ bytes \(its dictionary-encoded"):
        list(StreamingDataset(str(table), prefetch_bytes=4 * MiB, shuffle=False))
    with pytest.warns(RuntimeWarning, match="skipped 2048 unreadable"):
        kept = list(StreamingDataset(str(table), prefetch_bytes=4 * MiB, shuffle=False, on_error="skip"))
    assert sorted(s["x"] for s in kept if isinstance(s, dict)) == [b"fine-%d" % i for i in range(5)]
    rows = list(StreamingDataset(str(table), prefetch_bytes=64 * MiB, shuffle=False))
    assert len(rows) == 2048 + 5 and rows[0]["x"] == bytes(4096)
    datapipe.pack(str(table), str(tmp_path / "out"), workers=1)
    assert len(datapipe.open_dataset(str(tmp_path / "out"))) == 2048 + 5


def test_a_bad_pack_row_group_limit_is_an_option_error(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"x": [b"a"]}), path)
    monkeypatch.setenv("DATAPIPE_PACK_ROW_GROUP_BYTES", "-5")
    with pytest.raises(OptionError, match=r"DATAPIPE_PACK_ROW_GROUP_BYTES='-5': .*positive integer"):
        datapipe.pack(str(path), str(tmp_path / "out"), workers=1)


def _patch_footer(path: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` with ``new`` (as long) in the file's footer, which a reader takes at
    its word: the page data stays as written."""
    data = bytearray(open(path, "rb").read())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    at = data.find(old, footer)
    assert at > 0 and len(old) == len(new), (old, new)
    while at > 0:
        data[at : at + len(old)] = new
        at = data.find(old, at + 1)
    open(path, "wb").write(bytes(data))


def _varint(n: int, width: int | None = None) -> bytes:
    """Thrift's zigzag varint of ``n``, padded with continuation bytes to ``width``."""
    n, out = 2 * n, bytearray()
    while n >= 0x80 or (width is not None and len(out) < width - 1):
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_a_footer_that_understates_its_pages_is_refused_by_their_headers(tmp_path):
    """The footer's uncompressed sizes rewritten to 4 kB (the pages still hold 512 MiB):
    pyarrow trusts the page headers, and so does the check before it decodes them."""
    path = _bomb(str(tmp_path / "bomb.parquet"), "zstd pages")
    meta = pq.ParquetFile(path).metadata.row_group(0)
    for size in {meta.total_byte_size, meta.column(0).total_uncompressed_size}:
        _patch_footer(path, _varint(size), _varint(4096, len(_varint(size))))
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size == 4096
    got = _measure("stream", path, 16 * MiB)
    assert got["error"] is not None and got["error"][0] == "FormatError", got
    assert got["error"][1].startswith(f"{path} row group 0: decodes to ")
    assert "(by its page headers, column 'x' read last)" in got["error"][1]
    assert got["grew"] < 128 * MiB, f"the read took {got['grew'] / MiB:.0f} MiB more"
    got = _measure("pack", path, 16 * MiB, str(tmp_path / "out"))
    assert got["error"][0] == "InputFileError" and "by its page headers" in got["error"][1], got
    assert got["grew"] < 128 * MiB


def test_a_dictionary_the_footer_does_not_list_is_refused(tmp_path):
    """The footer's encodings of the dictionary bomb rewritten to say PLAIN: without the
    check pyarrow would decode its dictionary into 512 MiB, unmeasured."""
    path = _bomb(str(tmp_path / "bomb.parquet"), "dictionary")
    _patch_footer(path, b"\x35\x00\x06\x10", b"\x35\x00\x06\x00")  # [PLAIN, RLE, RLE_DICTIONARY] -> no dictionary
    assert "RLE_DICTIONARY" not in pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    got = _measure("stream", path, 16 * MiB)
    assert got["error"] is not None and got["error"][0] == "FormatError", got
    assert "column 'x': its pages hold a dictionary that its footer does not list" in got["error"][1]
    assert got["grew"] < 128 * MiB, f"the read took {got['grew'] / MiB:.0f} MiB more"
