"""What `datapipe index` may replace at its destination: index files it wrote (a commit that
stopped before its manifest leaves them beside records of the same shards), never a user's
``samples.parquet``/``shards.parquet``, even beside ``_index/`` records of other shards."""

from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.cli import main
from datapipe.errors import DestinationExistsError


def _shards(folder, n: int = 2) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(n):
        path = folder / f"shard-{k:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
            for i in range(3):
                data = f"sample {k}-{i}".encode()
                info = tarfile.TarInfo(f"s{k}{i}.txt")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def _users_table(dest) -> bytes:
    dest.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample": ["the user's own"], "score": [0.5]}), dest / "samples.parquet")
    return (dest / "samples.parquet").read_bytes()


def _foreign_records(dest) -> None:
    """``_index/`` records of shards this run does not index (another list's)."""
    (dest / "_index").mkdir()
    record = {"url": "/elsewhere/shard-000099.tar", "bytes": 10240, "version": "1", "checksum": "xxh3:0",
              "samples": {"keys": [], "offsets": [], "lengths": [], "checksums": []}, "fields": [],
              "passed_over": 0}
    (dest / "_index" / "records-0123456789abcdef-000000.jsonl").write_text(json.dumps(record) + "\n")
    (dest / "_index" / "records-fedcba9876543210-000000.jsonl").write_text("")


def test_records_of_other_shards_do_not_make_a_users_samples_parquet_ours(tmp_path):
    shards = _shards(tmp_path / "shards")
    dest = tmp_path / "dest"
    before = _users_table(dest)
    _foreign_records(dest)
    with pytest.raises(DestinationExistsError, match=r"dest/samples\.parquet exists and is not part of an index"):
        datapipe.index_shards(shards, str(dest), workers=1)
    assert (dest / "samples.parquet").read_bytes() == before
    assert not (dest / "manifest.json").exists() and not (dest / "shards.parquet").exists()


def test_the_cli_index_to_refuses_it_too(tmp_path, capsys):
    shards = _shards(tmp_path / "shards")
    dest = tmp_path / "dest"
    before = _users_table(dest)
    _foreign_records(dest)
    assert main(["index", *shards, "--index-to", str(dest), "--quiet"]) != 0
    assert "is not part of an index we wrote" in capsys.readouterr().err
    assert (dest / "samples.parquet").read_bytes() == before


def test_a_commit_that_stopped_before_its_manifest_is_finished(tmp_path):
    """Records of these shards beside the index files: a run of ours wrote them, and the
    same command finishes the index (a user's table beside no record is still refused)."""
    shards = _shards(tmp_path / "shards")
    dest = tmp_path / "dest"
    datapipe.index_shards(shards, str(dest), workers=1)
    (dest / "manifest.json").unlink()  # as a commit stopped between its index files and its manifest
    datapipe.index_shards(shards, str(dest), workers=1)
    ds = datapipe.open_dataset(str(dest))
    assert sorted(ds[i]["__key__"] for i in range(len(ds))) == [f"s{k}{i}" for k in range(2) for i in range(3)]
    # the same folder, its records gone: the files are no longer known to be ours
    (dest / "manifest.json").unlink()
    for f in (dest / "_index").iterdir():
        f.unlink()
    with pytest.raises(DestinationExistsError, match="is not part of an index we wrote"):
        datapipe.index_shards(shards, str(dest), workers=1)
