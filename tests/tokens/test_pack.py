"""pack_tokens and `datapipe pack-tokens`: JSONL and Parquet, text through a BPE tokenizer
trained here or token ids; tokens read back through datapipe.format.tokens equal to
tokenizer.encode(text).ids + [eos]; the same bytes whatever the number of workers; a flipped
bit in any output file a named error; kill -9 and resume byte for byte; destinations that
are someone else's refused; Megatron-LM's own reader on the output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.cli import main
from datapipe.errors import (
    DatapipeError,
    DestinationExistsError,
    EmptyInputError,
    InputFileError,
    MissingDependencyError,
    ObjectNotFoundError,
    PackOptionError,
)
from datapipe.format.tokens import MANIFEST, parse_token_manifest
from tests.tokens_corpus import (
    dataset_files,
    expected_documents,
    make_texts,
    read_token_dataset,
    train_tokenizer,
    write_jsonl,
    write_parquet,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON = "pip install megatron-core torch==2.13.0 (in a separate venv: it must not replace torch)"


@pytest.fixture(scope="module")
def corpus():
    texts = make_texts(600, seed=1)
    tok = train_tokenizer(make_texts(2000, seed=2))
    return texts, tok, tok.token_to_id("<|endoftext|>")


def _manifest(dest):
    return parse_token_manifest(Path(dest, MANIFEST).read_bytes(), str(dest))


# --- what goes in comes out ----------------------------------------------------------------


def test_jsonl_text_through_a_tokenizer(corpus, tmp_path):
    texts, tok, eos = corpus
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    r = datapipe.pack_tokens(src, tmp_path / "out", tokenizer=tok, workers=1)
    want = expected_documents(tok, texts, eos)
    assert read_token_dataset(tmp_path / "out") == want
    assert (r.documents, r.tokens, r.parts) == (len(texts), sum(map(len, want)), 1)
    m = _manifest(tmp_path / "out")
    assert (m.dtype, m.vocab_size, m.eos_id, m.doc["origin"]) == (np.dtype("<u2"), tok.get_vocab_size(), eos,
                                                                   "pack-tokens")
    assert sorted(os.listdir(tmp_path / "out")) == ["manifest.json", "part-00000-000.bin", "part-00000-000.idx",
                                                    "part-00000-000.xxh"]
    # empty documents are kept, as the EOS token alone: document j is row j
    assert next(want[j] for j in range(len(texts)) if texts[j] == "") == [eos]


def test_parquet_text_tokenizer_file_and_several_parts(corpus, tmp_path):
    texts, tok, eos = corpus
    src = write_parquet(tmp_path / "t.parquet", [{"text": t} for t in texts], row_group_size=50)
    tok.save(str(tmp_path / "tokenizer.json"))
    r = datapipe.pack_tokens(str(src), str(tmp_path / "out"), tokenizer=str(tmp_path), part_bytes=4096, workers=2)
    assert read_token_dataset(tmp_path / "out") == expected_documents(tok, texts, eos)
    m = _manifest(tmp_path / "out")
    assert r.parts == len(m.parts) > 4
    # a part holds at most part_bytes of tokens, unless one document alone is larger
    for p in m.parts:
        assert p.bin_bytes <= 4096 or p.documents == 1


def test_token_ids_from_parquet_and_jsonl(corpus, tmp_path):
    texts, tok, eos = corpus
    ids = [tok.encode(t).ids for t in texts]
    a = write_parquet(tmp_path / "a.parquet", [{"input_ids": x} for x in ids[:300]], row_group_size=40)
    b = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": x} for x in ids[300:]])
    r = datapipe.pack_tokens([a, b], tmp_path / "out", eos_id=eos, vocab_size=tok.get_vocab_size(),
                             part_bytes=8192, workers=2)
    assert read_token_dataset(tmp_path / "out") == [[*x, eos] for x in ids]
    assert r.documents == len(ids)
    with pytest.raises(PackOptionError, match="eos-id"):
        datapipe.pack_tokens(a, tmp_path / "no-eos")


def test_vocabulary_decides_the_dtype_and_bounds_the_ids(tmp_path):
    rows = [{"input_ids": [1, 70_000, 3]}, {"input_ids": []}, {"input_ids": [69_999]}]
    src = write_parquet(tmp_path / "big.parquet", rows)
    datapipe.pack_tokens(src, tmp_path / "wide", eos_id=2, vocab_size=70_001)
    assert _manifest(tmp_path / "wide").dtype == np.dtype("<i4")  # Megatron's rule: int32 from 65,500 on
    assert read_token_dataset(tmp_path / "wide") == [[1, 70_000, 3, 2], [2], [69_999, 2]]
    with pytest.raises(InputFileError, match=r"big\.parquet row 0: token id 70000 lies outside the vocabulary"):
        datapipe.pack_tokens(src, tmp_path / "narrow", eos_id=2, vocab_size=65_000)
    js = write_jsonl(tmp_path / "neg.jsonl", [{"input_ids": [1]}, {"input_ids": [5, -1]}])
    with pytest.raises(InputFileError, match=r"neg\.jsonl line 2: token id -1"):
        datapipe.pack_tokens(js, tmp_path / "neg", eos_id=0, vocab_size=10)
    assert not (tmp_path / "narrow" / MANIFEST).exists() and not (tmp_path / "neg" / MANIFEST).exists()


def test_same_bytes_whatever_the_number_of_workers(corpus, tmp_path):
    texts, tok, _ = corpus
    files = [write_jsonl(tmp_path / f"in-{k}.jsonl", [{"text": t} for t in texts[k::3]]) for k in range(3)]
    for w in (1, 3):
        datapipe.pack_tokens(str(tmp_path / "in-*.jsonl"), tmp_path / f"w{w}", tokenizer=tok, workers=w,
                             part_bytes=4096)
    one, three = dataset_files(tmp_path / "w1"), dataset_files(tmp_path / "w3")
    assert len(one) > 3 * 4 and one == three
    assert read_token_dataset(tmp_path / "w1") == [d for f in files for d in read_token_dataset_src(tok, f)]


def read_token_dataset_src(tok, path):
    eos = tok.token_to_id("<|endoftext|>")
    with open(path, encoding="utf-8") as f:
        return [[*tok.encode(json.loads(line)["text"]).ids, eos] for line in f]


def test_inputs_a_folder_a_glob_and_a_list(corpus, tmp_path):
    texts, tok, eos = corpus
    (tmp_path / "src" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "src" / "b.jsonl", [{"text": t} for t in texts[:5]])
    write_jsonl(tmp_path / "src" / "sub" / "a.jsonl", [{"text": t} for t in texts[5:9]])
    (tmp_path / "src" / "_SUCCESS").write_text("")
    (tmp_path / "src" / "notes.txt").write_text("not input")
    datapipe.pack_tokens(tmp_path / "src", tmp_path / "src" / "out", tokenizer=tok)  # the destination is not input
    assert read_token_dataset(tmp_path / "src" / "out") == expected_documents(tok, texts[:9], eos)
    with pytest.raises(ObjectNotFoundError, match="names no Parquet or JSONL"):
        datapipe.pack_tokens(str(tmp_path / "src" / "*.parquet"), tmp_path / "x", tokenizer=tok)
    with pytest.raises(ObjectNotFoundError, match="nothing at"):
        datapipe.pack_tokens(tmp_path / "missing", tmp_path / "x", tokenizer=tok)


# --- bad input, bad arguments --------------------------------------------------------------


def test_bad_rows_are_named_by_file_and_row(corpus, tmp_path):
    _, tok, _ = corpus
    cases = {
        "nojson.jsonl": (b'{"text": "a"}\n{"text": \n', r"nojson\.jsonl line 2: not JSON"),
        "nofield.jsonl": (b'{"text": "a"}\n\n{"body": "b"}\n', r"nofield\.jsonl line 3: no field 'text'"),
        "notext.jsonl": (b'{"text": 5}\n', r"notext\.jsonl line 1: field 'text' is int, not text"),
        "surrogate.jsonl": (b'{"text": "a"}\n{"text": "x\\ud800"}\n',  # a lone surrogate: JSON, but no text
                            r"surrogate\.jsonl line 2: the tokenizer refuses"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InputFileError, match=message):
            datapipe.pack_tokens(tmp_path / name, tmp_path / f"out-{name}", tokenizer=tok)
    src = write_parquet(tmp_path / "nulls.parquet", [{"text": "a"}, {"text": None}])
    with pytest.raises(InputFileError, match=r"nulls\.parquet row 1: column 'text' is null"):
        datapipe.pack_tokens(src, tmp_path / "out-nulls", tokenizer=tok)
    with pytest.raises(InputFileError, match="no column 'body'"):
        datapipe.pack_tokens(src, tmp_path / "out-col", tokenizer=tok, text_column="body")
    with pytest.raises(InputFileError, match="holds text: pass a tokenizer"):
        datapipe.pack_tokens(src, tmp_path / "out-kind", tokens_column="text", eos_id=0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff\xfe"], pa.binary()).view(pa.string())}),
                   tmp_path / "utf8.parquet")
    with pytest.raises(InputFileError, match=r"utf8\.parquet row 1: column 'text' is not UTF-8"):
        datapipe.pack_tokens(tmp_path / "utf8.parquet", tmp_path / "out-utf8", tokenizer=tok)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(EmptyInputError):
        datapipe.pack_tokens(tmp_path / "empty.jsonl", tmp_path / "out-empty", tokenizer=tok)


@pytest.mark.parametrize("kwargs, name", [
    ({"workers": 0}, "workers"), ({"workers": 1.5}, "workers"), ({"part_bytes": 100}, "part_bytes"),
    ({"eos_id": -1}, "eos_id"), ({"vocab_size": True}, "vocab_size"), ({"dtype": "float32"}, "dtype"),
    ({"dtype": "uint8", "vocab_size": 1000}, "vocab_size"), ({"eos_id": 500, "vocab_size": 100}, "eos_id"),
    ({"text_column": ""}, "text_column"), ({"block_bytes": 12}, "block_bytes"), ({"overwrite": "yes"}, "overwrite"),
    ({"tokenizer": 42}, "tokenizer"),
])
def test_bad_arguments_name_themselves(tmp_path, kwargs, name):
    src = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2]}])
    kwargs = {"eos_id": 0, **kwargs}
    with pytest.raises(PackOptionError, match=name):
        datapipe.pack_tokens(src, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_eos_and_a_damaged_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    with pytest.raises(PackOptionError, match="eos-id"):
        datapipe.pack_tokens(src, tmp_path / "out", tokenizer=bare)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(PackOptionError, match="not a tokenizers JSON file"):
        datapipe.pack_tokens(src, tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")


def test_without_tokenizers_installed_the_error_names_the_extra(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    (tmp_path / "tokenizer.json").write_text("{}")
    probe = ("import sys; sys.modules['tokenizers'] = None\n"
             "import datapipe\n"
             "from datapipe.errors import MissingDependencyError\n"
             "try:\n"
             f"    datapipe.pack_tokens({src!r}, {str(tmp_path / 'out')!r},\n"
             f"                         tokenizer={str(tmp_path / 'tokenizer.json')!r})\n"
             "except MissingDependencyError as e:\n"
             "    print('MISSING', e)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert "MISSING" in out.stdout and "pip install 'datapipe[tokens]'" in out.stdout, out.stderr
    assert issubclass(MissingDependencyError, datapipe.errors.OptionError)


@given(lines=st.lists(st.binary(max_size=40) | st.sampled_from([b'{"input_ids": [1, 2]}', b'{"input_ids": [true]}',
                                                                 b'{"input_ids": [1e9]}', b'{"input_ids": "12"}',
                                                                 b'{"input_ids": [99999999999999999999999]}',
                                                                 b'[1]', b'']), max_size=8))
@settings(max_examples=60)
def test_hostile_jsonl_is_a_named_error_or_a_dataset(tmp_path_factory, lines):
    d = tmp_path_factory.mktemp("hostile")
    (d / "in.jsonl").write_bytes(b"\n".join(lines))
    try:
        datapipe.pack_tokens(d / "in.jsonl", d / "out", eos_id=0, vocab_size=100)
    except DatapipeError as e:
        assert isinstance(e, InputFileError | EmptyInputError), repr(e)
        assert not (d / "out" / MANIFEST).exists()
    else:
        assert all(x[-1] == 0 for x in read_token_dataset(d / "out"))


# --- damage is a named error -------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory):
    texts, tok, _ = corpus
    d = tmp_path_factory.mktemp("packed")
    src = write_jsonl(d / "a.jsonl", [{"text": t} for t in texts[:200]])
    datapipe.pack_tokens(src, d / "out", tokenizer=tok, part_bytes=4096, block_bytes=4096)
    return d / "out", dataset_files(d / "out")


@given(data=st.data())
@settings(max_examples=80)
def test_a_flipped_bit_in_any_file_is_a_named_error(packed, data):
    root, files = packed
    name = data.draw(st.sampled_from(sorted(files)))
    body = bytearray(files[name])
    bit = data.draw(st.integers(0, 8 * len(body) - 1))
    body[bit // 8] ^= 1 << (bit % 8)
    path = root / name
    try:
        path.write_bytes(bytes(body))
        with pytest.raises(DatapipeError):
            read_token_dataset(root)
    finally:
        path.write_bytes(files[name])


# --- resume, reruns, destinations -----------------------------------------------------------

_KILL_SCRIPT = """
import os, signal, sys
import datapipe
from datapipe.publish import Journal

record = Journal.record
recorded = []

def record_then_stop(self, name, result):
    record(self, name, result)
    recorded.append(name)
    if len(recorded) == 3:  # pieces recorded, more to come: the test's kill -9 lands mid-pack
        os.kill(os.getpid(), signal.SIGSTOP)

Journal.record = record_then_stop
if __name__ == "__main__":
    datapipe.pack_tokens(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], part_bytes=4096,
                         workers=int(sys.argv[4]))
"""


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in "ZX":
                out.append(int(d))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.parametrize("workers", [1, 2])
def test_kill_9_then_rerun_gives_the_same_bytes(corpus, tmp_path, workers):
    texts, tok, _ = corpus
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    tok.save(str(tmp_path / "tokenizer.json"))
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    dest = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(script), src, str(dest), str(tmp_path / "tokenizer.json"),
                             str(workers)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    tree = []
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), f"the pack ended (status {status:#x}) before its third piece was recorded"
        tree = [c for c in _children(proc.pid)] + [g for c in _children(proc.pid) for g in _children(c)]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:  # the workers go with the pack
            time.sleep(0.05)
        assert not any(_alive(p) for p in tree), "a worker outlived the killed pack"
    finally:
        for p in [proc.pid, *tree]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert not (dest / MANIFEST).exists()
    (dest / ".tmp-0123abcd-part-00000-000.bin").write_bytes(b"another writer's")  # not the killed pack's token
    r = datapipe.pack_tokens(src, dest, tokenizer=tok, part_bytes=4096, workers=workers)
    assert r.resumed_parts >= 3
    assert (dest / ".tmp-0123abcd-part-00000-000.bin").read_bytes() == b"another writer's"
    os.unlink(dest / ".tmp-0123abcd-part-00000-000.bin")
    datapipe.pack_tokens(src, tmp_path / "whole", tokenizer=tok, part_bytes=4096, workers=1)
    assert dataset_files(dest) == dataset_files(tmp_path / "whole")  # no temporaries, no journal left either
    assert read_token_dataset(dest) == expected_documents(tok, texts, tok.token_to_id("<|endoftext|>"))


def test_other_input_is_refused_unless_overwrite(corpus, tmp_path):
    texts, tok, eos = corpus
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[:20]])
    datapipe.pack_tokens(a, tmp_path / "out", tokenizer=tok, part_bytes=4096)
    with pytest.raises(DestinationExistsError, match="overwrite"):
        datapipe.pack_tokens(a, tmp_path / "out", tokenizer=tok, part_bytes=4096)  # a finished dataset: as pack
    with pytest.raises(DestinationExistsError, match="overwrite"):
        datapipe.pack_tokens(b, tmp_path / "out", tokenizer=tok)
    datapipe.pack_tokens(b, tmp_path / "out", tokenizer=tok, overwrite=True)
    assert read_token_dataset(tmp_path / "out") == expected_documents(tok, texts[:20], eos)
    assert sorted(os.listdir(tmp_path / "out")) == ["manifest.json", "part-00000-000.bin", "part-00000-000.idx",
                                                    "part-00000-000.xxh"]  # the old parts are gone


def test_one_writer_per_destination(corpus, tmp_path):
    from datapipe.errors import DestinationBusyError
    from datapipe.publish import WriterLock
    from datapipe.storage import open_store

    texts, tok, _ = corpus
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:10]])
    with WriterLock(open_store(str(tmp_path / "out"))), pytest.raises(DestinationBusyError):
        datapipe.pack_tokens(src, tmp_path / "out", tokenizer=tok)
    datapipe.pack_tokens(src, tmp_path / "out", tokenizer=tok)  # once the other writer is gone


def test_someone_elses_files_at_our_names_are_refused(corpus, tmp_path):
    texts, tok, _ = corpus
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:10]])
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "part-00000-000.bin").write_bytes(b"mine")
    (tmp_path / "theirs" / "keep.txt").write_bytes(b"mine too")
    with pytest.raises(DestinationExistsError, match=r"part-00000-000\.bin"):
        datapipe.pack_tokens(src, tmp_path / "theirs", tokenizer=tok)
    assert (tmp_path / "theirs" / "part-00000-000.bin").read_bytes() == b"mine"
    datapipe.pack(str(tmp_path / "theirs"), str(tmp_path / "shards"), keys="file")  # a packed dataset
    with pytest.raises(DestinationExistsError, match="already holds a dataset"):
        datapipe.pack_tokens(src, tmp_path / "shards", tokenizer=tok)
    datapipe.pack_tokens(src, tmp_path / "theirs", tokenizer=tok, overwrite=True)
    assert (tmp_path / "theirs" / "keep.txt").read_bytes() == b"mine too"  # only our names are deleted


# --- the command, remote storage, Megatron -------------------------------------------------


def test_cli_pack_tokens(corpus, tmp_path, capsys):
    texts, tok, eos = corpus
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:50]])
    tok.save(str(tmp_path / "tok.json"))
    assert main(["pack-tokens", src, str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--part-bytes", "4K"]) == 0
    out = capsys.readouterr()
    assert "packed 50 documents" in out.out and "tok/s" in out.err  # the progress bar counts tokens
    assert read_token_dataset(tmp_path / "out") == expected_documents(tok, texts[:50], eos)
    assert main(["pack-tokens", src, str(tmp_path / "ids"), "-q", "--eos-id", "0"]) == 2  # text, no tokenizer
    assert "tokens-column" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "pack-tokens", "--help"], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}).stdout
    for flag in ("--tokenizer", "--text-column", "--tokens-column", "--eos-id", "--workers", "--part-bytes",
                 "--overwrite", "Megatron"):
        assert flag in out


def test_s3_source_and_destination(corpus, s3, tmp_path):
    texts, tok, eos = corpus
    root, opts = s3
    from datapipe.storage import open_store

    store = open_store(root, opts)
    store.put("in/a.jsonl", Path(write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:120]])).read_bytes())
    store.put("in/b.parquet", Path(write_parquet(tmp_path / "b.parquet", [{"text": t} for t in texts[120:200]],
                                                 row_group_size=16)).read_bytes())
    r = datapipe.pack_tokens(root + "/in", root + "/out", tokenizer=tok, part_bytes=4096, workers=2,
                             storage_options=opts)
    local = tmp_path / "copy"
    local.mkdir()
    for key in store.list("out/"):
        (local / key[4:]).write_bytes(store.get(key))
    assert sorted(os.listdir(local))[0] == MANIFEST and r.parts > 2
    assert read_token_dataset(local) == expected_documents(tok, texts[:200], eos)
    datapipe.pack_tokens(tmp_path / "a.jsonl", tmp_path / "here", tokenizer=tok, part_bytes=4096)
    assert dataset_files(local)["part-00000-000.bin"] == dataset_files(tmp_path / "here")["part-00000-000.bin"]


def test_megatron_reads_what_pack_tokens_writes(corpus, tmp_path):
    idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason=MEGATRON)
    texts, tok, eos = corpus
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    datapipe.pack_tokens(src, tmp_path / "out", tokenizer=tok, part_bytes=4096, workers=2)
    got = []
    for part in _manifest(tmp_path / "out").parts:
        ds = idx_mod.IndexedDataset(str(tmp_path / "out" / part.prefix))
        assert len(ds) == part.sequences and ds.index.dtype == np.uint16
        got.extend(ds[i].tolist() for i in range(len(ds)))
    assert got == expected_documents(tok, texts, eos)
