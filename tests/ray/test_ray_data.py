"""datapipe on Ray Data, on a real local Ray instance (``ray.init(num_cpus=2)``): pack
through Ray, a SIGKILLed write task, read -> map_batches -> write, tar indexes, and the
driver's cleanup. Marked ``ray``: deselected by default, run with ``pytest -m ray -n 0``."""

import json
import os
import re
import signal

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[tests,ray]' && pytest -m ray -n 0")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install -e '.[tests,ray]'")

import datapipe  # noqa: E402
import datapipe.ray as dr  # noqa: E402
from datapipe import cli  # noqa: E402
from datapipe.errors import DestinationBusyError, DuplicateKeyError  # noqa: E402
from datapipe.format import MANIFEST  # noqa: E402
from datapipe.publish import WriterLock  # noqa: E402
from datapipe.storage import open_store  # noqa: E402
from tools.corpus import generate_corpus, read_corpus  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

INDEX_FILES = {MANIFEST, "shards.parquet", "samples.parquet"}


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    generate_corpus(str(root), 300, seed=1, mean_bytes=2048, per_dir=50)
    return str(root)


def _samples(url):
    return {s["__key__"]: s for s in datapipe.open_dataset(url)}


def _files(dest):
    return {os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs}


def _assert_clean(dest):
    """Every file at ``dest`` is the index or a shard it names: nothing orphaned, no
    temporary, no journal left."""
    ix = datapipe.open_index(str(dest))
    assert _files(dest) == INDEX_FILES | {s.name for s in ix.shards}


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_ray_pack_matches_a_local_pack_by_key(ray_local, corpus, tmp_path, compression):
    local, on_ray = str(tmp_path / "local"), str(tmp_path / "ray")
    datapipe.pack(corpus, local, shard_bytes=96 * 1024, compression=compression, workers=1)
    r = dr.pack(corpus, on_ray, shard_bytes=96 * 1024, compression=compression)
    report = datapipe.verify_dataset(on_ray, all_problems=True)
    assert report.ok, report.problems
    got = _samples(on_ray)
    assert got == _samples(local) == read_corpus(corpus)  # byte-identical, by key
    assert r.samples == len(got) == 300 and r.merged_files == 900
    assert r.shards == datapipe.open_index(on_ray).num_shards > 1
    _assert_clean(on_ray)


def test_cli_engine_ray(ray_local, corpus, tmp_path, capsys):
    dest = str(tmp_path / "out")
    assert cli.main(["pack", corpus, dest, "--engine", "ray", "--shard-bytes", "64K", "-q"]) == 0
    assert "packed 300 samples" in capsys.readouterr().out
    assert cli.main(["verify", dest, "--all", "-q"]) == 0
    assert _samples(dest) == read_corpus(corpus)
    # a second pack to the same destination is refused, as a local one is
    assert cli.main(["pack", corpus, dest, "--engine", "ray", "-q"]) == 2
    assert "already holds a dataset" in capsys.readouterr().err
    assert cli.main(["pack", corpus, dest, "--engine", "ray", "--part", "0/2", "-q"]) == 2


def test_sigkilled_write_task_is_retried_and_leaves_nothing(ray_local, tmp_path):
    """The worker of one write task SIGKILLs itself on the first attempt, after it
    published its first shard and while its second is half written; Ray retries the task."""
    marker, dest = tmp_path / "killed", str(tmp_path / "out")
    rows = [{"__key__": f"k{i:04d}", "txt": f"text {i}", "n": i, "meta": {"i": i}} for i in range(60)]

    class KilledOnce(dr.DatapipeDatasink):  # defined here: Ray sends it to the workers by value
        def rows_of(self, blocks):
            for i, row in enumerate(super().rows_of(blocks)):
                if i == 6 and not marker.exists():  # 4 samples in shard 0 (published), 2 in shard 1
                    marker.write_text(json.dumps({"pid": os.getpid(), "files": sorted(os.listdir(dest))}))
                    os.kill(os.getpid(), signal.SIGKILL)
                yield row

    sink = KilledOnce(dest, max_samples=4)
    ray.data.from_items(rows, override_num_blocks=4).write_datasink(sink)
    killed = json.loads(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)  # the worker really died
    # ... after publishing its first shard, while writing its second
    half = [m.group(1) for f in killed["files"] if (m := re.match(r"\.tmp-\w+-shard-(\d{6})-000001\.tar$", f))]
    assert len(half) == 1 and f"shard-{half[0]}-000000.tar" in killed["files"]
    report = datapipe.verify_dataset(dest, all_problems=True)
    assert report.ok, report.problems
    keys = datapipe.open_index(dest).keys()
    assert sorted(keys) == [row["__key__"] for row in rows]  # each sample exactly once
    got = _samples(dest)
    assert got["k0037"] == {"__key__": "k0037", "txt": b"text 37", "n": b"37", "meta": b'{"i": 37}'}
    assert sink.result is not None and sink.result.samples == 60
    _assert_clean(dest)


def test_read_map_batches_write_round_trip(ray_local, corpus, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "upper")
    datapipe.pack(corpus, src, shard_bytes=64 * 1024, compression="zstd", workers=1)
    shards = datapipe.open_index(src).num_shards
    tasks = dr.DatapipeDatasource(src).get_read_tasks(4)
    assert len(tasks) == min(4, shards) > 1  # one read task per shard range
    assert sum(t.metadata.num_rows for t in tasks) == 300
    ds = dr.read(src)

    def upper(batch):
        batch["json"] = [b.upper() for b in batch["json"]]
        return batch

    r = dr.write(ds.map_batches(upper), dest, max_samples=64)
    before, after = _samples(src), _samples(dest)
    assert set(after) == set(before) and r.samples == 300
    for key, s in before.items():
        assert after[key] == dict(s, json=s["json"].upper())
    assert datapipe.verify_dataset(dest).ok
    _assert_clean(dest)


def test_read_a_tar_index(ray_local, tmp_path):
    """Shards written by webdataset, indexed by `datapipe index`, read into Ray."""
    wds = pytest.importorskip("webdataset")
    shards = tmp_path / "wds"
    shards.mkdir()
    expect = {}
    with wds.ShardWriter(str(shards / "shard-%06d.tar"), maxcount=7, verbose=0) as w:
        for i in range(30):
            s = {"__key__": f"s{i:04d}", "txt": f"caption {i}".encode(), "bin": os.urandom(10 + 31 * i)}
            expect[s["__key__"]] = s
            w.write(s)
    datapipe.index_shards([str(shards)])
    rows = dr.read(str(shards), shards_per_task=2).take_all()
    assert {r["__key__"]: {k: v for k, v in r.items() if v is not None} for r in rows} == expect


def test_damaged_shard_fails_the_read(ray_local, corpus, tmp_path):
    src = str(tmp_path / "src")
    datapipe.pack(corpus, src, shard_bytes=64 * 1024, workers=1)
    shard = os.path.join(src, datapipe.open_index(src).shards[1].name)
    with open(shard, "r+b") as f:
        f.seek(700)
        byte = f.read(1)
        f.seek(700)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(Exception, match="checksum mismatch"):
        dr.read(src).take_all()


def test_duplicate_keys_commit_nothing_and_remove_only_ours(ray_local, tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "notes.txt").write_text("the user's")
    rows = [{"__key__": f"k{i % 25:03d}", "txt": str(i)} for i in range(50)]
    with pytest.raises(DuplicateKeyError, match="k0"):
        dr.write(ray.data.from_items(rows, override_num_blocks=2), str(dest), max_samples=10)
    assert _files(dest) == {"notes.txt"}  # no manifest, no shard, no journal: nothing of ours left


def test_files_at_our_names_are_refused_unless_overwrite(ray_local, tmp_path):
    """A destination with no dataset and no journal, holding a user's file at a name a
    write would publish, is refused (the write would replace it); with overwrite=True it
    is deleted first, and nothing else there is touched."""
    from datapipe.errors import DestinationExistsError

    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "shard-000000-000000.tar").write_bytes(b"the user's")
    (dest / "notes.txt").write_text("the user's")
    rows = ray.data.from_items([{"__key__": f"k{i}", "txt": str(i)} for i in range(6)], override_num_blocks=1)
    with pytest.raises(DestinationExistsError, match=r"shard-000000-000000\.tar"):
        dr.write(rows, str(dest))
    assert (dest / "shard-000000-000000.tar").read_bytes() == b"the user's"
    assert _files(dest) == {"shard-000000-000000.tar", "notes.txt"}  # nothing of ours left
    dr.write(rows, str(dest), overwrite=True)
    assert sorted(datapipe.open_index(str(dest)).keys()) == [f"k{i}" for i in range(6)]
    assert (dest / "notes.txt").read_text() == "the user's"


def test_the_destination_is_locked_during_the_write(ray_local, tmp_path):
    dest = str(tmp_path / "out")
    with WriterLock(open_store(dest)):
        with pytest.raises(DestinationBusyError):
            dr.write(ray.data.from_items([{"__key__": "a", "x": b"1"}]), dest)


def test_driver_removes_shards_of_failed_attempts_it_journaled(ray_local, tmp_path):
    """Write tasks run in this process: task 5's first attempt wrote three shards and
    died; its retry (an upstream that gave fewer rows) wrote two. The third is journaled by
    this write and unreferenced: removed. A look-alike file that appeared during the write
    (a destination that holds one is refused before it starts) is not journaled: kept."""
    import pyarrow as pa
    from ray.data._internal.execution.interfaces import TaskContext

    dest = tmp_path / "out"
    dest.mkdir()
    sink = dr.DatapipeDatasink(str(dest), max_samples=2)
    sink.begin()
    (dest / "shard-000005-000009.tar").write_bytes(b"the user's")
    ctx = TaskContext(task_idx=5, op_name="Write")
    block = pa.table({"__key__": [f"k{i}" for i in range(6)], "txt": [str(i) for i in range(6)]})
    first = sink.write([block], ctx)
    assert [s["name"] for s in first["shards"]] == [f"shard-000005-00000{j}.tar" for j in range(3)]
    retry = sink.write([block.slice(0, 4)], ctx)
    from ray.data.datasource.datasink import WriteResult

    sink.on_write_complete(WriteResult(4, 0, [retry]))
    assert _files(dest) == INDEX_FILES | {"shard-000005-000000.tar", "shard-000005-000001.tar",
                                          "shard-000005-000009.tar"}
    assert sorted(datapipe.open_index(str(dest)).keys()) == ["k0", "k1", "k2", "k3"]
    assert json.loads((dest / MANIFEST).read_text())["num_shards"] == 2


def test_pack_to_s3_and_read_back(ray_local, corpus, s3):
    """Write tasks in Ray workers upload to moto's S3 on loopback (no temporaries there:
    an upload publishes on completion); the Datasource reads it back."""
    root, opts = s3
    dest = f"{root}/ds"
    r = dr.pack(corpus, dest, shard_bytes=96 * 1024, compression="zstd", storage_options=opts)
    assert r.samples == 300 and datapipe.verify_dataset(dest, storage_options=opts).ok
    store = open_store(dest, opts)
    names = {s.name for s in datapipe.open_index(dest, opts).shards}
    assert set(store.list()) == INDEX_FILES | names  # no journal, no lease left
    rows = dr.read(dest, storage_options=opts).take_all()
    assert {row["__key__"]: {k: v for k, v in row.items() if v is not None} for row in rows} == read_corpus(corpus)
