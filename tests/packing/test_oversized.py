"""A sample larger than the shard size limit gets a shard of its own (webdataset's
ShardWriter convention: the limit is exceeded by that shard only), in every packing path:
``pack`` of a directory (local and ``--skip-errors``), of a table, ``ShardWriter``, the CLI
and the Ray sink. Such a shard is read by the index, verify, random access and the loader."""

import json
import os

import pytest

import datapipe
from datapipe.cli import main
from datapipe.loader import StreamingDataset

LIMIT = 8192
HUGE = 20_000  # bytes of the one field of the oversized sample: larger than LIMIT
HUGE_TAR = 512 + 20_480  # its size in the tar: a header and the data padded to 512


def _write(root, rel, data):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _source(tmp_path):
    """20 small samples around one larger than LIMIT."""
    src = str(tmp_path / "src")
    expected = {}
    for i in range(20):
        data = bytes([i]) * 700
        _write(src, f"a{i:02d}.bin", data)
        expected[f"a{i:02d}"] = data
        if i == 9:
            big = os.urandom(HUGE)
            _write(src, "a09x.bin", big)
            expected["a09x"] = big
    return src, expected


def _check_dataset(url, expected):
    """Index, verify, random access and the loader all read the dataset whole."""
    ix = datapipe.open_index(url)
    assert ix.num_samples == len(expected)
    big = [s for s in ix.shards if s.tar_bytes > LIMIT]
    assert len(big) == 1 and big[0].samples == 1  # only the shard of the oversized sample exceeds it
    report = datapipe.verify_dataset(url, all_problems=True)
    assert report.ok, report.problems
    ds = datapipe.open_dataset(url)
    assert {s["__key__"]: s["bin"] for s in ds} == expected
    assert ds.get("a09x")["bin"] == expected["a09x"]
    assert ix.keys() == sorted(expected)  # in order: the shard of its own falls between the others
    streamed = {s["__key__"]: s["bin"] for s in StreamingDataset(url, shuffle=False)}
    assert streamed == expected


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("skip_errors", [False, True])
def test_pack_puts_an_oversized_sample_in_a_shard_of_its_own(tmp_path, compression, skip_errors):
    src, expected = _source(tmp_path)
    dest = str(tmp_path / "ds")
    r = datapipe.pack(src, dest, shard_bytes=LIMIT, compression=compression, workers=1, skip_errors=skip_errors)
    assert r.samples == len(expected) and not r.skipped
    assert r.oversized == 1 and r.oversized_examples == [("a09x", HUGE_TAR)]
    assert ("1 sample larger than --shard-bytes was put in a shard of its own, "
            "e.g. a09x (20,992 bytes)") in r.summary()
    _check_dataset(dest, expected)


def test_pack_with_worker_processes_notes_it_too(tmp_path):
    src, expected = _source(tmp_path)
    dest = str(tmp_path / "ds")
    r = datapipe.pack(src, dest, shard_bytes=LIMIT, workers=2)
    assert r.oversized == 1 and r.oversized_examples == [("a09x", HUGE_TAR)]
    _check_dataset(dest, expected)


def test_a_table_row_larger_than_the_limit(tmp_path):
    rows = [{"__key__": f"r{i:02d}", "txt": "x" * 500} for i in range(12)]
    rows[5]["txt"] = "y" * HUGE
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dest = str(tmp_path / "ds")
    r = datapipe.pack(str(src), dest, shard_bytes=LIMIT)
    assert r.samples == 12 and r.oversized == 1 and r.oversized_examples == [("r05", HUGE_TAR)]
    ix = datapipe.open_index(dest)
    big = [s for s in ix.shards if s.tar_bytes > LIMIT]
    assert len(big) == 1 and big[0].samples == 1
    assert datapipe.verify_dataset(dest).ok
    assert datapipe.open_dataset(dest).get("r05")["txt"] == b"y" * HUGE
    assert len(list(StreamingDataset(dest))) == 12


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_shardwriter_puts_an_oversized_sample_in_a_shard_of_its_own(tmp_path, compression):
    dest = str(tmp_path / "w")
    expected = {}
    with datapipe.ShardWriter(dest, max_bytes=LIMIT, compression=compression) as w:
        for i in range(20):
            data = os.urandom(HUGE) if i == 9 else bytes([i]) * 700
            key = "a09x" if i == 9 else f"a{i:02d}"
            w.write({"__key__": key, "bin": data})
            expected[key] = data
    assert w.oversized == [("a09x", HUGE_TAR)]
    _check_dataset(dest, expected)


def test_webdataset_reads_the_oversized_shard(tmp_path):
    import webdataset as wds

    src, expected = _source(tmp_path)
    dest = tmp_path / "ds"
    datapipe.pack(src, str(dest), shard_bytes=LIMIT, workers=1)
    urls = sorted(str(p) for p in dest.glob("shard-*.tar"))
    got = {s["__key__"]: s["bin"] for s in wds.WebDataset(urls, shardshuffle=False)}
    assert got == expected


def test_cli_pack_notes_the_oversized_sample(tmp_path, capsys):
    src, _ = _source(tmp_path)
    dest = str(tmp_path / "ds")
    assert main(["pack", src, dest, "--shard-bytes", "8K", "--skip-errors", "-q"]) == 0
    out = capsys.readouterr().out
    assert "packed 21 samples" in out
    assert "1 sample larger than --shard-bytes was put in a shard of its own, e.g. a09x" in out
    assert main(["verify", dest, "-q"]) == 0


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_pack_and_sink_put_an_oversized_sample_in_a_shard_of_its_own(tmp_path):
    """The Ray paths share the rule: ``datapipe.ray.pack`` (planned shards of files) and
    ``datapipe.ray.write`` (rows through ShardSeries). Run with ``-m ray -n 0``."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[tests,ray]'")
    pytest.importorskip("ray.data")
    import datapipe.ray as dr

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        src, expected = _source(tmp_path)
        r = dr.pack(src, str(tmp_path / "files"), shard_bytes=LIMIT)
        assert r.oversized == 1 and r.oversized_examples == [("a09x", HUGE_TAR)]
        _check_dataset(str(tmp_path / "files"), expected)
        rows = [{"__key__": k, "bin": v} for k, v in sorted(expected.items())]
        r = dr.write(ray.data.from_items(rows, override_num_blocks=1), str(tmp_path / "rows"), max_bytes=LIMIT)
        assert r.oversized == 1 and r.oversized_examples == [("a09x", HUGE_TAR)]
        _check_dataset(str(tmp_path / "rows"), expected)
    finally:
        ray.shutdown()
