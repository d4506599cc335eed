"""The pieces of `pack` that datapipe.ray reuses, and datapipe without Ray: runs in the
default suite (no Ray needed)."""

import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.format import shard_name
from datapipe.packing import list_directory
from datapipe.publish import ShardLimits, ShardSeries, retract_dataset
from datapipe.storage import LocalStore

_NAMES = st.sampled_from(["a.jpg", "a.json", "b.txt", "b.tar.gz", "c", ".hidden.txt", "d.x.y", "E.PNG", "a.cls"])
_FOLDERS = st.sampled_from(["", "x", "x/y", "x/y/z", "w", ".dot", "w/v"])


def _listing_in_pieces(root, keys):
    """What a Ray pack lists: the top without descending, then each folder by itself."""
    top = list_directory(root, keys=keys, recursive=False, allow_empty=True)
    samples, dropped = list(top.samples), list(top.dropped)
    for folder in top.folders:
        part = list_directory(root, keys=keys, within=folder, allow_empty=True)
        samples += part.samples
        dropped += part.dropped
    return sorted(samples, key=lambda s: s.key), sorted(dropped)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.tuples(_FOLDERS, _NAMES, st.integers(0, 3)), min_size=1, max_size=25),
       keys=st.sampled_from(["first-dot", "file"]))
def test_listing_in_pieces_is_the_whole_listing(files, keys):
    with tempfile.TemporaryDirectory() as root:
        for folder, name, size in files:
            d = os.path.join(root, *folder.split("/")) if folder else root
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"x" * size)
        whole = list_directory(root, keys=keys, allow_empty=True)
        samples, dropped = _listing_in_pieces(root, keys)
        assert samples == whole.samples  # same keys, same files (no sample split between pieces)
        assert dropped == sorted(whole.dropped)


def test_a_piece_lists_only_its_folder_with_keys_from_the_root(tmp_path):
    (tmp_path / "top.txt").write_text("t")
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "a.jpg").write_text("a")
    (tmp_path / "x" / "y" / "b.jpg").write_text("b")
    top = list_directory(str(tmp_path), recursive=False)
    assert [s.key for s in top.samples] == ["top"] and top.folders == ["x"]
    part = list_directory(str(tmp_path), within="x")
    assert [s.key for s in part.samples] == ["x/a", "x/y/b"] and part.folders == []


def test_shard_series_journals_each_name_before_its_first_byte(tmp_path):
    store = LocalStore(str(tmp_path)).for_writer("tok1")
    seen = []

    def before_open(name):  # nothing of this shard exists yet, not even a temporary
        assert not [f for f in os.listdir(tmp_path) if f.endswith(name)]
        seen.append(name)

    series = ShardSeries(store, ShardLimits(1 << 20, 3), "none", 3, lambda i: shard_name(i, "none", "shard-000007"),
                         before_open)
    for i in range(7):
        series.write({"__key__": f"k{i}", "txt": f"t{i}", "n": i})
    series.close()
    assert seen == ["shard-000007-000000.tar", "shard-000007-000001.tar", "shard-000007-000002.tar"]
    results = series.results
    assert [r["record"]["name"] for r in results] == seen
    assert [r["samples"]["keys"] for r in results] == [["k0", "k1", "k2"], ["k3", "k4", "k5"], ["k6"]]
    assert all(r["fields"] == ["n", "txt"] for r in results)
    assert sorted(os.listdir(tmp_path)) == seen


def test_shard_series_abort_leaves_no_partial_shard(tmp_path):
    store = LocalStore(str(tmp_path)).for_writer("tok2")
    series = ShardSeries(store, ShardLimits(1 << 20, 2), "zstd", 3, lambda i: shard_name(i, "zstd"))
    for i in range(3):
        series.write({"__key__": f"k{i}", "txt": "x"})
    series.abort(RuntimeError("stop"))
    assert os.listdir(tmp_path) == ["shard-000000.tar.zst"]  # the finished one; the partial one is gone
    with pytest.raises(Exception, match="written twice"):
        series.write({"__key__": "k0", "txt": "again"})


def test_overwrite_retracts_ray_shard_names_and_nothing_else(tmp_path):
    for name in ("manifest.json", "shards.parquet", "samples.parquet", "shard-000012-000003.tar",
                 "shard-1234567-000000.tar.zst", "shard-000001.tar", "shard-12-3.tar", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    retract_dataset(LocalStore(str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "shard-12-3.tar"]


_NO_RAY = "import sys; sys.modules['ray'] = None\n"


def test_datapipe_works_without_ray_and_says_what_to_install(tmp_path):
    code = _NO_RAY + (
        "import datapipe, datapipe.packing, datapipe.publish\n"
        "try:\n"
        "    import datapipe.ray\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout and "pip install 'datapipe[ray]'" in out.stdout
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a")
    code = _NO_RAY + "from datapipe.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "pack", str(tmp_path / "src"), str(tmp_path / "d"),
                          "--engine", "ray", "-q"], capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 2 and "pip install 'datapipe[ray]'" in out.stderr
    out = subprocess.run([sys.executable, "-c", code, "pack", str(tmp_path / "src"), str(tmp_path / "d"), "-q"],
                         capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0, out.stderr  # the default engine needs no Ray
