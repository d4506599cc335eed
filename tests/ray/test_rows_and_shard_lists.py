"""datapipe on Ray Data, what goes in and what is read: a ``__`` column other than
``__key__`` is refused by the sink as ``pack`` refuses it (never dropped while the write
reports success), and ``datapipe.ray.read`` takes a list of tar shards as
``open_dataset`` does. On a real local Ray instance; run with ``pytest -m ray -n 0``."""

import io
import os
import tarfile

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[tests,ray]' && pytest -m ray -n 0")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install -e '.[tests,ray]'")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

import datapipe  # noqa: E402
import datapipe.ray as dr  # noqa: E402
from datapipe.errors import InputFileError  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_the_sink_refuses_a_reserved_column_as_pack_does(ray_local, tmp_path):
    rows = [{"__key__": "a", "__x": "x", "txt": "y"}, {"__key__": "b", "__x": "z", "txt": "w"}]
    dest = tmp_path / "out"
    with pytest.raises(InputFileError, match=r"column '__x': names starting with '__' are reserved.*rename"):
        dr.write(ray.data.from_items(rows), str(dest))
    assert not (dest / "manifest.json").exists()
    assert [f for _, _, fs in os.walk(dest) for f in fs if f.endswith((".tar", ".zst"))] == []
    # pack refuses the same column of a table with the same check
    table = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table)
    with pytest.raises(InputFileError, match=r"column '__x': names starting with '__' are reserved"):
        datapipe.pack(str(table), str(tmp_path / "packed"), workers=1)
    # without it, the same rows are written whole
    r = dr.write(ray.data.from_items([{k: v for k, v in row.items() if k != "__x"} for row in rows]), str(dest))
    assert r.samples == 2 and datapipe.open_dataset(str(dest)).get("b")["txt"] == b"w"


def test_the_sink_refuses_two_columns_that_give_one_field(ray_local, tmp_path):
    image = pa.array([{"bytes": b"struct", "path": "p"}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    block = pa.table({"__key__": ["a"], "image": image, "image.bytes": [b"top"]})
    with pytest.raises(InputFileError, match=r"struct column 'image' .* and column 'image\.bytes' both give"):
        dr.write(ray.data.from_arrow(block), str(tmp_path / "out"))


def _shards(folder, n: int) -> list[str]:
    folder.mkdir()
    paths = []
    for k in range(n):
        path = folder / f"shard-{k:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
            for i in range(2):
                data = b"value %d %d" % (k, i)
                info = tarfile.TarInfo(f"s{k}{i}.txt")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def test_read_takes_a_list_of_tar_shards(ray_local, tmp_path):
    paths = _shards(tmp_path / "shards", 3)
    want = {f"s{k}{i}": b"value %d %d" % (k, i) for k in range(3) for i in range(2)}
    by_list = {r["__key__"]: r["txt"] for r in dr.read(paths).take_all()}
    by_pattern = {r["__key__"]: r["txt"] for r in dr.read(str(tmp_path / "shards" / "shard-{000000..000002}.tar"))
                  .take_all()}
    assert by_list == by_pattern == want
    assert {r["__key__"] for r in dr.read(paths[1:2]).take_all()} == {"s10", "s11"}
