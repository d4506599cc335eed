"""`datapipe inspect` on a destination a pack is writing now: its manifest is not missing,
it is not there yet. The pack's writer lease says who holds it (host, pid, since when),
read without taking the lease; before, the message told the user to run the pack again
while it was still running. A pack that died (its lease no longer held) still gets that
advice."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

from datapipe.publish import WriterLock
from datapipe.storage import open_store
from datapipe.storage.lease import current_holder


def _inspect(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", "inspect", url, *extra], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_inspect_names_the_pack_writing_the_destination_now(tmp_path):
    dest = str(tmp_path / "ds")
    with WriterLock(open_store(dest)):  # what a running pack holds
        out = _inspect(dest)
        holder = current_holder(open_store(dest), "_pack/writer.lock")
    assert out.returncode == 2
    assert "being packed now by writer" in out.stderr, out.stderr
    assert f"host {socket.gethostname()!r}, pid {os.getpid()}" in out.stderr and "since 2" in out.stderr
    assert "wait for that pack to finish" in out.stderr
    assert "run the same `datapipe pack` command again" not in out.stderr  # before: this, while it ran
    assert holder is not None and holder.local and holder.doc["pid"] == os.getpid()
    assert current_holder(open_store(dest), "_pack/writer.lock") is None  # released with the pack


def test_a_pack_that_died_still_gets_the_advice_to_run_it_again(tmp_path):
    dest = str(tmp_path / "ds")
    holder = textwrap.dedent(f"""
        import os, sys, time
        from datapipe.publish import WriterLock
        from datapipe.storage import open_store
        lock = WriterLock(open_store({dest!r})).__enter__()
        open({str(tmp_path / "work.tmp")!r}, "w").write("a temporary of the killed pack")
        os.rename({str(tmp_path / "work.tmp")!r}, {dest!r} + "/_pack/left.json")
        print("held", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout.readline().strip() == "held"
        assert "being packed now" in _inspect(dest).stderr
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    out = _inspect(dest)
    assert out.returncode == 2 and "being packed now" not in out.stderr
    assert "packing did not finish: run the same `datapipe pack` command again" in out.stderr, out.stderr
    assert current_holder(open_store(dest), "_pack/writer.lock") is None


def test_a_pack_writing_to_s3_is_named_by_its_lease(s3):
    import json

    root, opts = s3
    dest = f"{root}/ds"
    with WriterLock(open_store(dest, opts)):
        out = _inspect(dest, "--storage-options", json.dumps(opts))
        holder = current_holder(open_store(dest, opts), "_pack/lease.json")
    assert out.returncode == 2 and "being packed now by writer" in out.stderr, out.stderr
    assert f"pid {os.getpid()}" in out.stderr and "last heartbeat" in out.stderr
    assert holder is not None and not holder.local
    assert current_holder(open_store(dest, opts), "_pack/lease.json") is None
