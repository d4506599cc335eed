"""A loader's pass is its stages in order: plan -> fetch -> read -> decode/map -> batch, each
in its own module, each a function of the stage before.

- statically: no import circle inside ``datapipe/loader``, and no stage module imports a
  later stage's module (the read stage knows nothing of batches, the fetch stage nothing of
  readers);
- while a pass runs (every thread profiled): no code of a later stage runs inside a call
  from an earlier stage (stages pull from the stage before; none calls back into a later
  one), on every path a pass takes (samples, columnar batches, decoded batches in map
  threads, skipped samples, a Parquet table);
- the plan and fetch seams take another loader's units: token sequences planned by
  ``datapipe.plan.tokens``, fetched as token ranges and cut by a reader of the test's own.
"""

from __future__ import annotations

import ast
import os
import sys
import threading

import numpy as np
import pytest

import datapipe.loader as loader_face
from datapipe import ShardWriter
from datapipe.loader import StreamingDataset

LOADER = os.path.join(os.path.dirname(loader_face.__file__))

#: the stage each module belongs to, in pass order; other modules (the dataset, which holds
#: configuration and state, the shared pass state, the DataLoader side) are no stage
STAGES = {
    "datapipe.loader.chunks": 1, "datapipe.loader.mixing": 1,  # plan
    "datapipe.loader.prefetch": 2, "datapipe.loader.source": 2, "datapipe.loader.layouts": 2,  # fetch
    "datapipe.loader.readers": 3,  # read
    "datapipe.loader.decoding": 4, "datapipe.decode": 4,  # decode/map
    "datapipe.loader.batch": 5,  # batch
}


def _loader_imports() -> dict[str, set[str]]:
    """Each loader module's imports of its siblings, wherever they stand in the file
    (top level, ``if TYPE_CHECKING:``, inside a function)."""
    out: dict[str, set[str]] = {}
    names = {f[:-3] for f in os.listdir(LOADER) if f.endswith(".py")}
    for name in names:
        with open(os.path.join(LOADER, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    deps.add(node.module.split(".")[0])
                elif node.level == 1:  # from . import x
                    deps.update(a.name for a in node.names if a.name in names)
                elif node.level == 0 and node.module and node.module.startswith("datapipe.loader."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith("datapipe.loader."))
        out[name] = deps & names - {name}
    return out


def test_the_loader_package_has_no_import_circle():
    graph = _loader_imports()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError(f"import circle: {' -> '.join([*path[path.index(node):], node])}")
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_no_stage_imports_a_later_stage():
    later = []
    for name, deps in _loader_imports().items():
        mine = STAGES.get(f"datapipe.loader.{name}")
        if mine is None:
            continue
        later += [f"{name} (stage {mine}) imports {d} (stage {STAGES[f'datapipe.loader.{d}']})" for d in sorted(deps)
                  if STAGES.get(f"datapipe.loader.{d}", 0) > mine]
    assert not later


class _StageOrder:
    """Profiles every thread; records a call into a stage's code made, directly or
    through code of no stage, from code of an earlier stage."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.seen: set[int] = set()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        rank = STAGES.get(frame.f_globals.get("__name__", ""))
        if rank is None:
            return
        self.seen.add(rank)
        caller = frame.f_back
        while caller is not None:
            outer = STAGES.get(caller.f_globals.get("__name__", ""))
            if outer is not None:
                if rank > outer:
                    self.violations.append(
                        f"{frame.f_globals['__name__']}.{frame.f_code.co_name} (stage {rank}) called from "
                        f"{caller.f_globals['__name__']}.{caller.f_code.co_name} (stage {outer})")
                return
            caller = caller.f_back

    def __enter__(self) -> _StageOrder:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


N = 60


def _write(path, bad=()):
    with ShardWriter(str(path), max_samples=16) as w:
        for i in range(N):
            meta = b"{not json" if i in bad else {"i": i}
            w.write({"__key__": f"s{i:03d}", "cls": str(i), "json": meta, "bin": bytes([i]) * (i % 9 + 1)})
    return str(path)


def _double(sample):
    return {**sample, "cls": sample["cls"] * 2}


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return {"good": _write(root / "good"), "bad": _write(root / "bad", bad=(5, 33))}


CASES = {
    "samples": dict(),
    "columnar batches": dict(batched=True, batch_size=8, return_position=True),
    "decoded batches in threads": dict(batched=True, batch_size=8, decode="auto", map=_double, map_threads=2,
                                       return_position=True),
    "skipped samples": dict(decode="auto", on_error="skip", batch_size=4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pass_calls_no_stage_from_an_earlier_one(urls, case):
    kw = dict(CASES[case])
    url = urls["bad" if kw.get("on_error") == "skip" else "good"]
    expected = list(StreamingDataset(url, window=3, seed=1, chunk_samples=16, **kw))
    ds = StreamingDataset(url, window=3, seed=1, chunk_samples=16, **kw)
    with pytest.warns(RuntimeWarning) if kw.get("on_error") == "skip" else _no_warning():
        with _StageOrder() as order:
            got = list(ds)
    assert _keys(got) == _keys(expected) and len(_keys(got)) == N - (2 if kw.get("on_error") else 0)
    assert not order.violations, order.violations[:5]
    # every stage ran (the decode stage where there is a decoder)
    assert order.seen >= ({1, 2, 3, 4, 5} if kw.get("decode") else {1, 2, 3, 5})


def test_a_table_pass_calls_no_stage_from_an_earlier_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"__key__": [f"r{i:03d}" for i in range(N)], "n": list(range(N))}), path,
                   row_group_size=16)
    ds = StreamingDataset(path, window=2, seed=3, batched=True, batch_size=8)
    with _StageOrder() as order:
        got = [k for b in ds for k in b["__key__"]]
    assert sorted(got) == [f"r{i:03d}" for i in range(N)]
    assert not order.violations, order.violations[:5]


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _keys(items):
    out = []
    for x in items:
        out += list(x["__key__"]) if not isinstance(x["__key__"], str) else [x["__key__"]]
    return out


# -- another loader's units through the same plan and fetch stages -----------------------------

class _TokenRange:
    """What a token loader's fetch gives for one logical chunk: its covering token range."""

    def __init__(self, tokens, start):
        self.tokens, self.start, self.closed = tokens, start, False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("world,workers", [(1, 1), (2, 3)])
def test_token_sequences_go_through_the_plan_and_fetch_stages(world, workers):
    """A token loader plans sequences (logical chunks of them are the plan's units),
    fetches each chunk's token range instead of a shard, and cuts sequences: the stages
    take them as they are, every sequence once per epoch, its tokens those of the stream."""
    from datapipe.plan.tokens import ConcatLayout

    rng = np.random.default_rng(0)
    stream = rng.integers(0, 50_000, size=4000, dtype=np.int64)
    layout = ConcatLayout([1500, 2500], seq_len=32, chunk_sequences=7)
    fetched: list[_TokenRange] = []

    def fetch(chunk):
        a, b = layout.chunk_token_range(chunk)
        fetched.append(_TokenRange(stream[a:b], a))
        return fetched[-1]

    seen = []
    for rank in range(world):
        plan = layout.epoch_plan(seed=5, epoch=1, window=3, world=world)
        for worker in range(workers):
            key = loader_face.PassKey(1, rank, world, worker, workers, 4, 16)
            pre = loader_face.Prefetcher(loader_face.pass_chunks(plan, None, key), fetch,
                                         lambda c: 8 * (layout.seq_len * 7 + 1), max_bytes=1 << 12)
            fetching = loader_face.PassFetch(pre, key)
            for chunk in fetching.chunks():
                units = dict(zip(chunk.shards, chunk.fetched))
                for c, j in zip(chunk.shard.tolist(), chunk.sample.tolist()):
                    got = units[c]
                    a = (j * layout.seq_len)
                    seq = got.tokens[a : a + layout.seq_len + 1]
                    (q,) = layout.sequence_ids([c], [j]).tolist()
                    start, stop = layout.token_range([q])
                    assert np.array_equal(seq, stream[int(start[0]) : int(stop[0])])
                    seen.append(q)
            assert fetching.end(object()) is None  # no chain asked for: nothing read ahead
    assert sorted(seen) == list(range(layout.num_sequences))
    assert fetched and all(r.closed for r in fetched)
