"""A failed ``load_checkpoint(into=...)`` leaves no unverified bytes in the caller's arrays;
a box read block by block through a reading thread's scratch buffer is the saved run."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, LocalShard, load_checkpoint, reshard
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


# -- a box read block by block through a reading thread's scratch buffer ----------------------
# A 1-D tensor of 3.4 MiB in chunks of 2 MiB (blocks of 1 MiB: the second chunk's last block
# is short); a LocalShard of any run of it is filled from one contiguous run of the saved
# piece, read and checked in the scratch buffer one run of whole blocks at a time.

N = 891_237  # int32 values: 3,564,948 bytes
CHUNK = 2 << 20


@pytest.fixture(scope="module")
def long_step(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("through") / "ck")
    with CheckpointWriter(url, chunk_bytes=CHUNK, io_threads=1) as w:
        w.save(1, {"w": torch.arange(N, dtype=torch.int32)})
    chunks = sorted(os.path.join(d, f) for d, _s, fs in os.walk(url) for f in fs if f.endswith(".bin"))
    assert len(chunks) == 2 and os.path.getsize(chunks[0]) == CHUNK  # the range crosses a chunk's end
    return url, chunks


@given(a=st.integers(0, N - 1), n=st.integers(1, N), scratch=st.sampled_from([1 << 20, 3 << 19, 1 << 21, 1 << 19]))
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_run_read_through_the_scratch_buffer_is_the_saved_run(long_step, monkeypatch, a, n, scratch):
    # scratch sizes: one block, one and a half, two, and half a block (below a block the
    # chunk goes through a buffer of its own)
    url, _chunks = long_step
    n = min(n, N - a)
    monkeypatch.setattr(reshard, "SCRATCH_BYTES", scratch)  # read by each new reading thread
    into = {"w": LocalShard(torch.full((n,), -1, dtype=torch.int32), (N,), (a,))}
    load_checkpoint(url, step=1, into=into)
    assert torch.equal(into["w"].tensor, torch.arange(a, a + n, dtype=torch.int32))


def test_a_bad_block_in_a_long_run_reaches_no_byte_of_the_target(tmp_path):
    url = str(tmp_path / "ck")
    with CheckpointWriter(url, chunk_bytes=CHUNK, io_threads=1) as w:
        w.save(1, {"w": torch.arange(N, dtype=torch.int32)})
    first = sorted(os.path.join(d, f) for d, _s, fs in os.walk(url) for f in fs if f.endswith(".bin"))[0]
    bad = (1 << 20) + 1000  # a byte of the first chunk's second block
    with open(first, "r+b") as f:
        f.seek(bad)
        byte = f.read(1)
        f.seek(bad)
        f.write(bytes([byte[0] ^ 0x10]))
    target = torch.full((N,), -1, dtype=torch.int32)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_checkpoint(url, step=1, into={"w": LocalShard(target, (N,), (0,))})
    block = slice((1 << 20) // 4, (2 << 20) // 4)  # the bad block's values
    assert (target[block] == -1).all(), "bytes of a block that failed its check reached the target"
    written = target != -1
    assert torch.equal(target[written], torch.arange(N, dtype=torch.int32)[written])  # only checked bytes


# -- strided boxes: each reading thread reuses its slab buffer from one copy to the next ------
# 20 tensors of different widths, more than a load's 8 reading threads: a thread reads the
# spans of several copies, of several sizes, into the one buffer, and each box must hold
# exactly its columns.

WIDTHS = [37 * (i + 1) for i in range(20)]
ROWS_2D = 600


@pytest.fixture(scope="module")
def wide_step(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("strided") / "ck")
    state = {f"t{i}": torch.arange(ROWS_2D * w, dtype=torch.int32).reshape(ROWS_2D, w) + i
             for i, w in enumerate(WIDTHS)}
    with CheckpointWriter(url, chunk_bytes=CHUNK) as w:
        w.save(1, state)
    return url, state


@given(cuts=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)), min_size=20, max_size=20))
@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_strided_boxes_read_through_a_reused_slab_buffer_hold_their_columns(wide_step, cuts):
    url, state = wide_step
    into, want = {}, {}
    for i, (w, (c, span, row)) in enumerate(zip(WIDTHS, cuts)):
        c0 = min(int(c * w), w - 1)
        c1 = c0 + 1 + int(span * (w - c0 - 1))
        r0 = int(row * (ROWS_2D - 1))
        into[f"t{i}"] = LocalShard(torch.full((ROWS_2D - r0, c1 - c0), -1, dtype=torch.int32), (ROWS_2D, w), (r0, c0))
        want[f"t{i}"] = state[f"t{i}"][r0:, c0:c1]
    load_checkpoint(url, step=1, into=into)
    for k, v in want.items():
        assert torch.equal(into[k].tensor, v), k
