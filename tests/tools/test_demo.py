"""The README's first command, small: the main job runs end to end and proves its resume."""

import json
import subprocess
import sys


def test_demo_end_to_end(tmp_path):
    summary_path = tmp_path / "summary.json"
    out = subprocess.run([sys.executable, "-m", "tools.demo", "--samples", "400", "--workdir", str(tmp_path),
                          "--json", str(summary_path)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["pack"]["samples"] == 400
    assert summary["verify"] == {"ok": True, "shards": summary["pack"]["shards"], "samples": 400}
    assert summary["resumed_epoch_every_sample_once"] is True
    assert summary["checkpoint_saves"] >= 1
    assert summary["cache"]["cold_reads"] >= 1  # the workers' reads reached the node-wide cache counters
    assert "== summary" in out.stdout  # the human report is still printed
