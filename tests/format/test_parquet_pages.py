"""The Parquet page headers read before pyarrow decodes a column chunk
(``datapipe.format.parquet_pages``): every chunk pyarrow writes (codecs, data page v1 and
v2, dictionaries, statistics, checksums, page indexes, nested columns, many small pages)
is walked to its last byte and its row group read back exactly; damaged header bytes are a
FormatError, never another exception (hypothesis)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import FormatError, InputFileError
from datapipe.format.parquet_pages import chunk_pages
from datapipe.packing import parquet_dataset, read_fragment

_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _table(rows: int, seed: int) -> pa.Table:
    text = [None if (i * seed) % 7 == 3 else f"caption {i % (seed % 5 + 1)} " * (i % 9) for i in range(rows)]
    return pa.table({
        "id": pa.array(range(rows), pa.int64()),
        "small": pa.array([(i * seed) % 3 for i in range(rows)], pa.int32()),
        "flag": pa.array([i % 2 == 0 for i in range(rows)]),
        "score": pa.array([i / 7 for i in range(rows)], pa.float64()),
        "text": pa.array(text, pa.string()),
        "blob": pa.array([bytes([i % 256]) * (i % 300) for i in range(rows)], pa.binary()),
        "fixed": pa.array([bytes([i % 256]) * 5 for i in range(rows)], pa.binary(5)),
        "tags": pa.array([[j for j in range(i % 4)] for i in range(rows)], pa.list_(pa.int64())),
        "image": pa.array([{"bytes": b"\x89PNG" * (i % 5), "path": f"{i % 3}.png"} for i in range(rows)], _IMAGE),
    })


def _chunks(path: str):
    data = open(path, "rb").read()
    meta = pq.ParquetFile(path).metadata
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            yield col, data[start : start + col.total_compressed_size]


@settings(max_examples=40)
@given(rows=st.integers(1, 400), seed=st.integers(1, 50), compression=st.sampled_from(["none", "zstd", "snappy",
       "gzip", "lz4"]), dictionary=st.booleans(), version=st.sampled_from(["1.0", "2.0"]),
       statistics=st.booleans(), checksums=st.booleans(), page_index=st.booleans(),
       page_size=st.sampled_from([64, 1024, 1 << 20]), group=st.integers(1, 400))
def test_every_chunk_pyarrow_writes_is_walked_to_its_end_and_reads_back(tmp_path_factory, rows, seed, compression,
                                                                        dictionary, version, statistics, checksums,
                                                                        page_index, page_size, group):
    path = str(tmp_path_factory.mktemp("pages") / "t.parquet")
    table = _table(rows, seed)
    pq.write_table(table, path, compression=compression, use_dictionary=dictionary, data_page_version=version,
                   write_statistics=statistics, write_page_checksum=checksums, write_page_index=page_index,
                   data_page_size=page_size, row_group_size=group)
    for col, chunk in _chunks(path):
        pages = chunk_pages(chunk, col.num_values, 8, col.path_in_schema)
        assert pages.end == len(chunk), col.path_in_schema
        assert pages.dictionary == col.has_dictionary_page
        assert pages.decoded >= col.total_uncompressed_size - 200 * (1 + len(chunk) // 64)  # its headers aside
    ds = parquet_dataset(path)
    (frag,) = ds.get_fragments()
    got = [read_fragment(frag, ds.schema, g, 1 << 30, path, "test", InputFileError)
           for g in range(frag.metadata.num_row_groups)]
    assert pa.concat_tables(got).equals(pq.read_table(path))


@pytest.fixture(scope="module")
def chunk(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("one") / "t.parquet")
    pq.write_table(_table(300, 3), path, compression="zstd", data_page_size=512, write_page_checksum=True)
    col, data = next((col, data) for col, data in _chunks(path) if col.path_in_schema == "text")
    return col.num_values, data


@settings(max_examples=300)
@given(data=st.data())
def test_damaged_page_headers_are_a_format_error(chunk, data):
    values, good = chunk
    buf = bytearray(good)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, min(len(buf) - 1, 400)))  # the first pages' headers and bytes
        buf[at] = data.draw(st.integers(0, 255))
    buf = buf[: data.draw(st.integers(0, len(buf)))]
    try:
        pages = chunk_pages(bytes(buf), values, 8, "t.parquet column 'text'")
    except FormatError as e:
        assert str(e).startswith("t.parquet column 'text': the page header at byte ")
    else:
        assert pages.decoded >= 0 and pages.end >= 0


@settings(max_examples=300)
@given(buf=st.binary(max_size=600), values=st.integers(0, 1 << 40))
def test_arbitrary_bytes_are_a_format_error_or_pages(buf, values):
    try:
        pages = chunk_pages(buf, values, 8, "x")
    except FormatError:
        return
    assert pages.decoded >= 0
