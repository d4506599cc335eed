"""A checkpoint tier that fails during training is taken out of the path and taken back:
a writer with a node-local tier and a shared one, whose local folder is made read-only
(for root: ``chattr +i``), then removed and replaced by a file, then freed. Every save
commits on the shared tier, none raises, the local tier's failure is said once and its
return once, and no step that the local tier did not finish is listed complete there."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, Tier, list_checkpoints, load_checkpoint, restore_checkpoint
from datapipe.errors import CheckpointError
from tests.folder_faults import ReadOnly


def _state(step):
    return {"x": torch.arange(1000 * step), "step": step}


def _messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


@pytest.mark.parametrize("background", ["process", "thread"])
def test_a_failing_local_tier_is_skipped_and_taken_back(tmp_path, background):
    local, remote = tmp_path / "local", tmp_path / "remote"
    tiers = [Tier(str(local), keep_last=10, node_local=True), Tier(str(remote), keep_last=10)]
    ro = ReadOnly(local)
    metrics = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = CheckpointWriter(tiers=tiers, background=background, chunk_bytes=4096)
        try:
            for step in range(1, 9):
                if step == 3:
                    ro.on()  # read-only
                elif step == 5:
                    ro.replace_by_file()  # removed, and nothing can be written at its path
                elif step == 7:
                    os.unlink(local)  # free again: the probe writes there, the lease is taken again
                metrics[step] = w.save(step, _state(step)).wait()  # never raises
        finally:
            w.close()
            ro.off()
    for step, m in metrics.items():
        assert m["committed"], (step, m)
        assert "durable_s" in m["tiers"][str(remote)]
    assert "error" in metrics[3]["tiers"][str(local)] and metrics[3]["tiers_out"] == [str(local)]
    for step in (4, 5, 6):
        assert "skipped" in metrics[step]["tiers"][str(local)], metrics[step]
    for step in (7, 8):
        assert "durable_s" in metrics[step]["tiers"][str(local)] and metrics[step]["tiers_out"] == []
    out = _messages(caught, "taken out of the path")
    assert len(out) == 1 and str(local) in out[0] and "step 3" in out[0], [str(c.message) for c in caught]
    back = _messages(caught, "back in the path")
    assert len(back) == 1 and str(local) in back[0] and "step 7" in back[0]
    # nothing the failed tier did not finish is listed complete there
    assert [c.step for c in list_checkpoints(str(local / "rank-00000")) if c.complete] == [7, 8]
    assert [c.step for c in list_checkpoints(str(remote)) if c.complete] == list(range(1, 9))
    for step in (3, 5):  # committed on the remaining tier and restorable from it
        assert torch.equal(load_checkpoint(str(remote), step=step)["x"], torch.arange(1000 * step))
    r = restore_checkpoint(tiers)
    assert r.step == 8 and torch.equal(r.state["x"], torch.arange(8000))


@pytest.mark.parametrize("background", ["process", "thread"])
def test_a_step_no_tier_took_is_a_named_error(tmp_path, background):
    local, remote = tmp_path / "local", tmp_path / "remote"
    tiers = [Tier(str(local), node_local=True), Tier(str(remote))]
    ro_local, ro_remote = ReadOnly(local), ReadOnly(remote)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        w = CheckpointWriter(tiers=tiers, background=background, chunk_bytes=4096)
        try:
            w.save(1, _state(1)).wait()
            ro_local.on()
            ro_remote.on()
            with pytest.raises(CheckpointError, match=r"step 2 failed in 2 of 2 tiers.*local.*remote"):
                w.save(2, _state(2)).wait()
            with pytest.raises(CheckpointError, match=r"step 3 failed in 2 of 2 tiers.*out of the path"):
                w.save(3, _state(3)).wait()  # both out, both probed, both fail again: still raised
            ro_remote.off()
            m = w.save(4, _state(4)).wait()  # one back: the step is saved again
            assert m["committed"] and m["tiers_out"] == [str(local)]
        finally:
            w.close()
            ro_local.off()
            ro_remote.off()
    assert [c.step for c in list_checkpoints(str(remote)) if c.complete] == [1, 4]


def test_a_one_tier_writer_whose_tier_is_out_raises(tmp_path):
    url = tmp_path / "ckpt"
    ro = ReadOnly(url)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        w = CheckpointWriter(str(url), background="thread", chunk_bytes=4096)
        try:
            w.save(1, _state(1)).wait()
            ro.on()
            with pytest.raises(CheckpointError, match=r"step 2 .*Operation not permitted|step 2 .*Permission"):
                w.save(2, _state(2)).wait()  # its own error, as before
            with pytest.raises(CheckpointError, match=r"step 3 .*out of the path.*probe"):
                w.save(3, _state(3)).wait()
            ro.off()
            assert w.save(4, _state(4)).wait()["committed"]
        finally:
            w.close()
            ro.off()
    assert [c.step for c in list_checkpoints(str(url)) if c.complete] == [1, 4]


def test_a_tier_whose_lease_another_writer_took_is_not_taken_back(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    tiers = [Tier(str(local), keep_last=10, node_local=True), Tier(str(remote), keep_last=10)]
    own = local / "rank-00000"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = CheckpointWriter(tiers=tiers, background="thread", chunk_bytes=4096)
        try:
            w.save(1, _state(1)).wait()
            os.unlink(own / "writer.lease")
            other = CheckpointWriter(str(own), background="thread", run_id="other")  # takes the URL over
            try:
                other.save(100, _state(1)).wait()
                m2 = w.save(2, _state(2)).wait()  # the lease is lost: the local tier goes out
            finally:
                other.close()
            m3 = w.save(3, _state(3)).wait()  # writable and free, but taken over once: never again ours
        finally:
            w.close()
    assert m2["committed"] and m2["tiers_out"] == [str(local)] and "lost its lease" in m2["tiers"][str(local)]["error"]
    assert m3["committed"] and "skipped" in m3["tiers"][str(local)] and m3["tiers_out"] == [str(local)]
    assert not _messages(caught, "back in the path")
    assert [c.step for c in list_checkpoints(str(own)) if c.complete] == [1, 100]
