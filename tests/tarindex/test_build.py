"""`datapipe index` and tar shards given to the readers: shards written by webdataset's
ShardWriter and by GNU tar, read back byte-exact through open_dataset and StreamingDataset,
locally and from moto S3 with the index under another prefix; resume, damage, reruns,
--part, brace patterns, the pack refusal; hostile tar bytes (hypothesis)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datapipe
from benchmarks.fuzz_reader import deadline
from datapipe import StreamingDataset, TieredCache, index_shards, open_dataset, verify_dataset
from datapipe.cli import main
from datapipe.dataset import open_index
from datapipe.errors import CorruptShardError, DatapipeError, ObjectNotFoundError, PackError, PackOptionError
from datapipe.format import MANIFEST
from datapipe.format.tar import split_member_name, walk_members
from datapipe.tarindex import expand_braces, expand_urls

N = 57


def _reference(paths: list[str]) -> dict[str, dict[str, bytes]]:
    """What Python's tarfile (an independent reader) finds in the shards, by WebDataset's key rule."""
    out: dict[str, dict[str, bytes]] = {}
    for p in paths:
        with tarfile.open(p) as t:
            for m in t.getmembers():
                cut = split_member_name(m.name) if m.isfile() else None
                if cut is not None:
                    f = t.extractfile(m)
                    assert f is not None
                    out.setdefault(cut[0], {})[cut[1]] = f.read()
    return out


def _as_dict(samples) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for s in samples:
        assert s["__key__"] not in out, f"{s['__key__']} delivered twice"
        out[s["__key__"]] = {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
    return out


@pytest.fixture
def wds_dir(tmp_path) -> Path:
    """Shards written by webdataset.ShardWriter: 57 samples, 10 per shard."""
    src = tmp_path / "wds"
    src.mkdir()
    with wds.ShardWriter(str(src / "shard-%06d.tar"), maxcount=10, verbose=0) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "jpg": os.urandom(50 + 37 * i), "txt": f"caption {i}".encode(),
                     "json": json.dumps({"i": i}).encode()})
    return src


@pytest.fixture
def gnu_dir(tmp_path) -> tuple[Path, dict[str, dict[str, bytes]]]:
    """Shards written by GNU tar from files on disk: one listing files, one a folder (its
    directory members lie between samples), one with a name longer than 100 bytes."""
    files = tmp_path / "files"
    expect: dict[str, dict[str, bytes]] = {}
    for i in range(12):
        d = files / ("sub" if i >= 8 else "") / ("x" * 120 if i == 11 else "")
        d.mkdir(parents=True, exist_ok=True)
        for field, data in (("png", os.urandom(10 + 300 * i)), ("cls", str(i).encode())):
            (d / f"{i:03d}.{field}").write_bytes(data)
            key = str((d / f"{i:03d}").relative_to(files))
            expect.setdefault(key, {})[field] = data
    out = tmp_path / "gnu"
    out.mkdir()
    flat = sorted(p.name for p in files.iterdir() if p.is_file())
    subprocess.run(["tar", "-cf", str(out / "a-000.tar"), "-C", str(files), *flat[:8]], check=True)
    subprocess.run(["tar", "-cf", str(out / "a-001.tar"), "-C", str(files), *flat[8:]], check=True)
    subprocess.run(["tar", "--sort=name", "-cf", str(out / "a-002.tar"), "-C", str(files), "sub"], check=True)
    return out, expect


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "user-cache"))


def test_webdataset_shards_in_place_byte_exact(wds_dir):
    shards = sorted(str(p) for p in wds_dir.glob("*.tar"))
    r = index_shards(str(wds_dir), workers=2)
    assert (r.shards, r.samples, r.committed) == (len(shards), N, True)
    expect = _reference(shards)
    assert len(expect) == N
    ds = open_dataset(str(wds_dir))
    assert _as_dict(ds) == expect
    assert _as_dict(StreamingDataset(str(wds_dir), seed=3, window=2, decode=None)) == expect
    assert verify_dataset(str(wds_dir)).ok


def test_gnu_tar_index_elsewhere_leaves_source_alone(gnu_dir, tmp_path):
    src, expect = gnu_dir
    before = sorted(os.listdir(src))
    dest = tmp_path / "index"
    r = index_shards(str(src / "a-{000..002}.tar"), str(dest))
    assert sorted(os.listdir(src)) == before  # nothing written beside the shards
    assert r.samples == len(expect) and r.passed_over >= 1  # the "sub/" directory member
    assert _as_dict(open_dataset(str(dest))) == expect
    assert _as_dict(StreamingDataset(str(dest), seed=1, decode=None)) == expect
    # the shard table names the shards where they are
    assert [s.url for s in open_index(str(dest)).shards] == [str(src / f"a-00{i}.tar") for i in range(3)]
    assert verify_dataset(str(dest)).ok


def test_shard_urls_indexed_on_first_use_and_cached(wds_dir, tmp_path):
    shards = sorted(str(p) for p in wds_dir.glob("*.tar"))
    expect = _reference(shards)
    cache = TieredCache(hot_bytes=0, warm_dir=str(tmp_path / "warm"), warm_bytes=64 << 20)
    ds = StreamingDataset(shards, cache=cache, seed=0, decode=None)
    assert _as_dict(ds) == expect
    made = os.listdir(tmp_path / "warm" / "tar-index")
    assert len(made) == 1
    # the same list again finds that index; a brace pattern of the same shards too
    StreamingDataset(shards, cache=cache)
    StreamingDataset(str(wds_dir / "shard-{000000..000005}.tar"), cache=cache)
    assert os.listdir(tmp_path / "warm" / "tar-index") == made
    # without a cache: the per-user cache dir; a changed shard gets a new index
    assert _as_dict(open_dataset(str(wds_dir / "shard-*.tar"))) == expect
    assert len(os.listdir(tmp_path / "user-cache" / "tar-index")) == 1
    first_data = next(walk_members(Path(shards[0]).read_bytes(), "x"))[1]
    with open(shards[0], "r+b") as f:
        old = f.read(first_data + 1)[-1:]
        f.seek(first_data)  # the first byte of the first member's data
        f.write(b"\xff" if old != b"\xff" else b"\0")
    assert _as_dict(open_dataset(shards)) == _reference(shards) != expect
    assert len(os.listdir(tmp_path / "user-cache" / "tar-index")) == 2


def test_resume_over_indexed_tars(wds_dir):
    index_shards(str(wds_dir))
    full = [s["__key__"] for s in StreamingDataset(str(wds_dir), window=2, seed=5, batch_size=4)]
    ds = StreamingDataset(str(wds_dir), window=2, seed=5, batch_size=4)
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(21)]
    state = ds.state_dict()
    it.close()
    again = StreamingDataset(str(wds_dir), window=2, seed=5, batch_size=4)
    again.load_state_dict(state)
    assert first + [s["__key__"] for s in again] == full
    assert sorted(full) == sorted(f"s{i:04d}" for i in range(N))


def test_s3_shards_with_index_under_another_prefix(s3, wds_dir, tmp_path):
    import fsspec

    root, opts = s3
    fs = fsspec.filesystem("s3", **opts)
    names = sorted(p.name for p in wds_dir.glob("*.tar"))
    for n in names:
        fs.put(str(wds_dir / n), f"{root}/shards/{n}".split("://", 1)[1])
    expect = _reference([str(wds_dir / n) for n in names])
    r = index_shards(f"{root}/shards/shard-{{000000..{len(names) - 1:06d}}}.tar", f"{root}/index",
                     storage_options=opts, workers=2)
    assert r.samples == N
    assert not [k for k in fs.find(f"{root}/shards".split("://", 1)[1]) if not k.endswith(".tar")]
    assert _as_dict(open_dataset(f"{root}/index", storage_options=opts)) == expect
    assert _as_dict(StreamingDataset(f"{root}/index", storage_options=opts, seed=2, decode=None)) == expect
    # shard URLs straight to the loader, through a warm cache (the index lands in its warm dir)
    cache = TieredCache(hot_bytes=0, warm_dir=str(tmp_path / "warm"), warm_bytes=64 << 20, storage_options=opts)
    urls = [f"{root}/shards/{n}" for n in names]
    assert _as_dict(StreamingDataset(urls, cache=cache, storage_options=opts, decode=None)) == expect
    assert os.listdir(tmp_path / "warm" / "tar-index")


def _copy_shards(wds_dir, tmp_path) -> list[str]:
    dst = tmp_path / "copy"
    shutil.copytree(wds_dir, dst)
    return sorted(str(p) for p in dst.glob("*.tar"))


def test_truncated_shard_is_named_and_nothing_committed(wds_dir, tmp_path):
    shards = _copy_shards(wds_dir, tmp_path)
    size = os.path.getsize(shards[2])
    os.truncate(shards[2], size // 2 + 100)
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar.*byte \d+"):
        index_shards(shards, str(tmp_path / "ix"), workers=1)
    assert not (tmp_path / "ix" / MANIFEST).exists()
    # cut at a member boundary: no end-of-archive blocks
    with open(shards[2], "rb") as f:
        data = f.read()
    members = list(walk_members(data[: size // 2 + 100 - (size // 2 + 100) % 512], "x"))
    os.truncate(shards[2], members[1][3])
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar.*truncated"):
        index_shards(shards, str(tmp_path / "ix"), workers=1)


def test_flipped_header_byte_is_named(wds_dir, tmp_path):
    shards = _copy_shards(wds_dir, tmp_path)
    with open(shards[1], "rb") as f:
        data = bytearray(f.read())
    at = list(walk_members(bytes(data), "x"))[2][3]  # the third member's header
    data[at + 5] ^= 0x40
    Path(shards[1]).write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=rf"shard-000001\.tar: tar header checksum mismatch at byte {at}"):
        index_shards(shards, str(tmp_path / "ix"))
    assert not (tmp_path / "ix" / MANIFEST).exists()


def test_rerun_skips_shards_already_indexed(wds_dir, tmp_path):
    shards = _copy_shards(wds_dir, tmp_path)
    good = Path(shards[3]).read_bytes()
    Path(shards[3]).write_bytes(good[:700])
    dest = str(tmp_path / "ix")
    with pytest.raises(CorruptShardError):
        index_shards(shards, dest, workers=1)
    Path(shards[3]).write_bytes(good)  # repaired: the rerun reads it and those after it only
    r = index_shards(shards, dest, workers=1)
    assert (r.indexed_shards, r.reused_shards) == (len(shards) - 3, 3)
    mtime = os.stat(os.path.join(dest, MANIFEST)).st_mtime_ns
    r = index_shards(shards, dest)
    assert (r.indexed_shards, r.reused_shards, r.samples) == (0, len(shards), N)
    assert os.stat(os.path.join(dest, MANIFEST)).st_mtime_ns == mtime  # the same index is left as it is
    # a shard added later: only it is read
    extra = tmp_path / "extra.tar"
    with wds.TarWriter(str(extra)) as w:
        w.write({"__key__": "late", "txt": b"late"})
    r = index_shards([*shards, str(extra)], dest)
    assert (r.indexed_shards, r.samples) == (1, N + 1)
    assert open_dataset(dest).get("late")["txt"] == b"late"


def test_parts_then_commit(wds_dir, tmp_path):
    dest = str(tmp_path / "ix")
    pattern = str(wds_dir / "shard-{000000..000005}.tar")
    a = index_shards(pattern, dest, part="0/2")
    b = index_shards(pattern, dest, part=(1, 2))
    assert not a.committed and not b.committed and a.indexed_shards + b.indexed_shards == 6
    assert not os.path.exists(os.path.join(dest, MANIFEST))
    r = index_shards(pattern, dest)
    assert (r.indexed_shards, r.reused_shards, r.samples) == (0, 6, N)
    with pytest.raises(PackOptionError):
        index_shards(pattern, dest, part="2/2")


def test_brace_and_glob_expansion(tmp_path):
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}-{8..10}.tar") == ["a-8.tar", "a-9.tar", "a-10.tar", "b-8.tar", "b-9.tar", "b-10.tar"]
    assert expand_braces("x{1,{2..3}}") == ["x1", "x2", "x3"]
    assert expand_braces("x{y}") == ["x{y}"]
    with pytest.raises(PackOptionError):
        expand_braces("x{1..2")
    for n in ("b.tar", "a.tar", "c.txt"):
        (tmp_path / n).write_bytes(b"")
    assert expand_urls(str(tmp_path / "*.tar")) == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    assert expand_urls(str(tmp_path)) == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    with pytest.raises(ObjectNotFoundError, match="names no shard"):
        expand_urls(str(tmp_path / "*.none.tar"))
    with pytest.raises(PackOptionError, match="named twice"):
        expand_urls([str(tmp_path / "a.tar"), str(tmp_path / "{a,a}.tar")])


@pytest.mark.parametrize("name", ["s.tar.gz", "s.tar.zst"])
def test_whole_file_compressed_tars_are_refused(tmp_path, name):
    (tmp_path / name).write_bytes(b"\0" * 1024)
    with pytest.raises(PackOptionError, match="Decompress it first"):
        index_shards(str(tmp_path / name), str(tmp_path / "ix"))


def test_messages_name_datapipe_index(wds_dir):
    with pytest.raises(ObjectNotFoundError, match="datapipe index") as e:
        open_index(str(wds_dir))
    assert "datapipe pack" not in str(e.value)
    with pytest.raises(ObjectNotFoundError, match=r"is a file, not a dataset folder.*datapipe index"):
        open_index(str(wds_dir / "shard-000000.tar"))
    with pytest.raises(ObjectNotFoundError, match="datapipe index"):
        StreamingDataset(str(wds_dir))


def test_pack_refuses_a_folder_of_tars(wds_dir, tmp_path):
    with pytest.raises(PackError, match="datapipe index"):
        datapipe.pack(str(wds_dir), str(tmp_path / "out"))
    r = datapipe.pack(str(wds_dir), str(tmp_path / "out2"), tars_as_files=True)
    assert r.samples == 6  # each tar one sample, as asked


def test_cli_index_inspect_verify(wds_dir, tmp_path, capsys):
    dest = str(tmp_path / "ix")
    assert main(["index", str(wds_dir / "shard-*.tar"), "--index-to", dest, "--json", "-q", "--workers", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["shards"], out["samples"], out["committed"]) == (6, N, True) and out["read_bytes"] > 0
    assert main(["inspect", dest, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == N
    assert main(["verify", str(wds_dir / "shard-{000000..000005}.tar"), "-q"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["index", str(tmp_path / "none-*.tar"), "-q"]) == 2
    assert "names no shard" in capsys.readouterr().err


# --- hostile tar bytes ----------------------------------------------------------------


def _small_tar() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s.tar")
        with wds.TarWriter(p) as w:
            for i in range(4):
                w.write({"__key__": f"k{i}", "txt": b"t" * (i * 300), "cls": str(i).encode()})
        return Path(p).read_bytes()


def _small_gnu_tar() -> bytes:
    """GNU tar of a folder: directory members, a GNU long name, the 10,240-byte record tail."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src" / "sub"
        (src / ("y" * 110)).mkdir(parents=True)
        for i in range(3):
            (src / f"{i}.txt").write_bytes(b"g" * (i * 200 + 1))
        (src / ("y" * 110) / "long.bin").write_bytes(b"L" * 700)
        out = Path(d) / "s.tar"
        subprocess.run(["tar", "--sort=name", "-cf", str(out), "-C", str(Path(d) / "src"), "sub"], check=True)
        return out.read_bytes()


_BASES = [_small_tar(), _small_gnu_tar()]


def _strict_reading(data: bytes) -> dict[str, dict[str, bytes]]:
    """What the strict parser finds: regular members named key.field, grouped by key."""
    out: dict[str, dict[str, bytes]] = {}
    for name, start, stop, _ in walk_members(data, "ref", directories=True):
        cut = split_member_name(name)
        if cut is not None:
            out.setdefault(cut[0], {})[cut[1]] = data[start:stop]
    return out


@given(data=st.data())
@settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_tars_index_exactly_or_are_refused(tmp_path_factory, data):
    buf = bytearray(data.draw(st.sampled_from(_BASES)))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        at = data.draw(st.integers(0, len(buf) - 1))
        if kind == "flip":
            buf[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            buf[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del buf[at : at + data.draw(st.integers(1, 1024))]
        else:
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=600))
    d = tmp_path_factory.mktemp("fuzz")
    shard = d / "s.tar"
    shard.write_bytes(bytes(buf))
    with deadline(30, "index of a mutated tar"):
        try:
            index_shards(str(shard), str(d / "ix"), workers=1)
        except DatapipeError:
            assert not (d / "ix" / MANIFEST).exists()
            return
        got = _as_dict(open_dataset(str(d / "ix")))
    assert got == _strict_reading(bytes(buf))
    assert verify_dataset(str(d / "ix")).ok


def _keys_of(batch):
    return [s["__key__"] for s in batch]


def test_dataloader_workers_over_shard_urls(wds_dir):
    from datapipe import StreamingDataLoader

    ds = StreamingDataset(str(wds_dir / "shard-{000000..000005}.tar"), seed=4, batch_size=5, decode=None)
    loader = StreamingDataLoader(ds, batch_size=5, num_workers=2, collate_fn=_keys_of)
    got = [k for batch in loader for k in batch]
    assert sorted(got) == sorted(f"s{i:04d}" for i in range(N))


@pytest.mark.parametrize("base", range(len(_BASES)))
def test_unmutated_fuzz_bases_index(tmp_path, base):
    """The hypothesis test starts from tars that index (else it would test refusals only)."""
    shard = tmp_path / "s.tar"
    shard.write_bytes(_BASES[base])
    index_shards(str(shard), str(tmp_path / "ix"))
    got = _as_dict(open_dataset(str(tmp_path / "ix")))
    assert got == _strict_reading(_BASES[base]) and len(got) >= 4


def test_read_only_source_is_indexed_elsewhere(wds_dir, tmp_path, tmpfs):
    from datapipe.errors import StorageError

    fs = tmpfs("16m")
    for p in wds_dir.glob("*.tar"):
        shutil.copy(p, fs.path / p.name)
    fs.remount("ro")
    with pytest.raises(StorageError, match=r"cannot write the index at .*--index-to DEST"):
        index_shards(str(fs.path))
    dest = tmp_path / "ix"
    assert index_shards(str(fs.path), str(dest)).samples == N
    assert _as_dict(open_dataset(str(dest))) == _reference(sorted(str(p) for p in fs.path.glob("*.tar")))


def test_stream_of_tar_shards_mixes_with_a_packed_dataset(wds_dir, tmp_path):
    from datapipe import Stream

    packed = str(tmp_path / "packed")
    with datapipe.ShardWriter(packed) as w:
        for i in range(7):
            w.write({"__key__": f"p{i}", "txt": b"p"})
    ds = StreamingDataset([Stream(str(wds_dir / "shard-*.tar"), repeat=1), Stream(packed, repeat=2)], decode=None)
    keys = [s["__key__"] for s in ds]
    assert len(keys) == N + 14 and {k for k in keys if k.startswith("s")} == {f"s{i:04d}" for i in range(N)}


def test_a_foreign_manifest_beside_the_shards_is_never_deleted(tmp_path):
    import tarfile

    import datapipe
    from datapipe.errors import DestinationExistsError

    folder = tmp_path / "shards"
    folder.mkdir()
    src = tmp_path / "a.txt"
    src.write_bytes(b"hello")
    with tarfile.open(folder / "shard-000000.tar", "w", format=tarfile.USTAR_FORMAT) as t:
        t.add(src, arcname="s0.txt")
    (folder / "manifest.json").write_bytes(b"the user's own notes, not JSON")
    with pytest.raises(DestinationExistsError, match="not a datapipe index"):
        datapipe.index_shards([str(folder / "shard-000000.tar")])
    assert (folder / "manifest.json").read_bytes() == b"the user's own notes, not JSON"


def test_a_key_repeated_across_tar_shards_is_refused_by_get(tmp_path):
    import io
    import tarfile

    import datapipe

    folder = tmp_path / "dup"
    folder.mkdir()
    for n in range(2):
        with tarfile.open(folder / f"shard-{n:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as t:
            for key in ("same", f"only{n}"):
                data = f"{key}-{n}".encode()
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    datapipe.index_shards([str(folder / "shard-000000.tar"), str(folder / "shard-000001.tar")])
    d = datapipe.open_dataset(str(folder))
    assert len(d) == 4 and d.get("only1")["txt"] == b"only1-1"
    with pytest.raises(KeyError, match="more than one sample with key 'same'"):
        d.get("same")


def _header12(name: str, size: int) -> bytes:
    """A ustar header whose size field holds 12 octal digits and no terminator (as
    libarchive and star write large sizes; tarfile and GNU tar read them)."""
    h = bytearray(tarfile.TarInfo(name).tobuf(format=tarfile.USTAR_FORMAT))
    h[124:136] = b"%012o" % size
    h[148:156] = b"        "
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def test_sizes_written_with_twelve_digits_read_whole_on_every_path(tmp_path):
    shard = tmp_path / "shard-000.tar"
    body = b""
    for i in range(3):
        data = bytes([65 + i]) * (100 + i)
        body += _header12(f"s{i}.txt", len(data)) + data + bytes(-len(data) % 512)
    shard.write_bytes(body + bytes(1024))
    want = {f"s{i}": bytes([65 + i]) * (100 + i) for i in range(3)}
    with tarfile.open(shard) as t:  # the reference reader agrees with the file
        assert {m.name[:-4]: t.extractfile(m).read() for m in t.getmembers()} == want
    ix = str(tmp_path / "ix")
    index_shards(str(shard), ix, workers=1)
    assert {s["__key__"]: bytes(s["txt"]) for s in open_dataset(ix)} == want
    for batched in (False, True):  # the laid-out fast paths read the 12th digit too
        ds = StreamingDataset(ix, shuffle=False, decode=None, batched=batched, batch_size=2)
        got = ({k: bytes(v) for b in ds for k, v in zip(b["__key__"], b["txt"])} if batched
               else {s["__key__"]: s["txt"] for s in ds})
        assert got == want


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("version", ["0.0", "1.0"])
def test_gnu_sparse_members_are_refused_at_index_time(tmp_path, version):
    # a sparse member's stored bytes are a map plus the data, not the file: readers that
    # expand it and readers that do not would see other samples
    src = tmp_path / "src" / "dir"
    src.mkdir(parents=True)
    with open(src / "a.bin", "wb") as f:
        f.write(b"HEAD")
        f.seek(1 << 20)
        f.write(b"TAIL")
    (src / "a.txt").write_bytes(b"hi\n")
    shard = tmp_path / "sparse.tar"
    made = subprocess.run(["tar", "--sparse", f"--sparse-version={version}", "--format=pax", "-cf", str(shard),
                           "-C", str(tmp_path / "src"), "dir/a.bin", "dir/a.txt"], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"this tar writes no PAX sparse files: {made.stderr[:200]!r}")
    with pytest.raises(CorruptShardError, match="sparse"):
        index_shards(str(shard), str(tmp_path / "ix"), workers=1)


def test_a_sample_followed_by_a_key_that_extends_it_with_a_folder_reads(tmp_path):
    # foo.txt, then foo.v2/img.txt: two samples (a dot in a folder's name); the check that
    # the index does not cut a sample short must not take the second for part of the first
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in (("foo.txt", b"first sample"), ("foo.v2/img.txt", b"second sample")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    ix = str(tmp_path / "ix")
    index_shards(str(shard), ix, workers=1)
    ds = open_dataset(ix)
    assert [(s["__key__"], bytes(s["txt"])) for s in (ds[0], ds[1])] == [("foo", b"first sample"),
                                                                      ("foo.v2/img", b"second sample")]


@pytest.mark.parametrize("how", ["append", "concatenate"])
def test_a_tar_changed_outside_its_samples_since_indexed_is_said_so(tmp_path, how):
    # its samples still match their own checksums and are read; the change is not silent
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as t:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 4
            t.addfile(info, io.BytesIO(b"%4d" % i))
    ix = str(tmp_path / "ix")
    index_shards(str(shard), ix, workers=1)
    if how == "append":  # as tar -rf does: over the end-of-archive blocks
        with tarfile.open(shard, "a") as t:
            info = tarfile.TarInfo("s3.txt")
            info.size = 4
            t.addfile(info, io.BytesIO(b"   3"))
    else:
        shard.write_bytes(shard.read_bytes() * 2)
    with pytest.warns(RuntimeWarning, match="changed since it was indexed"):
        got = sorted(s["__key__"] for s in StreamingDataset(ix, shuffle=False, decode=None))
    assert got == ["s0", "s1", "s2"]
