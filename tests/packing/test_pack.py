"""`pack` end to end: directories, tables, parallel, parts, S3, resume after a crash."""

import json
import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import DestinationExistsError, ObjectNotFoundError
from tools.corpus import generate_corpus, read_corpus


def _all_samples(url, storage_options=None):
    ds = datapipe.open_dataset(url, storage_options)
    return {s["__key__"]: s for s in ds}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    generate_corpus(str(root), 300, seed=1, mean_bytes=2048, per_dir=100)
    return str(root)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_pack_directory_roundtrip(corpus, tmp_path, compression):
    dest = str(tmp_path / "ds")
    r = datapipe.pack(corpus, dest, shard_bytes=128 * 1024, compression=compression, workers=1)
    assert r.samples == 300 and r.shards > 3
    assert _all_samples(dest) == read_corpus(corpus)
    assert not os.path.exists(os.path.join(dest, "_pack"))
    assert datapipe.verify_dataset(dest).ok


def test_parallel_and_parts_give_the_same_samples(corpus, tmp_path):
    one = tmp_path / "one"
    par = tmp_path / "par"
    parts = tmp_path / "parts"
    datapipe.pack(corpus, str(one), shard_bytes=64 * 1024, workers=1)
    datapipe.pack(corpus, str(par), shard_bytes=64 * 1024, workers=2)
    for i in range(3):
        r = datapipe.pack(corpus, str(parts), part=f"{i}/3", shard_bytes=64 * 1024, workers=1)
        assert 90 <= r.samples <= 110
    with pytest.raises(DestinationExistsError):
        datapipe.pack(corpus, str(parts), part="1/3", shard_bytes=64 * 1024)
    assert datapipe.join_parts(str(parts)) == 300
    joined = datapipe.open_index(str(parts))
    assert [s.tar_bytes for s in joined.shards] == [
        s.tar_bytes for i in range(3) for s in datapipe.open_index(str(parts / f"part-{i:05d}-of-00003")).shards
    ]
    expected = _all_samples(str(one))
    assert _all_samples(str(par)) == expected
    assert _all_samples(str(parts)) == expected
    assert datapipe.verify_dataset(str(parts)).ok
    # identical inputs and options give identical shard bytes, whatever the worker count
    assert [s.checksum for s in datapipe.open_index(str(one)).shards] == [
        s.checksum for s in datapipe.open_index(str(par)).shards
    ]


def test_join_refuses_missing_part(corpus, tmp_path):
    dest = str(tmp_path / "parts")
    datapipe.pack(corpus, dest, part="0/2", workers=1)
    with pytest.raises(datapipe.errors.PackError, match=r"parts \[1\] of 2"):
        datapipe.join_parts(dest)


def test_pack_to_s3_and_random_access(corpus, s3):
    root, opts = s3
    dest = f"{root}/ds"
    r = datapipe.pack(corpus, dest, shard_bytes=128 * 1024, compression="zstd", workers=2, storage_options=opts)
    assert r.samples == 300
    ds = datapipe.open_dataset(dest, opts)
    src = read_corpus(corpus)
    for i in (0, 7, 150, 299):
        s = ds[i]
        assert s == src[s["__key__"]]
    assert ds.get("00002/sample00000250") == src["00002/sample00000250"]
    assert datapipe.verify_dataset(dest, storage_options=opts).ok
    with pytest.raises(DestinationExistsError):
        datapipe.pack(corpus, dest, storage_options=opts)
    datapipe.pack(corpus, dest, storage_options=opts, overwrite=True, workers=1)
    assert len(datapipe.open_dataset(dest, opts)) == 300


def test_pack_jsonl_and_parquet(tmp_path):
    rows = [{"__key__": f"r{i:03d}", "txt": f"caption {i}", "cls": i % 7, "meta": {"i": i}} for i in range(50)]
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    datapipe.pack(str(jl), str(tmp_path / "dj"), shard_samples=16)
    got = _all_samples(str(tmp_path / "dj"))
    assert got["r007"] == {"__key__": "r007", "txt": b"caption 7", "cls": b"0", "meta": b'{"i": 7}'}
    assert datapipe.open_index(str(tmp_path / "dj")).num_shards == 4

    table = pa.table({"jpg": [bytes([i]) * 100 for i in range(30)], "caption": [f"c{i}" for i in range(30)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=7)
    datapipe.pack(str(tmp_path / "t.parquet"), str(tmp_path / "dp"), part="1/2")
    datapipe.pack(str(tmp_path / "t.parquet"), str(tmp_path / "dp"), part="0/2")
    datapipe.join_parts(str(tmp_path / "dp"))
    got = _all_samples(str(tmp_path / "dp"))
    assert len(got) == 30
    assert got["000000021"] == {"__key__": "000000021", "jpg": bytes([21]) * 100, "caption": b"c21"}


_CRASH_SCRIPT = """
import os, signal, sys, datapipe
from datapipe.publish import Journal

record = Journal.record
recorded = []


def record_then_stop(self, name, result):
    # the pack stops itself right after recording its third shard, so the test's kill
    # always lands mid-pack: shards recorded, nothing committed
    record(self, name, result)
    recorded.append(name)
    if len(recorded) == 3:
        os.kill(os.getpid(), signal.SIGSTOP)


Journal.record = record_then_stop
datapipe.pack(sys.argv[1], sys.argv[2], shard_bytes=48 * 1024, workers=1)
"""


def test_killed_pack_is_invisible_and_rerun_finishes(corpus, tmp_path):
    dest = str(tmp_path / "ds")
    proc = subprocess.Popen([sys.executable, "-c", _CRASH_SCRIPT, corpus, dest], cwd=os.getcwd())
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # until it stops itself after three shards
    assert os.WIFSTOPPED(status), f"the pack ended (status {status:#x}) before recording a fourth shard"
    proc.send_signal(signal.SIGKILL)  # kill -9 mid-pack
    proc.wait()
    assert not os.path.exists(os.path.join(dest, "manifest.json"))
    with pytest.raises(ObjectNotFoundError, match="run the same"):
        datapipe.open_dataset(dest)
    r = datapipe.pack(corpus, dest, shard_bytes=48 * 1024, workers=1)
    assert r.resumed_shards == 3  # exactly the shards recorded before the kill
    assert _all_samples(dest) == read_corpus(corpus)
    assert datapipe.verify_dataset(dest).ok
    assert not [f for f in os.listdir(dest) if f.startswith(".tmp-")]


def test_second_shard_writer_on_one_destination_is_refused(tmp_path):
    """Two ShardWriters on one destination both reported success, and the dataset held only
    the one that closed last. The first holds the destination until it closes or aborts."""
    from datapipe.errors import DestinationBusyError

    dest = str(tmp_path / "ds")
    a = datapipe.ShardWriter(dest)
    a.write({"__key__": "a1", "txt": "A"})
    with pytest.raises(DestinationBusyError, match="another pack is writing"):
        datapipe.ShardWriter(dest)
    a.close()
    assert [s["__key__"] for s in datapipe.open_dataset(dest)] == ["a1"]
    assert sorted(os.listdir(dest)) == ["manifest.json", "samples.parquet", "shard-000000.tar", "shards.parquet"]
    b = datapipe.ShardWriter(str(tmp_path / "other"))
    b.abort()  # an aborted writer gives its destination up too
    with datapipe.ShardWriter(str(tmp_path / "other")) as c:
        c.write({"__key__": "c1", "txt": "C"})
    assert datapipe.verify_dataset(str(tmp_path / "other")).ok


def test_pack_without_progress_leaves_no_thread_behind(tmp_path):
    """A thread left behind (tqdm's monitor) would make the next pack pick forkserver. In a
    fresh interpreter: a test before this one may have started tqdm's monitor here."""
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"s{i}.bin").write_bytes(b"x" * 10)
    code = (
        "import threading, datapipe\n"
        f"datapipe.pack({str(src)!r}, {str(tmp_path / 'ds')!r}, workers=2)\n"
        f"datapipe.verify_dataset({str(tmp_path / 'ds')!r})\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['MainThread']"


def test_files_at_the_names_a_pack_writes_are_not_replaced_unasked(tmp_path):
    # no dataset and no journal of a pack: a shard-like file there is someone's
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"s{i}.txt").write_bytes(b"%d" % i)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "shard-000000.tar").write_bytes(b"my own file")
    (dest / ".tmp-x").write_bytes(b"also mine")
    with pytest.raises(DestinationExistsError, match=r"shard-000000\.tar"):
        datapipe.pack(str(src), str(dest))
    assert (dest / "shard-000000.tar").read_bytes() == b"my own file"
    r = datapipe.pack(str(src), str(dest), overwrite=True)  # asked: replaced
    assert r.samples == 3 and (dest / ".tmp-x").read_bytes() == b"also mine"
    assert sorted(s["__key__"] for s in datapipe.open_dataset(str(dest))) == ["s0", "s1", "s2"]


@pytest.mark.parametrize("name", ["c..d", "h..json"])
def test_a_file_whose_field_cannot_be_stored_is_skipped_or_named_when_listed(tmp_path, name):
    from datapipe.errors import InvalidMemberNameError

    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"s{i}.txt").write_bytes(b"ok")
    (src / name).write_bytes(b"bad")
    r = datapipe.pack(str(src), str(tmp_path / "a"), skip_errors=True)
    assert r.samples == 2 and [os.path.basename(p) for p, _why in r.skipped] == [name]
    with pytest.raises(InvalidMemberNameError, match=name.replace(".", r"\.")):
        datapipe.pack(str(src), str(tmp_path / "b"))
    assert not (tmp_path / "b" / "_pack").exists()  # refused while listing: nothing left behind
