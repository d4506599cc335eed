"""A checkpoint writer checks its local tiers as it starts (the doctor's folder check, cheap):
a tier below the first whose folder cannot be written is out of the path from the start, with
one warning naming it and the fix, never an exception; saves commit on the other tiers, the
tier is probed before each save and taken back when it answers. Real folders, made read-only
for real (``chattr +i`` for root)."""

from __future__ import annotations

import warnings

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, Tier, list_checkpoints
from datapipe.errors import CheckpointError
from datapipe.health import PROBE_PREFIX
from tests.folder_faults import ReadOnly


def _state(step):
    return {"x": torch.arange(1000 * step), "step": step}


def _messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


@pytest.mark.parametrize("background", ["process", "thread"])
def test_a_read_only_tier_below_the_first_is_out_from_the_start_and_taken_back(tmp_path, background):
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    local.mkdir()
    tiers = [Tier(str(remote), keep_last=10), Tier(str(local), keep_last=10, node_local=True)]
    ro = ReadOnly(local)
    ro.on()
    metrics = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w = CheckpointWriter(tiers=tiers, background=background, chunk_bytes=4096)  # no exception
            try:
                for step in (1, 2, 3, 4):
                    if step == 3:
                        ro.off()  # fixed: the probe before step 3 takes it back
                    metrics[step] = w.save(step, _state(step)).wait()
            finally:
                w.close()
    finally:
        ro.off()
    out = _messages(caught, "out of the path from the start")
    assert len(out) == 1, [str(c.message) for c in caught]
    assert str(local) in out[0] and "read-only" in out[0] and "fix its owner or mode" in out[0]
    assert len(_messages(caught, "back in the path")) == 1
    for step, m in metrics.items():
        assert m["committed"] and "durable_s" in m["tiers"][str(remote)], (step, m)
    for step in (1, 2):
        assert "skipped" in metrics[step]["tiers"][str(local)] and metrics[step]["tiers_out"] == [str(local)]
    for step in (3, 4):
        assert "durable_s" in metrics[step]["tiers"][str(local)] and metrics[step]["tiers_out"] == []
    assert [c.step for c in list_checkpoints(str(local / "rank-00000")) if c.complete] == [3, 4]
    assert [c.step for c in list_checkpoints(str(remote)) if c.complete] == [1, 2, 3, 4]
    # the check leaves nothing behind
    assert not [p for p in tmp_path.rglob(f"{PROBE_PREFIX}*")]


def test_healthy_tiers_pass_the_check_without_a_word(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    local.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = CheckpointWriter(tiers=[Tier(str(remote)), Tier(str(local), node_local=True)], background="thread")
        try:
            m = w.save(1, _state(1)).wait()
        finally:
            w.close()
    assert [str(c.message) for c in caught if "tier" in str(c.message)] == []
    assert m["tiers_out"] == []
    assert not [p for p in tmp_path.rglob(f"{PROBE_PREFIX}*")]


def test_a_read_only_first_tier_is_still_an_error_naming_it(tmp_path):
    # the first tier is where a one-tier writer's saves go: it is not passed by
    remote = tmp_path / "remote"
    remote.mkdir()
    ro = ReadOnly(remote)
    ro.on()
    try:
        with pytest.raises(CheckpointError, match=str(remote)):
            CheckpointWriter(tiers=[Tier(str(remote)), Tier(str(tmp_path / "local"), node_local=True)],
                             background="thread")
    finally:
        ro.off()
