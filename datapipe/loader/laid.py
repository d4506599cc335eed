"""Reading a whole chunk of samples whose shards all have a known field layout.

The per-sample path costs a dozen Python operations per sample before any byte is copied:
two dict lookups, a row lookup, an index walk per field. When every shard of a chunk is
verified and laid out (see :mod:`.members`) with the same fields, all of that is done once
per chunk with numpy: the rows of the chunk's samples are gathered from the shards' layout
tables in one fancy index, and turned into one plain list per column. What is left per
sample is one ``zip`` step, one dict display and one slice (the copy into ``bytes``) per
field, in a loop specialised to the number of fields.

The items are exactly the per-sample path's: ``{"__key__": key, field: bytes, ...}`` in
layout order, plus ``__shard__``/``__sample__`` when positions are asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import count
from typing import Any

import numpy as np

__all__ = ["chunk_columns", "item_loop"]

_LOOPS: dict[tuple[int, bool], Callable[..., Callable[..., Iterator[dict[str, Any]]]]] = {}


def _loop_factory(n_fields: int, with_pos: bool) -> Callable[..., Callable[..., Iterator[dict[str, Any]]]]:
    """A factory ``make(*field_names) -> loop``. Field names come from shard data, so they
    are never written into the generated source: they reach the loop as closure values."""
    names = [f"_f{i}" for i in range(n_fields)]
    cols = [f"a{i}, b{i}" for i in range(n_fields)]
    pos_args = ", g, j" if with_pos else ""
    pos_iter = ", shards, samples" if with_pos else ""
    pos_items = ", '__shard__': g, '__sample__': j" if with_pos else ""
    body = ", ".join(f"{n}: s[a{i}:b{i}]" for i, n in enumerate(names))
    src = (
        f"def make({', '.join(names)}):\n"
        f"    def loop(owner, first, srcs, keys, columns, shards, samples):\n"
        f"        for i, s, k{pos_args}, {', '.join(cols)} in zip(_count(first), srcs, keys{pos_iter}, *columns):\n"
        # counted before the item is handed out, as the per-sample path does: the owner's
        # count is the number of plan steps the consumer has taken
        f"            owner._yielded = i\n"
        f"            yield {{'__key__': k, {body}{pos_items}}}\n"
        f"    return loop\n"
    )
    namespace: dict[str, Any] = {"_count": count}
    exec(compile(src, f"<datapipe.loader.laid {n_fields} fields>", "exec"), namespace)  # noqa: S102
    return namespace["make"]


def item_loop(fields: Sequence[str], with_pos: bool) -> Callable[..., Iterator[dict[str, Any]]]:
    """``loop(owner, first, srcs, keys, columns, shards, samples)`` yielding the items of a
    chunk; it sets ``owner._yielded`` to ``first``, ``first + 1``, ... before each item."""
    key = (len(fields), with_pos)
    make = _LOOPS.get(key)
    if make is None:
        make = _LOOPS[key] = _loop_factory(len(fields), with_pos)
    return make(*fields)


def chunk_columns(datas: Sequence[Any], shard: np.ndarray, sample: np.ndarray) -> tuple[list, list, list]:
    """(srcs, keys, columns) of a chunk: ``srcs[i]`` the bytes-like object sample ``i`` is
    cut from, ``keys[i]`` its key, ``columns[2k][i]:columns[2k+1][i]`` its field ``k``.
    ``datas``: the chunk's shards (each with ``.shard``, ``.src``, ``.table``,
    ``.key_array``), ``shard``/``sample``: the chunk's shard and sample indices."""
    ids = np.array([d.shard for d in datas], dtype=np.int64)
    order = np.argsort(ids)
    loc = order[np.searchsorted(ids, shard, sorter=order)]  # position of each sample's shard in datas
    sizes = np.array([d.table.shape[0] for d in datas], dtype=np.int64)
    base = np.zeros(len(datas), dtype=np.int64)
    np.cumsum(sizes[:-1], out=base[1:])
    rows = base[loc] + sample
    table = np.concatenate([d.table for d in datas]) if len(datas) > 1 else datas[0].table
    columns = table[rows].T.tolist()
    keys = (np.concatenate([d.key_array for d in datas]) if len(datas) > 1 else datas[0].key_array)[rows].tolist()
    srcs_by_shard = np.empty(len(datas), dtype=object)
    for i, d in enumerate(datas):  # one by one: numpy would read an mmap as an array
        srcs_by_shard[i] = d.src
    return srcs_by_shard[loc].tolist(), keys, columns
