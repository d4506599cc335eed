"""A save and a writer's settings as the writer process is sent them: PersistJob and
PersistConfig to their JSON wire form and back, in one place (persist.py), through real
JSON, every field the same on the other side; and both backgrounds (a thread, a writer
process) run the same job through the same interface to the same checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, Tier, load_checkpoint
from datapipe.checkpoint.persist import PersistConfig, PersistJob
from datapipe.errors import CheckpointError
from datapipe.storage import set_storage_options

TIERS = [Tier("/ckpt/local", every=2, keep_last=1, node_local=True), Tier("s3://b/ckpt", every=5, keep_every=100)]
JSONABLE = st.recursive(st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=10)


def _through_json(doc):
    return json.loads(json.dumps(doc, allow_nan=False))


@st.composite
def jobs(draw):
    specs = draw(st.lists(st.dictionaries(st.text(max_size=5), JSONABLE, max_size=3), max_size=3))
    total = draw(st.integers(0, 1 << 40))
    local = draw(st.booleans())
    received = draw(st.none() | st.binary(max_size=64))
    return PersistJob(
        draw(st.integers(0, 10**12 - 1)), f"{draw(st.from_regex(r'[A-Za-z0-9_]{1,64}', fullmatch=True))}-"
        f"{draw(st.integers(0, 10**9 - 1))}", draw(JSONABLE), specs, total,
        draw(st.lists(st.sampled_from(TIERS), min_size=1, max_size=2, unique=True)),
        draw(st.floats(0, 1e9)), draw(st.integers(1, 1 << 40)), draw(st.integers(1 << 20, 1 << 32)),
        draw(st.floats(0.001, 1e6)),
        raw_checksums={(a, a + n): f"{a:016x}" for a, n in draw(st.dictionaries(st.integers(0, 1 << 40),
                                                                                 st.integers(1, 1 << 32),
                                                                                 max_size=4)).items()},
        local_specs=specs[::-1] if local else None, local_total=total + 64 if local else 0,
        local_chunk_bytes=1 << 20 if local else 0,
        received=None if received is None else ({"step": 1, "raw_checksums": ["ab"]}, memoryview(received)),
        link_error=draw(st.none() | st.text(max_size=20)))


@given(jobs())
def test_a_job_comes_back_from_its_wire_form_whole(job):
    replica = None if job.received is None else memoryview(bytes(job.received[1]) + b"bytes after the replica")
    back = PersistJob.from_wire(_through_json(job.to_wire()), {t.url: t for t in TIERS}, replica)
    assert back == job  # every field; the received bytes compared by value
    assert all(a is b for a, b in zip(back.due, job.due))  # the writer process's own Tier objects


def test_a_replica_without_its_memory_is_refused():
    job = PersistJob(1, "r-0", {}, [], 0, TIERS[:1], 0.0, 1, 1 << 20, 60.0,
                     received=({"step": 1}, memoryview(b"abc")))
    with pytest.raises(CheckpointError, match="step 1: a replica was sent without the memory"):
        PersistJob.from_wire(_through_json(job.to_wire()), {t.url: t for t in TIERS}, None)


def test_a_config_comes_back_from_its_wire_form_with_the_storage_options_of_this_process():
    set_storage_options("s3://b/", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}})
    try:
        tiers = [TIERS[0], dataclasses.replace(TIERS[1], storage_options={"anon": True})]
        config = PersistConfig(tiers, 3, 8, "run", 4, "run_0123456789ab", True, "zstd", 5, 2, 7, 30.0, 1.5)
        back = PersistConfig.from_wire(_through_json(config.to_wire()))
    finally:
        set_storage_options("s3://b/", None)
    assert back == config
    # what reaches the store here travels with the tier: set_storage_options is this process's
    assert back.tiers[1].storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}, "anon": True}
    assert back.tiers[0].storage_options == {}


@pytest.mark.parametrize("background", ["thread", "process"])
def test_both_backgrounds_persist_the_same_checkpoint(tmp_path, background):
    url = str(tmp_path / "c")
    state = {"w": torch.arange(5000, dtype=torch.float32), "step": 3}
    with CheckpointWriter(url, background=background, chunk_bytes=4096, compression="zstd") as w:
        assert w.background == background and (w._background.pid is None) == (background == "thread")
        m = w.save(3, state).wait()
    assert m["committed"] and m["stored_bytes"] > 0
    out = load_checkpoint(url)
    assert out["step"] == 3 and torch.equal(out["w"], state["w"])
    assert sorted(os.listdir(url)) == ["latest", "step-000000000003"]  # the lease released
