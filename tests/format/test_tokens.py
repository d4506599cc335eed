"""The token format: Megatron's .bin/.idx exactly, datapipe's .xxh and manifest, and every
damaged byte a named error, never a wrong token."""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.errors import ChecksumError, CorruptIndexError, DatapipeError, FormatError, OptionError
from datapipe.format.tokens import (
    BLOCK_BYTES,
    MAGIC,
    MAX_SEQUENCE_TOKENS,
    TokenPartWriter,
    block_span,
    block_sums,
    check_part,
    flat_index,
    idx_bytes,
    make_token_manifest,
    optimal_dtype,
    parse_token_manifest,
    read_flat,
    read_idx,
    read_xxh,
    token_dtype,
    verify_blocks,
    xxh_bytes,
)

BLOCK = 4096
docs_strategy = st.lists(st.lists(st.integers(0, 999), max_size=600), min_size=0, max_size=12)


def write_dataset(root: Path, parts: list[list[list[int]]], *, vocab_size: int = 1000, block: int = BLOCK,
                  eos_id: int | None = None) -> Path:
    """A token dataset of ``parts`` (each a list of documents) under ``root``, published."""
    records = []
    for i, docs in enumerate(parts):
        with TokenPartWriter(root / f"part-{i:05d}", vocab_size=vocab_size, block_bytes=block) as w:
            for d in docs:
                w.add_document(np.array(d, dtype=np.int64))
        for tmp, final in w.renames:
            os.replace(tmp, final)
        records.append(w.part)
    (root / "manifest.json").write_bytes(make_token_manifest(
        records, dtype=optimal_dtype(vocab_size), vocab_size=vocab_size, eos_id=eos_id, block_bytes=block))
    return root


def read_dataset(root: Path) -> list[np.ndarray]:
    """Every part's tokens, through every check a reader makes (manifest, .idx, .xxh, blocks)."""
    m = parse_token_manifest((root / "manifest.json").read_bytes(), str(root / "manifest.json"))
    out = []
    for i, part in enumerate(m.parts):
        pi = check_part(m, i, (root / part.idx).read_bytes(), (root / part.xxh).read_bytes(), where=str(root))
        data = (root / part.bin).read_bytes()
        verify_blocks(data, 0, pi.sums, m.block_bytes, where=part.bin, whole=True)
        tokens = np.frombuffer(data, dtype=m.dtype)
        starts = pi.index.document_starts()
        out.extend(tokens[a:b] for a, b in itertools.pairwise(starts))
    return out


# --- Megatron's layout, byte for byte ---------------------------------------------------


def test_dtype_follows_megatron_optimal_dtype():
    # DType.optimal_dtype: uint16 below 65500, else int32 (and int32 when unknown)
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32
    with pytest.raises(OptionError, match="vocab_size"):
        optimal_dtype(0)
    with pytest.raises(OptionError, match="dtype"):
        token_dtype(np.float32)


def test_idx_header_and_arrays_as_megatron_writes_them(tmp_path):
    docs = [[1, 2, 3], [], [7] * 5]
    with TokenPartWriter(tmp_path / "p", vocab_size=50257) as w:
        for d in docs:
            w.add_document(d)
    idx = Path(w.temporary[".idx"]).read_bytes()
    # _IndexWriter: header, <Q version 1, <B code (uint16 = 8), <Q sequences, <Q len(document_indices)
    expect = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 3) + struct.pack("<Q", 4)
    expect += np.array([3, 0, 5], "<i4").tobytes() + np.array([0, 6, 6], "<i8").tobytes()
    expect += np.array([0, 1, 2, 3], "<i8").tobytes()
    assert idx == expect
    assert Path(w.temporary[".bin"]).read_bytes() == np.array([1, 2, 3, 7, 7, 7, 7, 7], "<u2").tobytes()
    assert w.part.idx_bytes == len(expect) and w.part.sequences == 3 and w.part.documents == 3


MEGATRON = "pip install megatron-core torch==2.13.0 (in a separate venv: it must not replace torch)"


def test_megatron_reads_what_we_write(tmp_path):
    idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason=MEGATRON)
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50257, size=n) for n in rng.integers(0, 300, size=40)]
    ours = tmp_path / "ours"
    with TokenPartWriter(ours, vocab_size=50257) as w:
        for d in docs:
            w.add_document(d)
    for tmp, final in w.renames:
        os.replace(tmp, final)
    theirs = tmp_path / "theirs"
    b = idx_mod.IndexedDatasetBuilder(str(theirs) + ".bin", dtype=idx_mod.DType.optimal_dtype(50257))
    for d in docs:
        b.add_document(torch.from_numpy(d), [d.size])
    b.finalize(str(theirs) + ".idx")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes(), ext
    ds = idx_mod.IndexedDataset(str(ours))
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
    assert np.array_equal(ds.document_indices, np.arange(len(docs) + 1))


# --- round trip ---------------------------------------------------------------------------


@given(parts=st.lists(docs_strategy, min_size=1, max_size=3))
@settings(max_examples=30, deadline=None)
def test_round_trip(tmp_path_factory, parts):
    root = write_dataset(tmp_path_factory.mktemp("rt"), parts)
    got = read_dataset(root)
    want = [np.array(d) for docs in parts for d in docs]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    m = parse_token_manifest((root / "manifest.json").read_bytes(), "m")
    assert m.tokens == sum(map(len, want)) and m.documents == len(want)
    assert [p.prefix for p in m.parts] == [f"part-{i:05d}" for i in range(len(parts))]


def test_add_documents_equals_add_document(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 50, size=30)
    flat = rng.integers(0, 1000, size=int(lengths.sum()))
    with TokenPartWriter(tmp_path / "a", vocab_size=1000) as a:
        a.add_documents(flat, lengths)
    with TokenPartWriter(tmp_path / "b", vocab_size=1000) as b:
        for piece in np.split(flat, np.cumsum(lengths)[:-1]):
            b.add_document(piece)
    for ext in (".bin", ".idx", ".xxh"):
        assert Path(a.temporary[ext]).read_bytes() == Path(b.temporary[ext]).read_bytes()
    assert a.part == b.part.__class__(**{**b.part.__dict__, "prefix": "a", "idx": "a.idx", "xxh": "a.xxh"})


def test_writer_refuses_bad_tokens_and_cleans_up_only_its_own_files(tmp_path):
    (tmp_path / "p.bin").write_bytes(b"someone else's")
    with pytest.raises(OptionError, match="token id 1000"), TokenPartWriter(tmp_path / "p", vocab_size=1000) as w:
        w.add_document([1, 2, 1000])
    assert sorted(os.listdir(tmp_path)) == ["p.bin"]
    w2 = TokenPartWriter(tmp_path / "q", vocab_size=1000)
    for bad in ([[1, 2]], [1.5], [-1]):
        with pytest.raises(OptionError):
            w2.add_document(bad)
    with pytest.raises(OptionError, match="lengths"):
        w2.add_documents([1, 2, 3], [1, 1])
    w2.abort()
    assert sorted(os.listdir(tmp_path)) == ["p.bin"]
    with pytest.raises(OptionError, match="does not fit"):
        TokenPartWriter(tmp_path / "r", vocab_size=70000, dtype=np.uint16)


def test_a_document_longer_than_an_int32_length_is_several_sequences(tmp_path):
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:  # sparse: nothing is written but the size
        f.truncate(MAX_SEQUENCE_TOKENS + 5)
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    index = flat_index(tokens)
    assert index.lengths.tolist() == [MAX_SEQUENCE_TOKENS, 5]
    assert index.doc_index.tolist() == [0, 2]
    assert index.document_lengths().tolist() == [MAX_SEQUENCE_TOKENS + 5]
    again = read_idx(idx_bytes(index.lengths, index.doc_index, index.dtype), bin_size=MAX_SEQUENCE_TOKENS + 5)
    assert again.num_tokens == MAX_SEQUENCE_TOKENS + 5 and again.num_documents == 1


# --- flat (nanoGPT) files ----------------------------------------------------------------------


def test_flat_files_split_at_eos():
    toks = np.array([5, 9, 0, 3, 0, 0, 7, 8], dtype=np.uint16)
    _, one = read_flat(toks.tobytes())
    assert one.document_lengths().tolist() == [8]
    view, idx = read_flat(toks.tobytes(), eos_id=0)
    assert idx.document_lengths().tolist() == [3, 2, 1, 2]
    assert np.array_equal(view, toks)
    _, ends_with_eos = read_flat(toks[:6].tobytes(), eos_id=0)
    assert ends_with_eos.document_lengths().tolist() == [3, 2, 1]
    _, empty = read_flat(b"", eos_id=0)
    assert empty.num_documents == 0 and empty.num_tokens == 0
    with pytest.raises(FormatError, match="whole number"):
        read_flat(b"abc")
    _, i32 = read_flat(np.array([1, 2, 3], "<i4").tobytes(), dtype=np.int32, eos_id=2)
    assert i32.document_lengths().tolist() == [2, 1]
    roundtrip = read_idx(idx_bytes(idx.lengths, idx.doc_index, idx.dtype), bin_size=toks.nbytes)
    assert roundtrip.document_lengths().tolist() == [3, 2, 1, 2]


# --- strict .idx parsing ---------------------------------------------------------------------


def _idx(lengths=(3, 0, 5), docs=(0, 1, 2, 3), code=8):
    lengths = np.array(lengths, "<i4")
    ptr = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype("<i8") * 2
    return bytearray(MAGIC + struct.pack("<QBQQ", 1, code, lengths.size, len(docs)) + lengths.tobytes()
                     + ptr.tobytes() + np.array(docs, "<i8").tobytes())


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:20], "shorter than"),
    (lambda b: b"MMIDIDY\x00\x00" + b[9:], "magic"),
    (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version"),
    (lambda b: b[:17] + bytes([9]) + b[18:], "unknown dtype code"),
    (lambda b: b[:18] + struct.pack("<Q", 1 << 60) + b[26:], "take"),
    (lambda b: b[:26] + struct.pack("<Q", 0) + b[34:], "0 document indices; there is always one more"),
    (lambda b: b + b"\0", "take"),
    (lambda b: b + b"\0\0\0", "multimodal"),
    (lambda b: b[:34] + struct.pack("<i", -1) + b[38:], "negative length"),
    (lambda b: b[:46] + struct.pack("<q", 7) + b[54:], "points at byte"),
    (lambda b: b[:-16] + struct.pack("<q", 0) + b[-8:], "below the one before"),
    (lambda b: b[:-8] + struct.pack("<q", 2), "run from 0 to"),
], ids=["short", "magic", "version", "code", "huge-count", "no-docs", "extended", "modes", "negative",
        "pointer", "decreasing", "doc-end"])
def test_read_idx_names_each_violation(damage, match):
    good = _idx()
    assert read_idx(bytes(good), bin_size=16).num_tokens == 8
    with pytest.raises(CorruptIndexError, match=match):
        read_idx(bytes(damage(good)), where="x.idx")


def test_read_idx_checks_the_bin_size_and_refuses_float_codes():
    with pytest.raises(CorruptIndexError, match=r"the \.bin holds 17 bytes"):
        read_idx(bytes(_idx()), bin_size=17)
    with pytest.raises(FormatError, match="floats"):
        read_idx(bytes(_idx(code=7)))
    assert read_idx(bytes(_idx()) + b"\1\0\1", multimodal=True).modes.tolist() == [1, 0, 1]


@given(data=st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_read_idx_of_any_bytes_is_an_index_or_a_format_error(data):
    try:
        read_idx(data, bin_size=64)
    except FormatError:
        pass


@given(prefix_flips=st.lists(st.integers(0, 8 * 120 - 1), min_size=1, max_size=3))
@settings(max_examples=200, deadline=None)
def test_read_idx_of_a_damaged_index_is_consistent_or_refused(prefix_flips):
    data = _idx(lengths=(3, 0, 5, 1, 1), docs=(0, 2, 5))
    for bit in prefix_flips:
        data[bit // 8 % len(data)] ^= 1 << (bit % 8)
    try:
        index = read_idx(bytes(data), bin_size=20)
    except FormatError:
        return
    # what passes is self-consistent: every sequence lies inside the .bin
    ends = index.pointers + index.lengths.astype(np.int64) * index.dtype.itemsize
    assert (ends <= 20).all() and index.num_tokens * index.dtype.itemsize == 20


# --- block checksums ---------------------------------------------------------------------------


@given(size=st.integers(0, 5 * BLOCK), a=st.integers(0, 5 * BLOCK), b=st.integers(0, 5 * BLOCK))
@settings(max_examples=100, deadline=None)
def test_block_span_covers_and_verifies(size, a, b):
    data = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8).tobytes()
    sums = block_sums(data, BLOCK)
    assert read_xxh(xxh_bytes(sums), bin_bytes=size, block_bytes=BLOCK).tolist() == sums.tolist()
    a, b = sorted((min(a, size), min(b, size)))
    start, end, first = block_span(a, b, BLOCK, size)
    assert start == first * BLOCK and (start <= a <= b <= end <= size if b > a else end == start <= a)
    assert end % BLOCK == 0 or end == size
    verify_blocks(data[start:end], first, sums, BLOCK)
    if end > start:
        bad = bytearray(data[start:end])
        bad[(b - 1 - start) if b > a else 0] ^= 0x10
        with pytest.raises(ChecksumError, match=r"block \d+ \(bytes \["):
            verify_blocks(bytes(bad), first, sums, BLOCK, where="p.bin")


def test_verify_blocks_refuses_misaligned_and_overlong_data():
    data = bytes(range(256)) * 40  # 10240 bytes: blocks of 4096, 4096, 2048
    sums = block_sums(data, BLOCK)
    with pytest.raises(ChecksumError, match="short"):
        verify_blocks(data[:100], 0, sums, BLOCK)
    with pytest.raises(ChecksumError, match="extended"):
        verify_blocks(data + b"x" * BLOCK, 0, sums, BLOCK)
    with pytest.raises(ChecksumError, match=r"block 2 \(bytes \[8192, 10241\)\) fails"):
        verify_blocks(data + b"x", 0, sums, BLOCK)
    with pytest.raises(ChecksumError, match="whole file"):
        verify_blocks(data[:BLOCK], 0, sums, BLOCK, whole=True)
    with pytest.raises(OptionError, match="does not lie"):
        block_span(5, 3, BLOCK, len(data))
    verify_blocks(data[BLOCK:], 1, sums, BLOCK)
    assert block_span(0, 0, BLOCK, 0) == (0, 0, 0)


# --- damaged files: a named error, never a wrong token ------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    rng = np.random.default_rng(7)
    parts = [[rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(0, 900, size=9)] for _ in range(2)]
    root = write_dataset(tmp_path_factory.mktemp("pristine"), parts, eos_id=999)
    files = {p.name: p.read_bytes() for p in sorted(root.iterdir())}
    return files, [np.array(d) for docs in parts for d in docs]


@given(data=st.data())
@settings(max_examples=250, deadline=None)
def test_any_damaged_file_is_a_named_error(tmp_path_factory, pristine, data):
    files, want = pristine
    name = data.draw(st.sampled_from(sorted(files)))
    blob = bytearray(files[name])
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip" and blob:
        for bit in data.draw(st.lists(st.integers(0, 8 * len(blob) - 1), min_size=1, max_size=4)):
            blob[bit // 8] ^= 1 << (bit % 8)
    elif how == "truncate":
        del blob[data.draw(st.integers(0, max(len(blob) - 1, 0))):]
    else:
        blob += data.draw(st.binary(min_size=1, max_size=64))
    root = tmp_path_factory.mktemp("damaged")
    for n, b in files.items():
        (root / n).write_bytes(bytes(blob) if n == name else b)
    try:
        got = read_dataset(root)
    except (FormatError, ChecksumError) as e:
        assert isinstance(e, DatapipeError)
        return
    # nothing refused: then nothing that matters changed (a trailing newline of the manifest)
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


# --- the manifest --------------------------------------------------------------------------------


def test_manifest_refuses_edits_and_unsafe_names(tmp_path):
    root = write_dataset(tmp_path, [[[1, 2, 3]], [[4]]])
    raw = (root / "manifest.json").read_bytes()
    m = parse_token_manifest(raw, "m")
    assert m.dtype == np.uint16 and m.vocab_size == 1000 and m.block_bytes == BLOCK
    with pytest.raises(CorruptIndexError, match="checksum mismatch"):
        parse_token_manifest(raw.replace(b'"tokens": 4', b'"tokens": 5'), "m")
    with pytest.raises(FormatError, match="not a datapipe token manifest"):
        parse_token_manifest(b'{"format": "datapipe-shards"}', "m")
    with pytest.raises(CorruptIndexError, match="not JSON"):
        parse_token_manifest(b"[" * 100000, "m")
    part = m.parts[0]
    for field, value, match in (("prefix", "../etc/x", "leaves the dataset folder"),
                                ("xxh", "/abs/x.xxh", "leaves the dataset folder"),
                                ("tokens", 4, "is not tokens"),
                                ("idx_bytes", 1, "does not fit")):
        bad = part.__class__(**{**part.__dict__, field: value})
        doc = make_token_manifest([bad, m.parts[1]], dtype=np.uint16, vocab_size=1000, block_bytes=BLOCK)
        with pytest.raises(CorruptIndexError, match=match):
            parse_token_manifest(doc, "m")
    in_place = part.__class__(**{**part.__dict__, "prefix": "s3://bucket/tok/train", "idx": "/data/train.idx"})
    ok = parse_token_manifest(make_token_manifest([in_place], dtype=np.uint16, vocab_size=1000,
                                                  block_bytes=BLOCK), "m")
    assert ok.parts[0].bin == "s3://bucket/tok/train.bin"
    with pytest.raises(CorruptIndexError, match="eos_id"):
        parse_token_manifest(make_token_manifest([part], dtype=np.uint16, vocab_size=1000, eos_id=1000,
                                                 block_bytes=BLOCK), "m")


def test_check_part_names_the_file_that_disagrees(tmp_path):
    root = write_dataset(tmp_path, [[[1, 2, 3], [4, 5]]])
    m = parse_token_manifest((root / "manifest.json").read_bytes(), "m")
    idx, xxh = (root / "part-00000.idx").read_bytes(), (root / "part-00000.xxh").read_bytes()
    (tmp_path / "other").mkdir()
    other = write_dataset(tmp_path / "other", [[[1, 2], [3, 4, 5]]])  # the same size, other documents
    with pytest.raises(CorruptIndexError, match=r"part-00000\.idx: checksum"):
        check_part(m, 0, (other / "part-00000.idx").read_bytes(), xxh)
    with pytest.raises(CorruptIndexError, match=r"part-00000\.xxh: 0 bytes"):
        check_part(m, 0, idx, b"")
    assert check_part(m, 0, idx, xxh).index.document_lengths().tolist() == [3, 2]


def test_format_module_needs_no_torch():
    probe = ("import sys, datapipe.format.tokens, datapipe.plan.tokens, datapipe.plan.mixture; "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}).stdout.strip()
    assert out == "False"


def test_default_block_is_one_mib():
    assert BLOCK_BYTES == 1 << 20
