"""examples/llm_pretrain end to end, as its run.sh runs it: two corpora tokenized with a BPE
tokenizer trained there and packed, a tiny GPT trained on their mix by `torchrun
--nproc-per-node 2` on CPU, killed (SIGKILL) after step 6's checkpoint, resumed from it with
other weights. Every global batch holds each source's share exactly, and its tokens are the
ones a TokenMix in this process gives for the same weight schedule: the killed run's first
six steps and the resumed run's last six, nothing repeated or skipped at the resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "examples", "llm_pretrain")


def test_the_llm_example_trains_is_killed_and_resumes_with_other_weights(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    work = str(tmp_path / "work")
    subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), work], check=True, env=env, timeout=300)
    train = [torchrun, "--nproc-per-node", "2", os.path.join(HERE, "train.py"), work, "--steps", "12"]
    killed = subprocess.run([*train, "--kill-at", "6"], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0 and "killing rank 0 after the checkpoint of step 6" in killed.stdout
    resumed = subprocess.run([*train, "--resume", "--weights", "0.25,0.75"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 6 with weights [0.25, 0.75]: (2, 6) sequences per global batch" in resumed.stdout
    with open(os.path.join(work, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert [r["counts"] for r in log] == [[6, 2]] * 6 + [[2, 6]] * 6
    assert [r["resumed"] for r in log] == [False] * 6 + [True] * 6
    # the same global batches from a mix in this process, with the weights changed at step 6
    from datapipe import TokenMix

    mix = TokenMix({os.path.join(work, "prose"): 0.75, os.path.join(work, "code"): 0.25}, 64, global_batch=8,
                   steps=12, seed=0)
    mix.set_weights([0.25, 0.75], from_step=6)
    sums = [int(b["input_ids"].sum()) for b in mix]
    assert [r["token_sum"] for r in log] == sums
    assert log[-1]["loss"] < log[0]["loss"]
