"""The member layout an index records (format version 2): every writer records what the
strict tar parser finds, the loader uses it without working it out again, a recorded layout
the shard's bytes do not bear out is a named error, and indexes of version 1 (no layout)
still read.

``tests/data/v1-none`` and ``tests/data/v1-zstd`` were written by the datapipe of commit
bc3a4ce (index format version 1), 40 samples as ``_old_samples`` makes them, in shards of 16.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.errors import CorruptIndexError, CorruptShardError, DatapipeError
from datapipe.format import (
    SampleRecords,
    ShardRecord,
    StoredLayout,
    check_layout,
    decompress_frame,
    digest_bytes,
    make_manifest,
    sample_members,
)
from datapipe.format import layout as layout_module
from datapipe.format.layout import MemberTable, ShardLayout, shard_members
from datapipe.publish import write_index
from datapipe.storage import open_store

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def _samples(n=30, long_keys=False, mixed=False, varied=False):
    out = []
    for i in range(n):
        key = f"d/{'k' * (95 + i) if long_keys and i % 3 == 0 else 's'}{i:03d}"  # past 100 bytes: PAX headers
        if varied:  # keys of 6 to 98 bytes: names of 10 to 102 (100 exactly at a 96-byte key, no NUL after it)
            key = f"d/{'v' * (i * 4 % 93)}s{i:03d}"
        s = {"__key__": key, "cls": str(i % 10), "bin": bytes([i % 256]) * (i * 131 % 1500)}
        if mixed and i % 4 == 1:
            s["seg.png"] = b"p" * i  # a dotted field, in some samples only
        out.append(s)
    return out


def _write(dest, samples, **kw):
    with datapipe.ShardWriter(str(dest), max_samples=kw.pop("max_samples", 11), **kw) as w:
        for s in samples:
            w.write(s)
    return str(dest)


def _shard_bytes(ix, i):
    store, name = ix.shard_location(ix.shards[i])
    return bytes(store.get(name))


def _strict(ix, i):
    """(fields, data bounds from the sample's first byte) of each sample of shard i, by the
    strict tar parser."""
    data, t, out = _shard_bytes(ix, i), ix.shard_samples(i), []
    for j, key in enumerate(t.keys):
        raw = data[int(t.offsets[j]) : int(t.offsets[j] + t.lengths[j])]
        if ix.compression == "zstd":
            raw = decompress_frame(raw, "test", ix.shards[i].tar_bytes)
        out.append(sample_members(raw, 0, len(raw), key, "test"))
    return out


def _recorded(ix, i):
    t = ix.shard_samples(i)
    return [t.layout.sample(j) for j in range(len(t))]


def _pack_files(tmp_path, samples):
    src = tmp_path / "files"
    for s in samples:
        for f, v in s.items():
            if f != "__key__":
                path = src / f"{s['__key__']}.{f}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(v if isinstance(v, bytes) else str(v).encode())
    dest = str(tmp_path / "packed")
    datapipe.pack(str(src), dest, shard_samples=11, workers=1)
    return dest


def _pack_table(tmp_path, samples):
    rows = [{"__key__": s["__key__"], "cls": s["cls"], "bin": s["bin"]} for s in samples]
    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    dest = str(tmp_path / "from-table")
    datapipe.pack(path, dest, shard_samples=11, workers=1)
    return dest


def _tar_index(tmp_path, samples):
    folder = tmp_path / "tars"
    folder.mkdir()
    for k in range(3):
        with tarfile.open(folder / f"part-{k}.tar", "w", format=tarfile.PAX_FORMAT) as tf:
            info = tarfile.TarInfo("d")
            info.type = tarfile.DIRTYPE
            tf.addfile(info)  # a member that names no sample
            for s in samples[k::3]:
                for f in sorted(s, reverse=k == 1):  # stored in another order in one shard
                    if f != "__key__":
                        v = s[f] if isinstance(s[f], bytes) else str(s[f]).encode()
                        info = tarfile.TarInfo(f"{s['__key__']}.{f}")
                        info.size = len(v)
                        tf.addfile(info, io.BytesIO(v))
    datapipe.index_shards(str(folder), workers=1)
    return str(folder)


WRITERS = {
    "shardwriter": lambda tmp, s: _write(tmp / "w", s),
    "shardwriter-zstd": lambda tmp, s: _write(tmp / "z", s, compression="zstd"),
    "pack-files": _pack_files,
    "pack-table": _pack_table,
    "tar-index": _tar_index,
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("kind", ["uniform", "long_keys", "mixed"])
def test_every_writer_records_the_layout_the_strict_parser_finds(tmp_path, writer, kind):
    samples = _samples(long_keys=kind == "long_keys", mixed=kind == "mixed")
    if writer == "pack-table":
        samples = [{k: v for k, v in s.items() if k != "seg.png"} for s in samples]
    dest = WRITERS[writer](tmp_path, samples)
    ix = datapipe.open_index(dest)
    assert ix.manifest["version"] == 2 == ix.version
    for i in range(ix.num_shards):
        assert _recorded(ix, i) == _strict(ix, i)
    assert datapipe.verify_dataset(dest).ok
    expected = {s["__key__"]: {k: (v if isinstance(v, bytes) or k == "__key__" else str(v).encode())
                               for k, v in s.items()} for s in samples}
    got = {s["__key__"]: dict(s) for s in datapipe.StreamingDataset(dest, decode=None, seed=3)}
    assert got == expected


def test_the_loader_reads_the_recorded_layout_and_finds_none(tmp_path, monkeypatch):
    dest = _write(tmp_path / "ds", _samples(60, long_keys=True, mixed=True))
    reference = datapipe.StreamingDataset(dest, decode=None, seed=1, return_position=True)
    reference.source.find_layouts = False  # every sample parsed on its own by the strict parser
    expected = list(reference)

    def no(*a, **k):
        raise AssertionError("the loader worked out a layout the index records")

    import datapipe.format.layout as layout
    import datapipe.loader.source as source

    monkeypatch.setattr(source, "find_layout", no)
    monkeypatch.setattr(layout, "fast_layout", no)
    monkeypatch.setattr(layout, "shard_members", no)
    ds = datapipe.StreamingDataset(dest, decode=None, seed=1, return_position=True)
    assert list(ds) == expected
    assert len(ds.source.layouts) == datapipe.open_index(dest).num_shards  # every shard laid out


# -- a recorded layout that the shard does not bear out ----------------------------------------


def _index(dest):
    """(shard records, per-shard sample records with their layout, manifest), read with pyarrow."""
    shards = [ShardRecord(**r) for r in pq.read_table(f"{dest}/shards.parquet").to_pylist()]
    rows = pq.read_table(f"{dest}/samples.parquet").to_pylist()
    per = []
    for i in range(len(shards)):
        mine = [r for r in rows if r["shard"] == i]
        per.append(SampleRecords([r["key"] for r in mine], [r["offset"] for r in mine], [r["length"] for r in mine],
                                 [r["checksum"] for r in mine], [r["member_fields"] for r in mine],
                                 [b for r in mine for b in r["member_bounds"]]))
    return shards, per, json.loads(open(f"{dest}/manifest.json").read())


def _resign(dest, shards, per, manifest):
    write_index(open_store(dest), shards, per, manifest["compression"], manifest["fields"])


def _skip(dest):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [s["__key__"] for s in datapipe.StreamingDataset(dest, decode=None, on_error="skip")]


@pytest.mark.parametrize("damage", ["bound", "order", "name", "member"])
def test_a_recorded_layout_the_shard_does_not_bear_out_is_a_named_error(tmp_path, damage):
    samples = _samples(33)
    dest = _write(tmp_path / "ds", samples)
    shards, per, manifest = _index(dest)
    r = per[1]  # sample 2 of shard 1: fields bin, cls
    if damage == "bound":  # its first member's data said to lie a block later
        r.member_bounds[4 * 2] += 512
        r.member_bounds[4 * 2 + 1] += 512
    elif damage == "order":
        r.member_fields[2] = "cls/bin"
    elif damage == "name":
        r.member_fields[2] = "bin/txt"
    else:  # a member the shard does not hold
        r.member_fields[2] = "bin/cls/json"
        r.member_bounds[4 * 2 + 4 : 4 * 2 + 4] = [1536, 1537]  # where cls lies
    _resign(dest, shards, per, manifest)
    with pytest.raises(CorruptShardError) as e:
        list(datapipe.StreamingDataset(dest, decode=None, shuffle=False))
    assert shards[1].name in str(e.value) and r.keys[2] in str(e.value)
    left = _skip(dest)  # the shard's samples are skipped, every other one is read
    assert sorted(left) == sorted(s["__key__"] for s in samples if s["__key__"] not in r.keys)
    report = datapipe.verify_dataset(dest)
    assert not report.ok and r.keys[2] in str(report.problems[0])
    assert datapipe.open_dataset(dest)[13]["__key__"] == r.keys[2]  # random access reads by the strict parser


def test_a_recorded_layout_outside_its_sample_is_refused_with_the_index(tmp_path):
    dest = _write(tmp_path / "ds", _samples(20))
    shards, per, manifest = _index(dest)
    per[0].member_bounds[1] = per[0].lengths[0] + 1  # past the sample's end: the rows alone show it
    _resign(dest, shards, per, manifest)
    for read in (lambda: list(datapipe.StreamingDataset(dest, decode=None)), lambda: _skip(dest)):
        with pytest.raises(CorruptIndexError, match=r"samples.parquet .shard #0"):
            read()


def test_a_layout_recorded_for_some_samples_of_a_shard_only_is_refused(tmp_path):
    dest = _write(tmp_path / "ds", _samples(20))
    _, _, manifest = _index(dest)
    table = pq.read_table(f"{dest}/samples.parquet")
    fields = table.column("member_fields").to_pylist()
    fields[3] = None  # shard 0's sample 3
    table = table.set_column(table.schema.get_field_index("member_fields"), "member_fields",
                             pa.array(fields, pa.string()))
    _rewrite(dest, table, manifest, 2)
    with pytest.raises(CorruptIndexError, match="some samples of a shard"):
        list(datapipe.StreamingDataset(dest, decode=None))


# -- the fast structural check of a recorded layout against the strict parser ------------------


def _base(tmp_path_factory, kind):
    dest = _write(tmp_path_factory.mktemp(kind) / "ds", _samples(24, long_keys=kind == "long_keys",
                                                                  mixed=kind == "mixed", varied=kind == "varied"),
                  max_samples=24)
    ix = datapipe.open_index(dest)
    t = ix.shard_samples(0)
    return _shard_bytes(ix, 0), t


#: the keys of one length; some past 100 bytes (PAX headers); fields in some samples only;
#: keys of many lengths, some names exactly 100 bytes
KINDS = ("uniform", "long_keys", "mixed", "varied")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return {kind: _base(tmp_path_factory, kind) for kind in KINDS}


def _per_sample(layout, n):
    if isinstance(layout, ShardLayout):
        return [(layout.fields, layout.table[j].tolist()) for j in range(n)]
    assert isinstance(layout, MemberTable)
    out = []
    for j in range(n):
        s, first = int(layout.shape[j]), int(layout.first[j])
        fields = layout.shapes[s] if s >= 0 else ()
        out.append(None if s < 0 else (fields, layout.bounds[first : first + 2 * len(fields)].tolist()))
    return out


def _check(src, t, stored=None):
    ends = t.offsets + t.lengths
    return check_layout(src, stored or t.layout, t.offsets, ends, *t.key_bytes, t.keys, "shard")


def _strict_layout(src, t):
    ends = t.offsets + t.lengths
    return shard_members(src, t.offsets.tolist(), ends.tolist(), t.keys, "shard")


def _header_sum(block):
    return sum(block[:148]) + 8 * 32 + sum(block[156:512])


@pytest.mark.parametrize("kind", KINDS)
def test_the_check_of_a_recorded_layout_lays_out_as_the_strict_parse(bases, kind, monkeypatch):
    """The same layout as the strict parse, and the fast check vouches for every sample
    whose members are plain ustar headers: only those with a name past 100 bytes (a PAX
    header) are parsed strictly."""
    src, t = bases[kind]
    strict = _strict_layout(src, t)
    parsed = []
    strict_one = layout_module.sample_members
    monkeypatch.setattr(layout_module, "sample_members", lambda *a: parsed.append(a[3]) or strict_one(*a))
    got = _check(src, t)
    assert type(got) is type(strict) and _per_sample(got, len(t)) == _per_sample(strict, len(t))
    long_names = [key for j, key in enumerate(t.keys)
                  if any(len(f"{key}.{f}".encode()) > 100 for f in t.layout.sample(j)[0])]
    assert parsed == long_names
    assert kind not in ("long_keys", "varied") or long_names  # both kinds hold some


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), sample=st.integers(0, 23), member=st.integers(0, 2),
       at=st.one_of(st.integers(0, 511), st.sampled_from([0, 5, 99, 100, 124, 130, 134, 135, 156, 257, 263, 345])),
       value=st.integers(0, 255))
def test_damaged_tar_headers_are_refused_or_laid_out_as_the_strict_parse(bases, kind, sample, member, at, value):
    """A header byte changed (its header checksum made right again, so that the strict parser
    judges the rest): the check of the recorded layout refuses the shard, or gives exactly
    what the strict parse gives, which is then the recorded layout."""
    src, t = bases[kind]
    fields, rel = t.layout.sample(sample)
    member %= len(fields)
    head = int(t.offsets[sample]) + rel[2 * member] - 512
    data = bytearray(src)
    data[head + at] = value
    data[head + 148 : head + 156] = b"%06o\0 " % _header_sum(data[head : head + 512])
    damaged = bytes(data)
    try:
        strict = _strict_layout(damaged, t)
    except CorruptShardError:
        strict = None
    try:
        got = _check(damaged, t)
    except CorruptShardError:
        return
    assert strict is not None, "the check vouched for a shard the strict parser refuses"
    assert _per_sample(got, len(t)) == _per_sample(strict, len(t)) == _per_sample(_check(src, t), len(t))


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), sample=st.integers(0, 23), pos=st.integers(0, 40),
       delta=st.sampled_from([-513, -512, -1, 1, 511, 512, 1024]), rename=st.booleans())
def test_damaged_recorded_layouts_are_refused(bases, kind, sample, pos, delta, rename):
    """A recorded bound moved, or a field renamed: never laid out otherwise than the shard is."""
    src, t = bases[kind]
    lay = t.layout
    bounds = lay.bounds.copy()
    lo, hi = int(lay.first[sample]), int(lay.first[sample + 1])
    bounds[lo + pos % (hi - lo)] += delta
    shapes = list(lay.shapes)
    if rename:
        s = int(lay.shape[sample])
        shapes[s] = ("x" + shapes[s][0], *shapes[s][1:])
    damaged = StoredLayout(shapes, lay.shape, lay.first, bounds)
    with pytest.raises(CorruptShardError):
        _check(src, t, damaged)


# -- indexes of version 1 (no layout) still read ------------------------------------------------


def _old_samples():
    return [{"__key__": f"old/s{i:03d}", "bin": bytes([i]) * (i * 53 % 900 + 1), "cls": str(i % 7).encode()}
            for i in range(40)]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_dataset_written_with_index_version_1_still_reads(tmp_path, compression):
    dest = str(tmp_path / "old")
    shutil.copytree(os.path.join(DATA, f"v1-{compression}"), dest)
    ix = datapipe.open_index(dest)
    assert ix.version == 1 and ix.shard_samples(0).layout is None
    expected = sorted(_old_samples(), key=lambda s: s["__key__"])
    got = sorted((dict(s) for s in datapipe.StreamingDataset(dest, decode=None, seed=2)), key=lambda s: s["__key__"])
    assert got == expected
    ds = datapipe.StreamingDataset(dest, decode=None)
    list(ds)
    assert len(ds.source.layouts) == (3 if compression == "none" else 0)  # found by the reader, as before
    loader = datapipe.StreamingDataLoader(datapipe.StreamingDataset(dest, decode=None), batch_size=8, num_workers=2)
    assert sorted(k for b in loader for k in b["__key__"]) == [s["__key__"] for s in expected]
    r = datapipe.open_dataset(dest)
    assert [r[i] for i in range(len(r))] == expected and r.get("old/s017") == expected[17]
    assert datapipe.verify_dataset(dest).ok


def _rewrite(dest, table, manifest, version):
    """samples.parquet replaced by ``table`` (in row groups of the manifest's size) and the
    manifest re-signed at ``version``, as a writer of that version would have written them."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=manifest["sample_row_group"])
    body = buf.getvalue()
    open(f"{dest}/samples.parquet", "wb").write(body)
    shards = [ShardRecord(**r) for r in pq.read_table(f"{dest}/shards.parquet").to_pylist()]
    files = {"shards.parquet": digest_bytes(open(f"{dest}/shards.parquet", "rb").read()),
             "samples.parquet": digest_bytes(body)}
    doc = make_manifest(shards, manifest["compression"], manifest["fields"], {"version": version}, index_files=files)
    open(f"{dest}/manifest.json", "wb").write(doc)


def test_an_index_rewritten_as_version_1_reads_as_the_same_dataset(tmp_path):
    samples = _samples(50, long_keys=True, mixed=True)
    dest = _write(tmp_path / "ds", samples)
    before = list(datapipe.StreamingDataset(dest, decode=None, seed=4))
    _, _, manifest = _index(dest)
    table = pq.read_table(f"{dest}/samples.parquet").select(["key", "shard", "offset", "length", "checksum"])
    _rewrite(dest, table, manifest, 1)
    ix = datapipe.open_index(dest)
    assert ix.version == 1 and all(ix.shard_samples(i).layout is None for i in range(ix.num_shards))
    assert list(datapipe.StreamingDataset(dest, decode=None, seed=4)) == before
    assert datapipe.verify_dataset(dest).ok


def test_an_index_of_a_later_version_is_refused_naming_the_versions(tmp_path):
    dest = _write(tmp_path / "ds", _samples(5))
    _, _, manifest = _index(dest)
    _rewrite(dest, pq.read_table(f"{dest}/samples.parquet"), manifest, 3)
    with pytest.raises(DatapipeError, match=r"version 3.*reads versions 1, 2"):
        datapipe.open_index(dest)


def test_join_keeps_each_parts_layout_and_reads_parts_of_version_1(tmp_path):
    dest = tmp_path / "joined"
    for i in range(2):
        _write(dest / f"part-{i:05d}-of-00002", [dict(s, __key__=f"p{i}/{s['__key__']}") for s in _samples(20)])
    part0 = str(dest / "part-00000-of-00002")
    _, _, manifest = _index(part0)
    _rewrite(part0, pq.read_table(f"{part0}/samples.parquet").select(["key", "shard", "offset", "length", "checksum"]),
             manifest, 1)
    datapipe.join_parts(str(dest))
    ix = datapipe.open_index(str(dest))
    laid = [ix.shard_samples(i).layout is not None for i in range(ix.num_shards)]
    assert ix.version == 2 and laid == [False] * 2 + [True] * 2  # part 0 recorded none, part 1 did
    for i in range(2, 4):
        assert _recorded(ix, i) == _strict(ix, i)
    assert len(list(datapipe.StreamingDataset(str(dest), decode=None))) == 40
    assert datapipe.verify_dataset(str(dest)).ok
    np.testing.assert_array_equal(ix.sample_counts, [11, 9, 11, 9])
