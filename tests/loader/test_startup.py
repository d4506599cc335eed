"""What a new StreamingDataset pays before and during its first pass, in this process and in
fresh DataLoader workers: no import (everything a pass needs is imported with the loader),
and no Python step per shard to open an index or per sample to make a shard readable (the
index holds the shard's layout, and its columns are checked with numpy)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

import datapipe
from datapipe.loader.source import ShardSource


def _write(dest, shards, per_shard, fields=("cls", "json")):
    with datapipe.ShardWriter(str(dest), max_samples=per_shard) as w:
        for i in range(shards * per_shard):
            w.write({"__key__": f"d{i // 1000:03d}/s{i:06d}", **{f: f"{f}{i}" for f in fields}})
    return str(dest)


_FIRST_PASS = textwrap.dedent('''
    import sys

    import datapipe

    BASE = set()

    def at_start(worker_id):
        BASE.update(sys.modules)

    def imported(sample):  # what this process imported since its worker started
        return {"__key__": sample["__key__"], "new": ",".join(sorted(set(sys.modules) - BASE))}

    url, where = sys.argv[1:]
    if where == "here":
        ds = datapipe.StreamingDataset(url, decode=None)
        BASE.update(sys.modules)
        keys = [s["__key__"] for s in ds]
        print(f"one process: [{','.join(sorted(set(sys.modules) - BASE))}] {len(keys)}")
    else:  # this process never reads the dataset: each worker's first pass is the first
        ds = datapipe.StreamingDataset(url, map=imported)
        loader = datapipe.StreamingDataLoader(ds, batch_size=16, num_workers=2, persistent_workers=False,
                                              worker_init_fn=at_start, multiprocessing_context="fork")
        for epoch in range(2):
            ds.set_epoch(epoch)
            seen = sorted({n for batch in loader for n in batch["new"]})
            print(f"workers, epoch {epoch}: [{','.join(seen)}]")
''')


@pytest.mark.parametrize("where", ["here", "workers"])
def test_a_first_pass_imports_nothing(tmp_path, where):
    """Old code: the first pass imported pandas (through pyarrow's to_numpy), numpy.random
    and numpy.char, half a second of every fresh worker's first batch."""
    url = _write(tmp_path / "ds", 6, 50)
    script = tmp_path / "first_pass.py"
    script.write_text(_FIRST_PASS)
    out = subprocess.run([sys.executable, str(script), url, where], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expected = ["one process: [] 300"] if where == "here" else ["workers, epoch 0: []", "workers, epoch 1: []"]
    assert out.stdout.splitlines() == expected, out.stdout[:3000]


def _python_calls(fn):
    """Calls that datapipe's code makes while ``fn()`` runs (of Python functions, and of C
    functions from Python), in every thread it starts too; not the retry layer's, whose
    waits for an attempt's thread depend on timing."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        name = frame.f_code.co_filename
        if event in ("call", "c_call") and "datapipe" in name and not name.endswith("retry.py"):
            calls += 1

    threading.setprofile(count)
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls


def test_opening_an_index_costs_no_python_step_per_shard(tmp_path):
    few, many = _write(tmp_path / "few", 20, 2), _write(tmp_path / "many", 600, 2)
    datapipe.open_index(few)  # imports and caches warmed
    calls = [_python_calls(lambda u=u: datapipe.open_index(u)) for u in (few, many)]
    assert calls[1] - calls[0] < 20, calls  # old code: about 30 calls more per shard
    ix = datapipe.open_index(many)
    assert ix.shards[599].name == "shard-000599.tar" and ix.shards[-1].first_sample == 1198
    assert [s.samples for s in ix.shards[:3]] == [2, 2, 2] and len(ix.shards) == 600


@pytest.mark.parametrize("fields", [("cls",), ("cls", "json", "txt")])
def test_making_a_shard_readable_costs_no_python_step_per_sample(tmp_path, fields):
    few, many = _write(tmp_path / "few", 1, 20, fields), _write(tmp_path / "many", 1, 2000, fields)
    counts = []
    for url in (few, many):
        source = ShardSource([url])
        source.fetch(0).close()  # warmed: the verified-shard memo, imports

        def fetch(source=source):
            source.layouts = type(source.layouts)()  # the layout is checked again
            data = source.fetch(0)
            assert data.layout is not None and data.layout.samples == len(data.keys)
            data.close()

        counts.append(_python_calls(fetch))
    assert counts[1] - counts[0] < 20, counts  # old code: a str.encode per key, and more


_WORK: list[str] = []  # what a process did (each forked DataLoader worker counts in its own copy)


def test_fresh_workers_neither_hash_nor_check_what_earlier_workers_verified(tmp_path, monkeypatch):
    """PyTorch starts DataLoader workers afresh at every epoch by default: a shard file the
    workers of an earlier epoch verified (its bytes against its checksum, its recorded layout
    against its headers) is read, not hashed or checked again, while it keeps its identity.
    Old code: every fresh worker hashed and laid out every shard again."""
    import datapipe.loader.source as source

    url = _write(tmp_path / "ds", 6, 40)
    monkeypatch.setattr(source, "_RACY_NS", 0)  # the files count as settled at once
    real_checksum, real_check = source.checksum, source.check_layout

    def counted_checksum(data):
        _WORK.append("hash")
        return real_checksum(data)

    def counted_check(*args):
        _WORK.append("layout")
        return real_check(*args)

    monkeypatch.setattr(source, "checksum", counted_checksum)
    monkeypatch.setattr(source, "check_layout", counted_check)

    def work(sample):
        return {"__key__": sample["__key__"], "work": f"{_WORK.count('hash')}/{_WORK.count('layout')}"}

    ds = datapipe.StreamingDataset(url, map=work, seed=3)
    loader = datapipe.StreamingDataLoader(ds, batch_size=16, num_workers=2, persistent_workers=False,
                                          multiprocessing_context="fork")
    _WORK.clear()  # what opening the dataset here did (its identity hashes the manifests): not the workers'
    seen = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        keys, work_done = [], set()
        for batch in loader:
            keys += batch["__key__"]
            work_done.update(batch["work"])
        assert sorted(keys) == sorted(f"d000/s{i:06d}" for i in range(240))
        seen.append(work_done)
    assert seen[0] != {"0/0"}  # the first epoch's workers hashed and checked
    assert seen[1] == seen[2] == {"0/0"}, seen  # later ones took what those found


def test_a_local_shard_is_fetched_without_a_thread_of_its_own(tmp_path, monkeypatch):
    """The retry layer runs each attempt of a request in a thread of its own, to abandon one
    that hangs on a network; a local dataset's sample table is read as its shard bytes are,
    in the fetching thread. Old code: a "datapipe-attempt" thread per shard fetched."""
    url = _write(tmp_path / "ds", 3, 20)
    source = ShardSource([url])
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread):
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    for g in range(3):
        data = source.fetch(g)
        assert data.verified and len(data.keys) == 20
        data.close()
    assert started == []
