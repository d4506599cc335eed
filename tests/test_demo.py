"""The README's first command, small: the main job runs end to end and proves its resume."""

import subprocess
import sys


def test_demo_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.demo", "--samples", "400", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "OK: " in text and "every sample exactly once: True" in text
    assert "resumed_epoch_every_sample_once: True" in text
    cold = int(text.split("cold_reads=")[1].split(",")[0])
    assert cold >= 1  # the workers' reads reached the node-wide cache counters
