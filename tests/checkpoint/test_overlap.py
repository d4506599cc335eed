"""The geometry of global tensors (datapipe.checkpoint.overlap), property-tested without a
file: random tilings of random global tensors (grids as a device mesh shards them, and
boxes split at random), random target boxes, random slab sizes. The copies plan_copies
makes fill every byte of the target exactly once with the bytes the global tensor holds
there, and never read a byte outside their piece; tiling_defect agrees with counting each
element's pieces one by one."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from datapipe.checkpoint.overlap import GlobalTensor, Piece, plan_copies, row_major_strides, tiling_defect

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)


@st.composite
def split_boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A tiling of ``shape`` made by cutting boxes in two at random (a k-d tree)."""
    boxes: list[Box] = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(1, 12))):
        i = draw(st.integers(0, len(boxes) - 1))
        start, sh = boxes[i]
        dims = [d for d in range(len(shape)) if sh[d] >= 2]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, sh[d] - 1))
        boxes[i : i + 1] = [(start, (*sh[:d], cut, *sh[d + 1 :])),
                            ((*start[:d], start[d] + cut, *start[d + 1 :]), (*sh[:d], sh[d] - cut, *sh[d + 1 :]))]
    return boxes


@st.composite
def grid_boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A tiling of ``shape`` as a mesh shards it: cut points along each dimension."""
    edges = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set())
        edges.append([0, *cuts, n])
    return [(tuple(e[i] for e, i in zip(edges, idx)), tuple(e[i + 1] - e[i] for e, i in zip(edges, idx)))
            for idx in itertools.product(*[range(len(e) - 1) for e in edges])]


@st.composite
def problems(draw: st.DrawFn) -> tuple[GlobalTensor, dict[int, np.ndarray], np.ndarray, tuple[int, ...],
                                       tuple[int, ...], int]:
    """A global tensor stored as pieces in ranks' data (its bytes random), a target box and
    a slab size: ``(gt, rank data, the tensor's bytes (shape + (itemsize,)), start, shape, slab)``."""
    ndim = draw(st.sampled_from([2, 3, 1, 0]))  # mostly boxes whose rows are cut
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    boxes = draw(st.one_of(split_boxes(shape), grid_boxes(shape)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    whole = rng.integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    gt = GlobalTensor("w", "numpy", f"<u{itemsize}", itemsize, shape)
    data: dict[int, bytearray] = {}
    for start, sh in boxes:
        r = draw(st.integers(0, 3))
        buf = data.setdefault(r, bytearray())
        buf += bytes(draw(st.integers(0, 5)))  # pieces need not be aligned or back to back
        gt.pieces.append(Piece(r, len(buf), start, sh))
        buf += whole[tuple(slice(s, s + n) for s, n in zip(start, sh))].tobytes()
    t_start = tuple(draw(st.integers(0, n - 1)) for n in shape)
    t_shape = tuple(draw(st.integers(1, n - s)) for n, s in zip(shape, t_start))
    slab = draw(st.integers(1, 64))
    return gt, {r: np.frombuffer(bytes(b), np.uint8) for r, b in data.items()}, whole, t_start, t_shape, slab


def _byte_runs(first: int, strides: tuple[int, ...], outer: tuple[int, ...], run: int) -> list[range]:
    """The byte ranges a copy touches on one side: one run per index of its outer dims."""
    starts = (first + sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, outer)))
    return [range(a, a + run) for a in starts]


@settings(max_examples=300)  # cheap examples; a plan wrong in one layout in a hundred is still found
@given(problems())
def test_the_copies_fill_the_target_exactly_once_reading_only_their_piece(problem):
    gt, data, whole, t_start, t_shape, slab = problem
    isz = gt.itemsize
    assert tiling_defect(gt, [f"part-{r}" for r in range(4)]) is None
    dst = np.zeros(math.prod(t_shape) * isz, np.uint8)
    copies = plan_copies(gt, dst, t_start, t_shape, slab)
    written = np.zeros(dst.size, np.int64)
    for c in copies:
        assert c.dst is dst
        piece_bytes = math.prod(c.piece.shape) * isz
        src = _byte_runs(c.src_first, c.src_strides, c.outer, c.run)
        assert all(0 <= r.start and r.stop <= piece_bytes for r in src), (c, piece_bytes)
        # a slab: at most `slab` bytes of source span, or one row of the piece when a row is more
        assert c.src_first + c.span() <= piece_bytes
        assert c.span() <= (max(slab, c.src_strides[0]) if c.outer else slab)
        for r in _byte_runs(c.dst_first, c.dst_strides, c.outer, c.run):
            assert 0 <= r.start and r.stop <= dst.size
            written[r.start : r.stop] += 1
        # the copy as the resharding load runs it (reshard._run_copy), from the rank's data
        base = data[c.piece.rank][c.piece.data_offset + c.src_first :]
        view = (*c.outer, c.run)
        np.copyto(as_strided(dst[c.dst_first :], shape=view, strides=(*c.dst_strides, 1)),
                  as_strided(base, shape=view, strides=(*c.src_strides, 1), writeable=False))
    assert (written == 1).all(), written
    want = whole[tuple(slice(s, s + n) for s, n in zip(t_start, t_shape))]
    assert dst.tobytes() == want.tobytes()


@given(problems())
def test_a_whole_target_reads_every_piece(problem):
    """A target that is the whole tensor overlaps every piece: no piece is left unread."""
    gt, _data, _whole, _s, _t, slab = problem
    dst = np.zeros(math.prod(gt.shape) * gt.itemsize, np.uint8)
    copies = plan_copies(gt, dst, (0,) * len(gt.shape), gt.shape, slab)
    assert {id(c.piece) for c in copies} == {id(p) for p in gt.pieces}


@st.composite
def any_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """Boxes inside a global shape that may leave gaps, overlap or be empty."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    base = draw(st.one_of(split_boxes(shape), grid_boxes(shape)))
    boxes = list(base)
    for _ in range(draw(st.integers(0, 3))):  # edits: drop one, add one anywhere
        if boxes and draw(st.booleans()):
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        start = tuple(draw(st.integers(0, n - 1)) for n in shape)
        boxes.append((start, tuple(draw(st.integers(0, n - s)) for n, s in zip(shape, start))))
    return shape, boxes


@given(any_boxes())
def test_tiling_defect_is_none_exactly_when_each_element_has_one_piece(case):
    shape, boxes = case
    gt = GlobalTensor("w", "numpy", "<f4", 4, shape,
                      [Piece(i % 3, 0, start, sh) for i, (start, sh) in enumerate(boxes)])
    count = np.zeros(shape, np.int64)
    for start, sh in boxes:
        count[tuple(slice(s, s + n) for s, n in zip(start, sh))] += 1
    why = tiling_defect(gt, ["part-0", "part-1", "part-2"])
    assert (why is None) == bool((count == 1).all()), (why, count)
    if why is not None:  # named by the part files that hold the pieces
        assert "part-" in why


def test_an_overlap_of_equal_volume_is_named_by_both_parts():
    gt = GlobalTensor("w", "numpy", "<f4", 4, (6,), [Piece(0, 0, (0,), (4,)), Piece(1, 0, (2,), (2,))])
    assert tiling_defect(gt, ["a.json", "b.json"]) == "the pieces in a.json (at [0]) and b.json (at [2]) overlap"


def test_row_major_strides():
    assert row_major_strides((2, 3, 4)) == (12, 4, 1) and row_major_strides(()) == ()
