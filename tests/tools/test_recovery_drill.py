"""The recovery drill as a test: real processes (4 ranks over gloo), SIGKILL of one node,
its local tier deleted, restore from the peer replicas, every sample exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_recovery_drill(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tools.recovery_drill", "--dir", str(tmp_path / "drill"), "--samples", "256",
         "--batch", "8", "--local-every", "2", "--remote-every", "4", "--extra-mb", "1", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every sample exactly once: True" in out.stdout
    assert "restored from: peer replica" in out.stdout
    figures = json.loads(out.stdout[out.stdout.index("\n{") + 1:])
    assert figures["every_sample_exactly_once"] is True
    assert figures["sources"] == ["local", "local", "peer replica", "peer replica"]
    # the failure came after the restored step and cost at most one local interval
    assert 0 < figures["lost_steps"] <= 2 and figures["restored_step"] % 2 == 0
    # the remote tier was written but not needed
    assert any((tmp_path / "drill" / "remote").iterdir())


def test_recovery_drill_refuses_a_foreign_dir(tmp_path):
    """A non-empty --dir the drill did not make is refused before anything is deleted."""
    work = tmp_path / "mine"
    (work / "node0").mkdir(parents=True)
    (work / "node0" / "keep.txt").write_text("not the drill's")
    out = subprocess.run(
        [sys.executable, "-m", "tools.recovery_drill", "--dir", str(work), "--samples", "32", "--batch", "8"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode != 0 and "not made by the recovery drill" in out.stderr, out.stderr[-2000:]
    assert (work / "node0" / "keep.txt").read_text() == "not the drill's"
