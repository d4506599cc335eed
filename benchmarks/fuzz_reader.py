"""Fuzz every reader of a packed dataset with damaged and hostile copies of it.

    python -m benchmarks.fuzz_reader --cases 3000 [--seed 0]

Each case copies a small reference dataset (uncompressed or zstd), damages one of its
files (a shard, ``samples.parquet``, ``shards.parquet`` or ``manifest.json``) by byte flips,
a truncation, overwritten bytes or an edited field, and reads the copy through
``open_dataset`` (every sample, and one by key), ``verify_dataset`` and one
``StreamingDataset`` epoch (in-process; once raising, once skipping). The rule, for every
reader: it returns exactly the original samples, or raises a ``DatapipeError`` naming the
damaged file; never other data, never another exception, never a hang (each case runs
under a deadline). ``verify`` saying OK means every reader returned the original samples.

Some edits "re-sign" the index (recompute the manifest's checksums over the edited index
files, as a buggy or hostile writer would): they get past every checksum, so what catches
them is validation. The shards' bytes are never re-signed, so any sample a reader hands out
must be an original one. An error for a re-signed edit may name any file of the dataset:
the reader cannot tell which of two consistent-looking files is the wrong one.

The test suite runs a few hundred cases through hypothesis (tests/benchmarks/test_fuzz_reader.py);
this script runs thousands from a seeded random generator and prints the tally.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import datapipe
from datapipe.checksum import checksum
from datapipe.errors import DatapipeError

__all__ = ["build_references", "random_case", "run_case", "Draw", "main"]

#: ``draw(lo, hi)``: an integer in [lo, hi]; hypothesis or a seeded Random supplies it
Draw = Callable[[int, int], int]

DEADLINE_S = 30
INDEX_FILES = ("samples.parquet", "shards.parquet", "manifest.json")


def _samples() -> list[dict[str, Any]]:
    out = []
    for i in range(21):
        key = f"part.{i % 3}/s{i:03d}" if i != 7 else "long/" + "k" * 110  # PAX header for its names
        out.append({"__key__": key, "cls": str(i % 5), "bin": bytes([i]) * (100 + 97 * i), "json": {"i": i}})
    out[4]["extra"] = b"only here"  # one sample with another field: its shard takes the general path
    return out


def _expected() -> dict[str, dict[str, bytes]]:
    from datapipe.format.sample import field_bytes

    return {s["__key__"]: {k: bytes(field_bytes(s["__key__"], k, v)) if k != "__key__" else v for k, v in s.items()}
            for s in _samples()}


def build_references(root: str) -> dict[str, str]:
    """One small dataset per compression under ``root``: three shards of 7 samples."""
    refs = {}
    for compression in ("none", "zstd"):
        dest = os.path.join(root, f"ref-{compression}")
        with datapipe.ShardWriter(dest, max_samples=7, compression=compression) as w:
            for s in _samples():
                w.write(s)
        refs[compression] = dest
    return refs


# -- damage -------------------------------------------------------------------------------


def _resign_index(dest: str) -> None:
    """Make the manifest vouch for the index files as they are now."""
    from datapipe.format.index import digest_bytes

    path = os.path.join(dest, "manifest.json")
    doc = json.loads(open(path, "rb").read())
    files = {}
    for name in ("shards.parquet", "samples.parquet"):
        with open(os.path.join(dest, name), "rb") as f:
            files[name] = digest_bytes(f.read())
    doc["index_files"] = files
    doc["index_checksums"] = {k: v["checksum"] for k, v in files.items()}
    _resign_manifest(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _resign_manifest(doc: dict[str, Any]) -> None:
    rest = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    doc["manifest_checksum"] = checksum(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def _new_value(draw: Draw, value: Any, others: list[Any]) -> Any:
    """Another value for a field: near misses, type changes, another row's value."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return [value + 1, value - 1, value + 512, value - 512, 0, -1, 1 << 31, value * 2, 1 << 62,
                str(value), None, float(value)][draw(0, 11)]
    if isinstance(value, str):
        other = others[draw(0, len(others) - 1)] if others else value
        return [value + "x", value[:-1], "", "../" + value, "/" + value, other, value.upper(),
                value.replace("/", "/../"), value + "\0", 7][draw(0, 9)]
    if isinstance(value, list):
        return [value[:-1], value + value[:1], [], None, "x"][draw(0, 4)]
    if isinstance(value, dict):
        keys = sorted(value)
        if not keys:
            return None
        k = keys[draw(0, len(keys) - 1)]
        return {**value, k: _new_value(draw, value[k], [])}
    return [None, 0, "x"][draw(0, 2)]


def _edit_manifest(draw: Draw, path: str, resign: bool) -> str:
    doc = json.loads(open(path, "rb").read())
    keys = sorted(doc)
    k = keys[draw(0, len(keys) - 1)]
    doc[k] = _new_value(draw, doc[k], [])
    if draw(0, 5) == 0:
        del doc[k]
    if resign:
        _resign_manifest(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    return f"manifest.json {k!r} edited" + (" (re-signed)" if resign else "")


def _edit_parquet(draw: Draw, path: str, resign: bool, dest: str) -> str:
    table = pq.read_table(path)
    name = table.column_names[draw(0, table.num_columns - 1)]
    col = table.column(name).to_pylist()
    r = draw(0, len(col) - 1)
    new = _new_value(draw, col[r], col)
    if new is not None and not isinstance(new, type(col[r])):
        new = col[r]  # the column's type holds: a type change is a flip's job
    col[r] = new
    typ = table.schema.field(name).type
    try:
        arr = pa.array(col, type=typ)
    except (pa.ArrowException, OverflowError):
        arr = table.column(name)
    table = table.set_column(table.column_names.index(name), name, arr)
    pq.write_table(table, path, compression="zstd", row_group_size=65536)
    if resign:
        _resign_index(dest)
    return f"{os.path.basename(path)} row {r} {name!r} edited" + (" (re-signed)" if resign else "")


def random_case(draw: Draw) -> dict[str, Any]:
    """A case: which reference, which file, which damage; all from ``draw``."""
    compression = ("none", "zstd")[draw(0, 1)]
    target = draw(0, 5)  # 0-2: a shard, 3-5: an index file
    kind = ("flip", "truncate", "overwrite", "edit", "edit-resigned")[draw(0, 4)]
    return {"compression": compression, "target": target, "kind": kind, "draw": draw}


def damage(case: dict[str, Any], dest: str) -> tuple[str, str, bool]:
    """Apply the case's damage to the dataset copy at ``dest``; returns (what was done, the
    damaged file, whether an error may name any file of the dataset instead)."""
    draw = case["draw"]
    target, kind = case["target"], case["kind"]
    if target < 3:
        name = sorted(n for n in os.listdir(dest) if n.startswith("shard-"))[target]
        if kind.startswith("edit"):
            kind = "overwrite"  # a shard's fields are bytes: an edit is an overwrite
    else:
        name = INDEX_FILES[target - 3]
    path = os.path.join(dest, name)
    data = bytearray(open(path, "rb").read())
    if kind == "flip":
        flips = [(draw(0, len(data) - 1), draw(0, 7)) for _ in range(draw(1, 3))]
        for pos, bit in flips:
            data[pos] ^= 1 << bit
        what = f"{name}: bits flipped at {flips}"
    elif kind == "truncate":
        cut = draw(0, len(data) - 1)
        del data[cut:]
        what = f"{name}: truncated to {cut} bytes"
    elif kind == "overwrite":
        pos = draw(0, len(data) - 1)
        n = min(len(data) - pos, draw(1, 600))
        fill = (b"\0", b"\xff", b"7", b" ")[draw(0, 3)]
        data[pos : pos + n] = fill * n
        what = f"{name}: {n} bytes at {pos} overwritten with {fill!r}"
    else:
        resign = kind == "edit-resigned"
        if name == "manifest.json":
            return _edit_manifest(draw, path, resign), name, resign
        return _edit_parquet(draw, path, resign, dest), name, resign
    with open(path, "wb") as f:
        f.write(data)
    return what, name, False


# -- reading ------------------------------------------------------------------------------


class CaseFailure(AssertionError):
    pass


@contextmanager
def deadline(seconds: int, what: str):
    """Raise CaseFailure in this (main) thread if the block runs longer than ``seconds``."""

    def hang(*_: Any) -> None:
        raise CaseFailure(f"{what}: no answer within {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _named(e: BaseException, names: tuple[str, ...], reader: str, what: str) -> None:
    if not isinstance(e, DatapipeError):
        raise CaseFailure(f"{what}: {reader} raised a foreign {type(e).__name__}: {e}\n"
                          + "".join(traceback.format_exception(e)))
    if not any(n in str(e) for n in names):
        raise CaseFailure(f"{what}: {reader} raised {type(e).__name__} naming none of {names}: {e}")


def run_case(case: dict[str, Any], refs: dict[str, str], work: str) -> str:
    """Damage a copy of the case's reference dataset and read it through every reader.
    Returns ``"intact"`` (every reader returned the original samples) or ``"refused"``
    (some reader raised a named DatapipeError); raises :class:`CaseFailure` otherwise."""
    dest = os.path.join(work, "case")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(refs[case["compression"]], dest)
    what, name, any_file = damage(case, dest)
    what = f"[{case['compression']}] {what}"
    files = tuple(os.listdir(dest)) if any_file else (name,)
    expected = _expected()
    results = {}
    with deadline(DEADLINE_S, what):
        # random access: every sample by position, one by key
        try:
            ds = datapipe.open_dataset(dest)
            got = {}
            for i in range(len(ds)):
                s = ds[i]
                got[s["__key__"]] = s
            some = next(iter(expected))
            if ds.get(some) != expected[some]:
                raise CaseFailure(f"{what}: ds.get({some!r}) returned other data")
            if got != expected or len(ds) != len(expected):
                raise CaseFailure(f"{what}: open_dataset returned other samples than the original, no error")
            results["random"] = "intact"
        except CaseFailure:
            raise
        except BaseException as e:
            _named(e, files, "open_dataset", what)
            results["random"] = "refused"
        # verify
        try:
            report = datapipe.verify_dataset(dest, all_problems=True)
        except BaseException as e:
            _named(e, files, "verify_dataset", what)
            results["verify"] = "refused"
        else:
            if report.ok:
                results["verify"] = "intact"
            else:
                for p in report.problems:
                    _named(DatapipeError(str(p)), files, "verify_dataset", what)
                results["verify"] = "refused"
        # one epoch, raising, then one skipping
        for mode in ("raise", "skip"):
            got_list: list[dict[str, Any]] = []
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    sds = datapipe.StreamingDataset(dest, decode=None, seed=3, on_error=mode, window=2)
                    for s in sds:
                        got_list.append(dict(s))
                keys = [g["__key__"] for g in got_list]
                if any(expected.get(g["__key__"]) != g for g in got_list) or len(set(keys)) != len(keys):
                    raise CaseFailure(f"{what}: StreamingDataset ({mode}) handed out a sample that is not an original")
                if mode == "raise" and len(got_list) != len(expected):
                    raise CaseFailure(f"{what}: StreamingDataset returned {len(got_list)} of {len(expected)} "
                                      "samples, no error")
                if mode == "skip" and len(got_list) != len(expected) and not sds.skipped:
                    raise CaseFailure(f"{what}: StreamingDataset (skip) lost samples without reporting a skip")
                if mode == "skip" and sds.skipped:
                    for url, _key, why in sds.skipped:
                        _named(DatapipeError(f"{url}: {why}"), files, "StreamingDataset (skip)", what)
                results[f"epoch-{mode}"] = "intact" if len(got_list) == len(expected) else "refused"
            except CaseFailure:
                raise
            except BaseException as e:
                _named(e, files, f"StreamingDataset ({mode})", what)
                results[f"epoch-{mode}"] = "refused"
    if results["verify"] == "intact" and "refused" in results.values():
        raise CaseFailure(f"{what}: verify said OK but a reader refused: {results}")
    return "refused" if "refused" in results.values() else "intact"


def hypothesis_draw(data: Any) -> Draw:
    from hypothesis import strategies as st

    return lambda lo, hi: data.draw(st.integers(lo, hi))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tally: Counter[str] = Counter()
    failures: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        refs = build_references(root)
        for i in range(a.cases):
            rng = random.Random(a.seed * 1_000_003 + i)
            case = random_case(rng.randint)
            try:
                tally[run_case(case, refs, root)] += 1
            except CaseFailure as e:
                tally["FAILED"] += 1
                failures.append(f"case {i} (seed {a.seed}): {e}")
            if (i + 1) % 500 == 0:
                print(f"{i + 1} cases, {dict(tally)}, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for f in failures[:20]:
        print(f, file=sys.stderr)
    print(f"fuzz_reader: {a.cases} cases in {time.perf_counter() - t0:.0f} s: {tally['intact']} read back intact, "
          f"{tally['refused']} refused with a named DatapipeError, {tally['FAILED']} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
