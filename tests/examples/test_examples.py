"""Every example under examples/ runs, as a user runs it: its script in a fresh interpreter,
on generated data in a temporary folder. The checkpoint example is killed with SIGKILL between
two checkpoints and run again; the Ray example runs with the Ray tests (``-m ray``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import datapipe

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"
#: how long one example may run here (each runs in well under a minute on a quiet machine)
TIMEOUT_S = 240
#: examples run by a test file of their own
TESTED_ELSEWHERE = {"llm_pretrain": "tests/examples/test_llm_pretrain.py"}
TESTED_HERE = {"image_classification", "checkpoint_resume", "ray_packing"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("RAY_ADDRESS", None)
    return env


def _run(script: str, *args: str) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"{script} exited {r.returncode}\n--- stdout ---\n{r.stdout}\n--- stderr ---\n{r.stderr}"
    return r.stdout


def test_every_example_is_run_by_a_test() -> None:
    folders = {p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    untested = sorted(folders - TESTED_HERE - set(TESTED_ELSEWHERE))
    assert not untested, f"examples without a test: {untested} (add one to tests/examples/test_examples.py)"
    missing = sorted(f"{name}: {test}" for name, test in TESTED_ELSEWHERE.items()
                     if name in folders and not (ROOT / test).exists())
    assert not missing, f"examples whose test file is missing: {missing}"
    assert TESTED_HERE <= folders


def test_image_classification(tmp_path: Path) -> None:
    out = _run("image_classification/train.py", "--workdir", str(tmp_path), "--images", "256", "--epochs", "2")
    epochs = re.findall(r"epoch (\d+): (\d+) images, loss [\d.]+, train accuracy ([\d.]+)", out)
    assert [(e, n) for e, n, _ in epochs] == [("0", "256"), ("1", "256")], out  # every image once per epoch
    assert float(epochs[-1][2]) >= 0.5, f"the CNN did not learn four colours in two epochs:\n{out}"
    assert datapipe.open_index(str(tmp_path / "shards")).num_samples == 256


def _logged_steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    steps = []
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in row:
            steps.append(row["step"])
    return steps


@pytest.mark.timeout(3 * TIMEOUT_S)  # two runs and the check, each bounded by TIMEOUT_S
def test_checkpoint_resume_after_kill_9(tmp_path: Path) -> None:
    train = [sys.executable, str(EXAMPLES / "checkpoint_resume/train.py"), "--workdir", str(tmp_path),
             "--samples", "480", "--save-every", "5", "--step-sleep", "0.1"]
    log, ckpt = tmp_path / "log.jsonl", str(tmp_path / "checkpoints")
    # its own session: the kill takes the trainer, its DataLoader workers and its writer process
    first = subprocess.Popen(train, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    killed_at = None
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and first.poll() is None:
            done = [c.step for c in datapipe.list_checkpoints(ckpt) if c.complete] if os.path.isdir(ckpt) else []
            steps = _logged_steps(log)
            # between two checkpoints, after one is complete: the steps since it are lost
            if done and steps and steps[-1] % 5 in (2, 3) and steps[-1] > max(done):
                os.killpg(first.pid, signal.SIGKILL)
                killed_at = steps[-1]
                break
            time.sleep(0.05)
    finally:
        if first.poll() is None and killed_at is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    output = first.stdout.read().decode() if first.stdout else ""
    assert killed_at is not None, f"the first run ended before it could be killed mid-run:\n{output}"
    assert first.returncode == -signal.SIGKILL

    second = subprocess.run(train, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert second.returncode == 0, second.stdout + second.stderr
    resumed = re.search(r"resumed from the checkpoint of step (\d+)", second.stdout)
    assert resumed, second.stdout
    assert 5 <= int(resumed.group(1)) < killed_at and int(resumed.group(1)) % 5 == 0
    assert "finished at step 60" in second.stdout, second.stdout  # 2 epochs of 480 / 16

    check = subprocess.run([sys.executable, str(EXAMPLES / "checkpoint_resume/verify.py"), str(tmp_path)], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "60 steps from 2 attempts, epochs [0, 1]: every sample exactly once per epoch: True" in check.stdout


def test_checkpoint_resume_verify_notices_a_sample_seen_twice(tmp_path: Path) -> None:
    # the check itself: a timeline that repeats a sample is refused
    spec = importlib.util.spec_from_file_location("checkpoint_resume_verify", EXAMPLES / "checkpoint_resume/verify.py")
    assert spec is not None and spec.loader is not None
    verify = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verify)
    with datapipe.ShardWriter(str(tmp_path / "data")) as w:
        for k in ("a", "b"):
            w.write({"__key__": k, "cls": "0"})
    rows = [{"attempt": "1", "resumed_from": 0}, {"attempt": "1", "epoch": 0, "step": 1, "keys": ["a"]},
            {"attempt": "2", "resumed_from": 1}, {"attempt": "2", "epoch": 0, "step": 2, "keys": ["b"]}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut sho')
    assert verify.check(str(tmp_path))["every_sample_once"]
    rows[2]["resumed_from"] = 0  # attempt 2 from step 0, logging "b" twice: "a" missing, "b" twice
    rows.append({"attempt": "2", "epoch": 0, "step": 3, "keys": ["b"]})
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not verify.check(str(tmp_path))["every_sample_once"]


@pytest.mark.ray
def test_ray_packing(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="pip install -e '.[tests,ray]'")
    out = _run("ray_packing/pack_on_ray.py", "--workdir", str(tmp_path), "--samples", "500")
    assert "packed 500 samples into 2 shards" in out, out
    assert "verified 2 shards, 500 samples: ok" in out, out
    assert "read back on Ray: 500 rows" in out, out
    assert "streamed 500 samples through StreamingDataLoader(num_workers=2)" in out, out
