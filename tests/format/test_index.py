"""Issue 9, items 1, 2 and 12: no offset from an index is used before the index is verified,
and an index that disagrees with its shards is an error naming the file, never data.

"Re-signed" damage below rewrites the index with valid checksums through the packer's own
``write_index``, as a buggy or hostile writer would: it gets past every checksum, so only
validation and the tar-header-vs-index checks can catch it.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import datapipe
from datapipe.errors import DatapipeError
from datapipe.format import SampleRecords, ShardRecord
from datapipe.publish import write_index
from datapipe.storage import open_store


def _make(path, compression="none", n=24, **kw):
    dest = str(path)
    with datapipe.ShardWriter(dest, max_samples=8, compression=compression, **kw) as w:
        for i in range(n):
            w.write({"__key__": f"d/s{i:03d}", "cls": str(i % 10), "bin": bytes([i]) * 700})
    return dest


def _expected(n=24):
    return [{"__key__": f"d/s{i:03d}", "bin": bytes([i]) * 700, "cls": str(i % 10).encode()} for i in range(n)]


def _index(dest):
    """(shard records, per-shard sample columns, manifest) read with pyarrow alone."""
    shards = [ShardRecord(**r) for r in pq.read_table(f"{dest}/shards.parquet").to_pylist()]
    rows = pq.read_table(f"{dest}/samples.parquet").to_pylist()
    per = []
    for i in range(len(shards)):
        mine = [r for r in rows if r["shard"] == i]
        per.append(SampleRecords([r["key"] for r in mine], [r["offset"] for r in mine],
                                 [r["length"] for r in mine], [r["checksum"] for r in mine]))
    return shards, per, json.loads(open(f"{dest}/manifest.json").read())


def _resign(dest, shards, per, manifest):
    write_index(open_store(dest), shards, per, manifest["compression"], manifest["fields"])


def _read_all(dest):
    ds = datapipe.open_dataset(dest)
    return [ds[i] for i in range(len(ds))]


def _stream(dest, **kw):
    ds = datapipe.StreamingDataset(dest, shuffle=False, decode=None, **kw)
    return [dict(s) for s in ds]


def _refused(fn, *names):
    """``fn()`` raises a DatapipeError naming one of ``names``; anything else fails."""
    with pytest.raises(DatapipeError) as e:
        fn()
    assert any(n in str(e.value) for n in names), str(e.value)


# -- item 1: the index is verified before any offset from it is used -----------------------


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_bit_flips_in_samples_parquet_are_refused_by_every_reader(tmp_path, compression):
    src = _make(tmp_path / "src", compression)
    good = open(f"{src}/samples.parquet", "rb").read()
    size = len(good)
    # flips spread over the whole file: data pages, page headers, footer, magic
    for k, pos in enumerate(range(3, size, max(1, size // 12))):
        dest = tmp_path / f"d{k}"
        _make(dest, compression)
        bad = bytearray(good)
        bad[pos] ^= 1 << (k % 8)
        (dest / "samples.parquet").write_bytes(bytes(bad))
        _refused(lambda d=str(dest): _read_all(d), "samples.parquet")
        _refused(lambda d=str(dest): _stream(d), "samples.parquet")
        report = datapipe.verify_dataset(str(dest))
        assert not report.ok and "samples.parquet" in str(report.problems[0])


def test_damaged_samples_parquet_is_a_named_error_not_a_pyarrow_one(tmp_path):
    dest = _make(tmp_path / "ds")
    path = tmp_path / "ds" / "samples.parquet"
    data = path.read_bytes()
    for bad in (data[: len(data) // 2], data[:-3] + b"XYZ", b"\0" * len(data), data[:8] + b"\xff" * 64 + data[72:]):
        path.write_bytes(bad)
        _refused(lambda: _read_all(dest), "samples.parquet")
        _refused(lambda: datapipe.open_dataset(dest).get("d/s003"), "samples.parquet")


def test_rows_that_do_not_tile_their_shard_are_refused(tmp_path):
    dest = _make(tmp_path / "ds")
    shards, per, manifest = _index(dest)
    # sample 1 starts one member late, sample 0 takes its first member: checksums re-signed
    r = per[0]
    r.lengths[0] += 1536
    r.offsets[1] += 1536
    r.lengths[1] -= 1536
    import xxhash

    blob = open(f"{dest}/{shards[0].name}", "rb").read()
    for j in (0, 1):
        r.checksums[j] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(blob[r.offsets[j] : r.offsets[j] + r.lengths[j]])
    _resign(dest, shards, per, manifest)
    # sample 1 alone looks whole (its key, its bytes' checksum): the member after sample 0's
    # range, or the walk over the shard, shows that the index cut it
    _refused(lambda: datapipe.open_dataset(dest)[0], shards[0].name)
    got = []

    def epoch():
        for s in datapipe.StreamingDataset(dest, shuffle=False, decode=None):
            got.append(dict(s))

    _refused(epoch, shards[0].name)
    assert all(g in _expected() for g in got)  # nothing wrong was handed out before the error
    # skipping what fails must not hand out sample 1 without its first field
    skipped = _stream_skip(dest)
    assert all(g in _expected() for g in skipped) and len(skipped) >= 16
    assert not datapipe.verify_dataset(dest).ok


def test_rows_with_overlapping_ranges_are_refused(tmp_path):
    dest = _make(tmp_path / "ds")
    shards, per, manifest = _index(dest)
    per[0].offsets[3] = per[0].offsets[2]  # sample 3 read as sample 2's bytes
    per[0].lengths[3] = per[0].lengths[2]
    per[0].checksums[3] = per[0].checksums[2]
    _resign(dest, shards, per, manifest)
    _refused(lambda: _read_all(dest), "samples.parquet", shards[0].name)
    _refused(lambda: _stream(dest), "samples.parquet", shards[0].name)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_index_key_must_match_the_tar_header_key(tmp_path, compression):
    """Item 12 / item 1: an index key that no tar header carries is an error, not a sample
    handed out under the header's key."""
    dest = _make(tmp_path / "ds", compression)
    shards, per, manifest = _index(dest)
    per[1].keys[2] = "d/renamed"
    _resign(dest, shards, per, manifest)
    ds = datapipe.open_dataset(dest)
    _refused(lambda: ds[10], shards[1].name)
    _refused(lambda: ds.get("d/renamed"), shards[1].name)
    assert ds[0] == _expected()[0]
    _refused(lambda: _stream(dest), shards[1].name)
    got = _stream_skip(dest)  # skips what it cannot vouch for (all of shard 1, uncompressed)
    assert all(g in _expected() for g in got) and "d/s010" not in [g["__key__"] for g in got]
    assert len(got) >= 16
    report = datapipe.verify_dataset(dest)
    assert not report.ok and "d/renamed" in str(report.problems[0])


def _stream_skip(dest):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _stream(dest, on_error="skip")


def test_empty_sample_checksums_are_refused_by_the_loader(tmp_path):
    """An index whose sample checksums are empty verifies nothing: refused before any
    sample is read, by every reader (StreamingDataset used to read it unchecked)."""
    dest = _make(tmp_path / "ds")
    shards, per, manifest = _index(dest)
    for r in per:
        r.checksums[:] = [""] * len(r.checksums)
    _resign(dest, shards, per, manifest)
    _refused(lambda: _stream(dest), "samples.parquet")
    _refused(lambda: _stream_skip(dest), "samples.parquet")
    _refused(lambda: _read_all(dest), "samples.parquet")


# -- item 2: the manifest has a checksum of its own, and every field is validated --------------


def test_a_row_groups_statistics_are_checked_as_it_is_first_read(tmp_path, monkeypatch):
    """The footer's column statistics of each row group of samples.parquet are checked
    before any of that group's rows is decoded (as the group is first read: walking them
    all at open cost 33 ms at 10^7 samples): a re-signed table whose third group holds
    empty checksums opens, serves the groups before it, and names that group when read."""
    import datapipe.format.index

    monkeypatch.setattr(datapipe.format.index, "SAMPLE_ROW_GROUP", 8)  # 24 samples: 3 groups
    dest = _make(tmp_path / "ds")
    shards, per, manifest = _index(dest)
    assert manifest["sample_row_group"] == 8
    per[2].checksums[:] = [""] * len(per[2].checksums)  # shard 2: samples 16..23, row group 2
    _resign(dest, shards, per, manifest)
    ds = datapipe.open_dataset(dest)
    assert [ds[i]["__key__"] for i in (0, 9, 15)] == ["d/s000", "d/s009", "d/s015"]
    with pytest.raises(datapipe.errors.CorruptIndexError, match=r"samples.parquet: column 'checksum' of row group 2"):
        ds[20]


@pytest.mark.parametrize("field,value", [
    ("sample_row_group", 8), ("sample_row_group", 65537), ("sample_row_group", 0), ("num_samples", 23),
    ("num_samples", "24"), ("num_shards", 2), ("compression", "zstd"), ("stored_bytes", -1),
    ("shards_file", "../x/shards.parquet"), ("samples_file", "/etc/passwd"), ("version", 1.0),
])
def test_edited_manifest_field_is_refused(tmp_path, field, value):
    dest = _make(tmp_path / "ds")
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    doc[field] = value
    path.write_text(json.dumps(doc))
    _refused(lambda: _read_all(dest), "manifest.json")
    _refused(lambda: datapipe.open_dataset(dest).get("d/s005"), "manifest.json")
    _refused(lambda: _stream(dest), "manifest.json")


def test_one_digit_of_sample_row_group_does_not_return_another_sample(tmp_path):
    """The reported case: sample_row_group 65536 -> 65535 made ds[i] another sample."""
    from datapipe.format import SAMPLE_ROW_GROUP

    dest = _make(tmp_path / "ds", n=24)
    path = tmp_path / "ds" / "manifest.json"
    was = f'"sample_row_group": {SAMPLE_ROW_GROUP}'
    assert was in path.read_text()
    path.write_text(path.read_text().replace(was, f'"sample_row_group": {SAMPLE_ROW_GROUP - 1}'))
    _refused(lambda: datapipe.open_dataset(dest)[5], "manifest.json")


@pytest.mark.parametrize("field,value", [
    ("sample_row_group", 8), ("num_samples", 23), ("compression", "zstd"), ("shards_file", "../up/shards.parquet"),
    ("num_shards", 4),
])
def test_resigned_manifest_field_is_checked_against_the_index(tmp_path, field, value):
    """A manifest whose checksum matches (a buggy writer) is still checked field by field
    and against the index files."""
    from datapipe.checksum import checksum

    dest = _make(tmp_path / "ds")
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    doc[field] = value
    if "manifest_checksum" in doc:
        rest = {k: v for k, v in doc.items() if k != "manifest_checksum"}
        doc["manifest_checksum"] = checksum(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(doc))
    _refused(lambda: _read_all(dest), "manifest.json", "shards.parquet", "samples.parquet")
    _refused(lambda: _stream(dest), "manifest.json", "shards.parquet", "samples.parquet")


def test_manifest_without_its_checksum_says_what_to_do(tmp_path):
    dest = _make(tmp_path / "ds")
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("manifest_checksum", None)
    path.write_text(json.dumps(doc))
    with pytest.raises(datapipe.errors.CorruptIndexError, match=r"manifest.json.*[Rr]e-run"):
        datapipe.open_dataset(dest)


# -- item 12: names that leave the dataset -------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside/x.tar", "/etc/x.tar", "a/../../x.tar", "s3://b/x.tar"])
def test_shard_name_leaving_the_dataset_is_refused(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = _make(tmp_path / "ds")
    shards, per, manifest = _index(dest)
    # a copy of shard 0 outside the dataset, so that following the name would read data
    (outside / "x.tar").write_bytes(open(f"{dest}/{shards[0].name}", "rb").read())
    shards[0] = ShardRecord(name, *[getattr(shards[0], f) for f in ("bytes", "samples", "checksum", "tar_bytes")])
    _resign(dest, shards, per, manifest)
    _refused(lambda: _read_all(dest), name)
    _refused(lambda: _stream(dest), name)
    assert not datapipe.verify_dataset(dest).ok


@pytest.mark.parametrize("key", ["../../etc/x", "/abs/x", "a/./b", "a\\b"])
def test_sample_key_leaving_the_dataset_is_refused(tmp_path, key):
    dest = _make(tmp_path / "ds")
    shards, per, manifest = _index(dest)
    per[0].keys[0] = key
    _resign(dest, shards, per, manifest)
    _refused(lambda: _read_all(dest), "samples.parquet")
    _refused(lambda: _stream(dest), "samples.parquet")


@pytest.mark.parametrize("prefix", ["d/s", "d/é"])
def test_rows_that_cut_a_sample_short_are_refused_by_random_access(tmp_path, prefix):
    """Sample 0's range re-signed to end before its last member (``cls``), which the range
    of sample 1 then starts with: random access to sample 0 must not return it without
    ``cls``. The check of the header after the range compared the key's length in
    characters with bytes, so it never fired for a key that is not ASCII."""
    import xxhash

    dest = str(tmp_path / "ds")
    with datapipe.ShardWriter(dest, max_samples=8) as w:
        for i in range(8):
            w.write({"__key__": f"{prefix}{i:03d}", "cls": str(i), "bin": bytes([i]) * 700})
    shards, per, manifest = _index(dest)
    r = per[0]
    r.lengths[0] -= 1024  # the cls member: one header block, one data block
    r.offsets[1] -= 1024
    r.lengths[1] += 1024
    blob = open(f"{dest}/{shards[0].name}", "rb").read()
    for j in (0, 1):
        r.checksums[j] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(blob[r.offsets[j] : r.offsets[j] + r.lengths[j]])
    _resign(dest, shards, per, manifest)
    ds = datapipe.open_dataset(dest)
    _refused(lambda: ds[0], shards[0].name)
    _refused(lambda: ds[1], shards[0].name)
    assert ds[2] == {"__key__": f"{prefix}002", "bin": bytes([2]) * 700, "cls": b"2"}
