import gc
import multiprocessing
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.ranks import PRELOAD
from tools.s3_endpoint import LocalS3

# Before anything in this process starts a forkserver: it imports torch once, and every rank
# of a multi-rank test (tests/ranks.py) and every forkserver child after it is forked from it
# with torch already imported, where a spawned process spends 2.7 s of CPU importing it.
multiprocessing.set_forkserver_preload(PRELOAD)

# No test is timed: hypothesis' default 200 ms deadline per example failed a property test on
# a loaded machine (DeadlineExceeded at 201.76 ms). Speed lives in the benchmarks.
settings.register_profile("datapipe", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("datapipe")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test: collect the garbage of the tests before it (until nothing more is
    found: a collection runs finalizers that free more), then freeze what is still alive
    (imported modules, torch, boto and moto, session and module fixtures) so that Python's
    automatic full collections scan only what this test makes. Unfrozen, a full collection
    of the suite's heap took 0.3-0.5 s and ran several times in an S3-heavy test (a
    quarter of the S3 tests' time). Nothing a test makes is frozen before it ends, so its
    own gc.collect() and finalizers behave as before. An object alive at a freeze that
    later dies in a reference cycle is not reclaimed until the session's end (a few MB
    per loader test module: a finished pass's prefetcher and its shard buffers)."""
    while gc.collect():
        pass
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Give what the freezes kept back to the collector, so pytest's last collections
    (and their ResourceWarnings) see it."""
    gc.unfreeze()
    gc.collect()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1, one per test session."""
    with LocalS3() as server:
        yield server


@pytest.fixture
def s3(s3_server):
    """A fresh bucket on the loopback S3 server; yields (root URL, storage_options)."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    root = s3_server.create_bucket(bucket)
    return root, s3_server.storage_options


class Tmpfs:
    """A tmpfs mounted at ``path`` for one test (a full disk of a known size, or a
    filesystem that can turn read-only even for root, whom chmod does not stop)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def remount(self, mode: str) -> None:
        """``"ro"`` or ``"rw"``. The kernel answers "busy" while a file there is open for
        writing (a counter file being replaced), so a few refusals are retried."""
        for _ in range(100):
            r = subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"remount,{mode} of {self.path} failed: {r.stderr.decode()}")


@pytest.fixture
def tmpfs(tmp_path):
    """Factory: ``tmpfs("8m")`` mounts a fresh tmpfs of that size under ``tmp_path`` and
    returns a :class:`Tmpfs`; unmounted after the test. Where no tmpfs can be mounted (not
    root, no mount(8), the mount refused) the test is skipped with the reason, or, with
    ``optional=True`` (a caller that has a fallback), None is returned."""
    mounted: list[Path] = []

    def mount(size: str, *, optional: bool = False) -> Tmpfs | None:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            why = "mounting a tmpfs needs root and mount(8)"
        else:
            path = tmp_path / f"tmpfs-{len(mounted)}"
            path.mkdir()
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
            if r.returncode == 0:
                mounted.append(path)
                return Tmpfs(path)
            why = f"cannot mount a tmpfs here: {r.stderr.decode().strip()}"
        if optional:
            return None
        pytest.skip(why)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
