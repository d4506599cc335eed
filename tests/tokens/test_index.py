"""index_tokens and `datapipe index` of token files: Megatron .bin/.idx pairs (written by
format.tokens.TokenPartWriter, and by megatron-core where it imports) and nanoGPT-style flat
uint16 files indexed in place or under --index-to; the user's files never changed; folders
holding someone else's files at our names refused; damaged or inconsistent files named."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.cli import main
from datapipe.errors import (
    ChecksumError,
    CorruptIndexError,
    DatapipeError,
    DestinationExistsError,
    FormatError,
    ObjectNotFoundError,
    PackOptionError,
)
from datapipe.format.tokens import MANIFEST, TokenPartWriter, parse_token_manifest
from tests.tokens_corpus import dataset_files, read_token_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _docs(seed: int, n: int = 40, vocab: int = 1000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=k).tolist() for k in rng.integers(0, 300, size=n)]


def megatron_pair(prefix: Path, docs: list[list[int]], vocab: int = 1000) -> Path:
    with TokenPartWriter(prefix, vocab_size=vocab) as w:
        for d in docs:
            w.add_document(np.array(d, dtype=np.int64))
    for tmp, final in w.renames:
        if not final.endswith(".xxh"):  # a Megatron pair as Megatron writes it: .bin and .idx only
            os.replace(tmp, final)
        else:
            os.unlink(tmp)
    return prefix


def _digests(folder: Path) -> dict[str, tuple[str, int]]:
    return {n: (hashlib.sha256((folder / n).read_bytes()).hexdigest(), (folder / n).stat().st_mtime_ns)
            for n in os.listdir(folder) if (folder / n).is_file()}


def _manifest(folder: Path):
    return parse_token_manifest((folder / MANIFEST).read_bytes(), str(folder))


def test_megatron_pairs_in_place(tmp_path):
    a, b = _docs(1), _docs(2)
    megatron_pair(tmp_path / "a", a)
    megatron_pair(tmp_path / "b", b)
    before = _digests(tmp_path)
    r = datapipe.index_tokens([str(tmp_path / "a"), str(tmp_path / "b.idx")])
    assert (r.parts, r.documents, r.tokens) == (2, len(a) + len(b), sum(map(len, a + b)))
    assert read_token_dataset(tmp_path) == a + b
    after = _digests(tmp_path)
    assert {n: after[n] for n in before} == before  # the user's files, untouched
    assert sorted(set(after) - set(before)) == ["a.xxh", "b.xxh", MANIFEST]
    m = _manifest(tmp_path)
    assert [(p.prefix, p.idx, p.xxh) for p in m.parts] == [("a", "a.idx", "a.xxh"), ("b", "b.idx", "b.xxh")]
    assert m.doc["origin"] == "token-index"
    # a rerun writes the same index; a folder argument names every .bin in it
    first = dataset_files(tmp_path)
    datapipe.index_tokens(str(tmp_path))
    assert dataset_files(tmp_path) == first


def test_flat_uint16_file(tmp_path):
    tokens = np.array([5, 6, 0, 7, 0, 0, 8, 9], dtype="<u2")
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    r = datapipe.index_tokens(tmp_path / "train.bin", eos_id=0, vocab_size=10)
    assert read_token_dataset(tmp_path) == [[5, 6, 0], [7, 0], [0], [8, 9]]  # EOS ends a document
    assert (r.flat, r.documents) == (1, 4)
    assert sorted(os.listdir(tmp_path)) == [MANIFEST, "train.bin", "train.flat.idx", "train.xxh"]
    assert not (tmp_path / "train.idx").exists()  # never beside the user's file: it would look like a pair
    part = _manifest(tmp_path).parts[0]
    assert (part.prefix, part.idx) == ("train", "train.flat.idx")
    datapipe.index_tokens(tmp_path / "train.bin", eos_id=None)  # rerun, other options: whole file, one document
    assert read_token_dataset(tmp_path) == [tokens.tolist()]
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(FormatError, match="whole number of uint16"):
        datapipe.index_tokens(tmp_path / "odd.bin", index_to=tmp_path / "odd")


def test_index_to_another_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = _docs(3)
    megatron_pair(src / "train", docs)
    np.array([1, 2, 3], dtype="<u2").tofile(src / "flat.bin")
    before = _digests(src)
    assert main(["index", str(src / "train"), str(src / "flat.bin"), "--index-to", str(tmp_path / "ix"), "-q"]) == 0
    assert _digests(src) == before  # nothing written beside the files
    assert read_token_dataset(tmp_path / "ix") == [*docs, [1, 2, 3]]
    m = _manifest(tmp_path / "ix")
    assert [(p.prefix, p.idx, p.xxh) for p in m.parts] == [
        (str(src / "train"), str(src / "train.idx"), "train.xxh"), (str(src / "flat"), "flat.flat.idx", "flat.xxh")]


def test_someone_elses_files_at_our_names_are_refused(tmp_path):
    megatron_pair(tmp_path / "a", _docs(4))
    (tmp_path / "a.xxh").write_bytes(b"not ours")
    with pytest.raises(DestinationExistsError, match=r"a\.xxh exists and no index of ours wrote it"):
        datapipe.index_tokens(tmp_path / "a")
    assert (tmp_path / "a.xxh").read_bytes() == b"not ours" and not (tmp_path / MANIFEST).exists()
    os.unlink(tmp_path / "a.xxh")
    (tmp_path / MANIFEST).write_text('{"format": "datapipe", "version": 1}')
    with pytest.raises(DestinationExistsError, match="not an index of token files"):
        datapipe.index_tokens(tmp_path / "a")
    os.unlink(tmp_path / MANIFEST)
    packed = tmp_path / "packed"
    datapipe.pack_tokens(datapipe_input(tmp_path), packed, eos_id=0)
    with pytest.raises(DestinationExistsError, match="written by pack_tokens"):
        datapipe.index_tokens(tmp_path / "a", index_to=packed)


def datapipe_input(tmp_path: Path) -> str:
    from tests.tokens_corpus import write_jsonl

    return write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}])


def test_damaged_and_inconsistent_files_are_named(tmp_path):
    megatron_pair(tmp_path / "a", _docs(5))
    idx = (tmp_path / "a.idx").read_bytes()
    (tmp_path / "a.idx").write_bytes(idx[:-8])
    with pytest.raises(CorruptIndexError, match=r"a\.idx"):
        datapipe.index_tokens(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes(idx)
    with open(tmp_path / "a.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(CorruptIndexError, match=r"the \.bin holds"):
        datapipe.index_tokens(tmp_path / "a")
    megatron_pair(tmp_path / "w", _docs(6, vocab=70_000), vocab=70_000)  # int32
    megatron_pair(tmp_path / "n", _docs(6))
    with pytest.raises(FormatError, match="share one dtype"):
        datapipe.index_tokens([tmp_path / "n", tmp_path / "w"])
    with pytest.raises(FormatError, match=r"w\.bin: token \d+ \(document \d+\) is id \d+, outside the vocabulary"):
        datapipe.index_tokens(tmp_path / "w", vocab_size=1000)
    with pytest.raises(ObjectNotFoundError, match="nope"):
        datapipe.index_tokens(tmp_path / "nope")
    (tmp_path / "lonely.idx").write_bytes(idx)
    with pytest.raises(ObjectNotFoundError, match="without its data file"):
        datapipe.index_tokens(tmp_path / "lonely.idx")
    with pytest.raises(PackOptionError, match="index_to"):
        sub = tmp_path / "sub"
        sub.mkdir()
        megatron_pair(sub / "c", _docs(7))
        datapipe.index_tokens([tmp_path / "n", sub / "c"])


def test_a_changed_bin_after_indexing_is_a_checksum_error(tmp_path):
    megatron_pair(tmp_path / "a", _docs(8))
    datapipe.index_tokens(tmp_path / "a")
    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[100] ^= 4
    (tmp_path / "a.bin").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"a\.bin"):
        read_token_dataset(tmp_path)


@given(flip=st.integers(0, 10_000), which=st.sampled_from(["bin", "idx"]))
@settings(max_examples=40)
def test_hostile_idx_and_bin_are_named_errors(tmp_path_factory, flip, which):
    d = tmp_path_factory.mktemp("hostile")
    megatron_pair(d / "a", _docs(9, n=10))
    path = d / f"a.{which}"
    data = bytearray(path.read_bytes())
    data[flip % len(data)] ^= 1 << (flip % 8)
    path.write_bytes(bytes(data))
    try:
        datapipe.index_tokens(d / "a", vocab_size=1000)
    except DatapipeError:
        assert not (d / MANIFEST).exists()
    else:  # a flipped token id still inside the vocabulary is data, and is now checksummed as such
        assert len(read_token_dataset(d)) == 10


_KILL = """
import os, signal, sys
import datapipe
from datapipe.tokens import index as ix
real, count = ix._bin_sums, [0]
def bin_sums(*a, **k):
    count[0] += 1
    if count[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
ix._bin_sums = bin_sums
datapipe.index_tokens(sys.argv[1:])
"""


def test_rerun_after_kill_9_finishes(tmp_path):
    a, b = _docs(10), _docs(11)
    megatron_pair(tmp_path / "a", a)
    megatron_pair(tmp_path / "b", b)
    p = subprocess.run([sys.executable, "-c", _KILL, str(tmp_path / "a"), str(tmp_path / "b")], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert (tmp_path / "a.xxh").exists() and not (tmp_path / MANIFEST).exists()  # one written, no index
    datapipe.index_tokens([tmp_path / "a", tmp_path / "b"])  # its own files: known from the journal
    assert read_token_dataset(tmp_path) == a + b
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "a.xxh", "b.bin", "b.idx", "b.xxh", MANIFEST]


def test_cli_dispatch(tmp_path, capsys):
    megatron_pair(tmp_path / "a", _docs(12))
    assert main(["index", str(tmp_path / "a"), "-q"]) == 0
    assert "indexed 1 token files" in capsys.readouterr().out
    assert main(["index", str(tmp_path / "a"), "--part", "0/2", "-q"]) == 2
    assert "--part" in capsys.readouterr().err
    assert main(["index", str(tmp_path / "x.tar"), "--eos-id", "3"]) == 2
    assert "token files" in capsys.readouterr().err


def test_s3_pair_indexed_to_a_local_folder(s3, tmp_path):
    root, opts = s3
    from datapipe.storage import open_store

    docs = _docs(13)
    megatron_pair(tmp_path / "a", docs)
    store = open_store(root, opts)
    for ext in (".bin", ".idx"):
        store.put("data/a" + ext, (tmp_path / ("a" + ext)).read_bytes())
    datapipe.index_tokens(root + "/data/a", index_to=tmp_path / "ix", storage_options=opts)
    m = _manifest(tmp_path / "ix")
    assert (m.parts[0].prefix, m.parts[0].idx) == (root + "/data/a", root + "/data/a.idx")
    assert store.list("data/") == ["data/a.bin", "data/a.idx"]
    (tmp_path / "ix" / "local").mkdir()
    for ext in (".bin", ".idx"):  # read back with the remote files brought here
        (tmp_path / "ix" / "local" / ("a" + ext)).write_bytes(store.get("data/a" + ext))
    assert read_token_dataset_at(tmp_path / "ix", {root + "/data/a": str(tmp_path / "ix" / "local" / "a")}) == docs


def read_token_dataset_at(folder: Path, moved: dict[str, str]):
    """read_token_dataset with the parts' remote prefixes mapped to local copies."""
    from datapipe.format.tokens import check_part, verify_blocks

    m = _manifest(folder)
    out = []
    for i, part in enumerate(m.parts):
        local = moved[part.prefix]
        checked = check_part(m, i, Path(local + ".idx").read_bytes(), (folder / part.xxh).read_bytes())
        data = Path(local + ".bin").read_bytes()
        verify_blocks(data, 0, checked.sums, m.block_bytes, whole=True)
        tokens = np.frombuffer(data, dtype=m.dtype)
        starts = checked.index.document_starts()
        out.extend(tokens[starts[j]:starts[j + 1]].tolist() for j in range(checked.index.num_documents))
    return out


MEGATRON = "pip install megatron-core torch==2.13.0 (in a separate venv: it must not replace torch)"


def test_megatron_written_pair_with_sentences(tmp_path):
    idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason=MEGATRON)
    torch = pytest.importorskip("torch")
    b = idx_mod.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=idx_mod.DType.optimal_dtype(1000))
    docs = _docs(14, n=20)
    for d in docs:  # each document as two "sentences": several sequences per document
        cut = len(d) // 2
        b.add_document(torch.tensor(d, dtype=torch.int64), [cut, len(d) - cut] if cut else [len(d)])
    b.finalize(str(tmp_path / "m.idx"))
    datapipe.index_tokens(tmp_path / "m")
    assert read_token_dataset(tmp_path) == docs
