"""Checkpoint tiers in one process: cadence and retention per tier, one staging copy for
every due tier, a save no tier is due for costs nothing, the remote tier on moto S3,
restore from the best place, and damaged manifests in a tier (hypothesis)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, Tier, list_checkpoints, load_checkpoint, restore_checkpoint
from datapipe.checkpoint.format import encode_doc
from datapipe.errors import CheckpointError, NoCheckpointError


def _state(step: int):
    return {"w": torch.full((64, 65), float(step)), "step": step, "ids": torch.arange(1000) * step}


def test_cadence_retention_and_one_staging_copy(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    tiers = [Tier(local, every=2, keep_last=2, node_local=True), Tier(remote, every=5, keep_last=1, keep_every=10)]
    with CheckpointWriter(tiers=tiers, chunk_bytes=4096) as w:
        for step in range(1, 13):
            m = w.save(step, _state(step)).wait()
            due = [t.url for t in tiers if step % t.every == 0]
            assert m["due_tiers"] == due and sorted(m.get("tiers", {})) == sorted(due)
            if step == 10:  # both tiers from one copy: a buffer taken once, checksums computed once
                assert m["tiers"][local]["stored_bytes"] == m["tiers"][remote]["stored_bytes"] == m["bytes"]
        assert w._staging.allocations == 1
    assert [(c.step, c.complete) for c in list_checkpoints(local + "/rank-00000")] == [(10, True), (12, True)]
    # keep_last=1 keeps 10 (keep_every) and nothing else: 5 went when 10 committed
    assert [(c.step, c.complete) for c in list_checkpoints(remote)] == [(10, True)]
    r = restore_checkpoint(tiers)
    assert (r.step, r.source, r.sources) == (12, "local", ["local"])
    assert torch.equal(r.state["ids"], _state(12)["ids"])
    assert load_checkpoint(tiers=tiers)["step"] == 12  # the existing entry point, tiers= form
    shutil.rmtree(local)  # the node's disk is gone: the remote tier has step 10
    r = restore_checkpoint(tiers)
    assert (r.step, r.source) == (10, "remote") and r.state["step"] == 10


def test_a_step_no_tier_is_due_for_costs_nothing(tmp_path):
    tiers = [Tier(str(tmp_path / "a"), every=3)]
    with CheckpointWriter(tiers=tiers) as w:
        # not flattened, not staged: even a state that could not be saved is not looked at
        h = w.save(1, {"x": object()})
        assert h.skipped and h.done() and h.metrics["due_tiers"] == [] and w.staging_bytes == 0
        with pytest.raises(CheckpointError, match="object"):
            w.save(3, {"x": object()})
        w.save(3, _state(3)).wait()
    assert [c.step for c in list_checkpoints(str(tmp_path / "a"))] == [3]


def test_tier_arguments_are_checked(tmp_path):
    for kw in ({"every": 0}, {"keep_last": 0}, {"keep_every": 0}, {"replicate": 2},
               {"replicate": 1, "node_local": False}):
        with pytest.raises(CheckpointError):
            Tier(str(tmp_path), **kw)
    with pytest.raises(CheckpointError, match="url or tiers"):
        CheckpointWriter(str(tmp_path), tiers=[Tier(str(tmp_path / "x"))])
    with pytest.raises(CheckpointError, match="share a URL"):
        CheckpointWriter(tiers=[Tier(str(tmp_path)), Tier(str(tmp_path))])
    with pytest.raises(CheckpointError, match="two nodes"):  # one node: a replica would die with it
        CheckpointWriter(tiers=[Tier(str(tmp_path), replicate=1)], ranks_per_node=1)


def test_remote_tier_on_s3(tmp_path, s3):
    root, opts = s3
    local = str(tmp_path / "local")
    tiers = [Tier(local, every=1, keep_last=1, node_local=True),
             Tier(f"{root}/ckpt", every=2, keep_last=2, storage_options=opts)]
    with CheckpointWriter(tiers=tiers, chunk_bytes=4096, compression="zstd") as w:
        for step in range(1, 6):
            w.save(step, _state(step)).wait()
    assert [c.step for c in list_checkpoints(f"{root}/ckpt", storage_options=opts)] == [2, 4]
    assert restore_checkpoint(tiers).source == "local"
    # the local copy of step 5 is corrupt, and the remote tier's step 4 is the newest good one
    chunk = next((tmp_path / "local" / "rank-00000").rglob("chunk-000000.bin"))
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"local copy of rank 0's part of step 5 .*rank-00000"):
        r = restore_checkpoint(tiers)
    assert (r.step, r.source) == (4, "remote") and torch.equal(r.state["w"], _state(4)["w"])


# -- damaged manifests in a tier ---------------------------------------------------------

def _damage(path, how: str, pos: int, value: int) -> None:
    if not path.is_file():  # replaced by something that is not a file before
        return
    if how in ("fifo", "loop"):  # a FIFO would block a reader forever; a symlink loop is an OSError
        path.unlink()
        os.mkfifo(path) if how == "fifo" else os.symlink(path, path)
        return
    data = bytearray(path.read_bytes())
    if not data:  # truncated to nothing before
        return
    if how == "flip":
        data[pos % len(data)] ^= value or 1
    elif how == "truncate":
        data = data[: pos % len(data)]
    elif how == "resign":
        # a document edited by someone who recomputed its checksum: a valid manifest that lies
        try:
            doc = json.loads(data)
        except ValueError:  # damaged before: leave it so
            return
        doc.pop("checksum")
        field = ["step", "world_size", "origin", "parts", "data_bytes", "attempt"][pos % 6]
        doc[field] = [value, "x", None, {"rank": 9, "world_size": 1}, [], -1][value % 6]
        data = bytearray(encode_doc({k: v for k, v in doc.items() if k not in ("format", "kind", "version")},
                                    "manifest"))
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved_tiers(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiers")
    tiers = [Tier(str(base / "local"), every=1, keep_last=2, node_local=True), Tier(str(base / "remote"), every=2)]
    with CheckpointWriter(tiers=tiers, chunk_bytes=4096) as w:
        for step in range(1, 5):
            w.save(step, _state(step)).wait()
    return base


@pytest.mark.timeout(300)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(victims=st.lists(st.tuples(st.sampled_from(["local3", "local4", "remote2", "remote4"]),
                                  st.sampled_from(["flip", "truncate", "resign", "fifo", "loop"]),
                                  st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4))
def test_damaged_manifests_in_tiers(saved_tiers, tmp_path_factory, victims):
    base = tmp_path_factory.mktemp("case")
    shutil.copytree(saved_tiers, base, dirs_exist_ok=True)
    tiers = [Tier(str(base / "local"), every=1, keep_last=2, node_local=True), Tier(str(base / "remote"), every=2)]
    paths = {"local3": base / "local/rank-00000/step-000000000003/manifest.json",
             "local4": base / "local/rank-00000/step-000000000004/manifest.json",
             "remote2": base / "remote/step-000000000002/manifest.json",
             "remote4": base / "remote/step-000000000004/manifest.json"}
    for name, how, pos, value in victims:
        _damage(paths[name], how, pos, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            r = restore_checkpoint(tiers)
        except NoCheckpointError:
            return  # every copy damaged: said so, no loop, nothing else raised
    # whatever loads is exactly what was saved at that step, and no newer intact copy was passed over
    s = r.step
    assert r.state["step"] == s and torch.equal(r.state["ids"], _state(s)["ids"])
    damaged = {n for n, *_rest in victims}
    intact = [4 if "local4" not in damaged else None, 4 if "remote4" not in damaged else None,
              3 if "local3" not in damaged else None, 2 if "remote2" not in damaged else None]
    newest_intact = max((x for x in intact if x is not None), default=None)
    assert newest_intact is None or s >= newest_intact


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["part-fifo", "manifest-loop", "attempt-is-a-file"])
def test_a_step_holding_what_is_not_a_file_is_skipped_by_name(saved_tiers, tmp_path_factory, what):
    base = tmp_path_factory.mktemp("odd")
    shutil.copytree(saved_tiers, base, dirs_exist_ok=True)
    tiers = [Tier(str(base / "local"), every=1, keep_last=2, node_local=True), Tier(str(base / "remote"), every=2)]
    step4 = base / "local/rank-00000/step-000000000004"
    if what == "part-fifo":
        victim = glob.glob(str(step4 / "*" / "part-00000.json"))[0]
        os.unlink(victim)
        os.mkfifo(victim)
    elif what == "manifest-loop":
        victim = str(step4 / "manifest.json")
        os.unlink(victim)
        os.symlink(victim, victim)
    else:
        victim = glob.glob(str(step4 / "*-*"))[0]
        shutil.rmtree(victim)
        open(victim, "wb").close()
    with pytest.warns(UserWarning, match="step-000000000004") as seen:
        r = restore_checkpoint(tiers)
    assert (r.step, r.source) == (4, "remote") and torch.equal(r.state["w"], _state(4)["w"])
    assert any(os.path.basename(victim) in str(w.message) or "step-000000000004" in str(w.message) for w in seen)
    local = str(base / "local/rank-00000")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_checkpoint(local)["step"] == 3  # the folder alone: the next older step
