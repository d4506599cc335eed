"""Global tensors without a process group: LocalShard and Replicated saved by two writers
of one 2-rank checkpoint (as two ranks would), read back by overlap; hostile edits of the
pieces' global records (offsets, shapes, regions, replica flags) in documents whose
checksums were recomputed; block checksums that check only what a read touches."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, LocalShard, Replicated, load_checkpoint
from datapipe.checkpoint.format import encode_doc, manifest_key
from datapipe.checksum import checksum
from datapipe.errors import CheckpointError, CorruptCheckpointError, UnsupportedStateError
from datapipe.storage import open_store

W = torch.arange(12 * 7, dtype=torch.float32).reshape(12, 7)
C = (torch.arange(5 * 9, dtype=torch.int16).reshape(5, 9) * 3)
R = np.linspace(0, 1, 33)

ROWS = [(0, 7), (7, 12)]  # W: Shard(0) over 2 ranks, unevenly
COLS = [(0, 4), (4, 9)]  # C: Shard(1)


def _state(r: int) -> dict:
    (a, b), (c, d) = ROWS[r], COLS[r]
    return {"w": LocalShard(W[a:b], W.shape, (a, 0)),
            "c": LocalShard(C[:, c:d].contiguous(), C.shape, (0, c)),
            "r": Replicated(R), "per": torch.full((3,), r), "loader": {"epoch": 1, "pos": [4, 5]}}


def _save(url: str, step: int = 1, world: int = 2, state=_state, **kw) -> None:
    writers = [CheckpointWriter(url, rank=r, world_size=world, run_id="fixed", **kw) for r in range(world)]
    try:
        for h in [w.save(step, state(r)) for r, w in enumerate(writers)]:
            h.wait()
    finally:
        for w in writers:
            w.close()


def _into() -> dict:
    return {"w": torch.zeros(12, 7), "c": LocalShard(torch.zeros(3, 5, dtype=torch.int16), (5, 9), (1, 2)),
            "r": np.zeros(33), "loader": None}


def _check_full(out: dict, into: dict) -> None:
    assert torch.equal(into["w"], W) and out["w"] is into["w"]
    assert torch.equal(into["c"].tensor, C[1:4, 2:7])
    assert np.array_equal(into["r"], R)
    assert out["loader"] == {"epoch": 1, "pos": [4, 5]}


def test_two_writers_reshard_by_overlap(tmp_path):
    url = str(tmp_path / "c")
    _save(url)
    into = _into()
    _check_full(load_checkpoint(url, into=into, rank=5), into)  # any rank of any world size
    part1 = load_checkpoint(url, rank=1)  # a part without into=: global tensors whole
    assert torch.equal(part1["w"], W) and torch.equal(part1["c"], C) and np.array_equal(part1["r"], R)
    assert torch.equal(part1["per"], torch.full((3,), 1))
    # a per-rank plain tensor has no box on another world size: said, with what to do
    with pytest.raises(CheckpointError, match="Replicated"):
        load_checkpoint(url, into={"per": torch.zeros(3, dtype=torch.int64)}, rank=3)
    out = load_checkpoint(url, into={"per": torch.zeros(3, dtype=torch.int64)}, rank=1)
    assert torch.equal(out["per"], torch.full((3,), 1))
    assert set(out) == {"per", "loader"}  # saved arrays `into` does not ask for are not read
    with pytest.raises(CheckpointError, match="global shape"):
        load_checkpoint(url, into={"w": torch.zeros(12, 8)})
    with pytest.raises(CheckpointError, match="float64"):
        load_checkpoint(url, into={"w": torch.zeros(12, 7, dtype=torch.float64)})
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        load_checkpoint(url, into={"nope": torch.zeros(1)})


def test_compressed_parts_reshard_too(tmp_path):
    url = str(tmp_path / "z")
    _save(url, compression="zstd")
    into = _into()
    _check_full(load_checkpoint(url, into=into), into)


def test_a_box_outside_the_global_tensor_is_refused_at_save(tmp_path):
    with pytest.raises(UnsupportedStateError, match="outside the global size"):
        with CheckpointWriter(str(tmp_path / "c")) as w:
            w.save(1, {"w": LocalShard(torch.zeros(3, 2), (4, 2), (2, 0))})


def test_block_checksums_check_what_is_read(tmp_path):
    """A 4 MiB tensor in one chunk of four 1 MiB blocks: a read of its first rows checks
    the first block only, so damage elsewhere goes unread (and is caught by a read that
    covers it); damage inside the rows read is caught, naming the chunk."""
    url = str(tmp_path / "b")
    big = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)
    with CheckpointWriter(url, io_threads=1) as w:  # one thread: one chunk (more would split it)
        w.save(1, {"big": big})
    chunk = next(os.path.join(d, f) for d, _, fs in os.walk(url) for f in fs if f.endswith(".bin"))

    def flip(at: int) -> None:
        with open(chunk, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))

    head = LocalShard(torch.zeros(100, 1024), (1024, 1024), (0, 0))
    flip(3 << 20)  # in the fourth block
    load_checkpoint(url, into={"big": head})
    assert torch.equal(head.tensor, big[:100])
    with pytest.raises(CorruptCheckpointError, match=r"chunk-000000\.bin"):
        load_checkpoint(url, step=1, into={"big": torch.zeros(1024, 1024)})
    flip(3 << 20)
    flip(1000)  # inside the rows read
    with pytest.raises(CorruptCheckpointError, match=r"chunk-000000\.bin"):
        load_checkpoint(url, step=1, into={"big": head})


@pytest.fixture(scope="module")
def odd_chunks(tmp_path_factory):
    """A uint8 tensor of ~5.3 MB in chunks of 2.5 MiB: chunks end inside a 1 MiB block, so
    ranges meet whole blocks, cut blocks, a chunk's short last block and chunk seams."""
    url = str(tmp_path_factory.mktemp("odd") / "c")
    data = torch.randint(0, 256, (5_300_017,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with CheckpointWriter(url, chunk_bytes=5 << 19) as w:
        w.save(1, {"pad": torch.ones(3, dtype=torch.uint8), "data": data})
    return url, data


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_byte_range_reads_back_exactly(odd_chunks, data):
    url, full = odd_chunks
    start = data.draw(st.integers(0, full.numel()))
    n = data.draw(st.one_of(st.integers(0, 64), st.integers(0, full.numel() - start)))
    n = min(n, full.numel() - start)
    box = LocalShard(torch.zeros(n, dtype=torch.uint8), (full.numel(),), (start,))
    load_checkpoint(url, step=1, into={"data": box})
    assert torch.equal(box.tensor, full[start : start + n])


# -- hostile global records -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("pristine") / "c")
    _save(url)
    return url


def _part_keys(store) -> list[str]:
    return sorted(k for k in store.list() if "/part-" in k)


junk = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=False, allow_infinity=False),
                 st.integers(-3, 40), st.lists(st.integers(-2, 20), max_size=4))
box = st.lists(st.integers(-1, 14), min_size=0, max_size=3)


@st.composite
def edits(draw):
    rank = draw(st.integers(0, 1))
    leaf = draw(st.sampled_from(["w", "c", "r"]))
    field = draw(st.sampled_from(["shape", "offset", "region", "replica", "global", "kind", "dtype", "blocks"]))
    if field == "blocks":  # the block checksums of the rank's first chunk
        record = st.fixed_dictionaries({"bytes": st.one_of(junk, st.integers(1, 1 << 21)),
                                        "checksums": st.one_of(junk, st.lists(st.text(max_size=4)))})
        value = draw(st.one_of(junk, record))
    elif field in ("shape", "offset", "region"):
        value = draw(st.one_of(box, junk))
    elif field == "replica":
        value = draw(st.one_of(st.booleans(), junk))
    else:
        value = draw(junk)
    return rank, leaf, field, value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=edits())
def test_hostile_global_records_raise_corrupt_naming_the_part(pristine, tmp_path_factory, edit):
    rank, name, field, value = edit
    url = str(tmp_path_factory.mktemp("h") / "c")
    shutil.copytree(pristine, url)
    store = open_store(url)
    key = _part_keys(store)[rank]
    part = json.loads(store.get(key))
    spec = next((s for s in part["leaves"] if s["path"] == name), None)
    if spec is None or "global" not in spec:
        return  # rank 1 stores no piece of "r": nothing to edit
    if field == "blocks":
        part["chunks"][0]["blocks"] = value
    elif field in ("global", "kind", "dtype"):
        spec[field] = value
    else:
        spec["global"][field] = value
    part.pop("checksum")
    data = encode_doc(part, "part")
    store.put(key, data)
    m = json.loads(store.get(manifest_key(1)))
    m.pop("checksum")
    m["parts"][rank]["checksum"] = checksum(data)
    store.put(manifest_key(1), encode_doc(m, "manifest"))
    for attempt in ("into", "part"):
        into = _into()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if attempt == "into":
                    out = load_checkpoint(url, step=1, into=into)
                else:
                    out = load_checkpoint(url, step=1, rank=0)
        except CorruptCheckpointError as e:
            # the part file named, or (a block checksum that does not match) the rank's chunk
            assert store.url(key) in str(e) or f"rank-{rank:05d}/chunk-000000.bin" in str(e), (edit, str(e))
            continue
        except CheckpointError as e:
            # an edit that leaves the documents consistent but changes a shape or dtype the
            # target asks for: refused by name, never filled with other bytes
            assert attempt == "into" and name in str(e), (edit, str(e))
            continue
        # the edit changed nothing that matters (it wrote the value that was there):
        # the loaded data is the saved data
        if attempt == "into":
            _check_full(out, into)
        else:
            assert torch.equal(out["w"], W) and torch.equal(out["c"], C) and np.array_equal(out["r"], R)


@pytest.mark.parametrize("declared", ["huge", "wrong"])
def test_a_zstd_chunk_whose_frame_declares_another_size_is_refused_before_it_is_decompressed(tmp_path, declared):
    # python-zstandard allocates what a frame header declares, whatever max_output_size
    # says: a chunk re-signed by hand (its checksums recomputed) must not make a load
    # allocate it, through the range reader (into=) as through the plain load
    import resource
    import struct

    url = str(tmp_path / "c")
    with CheckpointWriter(url, chunk_bytes=4096, compression="zstd") as w:
        w.save(1, {"w": torch.arange(4096, dtype=torch.float32)}).wait()
    size = 1 << 45 if declared == "huge" else 4096 * 4 + 8
    # one frame: single segment, the content size declared, one RLE block of zeros
    frame = (struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", size)
             + (1 | (1 << 1) | (4096 << 3)).to_bytes(3, "little") + b"\0")
    store = open_store(url)
    key = _part_keys(store)[0]
    part = json.loads(store.get(key))
    c = part["chunks"][0]
    store.put(c["key"], frame)
    part["stored_bytes"] += len(frame) - c["stored_bytes"]
    c["stored_bytes"], c["checksum"] = len(frame), checksum(frame)
    part.pop("checksum")
    data = encode_doc(part, "part")
    store.put(key, data)
    m = json.loads(store.get(manifest_key(1)))
    m.pop("checksum")
    m["parts"][0].update(checksum=checksum(data), doc_bytes=len(data), stored_bytes=part["stored_bytes"])
    m["stored_bytes"] = part["stored_bytes"]
    store.put(manifest_key(1), encode_doc(m, "manifest"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for kw in ({}, {"into": {"w": torch.zeros(4096)}}):
        with pytest.raises(CorruptCheckpointError, match="zstd frame declares"):
            load_checkpoint(url, step=1, **kw)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing was allocated
