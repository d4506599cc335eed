"""Tier health checks (datapipe.health.check_tiers, `datapipe doctor`): real folders, a
read-only and a full tmpfs, a missing folder, moto's S3 on loopback (GET latency, 503
error rate), a store that never answers, config dicts, the command line."""

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from datapipe.cache import Tier as CacheTier
from datapipe.checkpoint import Tier as CheckpointTier
from datapipe.cli import main
from datapipe.errors import OptionError
from datapipe.health import PROBE_PREFIX, TierSpec, check_tiers, format_checks, tiers_from_config
from tests.folder_faults import fill_up
from tools.s3_endpoint import LocalS3


def test_a_healthy_folder_is_written_read_and_timed_and_left_as_it_was(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"x" * 1000)
    (tmp_path / f"{PROBE_PREFIX}someone-elses").write_bytes(b"keep me")  # a name like ours, not ours
    before = sorted(os.listdir(tmp_path))
    (c,) = check_tiers([TierSpec("warm", str(tmp_path), budget_bytes=1 << 20)], probe_bytes=1 << 20)
    assert (c.name, c.kind, c.status, c.problem) == ("warm", "dir", "ok", "")
    assert c.write_mb_s > 0 and c.read_mb_s > 0 and c.fsync_ms >= 0 and c.free_bytes > 0
    assert c.used_bytes >= 1000 and c.budget_bytes == 1 << 20
    assert sorted(os.listdir(tmp_path)) == before  # the probe is gone, nothing else is
    assert (tmp_path / f"{PROBE_PREFIX}someone-elses").read_bytes() == b"keep me"


def test_a_missing_folder_fails_with_the_reason(tmp_path):
    (c,) = check_tiers([str(tmp_path / "gone")])
    assert c.failed and c.name == "tier0" and c.problem.startswith(f"missing: no folder at {tmp_path / 'gone'}")
    f = tmp_path / "file"
    f.write_text("")
    (c,) = check_tiers([("warm", str(f))])
    assert c.failed and c.problem.startswith("not a folder")


def test_a_read_only_folder_fails_with_the_reason(tmp_path, tmpfs):
    fs = tmpfs("8m", optional=True)
    if fs is None:  # not root: a mode that forbids writing does it
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        path = ro
    else:
        (fs.path / "kept").write_bytes(b"data")
        fs.remount("ro")
        path = fs.path
    (c,) = check_tiers([TierSpec("warm", str(path))], probe_bytes=1 << 16)
    assert c.failed and c.problem.startswith("read-only:"), c.problem
    assert str(path) in c.problem
    if fs is not None:
        fs.remount("rw")
        assert os.listdir(fs.path) == ["kept"]


def test_a_full_tmpfs_fails_with_the_reason(tmpfs):
    fs = tmpfs("4m")
    fill_up(fs.path / "filler")  # to the last block
    (c,) = check_tiers([TierSpec("warm", str(fs.path))], probe_bytes=1 << 16)
    assert c.failed and c.problem.startswith("full:"), c.problem
    assert sorted(os.listdir(fs.path)) == ["filler"]  # no probe left behind


def test_a_nearly_full_tmpfs_fails_when_the_write_runs_out_of_space(tmpfs):
    fs = tmpfs("4m")
    with open(fs.path / "filler", "wb") as f:
        f.write(b"\0" * (3 << 20))
    # free space is checked first (1 MiB is there), then the 2 MiB probe runs out mid-write
    (c,) = check_tiers([TierSpec("warm", str(fs.path))], probe_bytes=(1 << 20) - 4096)
    assert c.status == "ok"
    (c,) = check_tiers([TierSpec("warm", str(fs.path))], probe_bytes=4 << 20)
    assert c.failed and c.problem.startswith("full:"), c.problem
    assert os.listdir(fs.path) == ["filler"]


def test_free_space_short_of_the_budget_is_a_warning(tmpfs):
    fs = tmpfs("8m")
    (fs.path / "cached").write_bytes(b"\1" * (2 << 20))
    (c,) = check_tiers([TierSpec("warm", str(fs.path), budget_bytes=1 << 30)], probe_bytes=1 << 16)
    assert c.status == "warn" and c.problem.startswith("short of its budget:") and "lower the budget" in c.problem
    assert c.used_bytes >= 2 << 20
    (c,) = check_tiers([TierSpec("warm", str(fs.path), budget_bytes=4 << 20)], probe_bytes=1 << 16)
    assert c.status == "ok"  # its own 2 MiB + the free space hold the budget


def test_a_slow_folder_fails_below_min_mb_s(tmp_path):
    (c,) = check_tiers([str(tmp_path)], probe_bytes=1 << 16, min_mb_s=1e12)
    assert c.failed and c.problem.startswith("slow: writes")


def _dataset(root, opts):
    from datapipe.storage import open_store

    store = open_store(root, opts)
    store.put("manifest.json", json.dumps({"version": 1}).encode() * 100)
    return store


def test_an_object_store_gets_timed_gets(s3):
    root, opts = s3
    store = _dataset(f"{root}/ds", opts)
    (c,) = check_tiers([TierSpec("cold", f"{root}/ds", storage_options=opts)], probes=6)
    assert (c.kind, c.status, c.gets, c.get_errors) == ("store", "ok", 6, 0)
    assert 0 < c.get_p50_ms <= c.get_p95_ms and c.read_mb_s > 0 and c.write_mb_s is None
    assert store.list() == ["manifest.json"]  # read only: nothing written


def test_a_checkpoint_store_gets_a_probe_object_that_is_deleted(s3):
    root, opts = s3
    (c,) = check_tiers([TierSpec("ckpt", f"{root}/ckpt", write=True)], probes=3, storage_options=opts)
    assert c.status == "ok" and c.write_mb_s > 0 and c.gets == 3
    from datapipe.storage import open_store

    assert open_store(f"{root}/ckpt", opts).list() == []


def test_an_object_store_with_nothing_to_get_and_no_writes_fails(s3):
    root, opts = s3
    (c,) = check_tiers([TierSpec("cold", f"{root}/empty", write=False, storage_options=opts)])
    assert c.failed and c.problem.startswith("nothing to GET")


def test_the_error_rate_of_a_throttling_store():
    with LocalS3(slowdown_rate=0.5, seed=3) as server:
        root = server.create_bucket("throttled")
        _dataset(f"{root}/ds", server.storage_options)
        (c,) = check_tiers([TierSpec("cold", f"{root}/ds", storage_options=server.storage_options)], probes=40)
    assert 0 < c.get_errors < 40 and c.gets == 40
    assert c.failed and f"{c.get_errors} of 40 GETs failed" in c.problem  # half fail: more than 20%
    assert c.get_throttled == c.get_errors and "throttled (503 SlowDown / 429)" in c.problem
    assert c.get_p50_ms is not None  # the GETs that succeeded are timed


def test_a_store_that_is_not_there_fails(s3):
    _, opts = s3
    (c,) = check_tiers([TierSpec("cold", "s3://no-such-bucket-here/ds", storage_options=opts)], probes=2)
    assert c.failed and c.problem


class _Hang(http.server.BaseHTTPRequestHandler):
    release = threading.Event()

    def do_GET(self):
        self.release.wait(120)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_a_store_that_never_answers_fails_by_the_deadline():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/ds"
        (c,) = check_tiers([TierSpec("cold", url)], timeout_s=1.0, probes=1)
        assert c.failed and c.problem.startswith("no answer within 1 s")
    finally:
        _Hang.release.set()
        server.shutdown()
        server.server_close()


def test_tiers_from_a_cache_config_and_a_checkpoint_config(tmp_path):
    specs = tiers_from_config({"warm_dir": "/nvme/c", "warm_bytes": 10 << 30, "shared_dir": "/lustre/c",
                               "shared_bytes": 1 << 40, "local_tiers": [CacheTier("/hdd/c", 1 << 35),
                                                                        {"path": "/hdd2/c", "bytes": 5}],
                               "cold": "s3://b/ds", "hot_bytes": 1 << 30, "prefetch_threads": 8})
    assert [(s.name, s.url, s.budget_bytes, s.kind) for s in specs] == [
        ("warm", "/nvme/c", 10 << 30, "dir"), ("node-local2", "/hdd/c", 1 << 35, "dir"),
        ("node-local3", "/hdd2/c", 5, "dir"), ("shared", "/lustre/c", 1 << 40, "dir"),
        ("cold", "s3://b/ds", None, "store")]
    specs = tiers_from_config({"url": "s3://b/ckpt", "tiers": [CheckpointTier("/local/ckpt", replicate=1),
                                                                {"url": "s3://b/ckpt2"}], "keep_last": 2})
    assert [(s.name, s.url, s.kind, s.write) for s in specs] == [
        ("checkpoint", "s3://b/ckpt", "store", True), ("checkpoint0-node-local", "/local/ckpt", "dir", None),
        ("checkpoint1", "s3://b/ckpt2", "store", True)]
    with pytest.raises(OptionError, match="config\\['warm_dri'\\]: not an argument of TieredCache"):
        tiers_from_config({"warm_dri": "/x"})
    with pytest.raises(OptionError, match="config\\['warm_bytes'\\]"):
        tiers_from_config({"warm_dir": "/x", "warm_bytes": -1})
    # a config dict goes straight to check_tiers, as a loader or writer would pass it
    (c,) = check_tiers({"warm_dir": str(tmp_path), "warm_bytes": 1 << 20}, probe_bytes=1 << 16, probes=1)
    assert c.name == "warm" and c.status == "ok"


@pytest.mark.parametrize("kwargs, name", [({"probe_bytes": 0}, "probe_bytes"), ({"probes": 0}, "probes"),
                                          ({"timeout_s": 0}, "timeout_s"), ({"min_mb_s": -1}, "min_mb_s")])
def test_bad_arguments_are_option_errors(tmp_path, kwargs, name):
    with pytest.raises(OptionError, match=name):
        check_tiers([str(tmp_path)], **kwargs)


def test_bad_tier_specs_are_option_errors():
    with pytest.raises(OptionError, match="kind="):
        TierSpec("x", "/tmp", kind="disk")
    with pytest.raises(OptionError, match="budget_bytes"):
        TierSpec("x", "/tmp", budget_bytes=1.5)
    with pytest.raises(OptionError, match="tiers\\[0\\]"):
        check_tiers([3])


def test_the_table_names_every_column_and_problem(tmp_path):
    checks = check_tiers([("warm", str(tmp_path)), ("gone", str(tmp_path / "gone"))], probe_bytes=1 << 16)
    text = format_checks(checks)
    head = text.splitlines()[0]
    for col in ("tier", "path", "write MB/s", "read MB/s", "fsync ms", "free/budget", "GET ms p50/p95", "status",
                "problem"):
        assert col in head
    assert "OK" in text and "FAILED" in text and "missing: no folder at" in text


def test_the_command_line(tmp_path, capsys):
    assert main(["doctor", f"warm={tmp_path}", "--probe-bytes", "64K", "--budget", "warm=1M"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("warm ") and "OK" in out
    assert main(["doctor", f"warm={tmp_path}", f"gone={tmp_path / 'gone'}", "--json", "--probe-bytes", "64K"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(d["name"], d["status"]) for d in doc] == [("warm", "ok"), ("gone", "failed")]
    config = tmp_path / "cache.json"
    config.write_text(json.dumps({"warm_dir": str(tmp_path), "warm_bytes": 1 << 20}))
    assert main(["doctor", "--config", str(config), "--probe-bytes", "64K"]) == 0
    assert main(["doctor", f"warm={tmp_path}", "--budget", "cold=1G"]) == 2  # no tier named cold
    assert "no tier named 'cold'" in capsys.readouterr().err
    assert main(["doctor"]) == 2
    assert "needs at least one tier" in capsys.readouterr().err


def test_the_command_line_exit_code_and_help(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-m", "datapipe.cli", "doctor", str(tmp_path / "gone")], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and "FAILED" in r.stdout and "1 tier(s) failed: tier0" in r.stderr
    r = subprocess.run([sys.executable, "-m", "datapipe.cli", "doctor", "--help"], capture_output=True, text=True,
                       env=env, check=True)
    for words in ("fsync", "--budget", "--config", "--json", "Exit code 0", "TieredCache"):
        assert words in r.stdout
    r = subprocess.run([sys.executable, "-m", "datapipe.cli", "--help"], capture_output=True, text=True, env=env,
                       check=True)
    assert "doctor" in r.stdout and "status" in r.stdout
