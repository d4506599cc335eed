"""The cache benchmark's simulated cluster, end to end at a tiny size, and the counting,
503-injecting S3 endpoint it reads from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.s3_endpoint import LocalS3

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_endpoint_counts_gets_and_bytes_per_object_and_answers_503_at_its_rate():
    with LocalS3(slowdown_rate=0.5, seed=4) as s3:
        s3.create_bucket("meter")
        client = s3.client()
        s3.set_slowdown_rate(0.0)
        client.put_object(Bucket="meter", Key="a/x.bin", Body=b"x" * 1000)
        client.list_objects_v2(Bucket="meter")
        assert client.get_object(Bucket="meter", Key="a/x.bin", Range="bytes=10-19")["Body"].read() == b"x" * 10
        t = s3.traffic()
        assert t["gets"] == {"meter/a/x.bin": 1} and t["bytes"] == {"meter/a/x.bin": 10}
        assert t["other_requests"] >= 3  # bucket, put, listing: not object GETs

        s3.reset_traffic()
        s3.set_slowdown_rate(0.5)
        import urllib.error
        import urllib.request

        url = client.generate_presigned_url("get_object", Params={"Bucket": "meter", "Key": "a/x.bin"})
        refused = 0
        for _ in range(60):  # plain HTTP: no client retries between us and the counts
            try:
                with urllib.request.urlopen(url) as resp:
                    assert len(resp.read()) == 1000
            except urllib.error.HTTPError as e:
                assert e.code == 503 and b"<Code>SlowDown</Code>" in e.read()
                refused += 1
        t = s3.traffic()
        assert t["slowdowns"]["meter/a/x.bin"] == refused and 15 < refused < 45  # about half of 60
        assert t["gets"]["meter/a/x.bin"] == 60 - refused
        assert t["bytes"]["meter/a/x.bin"] == 1000 * (60 - refused)


def test_the_rate_must_be_a_share():
    with pytest.raises(ValueError, match="slowdown_rate"):
        LocalS3(slowdown_rate=1.5).start()


def test_cluster_mode_end_to_end_serves_each_shard_from_cold_once(tmp_path):
    """Two nodes (process groups with a DataLoader worker each) over one shared tier, 503s
    injected: every shard comes from cold once in the whole run, every sample arrives
    byte-exact, local budgets hold; the last line printed is the JSON summary."""
    cmd = [sys.executable, "-m", "benchmarks.bench_cache", "--cluster", "2", "--node-workers", "1",
           "--shards", "6", "--samples-per-shard", "3", "--sample-kib", "8", "--cluster-epochs", "2",
           "--slowdown-rate", "0.2", "--objects", "6", "--object-mib", "0.03", "--epochs", "2",
           "--fractions", "0.5", "--json", str(tmp_path / "out.json")]
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    for field in ("nodes", "cold_gets_per_shard", "byte_exact", "local_budget_exceeded", "hit_rate_over_belady"):
        assert field in summary
    assert summary["nodes"] == 2 and summary["shards"] == 6 and summary["epochs"] == 2
    assert summary["cold_gets"] == 6  # once per shard for the whole run, across both nodes
    assert summary["cold_gets_per_shard"] == pytest.approx(0.5)  # ÷ shards ÷ epochs
    assert summary["byte_exact"] is True and summary["every_sample_each_epoch"] == [True, True]
    assert summary["local_budget_exceeded"] is False and summary["local_dir_samples"] > 0
    assert max(summary["local_peak_bytes"]) <= summary["local_budget_bytes"]
    assert summary["errors"] == {}
    assert set(summary["hit_rate_over_belady"]) == {"0.5"}
    full = json.loads((tmp_path / "out.json").read_text())
    row = full["loader"]["rows"]["0.5"]
    assert row["accesses"] == 12  # 6 shards x 2 epochs, each fetched once per epoch by the loader
    assert 0 <= row["datapipe_loader"]["hits"] <= row["belady_optimum"]["hits"]
