"""Smoke run of the packing benchmark (benchmarks/bench_pack.py) on a tiny corpus: every
system, the floor included, runs with the same number of processes and packs every sample;
the floor writes the bytes datapipe's uncompressed shards hold. Real packers in real
processes; no timing is asserted."""

from __future__ import annotations

import os

import pytest

from benchmarks import _pack_peers, bench_pack, tables
from tools.corpus import generate_corpus

pytest.importorskip("litdata")


def test_every_system_gets_the_same_processes(tmp_path) -> None:
    cfg = bench_pack.PackBenchConfig(samples=240, quick=True, repeats=1, workers=2, shard_mb=0.5, workdir=str(tmp_path),
                                     systems=("floor-np-pack", "floor-np", "floor-np-plain", "floor-np-write",
                                              "datapipe", "webdataset", "mds", "litdata"), cache="warm")
    r = bench_pack.run(cfg)
    assert r["config"]["workers"] == 2 and r["floor_system"] == "floor-np-pack"
    rows = {row["system"]: row for row in r["rows"]}
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        assert row["complete"], name
        assert row["processes"] == 2, (name, row["processes"])
    assert rows["litdata"]["settings"]["num_workers"] == 2
    assert rows["mds"]["settings"]["merge_index"] is True
    assert rows["floor-np-pack"]["ratio_to_floor"] == 1.0
    assert r["verdict"]["ratio_to_read_floor"] is not None
    md = tables.pack_md(r)
    assert "2 processes for every system" in md


def test_the_floor_writes_the_bytes_of_the_shards(tmp_path) -> None:
    """The ratio's floor does what a packer must: every input's tar bytes (a 512-byte
    header, the data, the padding), each output file ended as a tar, all fsync'd: as many
    bytes as datapipe's uncompressed shards, give or take the two end blocks of each file."""
    src = str(tmp_path / "src")
    generate_corpus(src, 300, seed=3, mean_bytes=3000, per_dir=100)
    files = [os.path.join(d, n) for d, _, names in os.walk(src) for n in names]
    data = sum(512 + os.path.getsize(p) + -os.path.getsize(p) % 512 for p in files)
    shard_bytes = 256 << 10
    floor = _pack_peers.measure("floor-np-pack", src, str(tmp_path / "floor"), shard_bytes, 2, str(tmp_path))
    outputs = os.listdir(tmp_path / "floor")
    assert floor["processes"] == 2 and floor["files"] == len(files) == 900
    assert len(outputs) > 2  # files cut at the shard limit in each process
    assert floor["out_bytes"] == data + 1024 * len(outputs)
    ours = _pack_peers.measure("datapipe", src, str(tmp_path / "ours"), shard_bytes, 2, str(tmp_path))
    assert ours["out_bytes"] == data + 1024 * ours["shards"]
    assert bench_pack.BASE == "floor-np-pack"


def test_a_run_without_the_pack_floor_says_which_floor_it_divides_by(tmp_path) -> None:
    cfg = bench_pack.PackBenchConfig(samples=120, quick=True, repeats=1, workers=2, shard_mb=0.5, workdir=str(tmp_path),
                                     systems=("floor-1p", "datapipe"), cache="warm")
    r = bench_pack.run(cfg)
    assert r["floor_system"] == "floor-1p"
    assert {row["system"]: row["ratio_to_floor"] for row in r["rows"]}["floor-1p"] == 1.0
    text = bench_pack.format_table(r)
    assert "x floor divides by 'floor: read all files, 1 process', the pack floor not run" in text
