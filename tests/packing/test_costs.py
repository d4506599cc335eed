"""What a pack costs beyond reading its inputs and writing its shards, and that the ways it
saves do not change what it writes: no pandas import (pyarrow's ``pa.array`` imports it to
ask whether values are pandas objects: 0.3 s warm, 0.75 s cold, in every commit), no
cyclic garbage collection over its listing, and inputs opened ahead of their reads with
the kernel asked to read them (a cold page cache then serves many files at once), each
input that fails still named in its own sample."""

import gc
import json
import os
import subprocess
import sys

import pytest

import datapipe
from tools.corpus import generate_corpus, read_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    generate_corpus(str(root), 400, seed=5, mean_bytes=1024, per_dir=100)
    return str(root)


def _run(code, *args):
    p = subprocess.run([sys.executable, "-c", code, *args], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _samples(url):
    return {s["__key__"]: s for s in datapipe.open_dataset(url)}


_IMPORTS = """
import sys
import datapipe
r = datapipe.pack(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), shard_samples=100)
print(r.shards, "pandas" in sys.modules)
"""


@pytest.mark.parametrize("workers", [1, 3])
def test_a_pack_imports_no_pandas(corpus, tmp_path, workers):
    assert _run(_IMPORTS, corpus, str(tmp_path / "ds"), str(workers)).split() == ["4", "False"]
    assert _samples(str(tmp_path / "ds")) == read_corpus(corpus)


def test_a_pack_runs_no_collection_in_its_process(corpus, tmp_path):
    seen = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    datapipe.pack(corpus, str(tmp_path / "first"), workers=1)  # lazy imports done before counting
    old = gc.get_threshold()
    gc.callbacks.append(cb)
    gc.set_threshold(50, 1, 1)  # a collection every few dozen new containers: a listing would run many
    try:
        datapipe.pack(corpus, str(tmp_path / "ds"), workers=1)
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(cb)
    assert len(seen) <= 1, f"{len(seen)} collections ran inside the pack"  # one may, as the collector comes back
    assert gc.isenabled()
    assert _samples(str(tmp_path / "ds")) == read_corpus(corpus)


# A pack (argv: src, dest, trace folder, "skip" or "raise") in which one input is deleted
# after the listing, recording each POSIX_FADV_WILLNEED advice its processes give (the
# file advised, in a file per process under the trace folder).
_ADVICE = """
import json, os, sys
import datapipe
from datapipe.packing import packer

src, dest, trace, mode, gone = sys.argv[1:6]
real_advise, real_plan = os.posix_fadvise, packer.plan_shards
def advise(fd, offset, length, advice):
    if advice == os.POSIX_FADV_WILLNEED:
        with open(os.path.join(trace, f"advice-{os.getpid()}"), "a") as f:
            f.write(os.readlink(f"/proc/self/fd/{fd}") + "\\n")
    return real_advise(fd, offset, length, advice)
def plan(*a, **k):
    os.unlink(gone)
    return real_plan(*a, **k)
os.posix_fadvise, packer.plan_shards = advise, plan
try:
    r = datapipe.pack(src, dest, workers=2, skip_errors=mode == "skip", shard_samples=100)  # a task per shard
    print(json.dumps([os.getpid(), r.samples, r.skipped]))
except datapipe.errors.InputFileError as e:
    print(json.dumps([os.getpid(), None, str(e)]))
"""


def _advised(trace):
    return {int(f.name.split("-")[1]): f.read_text().split() for f in trace.iterdir()}


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.isdir("/proc/self/fd"),
                    reason="read-ahead advice is Linux's")
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_inputs_are_read_ahead_and_a_failed_one_stays_in_its_sample(corpus, tmp_path, mode):
    src = tmp_path / "src"
    subprocess.run(["cp", "-a", corpus, str(src)], check=True)
    trace = tmp_path / "trace"
    trace.mkdir()
    gone = src / "00002" / "sample00000250.jpg"  # the middle file of its sample
    dest = tmp_path / "ds"
    me, samples, what = json.loads(_run(_ADVICE, str(src), str(dest), str(trace), mode, str(gone)))
    advised = _advised(trace)
    assert advised and me not in advised  # the workers advise, for the inputs each reads
    every = sorted(os.path.join(d, n) for d, _, ns in os.walk(src) for n in ns)
    if mode == "skip":
        assert (samples, what) == (399, [[str(gone), "No such file or directory"]])
        assert sorted(p for ps in advised.values() for p in ps) == every  # each input that opened, once
        expected = read_corpus(corpus)
        del expected["00002/sample00000250"]
        assert _samples(str(dest)) == expected
    else:
        assert samples is None and what.startswith(f"cannot read {gone}: No such file or directory")
        assert "sample '00002/sample00000250'" in what
        names = os.listdir(dest)  # finished shards are kept for the rerun, unreadable without a manifest
        assert "manifest.json" not in names and not [n for n in names if n.startswith(".tmp-")]
