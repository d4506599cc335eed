"""Bad input gets a named error, and nothing half-done reads as a dataset."""

import json
import os

import pytest

import datapipe
from datapipe.cli import main
from datapipe.errors import (
    DestinationExistsError,
    DuplicateKeyError,
    EmptyInputError,
    InputFileError,
    InvalidMemberNameError,
    ObjectNotFoundError,
    PackError,
    PackOptionError,
)


def _write(root, rel, data=b"x"):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_empty_input(tmp_path):
    (tmp_path / "src").mkdir()
    _write(str(tmp_path / "src"), "README")  # no key.field shape: ignored, so still empty
    with pytest.raises(EmptyInputError, match="no sample"):
        datapipe.pack(str(tmp_path / "src"), str(tmp_path / "ds"))
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_empty_table(tmp_path):
    (tmp_path / "t.jsonl").write_text("\n\n")
    with pytest.raises(EmptyInputError, match="no rows"):
        datapipe.pack(str(tmp_path / "t.jsonl"), str(tmp_path / "ds"))


def test_missing_source(tmp_path):
    with pytest.raises(InputFileError, match="does not exist"):
        datapipe.pack(str(tmp_path / "nope.jsonl"), str(tmp_path / "ds"))


def test_vanished_file_is_named_or_skipped(tmp_path):
    src = str(tmp_path / "src")
    _write(src, "a.txt", b"a")
    _write(src, "b.txt", b"b")
    os.symlink(os.path.join(src, "gone"), os.path.join(src, "c.txt"))  # a file that vanished
    with pytest.raises(InputFileError, match=r"c\.txt.*--skip-errors"):
        datapipe.pack(src, str(tmp_path / "ds"))
    r = datapipe.pack(src, str(tmp_path / "ds"), skip_errors=True)
    assert r.samples == 2
    assert [p for p, _ in r.skipped] == [os.path.join(src, "c.txt")]
    assert "SKIPPED 1" in r.summary() and "c.txt" in r.summary()


def test_unstorable_file_name(tmp_path):
    src = str(tmp_path / "src")
    _write(src, "ok.txt")
    with open(os.path.join(src.encode(), b"bad\xff.txt"), "wb") as f:
        f.write(b"x")
    with pytest.raises(InvalidMemberNameError, match="UTF-8"):
        datapipe.pack(src, str(tmp_path / "ds"))
    assert datapipe.pack(src, str(tmp_path / "ds"), skip_errors=True).samples == 1


def test_duplicate_keys(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text(json.dumps({"__key__": "a", "txt": "1"}) + "\n" + json.dumps({"__key__": "a", "txt": "2"}) + "\n")
    with pytest.raises(DuplicateKeyError, match="'a'"):
        datapipe.pack(str(jl), str(tmp_path / "ds"))
    with pytest.raises(DuplicateKeyError):
        with datapipe.ShardWriter(str(tmp_path / "w")) as w:
            w.write({"__key__": "k", "txt": b"1"})
            w.write({"__key__": "k", "txt": b"2"})
    with pytest.raises(ObjectNotFoundError):  # the aborted writer committed nothing
        datapipe.open_dataset(str(tmp_path / "w"))


def test_sample_larger_than_shard(tmp_path):
    # webdataset's convention, not an error: the sample gets a shard of its own (the
    # whole behaviour is in tests/packing/test_oversized.py)
    src = str(tmp_path / "src")
    _write(src, "small.bin", b"x" * 100)
    _write(src, "huge.bin", b"x" * 20000)
    r = datapipe.pack(src, str(tmp_path / "ds"), shard_bytes=8192)
    assert r.shards == 2 and r.oversized == 1 and r.oversized_examples[0][0] == "huge"
    with datapipe.ShardWriter(str(tmp_path / "w"), max_bytes=8192) as w:
        w.write({"__key__": "huge", "bin": b"x" * 20000})
    assert [k for k, _ in w.oversized] == ["huge"]


def test_existing_destination_needs_overwrite(tmp_path):
    src = str(tmp_path / "src")
    _write(src, "a.txt", b"a")
    datapipe.pack(src, str(tmp_path / "ds"))
    with pytest.raises(DestinationExistsError, match="--overwrite"):
        datapipe.pack(src, str(tmp_path / "ds"))
    _write(src, "b.txt", b"b")
    assert datapipe.pack(src, str(tmp_path / "ds"), overwrite=True).samples == 2
    assert len(datapipe.open_dataset(str(tmp_path / "ds"))) == 2


def test_unfinished_pack_of_other_input_is_refused(tmp_path):
    src = str(tmp_path / "src")
    _write(src, "a.txt", b"a")
    dest = tmp_path / "ds"
    (dest / "_pack").mkdir(parents=True)
    (dest / "_pack" / "plan.json").write_text(json.dumps({"fingerprint": "other"}))
    with pytest.raises(DestinationExistsError, match="unfinished"):
        datapipe.pack(src, str(dest))
    assert datapipe.pack(src, str(dest), overwrite=True).samples == 1


def test_cli_verify_names_shard_and_sample(tmp_path, capsys):
    dest = str(tmp_path / "ds")
    with datapipe.ShardWriter(dest, max_bytes=16384) as w:
        for i in range(20):
            w.write({"__key__": f"s{i:02d}", "bin": bytes([i]) * 3000})
    assert main(["verify", dest, "-q"]) == 0
    ix = datapipe.open_index(dest)
    t = ix.shard_samples(1)
    victim = ix.shards[1].url
    with open(victim, "r+b") as f:  # flip one byte inside the second sample of shard 1
        f.seek(int(t.offsets[1]) + 700)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    capsys.readouterr()
    assert main(["verify", dest, "-q"]) == 1
    err = capsys.readouterr().err
    assert victim in err and repr(t.keys[1]) in err
    # shard checksum and sample checksum: --all reports both
    assert main(["verify", dest, "-q", "--all"]) == 1
    assert "2 problem(s)" in capsys.readouterr().err
    with pytest.raises(datapipe.errors.ChecksumError, match=t.keys[1]):
        datapipe.open_dataset(dest).get(t.keys[1])


def test_cli_truncated_shard(tmp_path, capsys):
    dest = str(tmp_path / "ds")
    with datapipe.ShardWriter(dest) as w:
        for i in range(5):
            w.write({"__key__": f"s{i}", "bin": b"z" * 5000})
    path = datapipe.open_index(dest).shards[0].url
    os.truncate(path, os.path.getsize(path) - 3000)
    assert main(["verify", dest, "-q"]) == 1
    assert "truncated" in capsys.readouterr().err


def test_cli_pack_inspect_and_errors(tmp_path, capsys):
    src = str(tmp_path / "src")
    for i in range(10):
        _write(src, f"d.v1/k{i}.txt", b"t%d" % i)
        _write(src, f"d.v1/k{i}.cls", b"%d" % i)
    dest = str(tmp_path / "ds")
    assert main(["pack", src, dest, "-q", "--shard-bytes", "4K", "--compression", "zstd"]) == 0
    assert "packed 10 samples" in capsys.readouterr().out
    assert main(["inspect", dest, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] == 10 and info["compression"] == "zstd" and info["fields"] == ["cls", "txt"]
    assert main(["pack", src, dest, "-q"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def test_damaged_index_is_detected(tmp_path, capsys):
    dest = tmp_path / "ds"
    with datapipe.ShardWriter(str(dest), max_bytes=16384) as w:
        for i in range(20):
            w.write({"__key__": f"s{i:02d}", "bin": bytes([i]) * 3000})
    manifest = json.loads((dest / "manifest.json").read_text())
    assert set(manifest["index_checksums"]) == {"shards.parquet", "samples.parquet"}
    # a samples.parquet replaced by another valid one (another dataset's) no longer matches
    other = tmp_path / "other"
    with datapipe.ShardWriter(str(other), max_bytes=16384) as w:
        for i in range(20):
            w.write({"__key__": f"t{i:02d}", "bin": bytes([i]) * 2000})
    (dest / "samples.parquet").write_bytes((other / "samples.parquet").read_bytes())
    assert main(["verify", str(dest), "-q"]) == 1
    assert "samples.parquet" in capsys.readouterr().err
    # a damaged shard table fails at open
    data = bytearray((dest / "shards.parquet").read_bytes())
    data[len(data) // 2] ^= 1
    (dest / "shards.parquet").write_bytes(bytes(data))
    with pytest.raises(datapipe.errors.ChecksumError, match=r"shards\.parquet"):
        datapipe.open_index(str(dest))


def test_overwrite_deletes_only_what_pack_wrote(tmp_path):
    dest = tmp_path / "ds"
    src = dest / "inputs"  # a source that lives inside the destination
    _write(str(src), "a.txt", b"a")
    _write(str(dest), "notes.md", b"keep me")
    datapipe.pack(str(src), str(dest))
    assert datapipe.pack(str(src), str(dest), overwrite=True).samples == 1
    assert (src / "a.txt").read_bytes() == b"a" and (dest / "notes.md").read_bytes() == b"keep me"


def test_cli_names_an_os_error_without_traceback(tmp_path, capsys):
    _write(str(tmp_path / "src"), "a.txt", b"a")
    assert main(["pack", str(tmp_path / "src"), "/proc/no-such-dir/ds", "-q"]) == 2
    err = capsys.readouterr().err
    assert "/proc/no-such-dir" in err and "Traceback" not in err


def test_bad_arguments_raise_one_error_class_everywhere(tmp_path):
    # pack() and ShardWriter check the same arguments with the same error, which is both a
    # PackError and (Python's convention for a bad argument) a ValueError
    src = str(tmp_path / "src")
    _write(src, "a.bin", b"x")
    for call in (lambda: datapipe.pack(src, str(tmp_path / "p"), compression="lz4"),
                 lambda: datapipe.ShardWriter(str(tmp_path / "w"), compression="lz4"),
                 lambda: datapipe.ShardWriter(str(tmp_path / "w"), max_samples=0),
                 lambda: datapipe.pack(src, str(tmp_path / "p"), part="3/2")):
        with pytest.raises(PackOptionError) as info:
            call()
        assert isinstance(info.value, PackError) and isinstance(info.value, ValueError)
