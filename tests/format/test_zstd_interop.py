"""Our zstd shards in other readers. Python's tarfile (before 3.14), and so the webdataset
library, cannot open ``.tar.zst``; decompressed on the fly (``pipe:zstd -dc``, or the
zstandard package where the CLI is missing) they read as the plain shards do, and the
decompressed bytes are a tar GNU tar lists. Ray Data's ``read_webdataset`` opens files
through a pyarrow input stream whose codec it infers from the extension; that mechanism is
tested here (Ray itself is not installed)."""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import tarfile

import pytest

import datapipe

N = 23


def _files():
    """relative path -> bytes: three fields per sample, in two folders."""
    out = {}
    for i in range(N):
        key = f"d{i // 10}/s{i:03d}"
        out[f"{key}.txt"] = f"caption {i}".encode()
        out[f"{key}.json"] = b'{"i": %d}' % i
        out[f"{key}.bin"] = bytes((i * 7 + j) % 256 for j in range(i * 97 % 3000))
    return out


@pytest.fixture(scope="module")
def zstd_dataset(tmp_path_factory):
    src = tmp_path_factory.mktemp("zsrc")
    for rel, data in _files().items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    dest = str(tmp_path_factory.mktemp("zds") / "ds")
    datapipe.pack(str(src), dest, compression="zstd", shard_samples=7, workers=1)
    shards = sorted(glob.glob(os.path.join(dest, "*.tar.zst")))
    assert len(shards) == -(-N // 7)
    return dest, shards


def _ours(dest):
    return {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
            for s in datapipe.open_dataset(dest)}


def _pipe_commands():
    """How to decompress a shard to stdout: the zstd CLI where it is installed, and always the
    zstandard package (a dependency of datapipe) for machines without it."""
    script = ("import sys, zstandard; "
              "zstandard.ZstdDecompressor().copy_stream(open(sys.argv[1], 'rb'), sys.stdout.buffer)")
    python = f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    cli = pytest.param("zstd -dc", marks=pytest.mark.skipif(shutil.which("zstd") is None,
                                                              reason="the zstd command is not installed"))
    return [cli, python]


@pytest.mark.parametrize("decompress", _pipe_commands(), ids=["zstd-cli", "python-zstandard"])
def test_webdataset_reads_zstd_shards_through_a_pipe(zstd_dataset, decompress):
    import webdataset as wds

    dest, shards = zstd_dataset
    urls = [f"pipe:{decompress} {shlex.quote(p)}" for p in shards]
    theirs = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")}
              for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)}
    assert theirs == _ours(dest) and len(theirs) == N


def test_webdataset_cannot_open_them_directly(zstd_dataset):
    """Why the pipe is needed (Python < 3.14): the plain URL is not a tar to tarfile."""
    import webdataset as wds

    if sys.version_info >= (3, 14):
        pytest.skip("tarfile reads zstd from Python 3.14 on")
    _, shards = zstd_dataset
    with pytest.raises(Exception):  # noqa: B017 - whatever webdataset raises, it is not a sample
        list(wds.WebDataset(shards[:1], shardshuffle=False, empty_check=False))


@pytest.mark.skipif(shutil.which("zstd") is None or shutil.which("tar") is None, reason="needs zstd and tar")
def test_zstd_d_gives_a_tar_that_gnu_tar_lists(zstd_dataset, tmp_path):
    _, shards = zstd_dataset
    plain = tmp_path / "shard-000000.tar"
    subprocess.run(["zstd", "-d", "-q", shards[0], "-o", str(plain)], check=True)
    listed = subprocess.run(["tar", "tf", str(plain)], capture_output=True, text=True, check=True).stdout.split()
    with tarfile.open(plain) as t:
        assert listed == t.getnames()
    assert listed[:3] == ["d0/s000.bin", "d0/s000.json", "d0/s000.txt"]


def test_a_pyarrow_zstd_input_stream_reads_them_as_ray_does(zstd_dataset):
    """Ray Data's FileBasedDatasource opens a path with ``compression`` from
    ``pyarrow.Codec.detect(path)`` and its webdataset reader streams the result through
    ``tarfile.open(fileobj=..., mode="r|*")``: the same two steps here."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    dest, shards = zstd_dataset
    ours = _ours(dest)
    got: dict[str, dict[str, bytes]] = {}
    for path in shards:
        assert pa.Codec.detect(path).name == "zstd"
        with pafs.LocalFileSystem().open_input_stream(path, compression=pa.Codec.detect(path).name) as f, \
                tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                key, _, field = member.name.partition(".")
                got.setdefault(key, {})[field] = tar.extractfile(member).read()
    assert got == ours
