"""``load_checkpoint(into=...)`` targets that cannot hold what is loaded into them: a meta
tensor (an FSDP2 model before ``to_empty()``), a view whose elements share memory (an
``expand()``ed tensor, a broadcast array), a read-only array. Each is a ``CheckpointError``
naming the target's path, raised before anything is read; never a load that reports
success and keeps nothing, never torch's or numpy's own error."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, load_checkpoint
from datapipe.errors import CheckpointError
from tests.ranks import free_port, spawn_ranks

W = torch.arange(24.0).reshape(4, 6)
A = np.arange(12, dtype=np.int64)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("ckpt") / "c")
    with CheckpointWriter(url, background="thread") as w:
        w.save(1, {"model": {"w": W}, "a": A}).wait()
    return url


@pytest.mark.parametrize("into, what", [
    ({"model": {"w": torch.empty(4, 6, device="meta")}}, r"'model\.w' is a meta tensor.*to_empty"),
    ({"model": {"w": torch.zeros(1, 6).expand(4, 6)}}, r"'model\.w' is a tensor whose elements share memory"),
    ({"model": {"w": torch.zeros(9).as_strided((4, 6), (1, 1))}}, r"'model\.w' is a tensor whose elements share"),
    ({"a": np.broadcast_to(np.zeros(1, np.int64), (12,))}, r"'a' is a read-only numpy array"),
    ({"a": np.lib.stride_tricks.as_strided(np.zeros(6, np.int64), (12,), (0,), writeable=True)},
     r"'a' is an array whose elements share memory"),
], ids=["meta", "expanded", "overlapping", "broadcast", "stride-0-array"])
def test_a_target_that_cannot_hold_the_load_is_named(url, into, what):
    with pytest.raises(CheckpointError, match=what) as e:
        load_checkpoint(url, into=into)
    assert url in str(e.value)


def _fsdp2_before_to_empty(rank: int, port: int, url: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    fully_shard(model)
    with CheckpointWriter(url, background="thread") as w:
        w.save(1, {"model": model.state_dict()}).wait()
    with torch.device("meta"):
        fresh = torch.nn.Linear(6, 4)
    fully_shard(fresh)  # its parameters are DTensors on the meta device
    with pytest.raises(CheckpointError, match=r"'model\.weight' is a meta tensor.*to_empty"):
        load_checkpoint(url, into={"model": fresh.state_dict()})
    fresh.to_empty(device="cpu")
    load_checkpoint(url, into={"model": fresh.state_dict()})
    assert torch.equal(fresh.weight.full_tensor(), model.weight.full_tensor())
    assert torch.equal(fresh.bias.full_tensor(), model.bias.full_tensor())
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_an_fsdp2_model_before_to_empty_is_named_and_loads_after(tmp_path):
    spawn_ranks(_fsdp2_before_to_empty, (free_port(), str(tmp_path / "c")), 1)


def _overlaps(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    offsets = [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, shape))]
    return len(set(offsets)) < len(offsets)


@settings(max_examples=150)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 12)), min_size=1, max_size=3))
def test_any_strided_view_target_is_filled_exactly_or_named(url_of_sizes, dims):
    """Any strided view of a buffer as the target: filled with exactly the saved values, or
    refused by name; a view whose elements share memory always refused (torch would copy
    into it without a word, each shared element keeping one of its values)."""
    shape, strides = tuple(n for n, _ in dims), tuple(s for _, s in dims)
    saved = url_of_sizes(shape)
    span = 1 + sum((n - 1) * s for n, s in dims)
    target = torch.zeros(span).as_strided(shape, strides)
    try:
        load_checkpoint(saved, into={"t": target})
    except CheckpointError as e:
        assert "'t' is a tensor whose elements share memory" in str(e)
        # a view whose elements tile its span (contiguous, transposed, permuted) is never refused
        assert _overlaps(shape, strides) or span > np.prod(shape), (shape, strides)
    else:
        assert not _overlaps(shape, strides)
        assert torch.equal(target, torch.arange(float(np.prod(shape))).reshape(shape))


@pytest.fixture(scope="module")
def url_of_sizes(tmp_path_factory):
    """A checkpoint of ``t = arange(...)`` of a given shape, one per shape, made once."""
    made: dict[tuple[int, ...], str] = {}

    def of(shape: tuple[int, ...]) -> str:
        if shape not in made:
            url = str(tmp_path_factory.mktemp("shape") / "c")
            with CheckpointWriter(url, background="thread") as w:
                w.save(1, {"t": torch.arange(float(np.prod(shape))).reshape(shape)}).wait()
            made[shape] = url
        return made[shape]

    return of
