"""Bad arguments to the checkpoint API are CheckpointOptionError: a CheckpointError (what
callers caught before) and an OptionError, so a ValueError too, naming the argument and the
value. And url=/keep_last=/keep_every=/storage_options= are the shorthand of one Tier:
the writer has one path, so beside tiers= they are refused instead of ignored."""

from __future__ import annotations

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, Tier, list_checkpoints, load_checkpoint, restore_checkpoint
from datapipe.errors import CheckpointError, CheckpointOptionError, OptionError


def _refused(call, match):
    with pytest.raises(CheckpointOptionError, match=match) as e:
        call()
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, OptionError)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kw, match", [
    ({"keep_last": 0}, "keep_last must be an int >= 1"),
    ({"keep_every": 0}, "keep_every must be None or an int >= 1, got 0"),
    ({"compression": "lz4"}, "compression must be None or 'zstd', got 'lz4'"),
    ({"chunk_bytes": 100}, r"chunk_bytes must be an int in \[4096, 2\*\*32\], got 100"),
    ({"io_threads": 0}, "io_threads must be an int >= 1, got 0"),
    ({"if_busy": "drop"}, "if_busy must be 'wait' or 'skip', got 'drop'"),
    ({"background": "gpu"}, "background must be 'auto', 'thread' or 'process', got 'gpu'"),
    ({"max_staging_bytes": 0}, "max_staging_bytes must be positive, got 0"),
    ({"lease_ttl": 0}, "lease_ttl must be a positive number of seconds, got 0"),
    ({"run_id": "a b"}, "run_id must match"),
    ({"rank": 2, "world_size": 2, "run_id": "r"}, "rank 2 is not inside world size 2"),
])
def test_writer_arguments(tmp_path, kw, match):
    _refused(lambda: CheckpointWriter(str(tmp_path / "c"), **{"background": "thread", **kw}), match)


def test_tier_arguments(tmp_path):
    url = str(tmp_path)
    _refused(lambda: Tier(""), "Tier url must be a non-empty string")
    _refused(lambda: Tier(url, every=0), "every must be an int >= 1, got 0")
    _refused(lambda: Tier(url, keep_last=True), "keep_last must be an int >= 1")
    _refused(lambda: Tier(url, replicate=2), "replicate must be 0 or 1, got 2")
    _refused(lambda: Tier(url, replicate=1, node_local=False), "a shared tier")
    _refused(lambda: CheckpointWriter(tiers=[Tier(url, replicate=1)], ranks_per_node=1), "two nodes")
    _refused(lambda: CheckpointWriter(tiers=[]), "tiers must be a non-empty list of Tier")
    _refused(lambda: CheckpointWriter(tiers=[Tier(url), Tier(url)]), "share a URL")
    _refused(lambda: CheckpointWriter(), "needs a url or tiers")
    _refused(lambda: CheckpointWriter(url, tiers=[Tier(url)]), "a url or tiers=, not both")


def test_save_load_and_restore_arguments(tmp_path):
    url = str(tmp_path / "c")
    with CheckpointWriter(url, background="thread") as w:
        for step in (-1, 1.0, True, 10**12):
            _refused(lambda step=step: w.save(step, {}), "step must be an int in")
        _refused(lambda: w.save(1, {}, if_busy="later"), "if_busy must be 'wait' or 'skip'")
        w.save(1, {"x": torch.ones(3)}).wait()
    _refused(lambda: load_checkpoint(url, step=-2), "step must be a non-negative int")
    _refused(lambda: load_checkpoint(), "needs a url or tiers")
    _refused(lambda: load_checkpoint(url, tiers=[Tier(url)]), "takes no url")
    _refused(lambda: load_checkpoint(url, into={"x": torch.ones(1).expand(3)}), "share memory")
    _refused(lambda: restore_checkpoint([]), "tiers must be a non-empty list of Tier")
    _refused(lambda: restore_checkpoint([url]), "tiers must be a non-empty list of Tier")


def test_url_keep_last_keep_every_are_one_tier(tmp_path):
    url = str(tmp_path / "c")
    with CheckpointWriter(url, keep_last=2, keep_every=4, background="thread") as w:
        assert w.tiers == [Tier(url, every=1, keep_last=2, keep_every=4)]
        for step in range(1, 9):
            w.save(step, {"step": step}).wait()
    # the same retention as the tier it stands for: the last two and every 4th
    assert [c.step for c in list_checkpoints(url)] == [4, 7, 8]
    with CheckpointWriter(url, background="thread") as w:
        assert w.tiers == [Tier(url, every=1, keep_last=3)]  # keep_last's default is the Tier's


@pytest.mark.parametrize("kw", [{"keep_last": 2}, {"keep_every": 10}, {"storage_options": {"a": 1}}])
def test_the_one_tier_shorthand_is_refused_beside_tiers(tmp_path, kw):
    """Before, CheckpointWriter(tiers=[...], keep_last=2) ignored keep_last: each Tier's own
    retention applied, whatever the writer was told."""
    name = next(iter(kw))
    _refused(lambda: CheckpointWriter(tiers=[Tier(str(tmp_path))], **kw),
             rf"CheckpointWriter\(tiers=\.\.\.\) takes no {name}: .* give them to each Tier")
