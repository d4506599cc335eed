"""Document packing tables: what a DocumentLayout counts from every length, stored as bytes
once per (dataset, seq_len) and given back to later layouts, which then read no length
until a chunk is repacked, and give the same plan; damaged, hostile or stale tables are
named errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import CorruptIndexError, DatapipeError, OptionError, PlanError
from datapipe.plan.tokens import TABLE_MAGIC, DocumentLayout, DocumentTable

doc_lists = st.lists(st.lists(st.integers(0, 70), max_size=25), min_size=1, max_size=4)


def parts_of(docs):
    return [np.array(d, dtype=np.int32) for d in docs]


@given(docs=doc_lists, L=st.integers(1, 40), bt=st.integers(1, 300), k=st.integers(1, 4))
@settings(max_examples=120, deadline=None)
def test_a_stored_table_gives_the_layout_it_was_counted_from(docs, L, bt, k):
    parts = parts_of(docs)
    counted = DocumentLayout(parts, L, block_tokens=bt, chunk_blocks=k)
    data = counted.table.to_bytes("dataset-1")
    assert data == DocumentLayout(parts, L, block_tokens=bt, chunk_blocks=k).table.to_bytes("dataset-1")
    table = DocumentTable.from_bytes(data, "mem://t", identity="dataset-1")
    read = DocumentLayout(parts, L, block_tokens=bt, chunk_blocks=k, table=table)
    assert read.fingerprint == counted.fingerprint  # resume states of either load into the other
    assert np.array_equal(read.counts, counted.counts)
    assert np.array_equal(read.chunk_doc_start, counted.chunk_doc_start)
    assert np.array_equal(read.chunk_token_start, counted.chunk_token_start)
    assert (read.num_tokens, read.num_documents) == (counted.num_tokens, counted.num_documents)
    for c in range(read.num_chunks):
        a, b = read.chunk(c), counted.chunk(c)
        for f in ("offsets", "part", "start", "length", "doc", "continued"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
    plan_a = read.epoch_plan(seed=3, window=2, world=3)
    plan_b = counted.epoch_plan(seed=3, window=2, world=3)
    assert plan_a.state_dict(plan_a.per_rank) == plan_b.state_dict(plan_b.per_rank)


def test_a_layout_from_a_table_reads_no_length_until_a_chunk_is_repacked():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 900, size=4000).astype(np.int32)
    table = DocumentLayout([lengths], 128, chunk_blocks=2).table
    damaged = lengths.copy()
    damaged[-1] = -7  # a scan of every length would refuse this at once
    lay = DocumentLayout([damaged], 128, chunk_blocks=2, table=table)
    assert np.array_equal(lay.counts, table.counts)
    lay.chunk(0)  # untouched chunks repack as counted
    with pytest.raises(PlanError, match=f"chunk {lay.num_chunks - 1}'s documents.*changed"):
        lay.chunk(lay.num_chunks - 1)
    changed = lengths.copy()
    changed[:2] = changed[:2][::-1] + 1  # the same sizes, other lengths
    with pytest.raises(PlanError, match=r"chunk 0's documents.*changed"):
        DocumentLayout([changed], 128, chunk_blocks=2, table=table).chunk(0)


def test_a_table_counted_with_other_parameters_or_parts_is_refused():
    lengths = np.random.default_rng(6).integers(1, 500, size=600).astype(np.int32)
    table = DocumentLayout([lengths], 64, block_tokens=1000, chunk_blocks=2).table
    for kwargs in ({"block_tokens": 1001, "chunk_blocks": 2}, {"block_tokens": 1000, "chunk_blocks": 3}):
        with pytest.raises(PlanError, match="seq_len, block_tokens, chunk_blocks"):
            DocumentLayout([lengths], 64, table=table, **kwargs)
    with pytest.raises(PlanError, match="seq_len, block_tokens, chunk_blocks"):
        DocumentLayout([lengths], 65, block_tokens=1000, chunk_blocks=2, table=table)
    with pytest.raises(PlanError, match="parts"):
        DocumentLayout([lengths[:300], lengths[300:]], 64, block_tokens=1000, chunk_blocks=2, table=table)
    with pytest.raises(PlanError, match="parts"):
        DocumentLayout([lengths[:-1]], 64, block_tokens=1000, chunk_blocks=2, table=table)
    with pytest.raises(OptionError, match="table="):
        DocumentLayout([lengths], 64, table=table.to_bytes())  # type: ignore[arg-type]
    data = table.to_bytes("manifest-a")
    with pytest.raises(PlanError, match="computed for 'manifest-a', not 'manifest-b'"):
        DocumentTable.from_bytes(data, "file:///d/plans/t", identity="manifest-b")
    assert DocumentTable.from_bytes(data, "x").counts.size == table.counts.size  # identity not asked for


def _table_bytes() -> bytes:
    lengths = np.random.default_rng(7).integers(0, 300, size=500).astype(np.int32)
    return DocumentLayout([lengths[:200], lengths[200:]], 32, block_tokens=700, chunk_blocks=2).table.to_bytes("id")


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_a_damaged_table_is_a_named_error(data):
    good = _table_bytes()
    how = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    raw = bytearray(good)
    if how == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=40))
    with pytest.raises(CorruptIndexError, match="mem://plans/t"):
        DocumentTable.from_bytes(bytes(raw), "mem://plans/t", identity="id")


@given(raw=st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_arbitrary_bytes_are_no_table(raw):
    with pytest.raises(CorruptIndexError):
        DocumentTable.from_bytes(TABLE_MAGIC + raw, "t")
    with pytest.raises(CorruptIndexError):
        DocumentTable.from_bytes(raw, "t")


def _sealed(header: dict, payload: bytes) -> bytes:
    """A table file with this header and payload, checksums made right: what a hostile
    writer (who can compute checksums) could store."""
    import json

    from datapipe.checksum import canonical_json, checksum

    doc = dict(header, payload_checksum=checksum(payload))
    doc.pop("header_checksum", None)
    doc["header_checksum"] = checksum(canonical_json(doc))
    head = json.dumps(doc).encode()
    return TABLE_MAGIC + len(head).to_bytes(8, "little") + head + payload


def _parts(data: bytes) -> tuple[dict, np.ndarray]:
    import json

    n = int.from_bytes(data[8:16], "little")
    return json.loads(data[16:16 + n]), np.frombuffer(data[16 + n:], dtype="<i8").copy()


@pytest.mark.parametrize("change", ["negative count", "more sequences than tokens", "chunks out of order",
                                    "ends short", "huge sizes", "bool size", "float size"])
def test_a_well_sealed_table_that_is_no_partition_is_refused(change):
    header, flat = _parts(_table_bytes())
    P, N = header["parts"], header["chunks"]
    counts = slice(3 * P + 2 * (N + 1), 3 * P + 2 * (N + 1) + N)
    doc_start = slice(3 * P, 3 * P + N + 1)
    if change == "negative count":
        flat[counts][0] = -1
    elif change == "more sequences than tokens":
        flat[counts][0] = 10**9
    elif change == "chunks out of order":
        flat[doc_start][1], flat[doc_start][2] = flat[doc_start][2], flat[doc_start][1]
    elif change == "ends short":
        flat[doc_start][-1] -= 1
    elif change == "huge sizes":
        header["chunks"] = 1 << 61
    elif change == "bool size":
        header["seq_len"] = True
    else:
        header["seq_len"] = 32.0
    with pytest.raises(CorruptIndexError, match="not a document packing table"):
        DocumentTable.from_bytes(_sealed(header, flat.astype("<i8").tobytes()), "t")
    assert issubclass(CorruptIndexError, DatapipeError)


def test_a_table_built_by_hand_is_checked_too():
    t = DocumentTable.from_bytes(_table_bytes(), "t")
    lengths = np.zeros(int(t.part_docs.sum()), np.int32)
    parts = [lengths[:200], lengths[200:]]
    kw = {"block_tokens": 700, "chunk_blocks": 2}
    for bad, match in (({"counts": t.counts[:-1]}, "sizes"), ({"counts": t.counts.astype(np.int32)}, "int64"),
                       ({"chunk_doc_start": t.chunk_doc_start[::-1].copy()}, "in order"),
                       ({"part_tokens": t.part_tokens + 1}, "end where")):
        fields = {f: getattr(t, f) for f in ("seq_len", "block_tokens", "chunk_blocks", "part_docs", "part_tokens",
                                              "part_ranged", "chunk_doc_start", "chunk_token_start", "counts",
                                              "chunk_sums")}
        fields.update(bad)
        with pytest.raises(OptionError, match=match):
            DocumentLayout(parts, 32, table=DocumentTable(**fields), **kw)
