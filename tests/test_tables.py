"""Parquet tables read in place, by row group, with the loader's guarantees; and packed
with their Hive keys and struct-of-bytes columns."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import ObjectChangedError
from datapipe.loader import StreamingDataLoader, StreamingDataset

N = 240


def _table(lo: int, hi: int) -> pa.Table:
    img = pa.array([{"bytes": bytes([i % 256]) * (i % 50 + 1), "path": f"img{i}.jpg"} for i in range(lo, hi)],
                   type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    return pa.table({"id": pa.array(range(lo, hi), pa.int64()), "caption": [f"c{i}" for i in range(lo, hi)],
                     "image": img})


@pytest.fixture(scope="module")
def hive(tmp_path_factory):
    """A Hive-partitioned folder as pyarrow writes it: two partitions, row groups of 25."""
    root = tmp_path_factory.mktemp("tables") / "hive"
    for part, (lo, hi) in (("split=train", (0, 160)), ("split=val", (160, N))):
        os.makedirs(root / part)
        pq.write_table(_table(lo, hi), root / part / "part-0.parquet", row_group_size=25)
    (root / "_SUCCESS").write_bytes(b"")
    return str(root)


def _ids(items):
    return [int(s["id"]) for s in items]


def test_a_hive_table_streams_every_row_once_with_its_fields(hive):
    ds = StreamingDataset(hive, seed=3, window=2)
    rows = list(ds)
    assert sorted(_ids(rows)) == list(range(N))
    by_id = {s["id"]: s for s in rows}
    s = by_id[171]
    assert s["caption"] == "c171" and s["split"] == "val"
    assert s["image.bytes"] == bytes([171]) * 22 and s["image.path"] == "img171.jpg"
    assert s["__key__"] == "split=val/part-0.parquet/000000011"
    assert ds.source.num_shards == 7 + 4  # row groups: 160 / 25 -> 7, 80 / 25 -> 4
    ds.set_epoch(1)
    assert _ids(ds) != _ids(rows) and sorted(_ids(ds)) == list(range(N))


def test_a_table_partitions_over_ranks_and_resumes_exactly(hive):
    full = [_ids(StreamingDataset(hive, seed=1, window=3, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert sorted(i for ids in full for i in ids) == list(range(N))
    ds = StreamingDataset(hive, seed=1, window=3, rank=1, world_size=3, drop_last=True)
    it = iter(ds)
    head = [int(next(it)["id"]) for _ in range(33)]
    state = ds.state_dict()
    del it
    again = StreamingDataset(hive, seed=1, window=3, rank=1, world_size=3, drop_last=True)
    again.load_state_dict(state)
    assert head + _ids(again) == full[1]


def test_a_table_through_dataloader_workers(hive):
    ds = StreamingDataset(hive, seed=2)
    loader = StreamingDataLoader(ds, batch_size=32, num_workers=2)
    ids = [int(i) for b in loader for i in b["id"]]
    assert sorted(ids) == list(range(N))
    assert ids == _ids(StreamingDataset(hive, seed=2, batch_size=32))


def test_one_parquet_file_and_a_changed_file(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(_table(0, 50), path, row_group_size=20)
    ds = StreamingDataset(str(path), shuffle=False)
    assert _ids(ds) == list(range(50))
    pq.write_table(_table(0, 60), path, row_group_size=20)  # rewritten after the plan was made
    with pytest.raises(ObjectChangedError, match="changed since the table was opened"):
        list(ds)


def test_packing_a_hive_folder_keeps_rows_and_struct_bytes(hive, tmp_path):
    dest = str(tmp_path / "packed")
    r = datapipe.pack(hive, dest, workers=1)
    d = datapipe.open_dataset(dest)
    assert len(d) == N and r.shards >= 1
    got = {int(s["id"]): s for s in d}
    s = got[171]
    assert s["image.bytes"] == bytes([171]) * 22 and s["image.path"] == b"img171.jpg" and s["split"] == b"val"


def test_a_table_on_s3_streams_in_place(hive, s3):
    import s3fs

    root, opts = s3
    fs = s3fs.S3FileSystem(**opts)
    fs.put(hive, root[len("s3://"):] + "/hive", recursive=True)
    ds = StreamingDataset(root + "/hive", seed=5, storage_options=opts)
    rows = list(ds)
    assert sorted(_ids(rows)) == list(range(N))
    assert {s["split"] for s in rows} == {"train", "val"}


_NO_POOL = '''
import os, sys, threading, time
import datapipe
from datapipe.loader import StreamingDataset

def native():  # threads no Python code started: Arrow's pools, jemalloc's
    return set(map(int, os.listdir("/proc/self/task"))) - {t.native_id for t in threading.enumerate()}

if __name__ == "__main__":
    hive, dest = sys.argv[1:]
    before = native()
    datapipe.pack(hive, dest, workers=1)  # the table's rows counted and read here
    n = sum(1 for _ in datapipe.open_dataset(dest))  # both index tables read
    rows = sum(1 for _ in StreamingDataset(hive, seed=1))  # the table's row groups read in place
    # a Python thread that is ending has left threading.enumerate() a moment before the
    # system's list; Arrow's pool threads never end
    deadline = time.monotonic() + 10
    while native() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = []
    for t in native() - before:
        try:
            left.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:  # ended since
            pass
    print(n, rows, len(left), *left)
'''


def test_no_read_starts_arrows_thread_pools(hive, tmp_path):
    """Reading our index, packing a table and streaming one start none of Arrow's threads:
    once started, they can abort the process at exit (apache/arrow#34314: "terminate called
    without an active exception" after a run that succeeded)."""
    import subprocess
    import sys

    script = tmp_path / "no_pool.py"
    script.write_text(_NO_POOL)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # OpenMP and BLAS start their pools lazily on a large enough op: one thread each here, so
    # that a thread left over can only be Arrow's (its CPU pool also takes OMP_NUM_THREADS)
    one = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, str(script), hive, str(tmp_path / "packed")], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=root, **one), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(N), str(N), "0"]
