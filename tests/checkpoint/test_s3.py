"""Checkpoints on an S3 destination (moto's server on 127.0.0.1 through s3fs)."""

from __future__ import annotations

import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.errors import CheckpointError, CorruptCheckpointError
from datapipe.storage import open_store


def test_s3_round_trip_retention_and_bit_flip(s3):
    root, opts = s3
    url = f"{root}/run1/ckpt"
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 30).to(torch.bfloat16)
    with CheckpointWriter(url, storage_options=opts, keep_last=2, chunk_bytes=4096,
                          compression="zstd") as w:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.add_(1)
            m = w.save(step, {"model": model.state_dict(), "step": step}).wait()
            assert m["committed"]
    assert [(s, c) for s, c in list_checkpoints(url, storage_options=opts)] == [(20, True), (30, True)]
    loaded = load_checkpoint(url, storage_options=opts)
    assert loaded["step"] == 30
    assert torch.equal(loaded["model"]["weight"].view(torch.int16), model.weight.detach().view(torch.int16))

    store = open_store(url, opts)
    assert store.exists("latest")
    chunk = next(k for k in store.list("step-000000000030/") if k.endswith(".bin"))
    data = bytearray(store.get(chunk))
    data[len(data) // 2] ^= 1
    store.put(chunk, bytes(data))
    with pytest.warns(UserWarning, match=r"step 30.*chunk-"):
        assert load_checkpoint(url, storage_options=opts)["step"] == 20
    with pytest.raises(CorruptCheckpointError, match="chunk-"):
        load_checkpoint(url, step=30, storage_options=opts)


def test_s3_failing_destination_surfaces(s3):
    _root, opts = s3
    # the writer lease is the first write: an unwritable URL fails at construction
    with pytest.raises(CheckpointError, match=r"no-such-bucket-dp/ckpt/writer\.lease"):
        CheckpointWriter("s3://no-such-bucket-dp/ckpt", storage_options=opts)
