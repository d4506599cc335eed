"""benchmarks/bench_health.py runs end to end at a small size and prints every figure."""

import json

from benchmarks import bench_health


def test_bench_health_small(tmp_path, capsys):
    out = tmp_path / "r.json"
    bench_health.main(["--ranks", "3000", "--samples", "512", "--workdir", str(tmp_path), "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["detector"]["named_exactly_the_slowed"] and result["detector"]["data_cause_names_the_tier"]
    for key in ("floor_ns", "read_ns", "step_ns", "export_us", "merge_us"):
        assert result["records"][key] > 0
    assert result["batch"]["batch_s"] > 0 and result["batch"]["read_floor_batch_s"] > 0
    assert result["publish"]["file_board_ms_median"] > 0 and result["publish"]["tcpstore_board_ms_median"] > 0
