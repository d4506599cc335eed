"""Smoke run of the packing benchmark (benchmarks/bench_pack.py) on a tiny corpus: every
system, the floor included, runs with the same number of processes and packs every sample.
Real packers in real processes; no timing is asserted."""

from __future__ import annotations

import pytest

from benchmarks import bench_pack, tables

pytest.importorskip("litdata")


def test_every_system_gets_the_same_processes(tmp_path) -> None:
    cfg = bench_pack.PackBenchConfig(samples=240, quick=True, repeats=1, workers=2, shard_mb=0.5, workdir=str(tmp_path),
                                     systems=("floor-np", "floor-np-plain", "floor-np-write", "datapipe", "webdataset",
                                              "mds", "litdata"), cache="warm")
    r = bench_pack.run(cfg)
    assert r["config"]["workers"] == 2 and r["floor_system"] == "floor-np"
    rows = {row["system"]: row for row in r["rows"]}
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        assert row["complete"], name
        assert row["processes"] == 2, (name, row["processes"])
    assert rows["litdata"]["settings"]["num_workers"] == 2
    assert rows["mds"]["settings"]["merge_index"] is True
    assert rows["floor-np"]["ratio_to_floor"] == 1.0
    md = tables.pack_md(r)
    assert "2 processes for every system" in md
