"""datapipe on a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``):
write tasks really run on both nodes, and the result is one verified dataset. Marked
``ray``: deselected by default, run with ``pytest -m ray -n 0``."""

import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[tests,ray]' && pytest -m ray -n 0")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install -e '.[tests,ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

import datapipe  # noqa: E402
import datapipe.ray as dr  # noqa: E402
from tools.corpus import generate_corpus, read_corpus  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_write_tasks_run_on_both_nodes_and_pack_matches_local(two_nodes, tmp_path):
    corpus = str(tmp_path / "corpus")
    generate_corpus(corpus, 240, seed=3, mean_bytes=1024, per_dir=30)
    assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
    # pack on the cluster: the same samples as a local pack, by key
    local, on_ray = str(tmp_path / "local"), str(tmp_path / "ray")
    datapipe.pack(corpus, local, shard_bytes=32 * 1024, workers=1)
    r = dr.pack(corpus, on_ray, shard_bytes=32 * 1024)
    assert datapipe.verify_dataset(on_ray, all_problems=True).ok
    by_key = {s["__key__"]: s for s in datapipe.open_dataset(on_ray)}
    assert by_key == {s["__key__"]: s for s in datapipe.open_dataset(local)} == read_corpus(corpus)
    assert r.samples == 240
    # the nodes each write task ran on, as the tasks recorded them
    sink = dr.DatapipeDatasink(str(tmp_path / "copy"), max_bytes=16 * 1024)
    # a task per shard, each taking a node's one CPU, spread: Ray's SPREAD is best effort,
    # and with 4 tasks it put them all on one node about every other run
    dr.read(on_ray, shards_per_task=1).write_datasink(
        sink, ray_remote_args={"scheduling_strategy": "SPREAD", "num_cpus": 1})
    assert len(sink.task_nodes) > 4
    assert set(sink.task_nodes.values()) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    copy = str(tmp_path / "copy")
    assert datapipe.verify_dataset(copy, all_problems=True).ok
    assert {s["__key__"]: s for s in datapipe.open_dataset(copy)} == by_key
    assert not [f for f in os.listdir(copy) if f.startswith((".tmp-", "_pack"))]
