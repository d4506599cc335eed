"""``restore_checkpoint`` over tiers that hold two saves of one step (a run saved step 4
to the shared tier, a later run saved step 4 again to the node-local tier only): the later
save wins, whatever the two runs' ids are; manifests without a commit time still load, and
two saves that the manifests cannot order are refused by name."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, Tier, restore_checkpoint
from datapipe.checkpoint.format import encode_doc
from datapipe.errors import CheckpointError


def _two_saves(root: str, first: str | None, later: str | None) -> tuple[Tier, Tier]:
    local, remote = Tier(os.path.join(root, "local"), node_local=True), Tier(os.path.join(root, "remote"))
    # threads: a writer process per save would be most of this file's time
    with CheckpointWriter(tiers=[remote], run_id=first, background="thread") as w:  # run A: step 4, shared tier
        w.save(4, {"run": "A", "x": torch.ones(3)}).wait()
    with CheckpointWriter(tiers=[local], run_id=later, background="thread") as w:  # run B, later: again, node-local
        w.save(4, {"run": "B", "x": torch.ones(3) * 2}).wait()
    return local, remote


@pytest.mark.parametrize("first, later", [("zzz", "aaa"), ("aaa", "zzz"), (None, None)])
def test_the_later_of_two_saves_of_a_step_is_restored(tmp_path, first, later):
    # ("zzz", "aaa"): the earlier run's attempt name sorts after the later run's
    for i in range(3 if first is None else 1):  # drawn ids: either order, as chance gives it
        local, remote = _two_saves(str(tmp_path / str(i)), first, later)
        r = restore_checkpoint([local, remote])
        assert (r.step, r.state["run"], r.source) == (4, "B", "local"), r
        assert torch.equal(r.state["x"], torch.ones(3) * 2)


def _manifests(tier: Tier) -> list[str]:
    return glob.glob(os.path.join(tier.url, "**", "manifest.json"), recursive=True)


def _edit(path: str, **fields: object) -> None:
    """Rewrite a manifest with ``fields`` changed (``None``: removed), its checksum recomputed."""
    with open(path) as f:
        doc = json.load(f)
    for k, v in fields.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    with open(path, "wb") as f:
        f.write(encode_doc(doc, "manifest"))


def test_a_manifest_without_a_commit_time_still_restores(tmp_path):
    """Manifests written before the commit time was read (or edited without one) load as
    before; of two saves, the one with a commit time ranks above the one without."""
    local, remote = _two_saves(str(tmp_path), "aaa", "zzz")
    for m in _manifests(remote):
        _edit(m, created_unix=None)
    r = restore_checkpoint([local, remote])
    assert r.state["run"] == "B"
    r = restore_checkpoint([remote])  # the only save there: loads without a commit time
    assert (r.step, r.state["run"], r.source) == (4, "A", "remote")


def test_two_saves_the_manifests_cannot_order_are_refused_by_name(tmp_path):
    local, remote = _two_saves(str(tmp_path), "aaa", "zzz")
    for m in _manifests(local) + _manifests(remote):
        _edit(m, created_unix=1_000_000.0)
    with pytest.raises(CheckpointError, match=r"step 4 was saved twice, as attempts aaa_\w+-0 and zzz_\w+-0"):
        restore_checkpoint([local, remote])


@settings(max_examples=30)
@given(st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.integers(), st.lists(st.integers(), max_size=2),
                 st.floats(allow_nan=False, allow_infinity=False)))
def test_any_commit_time_in_a_manifest_restores_or_is_refused_by_name(tmp_path_factory, when):
    """A commit time of any JSON value (an edited manifest with its checksum recomputed) is
    read as a time or as none, never raised as a foreign error."""
    local, remote = _two_saves(str(tmp_path_factory.mktemp("t")), "aaa", "zzz")
    for m in _manifests(remote):
        _edit(m, created_unix=when)
    try:
        r = restore_checkpoint([local, remote])
    except CheckpointError as e:
        assert "saved twice" in str(e)
    else:
        assert r.state["run"] in ("A", "B") and r.step == 4
