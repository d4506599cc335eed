"""A failed ``load_checkpoint(into=...)`` leaves no unverified bytes in the caller's arrays."""

from __future__ import annotations

import os

import numpy as np
import pytest

from datapipe.checkpoint import CheckpointWriter, load_checkpoint
from datapipe.errors import CorruptCheckpointError


# -- 3: a failed load into= leaves no unverified bytes in the caller's tensors -----------------
def test_failed_load_into_writes_no_unverified_bytes(tmp_path):
    url = str(tmp_path / "ck")
    with CheckpointWriter(url) as w:
        w.save(1, {"w": np.arange(1 << 14, dtype=np.int64)})
    chunks = [os.path.join(d, f) for d, _s, fs in os.walk(url) for f in fs if f.endswith(".bin")]
    assert len(chunks) == 1
    data = bytearray(open(chunks[0], "rb").read())
    data[len(data) // 2] ^= 0x01
    open(chunks[0], "wb").write(bytes(data))
    into = {"w": np.zeros(1 << 14, dtype=np.int64)}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_checkpoint(url, step=1, into=into)
    assert not into["w"].any(), "corrupt bytes were written into the caller's array"
