"""The check of a folder tier at open (write, fsync, read back) runs once per process tree:
a DataLoader worker whose cache came from a process that checked the folder and found it
sound (forked, or pickled for spawn) does not check it again, epoch after epoch of fresh
workers (PyTorch's default). Counted node-wide (``<tier>_checks``), over real workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import sys
from torch.utils.data import DataLoader
from datapipe import ShardWriter
from datapipe.cache import TieredCache
from datapipe.loader import StreamingDataset

if __name__ == "__main__":
    d, context, parent_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    with ShardWriter(d + "/ds", max_samples=12) as w:
        for i in range(120):
            w.write({"__key__": f"k{i:05d}", "cls": str(i), "bin": bytes([i % 256]) * 700})
    cache = TieredCache(warm_dir=d + "/warm", warm_bytes=64 << 20)
    if parent_first:
        cache.stats()  # the parent opens its tiers (and checks them) before any worker starts
    ds = StreamingDataset(d + "/ds", cache=cache, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    for epoch in range(3):
        ds.set_epoch(epoch)
        assert sorted(int(x["cls"]) for x in loader) == list(range(120))
    del loader
    print("checks", cache.stats(node=True).get("warm_checks", 0))
"""


def _checks(tmp_path, context, parent_first):
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), context, "1" if parent_first else "0"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.split()[-1])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_fresh_workers_do_not_check_a_folder_their_parent_checked(tmp_path, context):
    # three epochs of two fresh workers each: six processes that open the tiers, none checks
    assert _checks(tmp_path, context, parent_first=True) == 1


def test_workers_check_when_no_process_above_them_did(tmp_path):
    # the parent opens no tier until it asks for the stats at the end: each of the six
    # fresh workers checks the folder, then the parent does
    assert _checks(tmp_path, "fork", parent_first=False) == 7
