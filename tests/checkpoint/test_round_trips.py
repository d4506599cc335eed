"""CheckpointWriter / load_checkpoint on a local directory: round trips, faults, retention."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    UnsupportedStateError,
)


def trained_state(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 32, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def assert_same(a, b, path="state"):
    """Byte-exact equality, including dtypes, container types, strides and scalar types."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.stride() == b.stride(), f"{path}: strides {a.stride()} != {b.stride()}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), path
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def rich_state():
    s = trained_state()
    s["bf16"] = trained_state(1, torch.bfloat16)
    base = torch.randn(6, 10)
    s["extra"] = {
        "transposed": base.t(),  # dense, permuted strides: layout preserved
        "sliced": base[:, ::3],  # gaps: stored and loaded contiguous, same values
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 7, dtype=torch.float16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "int8": torch.arange(-5, 5, dtype=torch.int8),
        "complex": torch.randn(3, dtype=torch.complex64),
        "np_f": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "np_u16": np.arange(10, dtype=">u2"),
        "np_scalar": np.float64(2.25),
        "np_int": np.int32(-7),
        "py": [1, -2**70, 2.5, float("inf"), float("nan"), True, None, "ü", b"\x00\xff", (1, (2,))],
        7: "int key",
    }
    return s


def test_round_trip_is_byte_exact(tmp_path):
    state = rich_state()
    with CheckpointWriter(str(tmp_path)) as w:
        h = w.save(10, state)
        m = h.wait()
    assert h.done() and h.exception() is None
    for k in ("stall_s", "staging_gbps", "write_gbps", "total_s", "waited_s", "bytes"):
        assert k in m and m[k] >= 0
    loaded = load_checkpoint(str(tmp_path))
    sliced = state["extra"]["sliced"]
    state["extra"]["sliced"] = sliced.contiguous()  # documented: gappy views come back contiguous
    assert_same(state, loaded)
    assert loaded["bf16"]["model"]["0.weight"].dtype == torch.bfloat16
    # the restored model and optimizer accept the loaded dicts
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    model.load_state_dict(loaded["model"])
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(loaded["optim"])


def test_zstd_round_trip_and_map_location(tmp_path):
    state = {"w": torch.zeros(5000), "r": torch.randn(300)}
    with CheckpointWriter(str(tmp_path), compression="zstd", chunk_bytes=4096) as w:
        m = w.save(1, state).wait()
    assert m["stored_bytes"] < m["bytes"]
    loaded = load_checkpoint(str(tmp_path), step=1, map_location="cpu")
    assert_same(state, loaded)


def test_unsupported_object_is_named_before_anything_is_written(tmp_path):
    state = trained_state()
    state["optim"]["state"][3]["exp_avg"] = object()
    w = CheckpointWriter(str(tmp_path))
    with pytest.raises(UnsupportedStateError, match=r"optim\.state\.3\.exp_avg"):
        w.save(1, state)
    with pytest.raises(UnsupportedStateError, match=r"a\.0"):
        w.save(1, {"a": [{1.5: 2}]})
    with pytest.raises(UnsupportedStateError, match="sparse"):
        w.save(1, {"s": torch.eye(3).to_sparse()})
    w.close()
    assert os.listdir(tmp_path) == []


def test_latest_pointer_and_list(tmp_path):
    with CheckpointWriter(str(tmp_path), keep_last=5) as w:
        for step in (1, 2, 3):
            w.save(step, {"x": torch.full((4,), step)}).wait()
    latest = json.loads((tmp_path / "latest").read_text())
    assert latest["step"] == 3
    assert [(s, c) for s, c in list_checkpoints(str(tmp_path))] == [(1, True), (2, True), (3, True)]
    assert load_checkpoint(str(tmp_path))["x"][0] == 3
    assert load_checkpoint(str(tmp_path), step=2)["x"][0] == 2
    with pytest.raises(NoCheckpointError):
        load_checkpoint(str(tmp_path), step=9)


def test_latest_is_not_trusted(tmp_path):
    with CheckpointWriter(str(tmp_path)) as w:
        w.save(1, {"x": torch.ones(3)}).wait()
        w.save(2, {"x": torch.ones(3) * 2}).wait()
    # a stale pointer (crash between manifest and pointer) must not hide step 2
    (tmp_path / "latest").write_text('{"step": 1}')
    assert load_checkpoint(str(tmp_path))["x"][0] == 2


def test_bit_flip_is_detected_named_and_skipped(tmp_path):
    with CheckpointWriter(str(tmp_path), chunk_bytes=4096) as w:
        w.save(1, {"x": torch.arange(3000, dtype=torch.float32)}).wait()
        w.save(2, {"x": torch.arange(3000, dtype=torch.float32) + 1}).wait()
    chunks = sorted(tmp_path.glob("step-000000000002/*/rank-00000/chunk-*.bin"))
    assert len(chunks) == 3
    data = bytearray(chunks[1].read_bytes())
    data[100] ^= 0x10
    chunks[1].write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=rf"step 2.*checksum mismatch in chunk .*{chunks[1].name}"):
        loaded = load_checkpoint(str(tmp_path))
    assert loaded["x"][0] == 0  # step 1
    with pytest.raises(CorruptCheckpointError, match=chunks[1].name):
        load_checkpoint(str(tmp_path), step=2)


def test_corrupt_manifest_and_part_are_skipped(tmp_path):
    with CheckpointWriter(str(tmp_path), keep_last=5) as w:
        for s in (1, 2, 3):
            w.save(s, {"x": torch.full((10,), s)}).wait()
    m3 = tmp_path / "step-000000000003" / "manifest.json"
    m3.write_text(m3.read_text().replace('"world_size": 1', '"world_size": 2'))
    part2 = next(tmp_path.glob("step-000000000002/*/part-00000.json"))
    part2.write_text(part2.read_text().replace('"nbytes": 80', '"nbytes": 72'))
    with pytest.warns(UserWarning) as rec:
        assert load_checkpoint(str(tmp_path))["x"][0] == 1
    text = " ".join(str(r.message) for r in rec)
    assert "step 3" in text and "checksum" in text and "step 2" in text
    info = {i.step: i for i in list_checkpoints(str(tmp_path))}
    assert not info[3].complete and "checksum" in info[3].reason
    # an entirely unreadable directory: no complete checkpoint at all
    with pytest.raises(NoCheckpointError):
        load_checkpoint(str(tmp_path / "nothing-here"))


def test_incomplete_checkpoint_is_skipped(tmp_path):
    with CheckpointWriter(str(tmp_path)) as w:
        w.save(1, {"x": torch.ones(2)}).wait()
        w.save(2, {"x": torch.ones(2) * 2}).wait()
    (tmp_path / "step-000000000002" / "manifest.json").unlink()  # as if killed before commit
    with pytest.warns(UserWarning, match="incomplete checkpoint step 2"):
        assert load_checkpoint(str(tmp_path))["x"][0] == 1
    assert [(s, c) for s, c in list_checkpoints(str(tmp_path))] == [(1, True), (2, False)]


def test_retention_keep_last_and_keep_every(tmp_path):
    with CheckpointWriter(str(tmp_path), keep_last=2, keep_every=4) as w:
        for step in range(1, 10):
            h = w.save(step, {"x": torch.full((3,), step)})
        h.wait()
    assert [s for s, c in list_checkpoints(str(tmp_path))] == [4, 8, 9]
    # an incomplete older step (killed save) is removed by the next commit, tmp files too
    junk = tmp_path / "step-000000000010" / "deadbeef-0" / "rank-00000"
    junk.mkdir(parents=True)
    (junk / "chunk-000000.bin").write_bytes(b"x")
    (junk / ".tmp-abc-chunk-000001.bin").write_bytes(b"x")
    with CheckpointWriter(str(tmp_path), keep_last=2, keep_every=4) as w:
        w.save(11, {"x": torch.ones(1)}).wait()
    assert [s for s, c in list_checkpoints(str(tmp_path))] == [4, 8, 9, 11]
    assert not (tmp_path / "step-000000000010").exists()


def test_resaving_a_step_replaces_it_whole(tmp_path):
    with CheckpointWriter(str(tmp_path)) as w:
        w.save(5, {"x": torch.zeros(100)}).wait()
        w.save(5, {"x": torch.ones(100)}).wait()
    assert torch.equal(load_checkpoint(str(tmp_path))["x"], torch.ones(100))
    attempts = [p.name for p in (tmp_path / "step-000000000005").iterdir() if p.is_dir()]
    assert len(attempts) == 1  # the replaced attempt is gone


def test_backpressure_waits_or_skips(tmp_path):
    gate = threading.Event()
    # threads: the slow store is patched into this process (the rule is the training side's)
    w = CheckpointWriter(str(tmp_path), background="thread")
    put = w.store.put

    def slow_put(key, data):
        gate.wait()
        put(key, data)

    w.store.put = slow_put  # holds the background write until the gate opens
    h1 = w.save(1, {"x": torch.ones(1000)})
    assert not h1.done()
    h2 = w.save(2, {"x": torch.ones(1000)}, if_busy="skip")
    assert h2.skipped and h2.done() and h2.metrics["skipped"]
    threading.Timer(0.3, gate.set).start()
    h3 = w.save(3, {"x": torch.ones(1000) * 3})
    assert h1.done() and h3.metrics["waited_s"] >= 0.2
    h3.wait()
    w.close()
    assert [s for s, c in list_checkpoints(str(tmp_path))] == [1, 3]


def test_staging_buffer_is_reused_and_does_not_alias_training(tmp_path):
    x = torch.zeros(10000)
    with CheckpointWriter(str(tmp_path), keep_last=5) as w:
        first = w.save(1, {"x": x}).wait()
        held = w.staging_bytes
        x += 1  # training goes on; the checkpoint holds the old values
        second = w.save(2, {"x": x}).wait()
        assert first["staging_allocated"] and not second["staging_allocated"]
        assert w.staging_bytes == held >= x.numel() * x.element_size()
    assert load_checkpoint(str(tmp_path), step=1)["x"].sum() == 0
    assert load_checkpoint(str(tmp_path), step=2)["x"].sum() == 10000


def test_prepare_with_meta_layout(tmp_path):
    real = trained_state()
    with torch.device("meta"):
        layout = {"model": {k: torch.empty_like(v) for k, v in real["model"].items()}}
    with CheckpointWriter(str(tmp_path)) as w:
        w.prepare(layout)  # in the background; save() waits for it
        assert not w.save(1, {"model": real["model"]}).wait()["staging_allocated"]  # prepare allocated it
        assert w.staging_bytes >= sum(v.numel() * v.element_size() for v in real["model"].values())
    assert_same({"model": real["model"]}, load_checkpoint(str(tmp_path)))


def test_staging_budget(tmp_path):
    with CheckpointWriter(str(tmp_path), max_staging_bytes=1000) as w:
        with pytest.raises(CheckpointError, match="max_staging_bytes"):
            w.save(1, {"x": torch.zeros(1000)})
        w.save(1, {"x": torch.zeros(10)}).wait()
        # a prepare() that fails in its thread surfaces at the next call
        w.prepare({"x": torch.empty(1000, device="meta")})
        with pytest.raises(CheckpointError, match="max_staging_bytes"):
            w.save(2, {"x": torch.zeros(10)})
        w.save(2, {"x": torch.zeros(10)}).wait()
    assert [s for s, c in list_checkpoints(str(tmp_path))] == [1, 2]


def test_failing_store_surfaces_and_keeps_previous(tmp_path):
    w = CheckpointWriter(str(tmp_path))
    w.save(1, {"x": torch.ones(10)}).wait()
    (tmp_path / "step-000000000002").write_bytes(b"not a directory")  # writes under it fail
    h = w.save(2, {"x": torch.ones(10) * 2})
    with pytest.raises(CheckpointError, match="step 2"):
        w.save(3, {"x": torch.ones(10) * 3})  # the background error surfaces here
    assert h.done() and isinstance(h.exception(), CheckpointError)
    (tmp_path / "step-000000000002").unlink()
    w.save(3, {"x": torch.ones(10) * 3}).wait()  # and the writer keeps working
    # an error nobody looked at surfaces at close()
    (tmp_path / "step-000000000004").write_bytes(b"x")
    w.save(4, {"x": torch.ones(10)})
    with pytest.raises(CheckpointError, match="step 4"):
        w.close()
    assert load_checkpoint(str(tmp_path), step=1)["x"][0] == 1
    assert load_checkpoint(str(tmp_path))["x"][0] == 3
    with pytest.raises(CheckpointError, match="closed"):
        w.save(5, {})


def test_bad_arguments(tmp_path):
    for kw in ({"keep_last": 0}, {"keep_every": 0}, {"compression": "lz4"}, {"if_busy": "drop"},
               {"world_size": 2, "rank": 0}):
        with pytest.raises(CheckpointError):
            CheckpointWriter(str(tmp_path), **kw)
    with CheckpointWriter(str(tmp_path)) as w:
        for step in (-1, 1.0, True, "3"):
            with pytest.raises(CheckpointError, match="step"):
                w.save(step, {})
    with pytest.raises(CheckpointError, match="step"):
        load_checkpoint(str(tmp_path), step=-2)


def test_data_loader_state_round_trips_and_resumes(tmp_path):
    from datapipe.plan import EpochPlan

    counts = np.array([5, 9, 3, 12, 7])
    plan = EpochPlan(counts, seed=7, epoch=2, window=2, world=2)
    state = {"step": 40, "loader": plan.state_dict(consumed=6)}
    with CheckpointWriter(str(tmp_path)) as w:
        w.save(40, state).wait()
    loaded = load_checkpoint(str(tmp_path))
    assert_same(state, loaded)
    resumed = EpochPlan.from_state(counts, loaded["loader"], seed=7, window=2, world=2)
    for rank in range(2):
        steps = np.arange(6, plan.per_rank)
        for a, b in zip(plan.rank_samples(rank, steps), resumed.rank_samples(rank, steps)):
            assert np.array_equal(a, b)


def test_every_torch_dtype_round_trips(tmp_path):
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    state, g = {}, torch.Generator().manual_seed(0)
    for dt in dtypes:
        if str(dt).startswith(("torch.qint", "torch.quint")):
            continue  # quantized tensors are refused (they carry scales, not just bytes)
        raw = torch.randint(0, 256, (3, 32), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            raw &= 1  # other byte patterns are not valid bools
        state[str(dt)] = raw.view(dt)
    assert len(state) >= 30  # bf16, float8 variants, sub-byte ints, uint16-64, complex32 ...
    with CheckpointWriter(str(tmp_path)) as w:
        w.save(1, state).wait()
    loaded = load_checkpoint(str(tmp_path))
    for k, v in state.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert torch.equal(loaded[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k


def test_state_without_arrays(tmp_path):
    with CheckpointWriter(str(tmp_path)) as w:
        assert w.save(1, {"epoch": 3, "names": ["a", "b"]}).wait()["bytes"] == 0
        w.save(2, {}).wait()
    assert load_checkpoint(str(tmp_path), step=1) == {"epoch": 3, "names": ["a", "b"]}
    assert load_checkpoint(str(tmp_path)) == {}


def test_streaming_dataset_state_in_checkpoint_resumes_the_stream(tmp_path):
    from datapipe import ShardWriter
    from datapipe.loader import StreamingDataset

    ds_url = str(tmp_path / "ds")
    with ShardWriter(ds_url, max_samples=17) as sw:
        for i in range(150):
            sw.write({"__key__": f"k{i:04d}", "cls": str(i)})
    full = [s["cls"] for s in StreamingDataset(ds_url, window=3, seed=4, batch_size=4)]
    ds = StreamingDataset(ds_url, window=3, seed=4, batch_size=4)
    it = iter(ds)
    first = [next(it)["cls"] for _ in range(61)]
    with CheckpointWriter(str(tmp_path / "ckpt")) as w:
        w.save(61, {"model": trained_state()["model"], "data": ds.state_dict()}).wait()
    it.close()
    loaded = load_checkpoint(str(tmp_path / "ckpt"))
    assert_same(ds.state_dict(), loaded["data"])
    again = StreamingDataset(ds_url, window=3, seed=4, batch_size=4)
    again.load_state_dict(loaded["data"])
    assert first + [s["cls"] for s in again] == full
