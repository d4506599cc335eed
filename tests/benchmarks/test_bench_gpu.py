"""Smoke run of benchmarks/bench_gpu.py (loader batches into device memory by worker count)
on a tiny corpus. Without CUDA the copies go to the CPU and the target is NOT MEASURED; the
test asserts the JSON shape and that every worker count delivered every sample exactly once."""

from __future__ import annotations

from benchmarks import bench_gpu, tables


def test_gpu_bench_smoke(tmp_path) -> None:
    r = bench_gpu.run(dict(bench_gpu.QUICK, workers=[0, 2], workdir=str(tmp_path)))
    assert r["samples"] == bench_gpu.QUICK["samples"]
    assert r["floor"]["GB_per_s"] > 0 and r["floor"]["bytes"] >= r["payload_MB"] * 1e6
    for w in ("0", "2"):
        run = r["runs"][w]
        assert "error" not in run, run
        assert all(e["exactly_once"] for e in run["epochs"])
        # every byte of every field reached the device
        assert run["epochs"][0]["bytes_to_device"] == round(r["payload_MB"] * 1e6)
        assert run["GB_per_s"] > 0 and run["path"]
    if r["device"] == "cpu":
        assert "target" not in r or r["target"]["status"] == "NOT MEASURED"
    md = tables.gpu_md(r)
    assert "GB/s into device memory" in md and "Floor" in md
