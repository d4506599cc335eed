"""pack_tokens(engine="ray") and `datapipe pack-tokens --engine ray`, on a real local Ray
instance (``ray.init(num_cpus=2)``): every file (manifest included) byte-identical to the
process path's, a SIGKILLed task retried into the same part names, a pack either engine
began finished by the other, a failing piece a named error. The tests marked ``ray`` are
deselected by default (run them with ``pytest -m ray -n 0``); the option and no-Ray tests
run in the default suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import datapipe
from datapipe.cli import main
from datapipe.errors import InputFileError, MissingDependencyError, PackError, PackOptionError
from datapipe.format.tokens import MANIFEST
from datapipe.publish import Journal
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


@pytest.fixture(scope="module")
def corpus():
    texts = make_texts(300, seed=3)
    tok = train_tokenizer(make_texts(1000, seed=4))
    return texts, tok, tok.token_to_id("<|endoftext|>")


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[tests,ray]' && pytest -m ray -n 0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _inputs(tmp_path, texts, tok):
    """Text in three JSONL files and token ids in a Parquet file: several pieces each."""
    files = [write_jsonl(tmp_path / f"in-{k}.jsonl", [{"text": t} for t in texts[k::3]]) for k in range(3)]
    ids = write_parquet(tmp_path / "ids.parquet", [{"input_ids": tok.encode(t).ids} for t in texts], row_group_size=40)
    return files, ids


@pytest.mark.ray
def test_ray_engine_writes_the_bytes_of_the_process_path(ray_local, corpus, tmp_path):
    texts, tok, eos = corpus
    files, ids = _inputs(tmp_path, texts, tok)
    r = datapipe.pack_tokens(files, tmp_path / "ray", tokenizer=tok, part_bytes=4096, engine="ray", progress=True)
    datapipe.pack_tokens(files, tmp_path / "local", tokenizer=tok, part_bytes=4096, workers=2)
    on_ray, local = dataset_files(tmp_path / "ray"), dataset_files(tmp_path / "local")
    assert len(on_ray) > 3 * 4 and MANIFEST in on_ray
    assert on_ray == local  # every file, manifest included: it records no engine and no time
    assert read_token_dataset(tmp_path / "ray") == [d for k in range(3) for d in
                                                    expected_documents(tok, texts[k::3], eos)]
    assert (r.documents, r.parts, r.resumed_parts) == (len(texts), len(on_ray) // 3, 0)
    # token ids from Parquet, row groups as pieces
    opts = dict(eos_id=eos, vocab_size=tok.get_vocab_size(), part_bytes=4096)
    datapipe.pack_tokens(ids, tmp_path / "ids-ray", engine="ray", **opts)
    datapipe.pack_tokens(ids, tmp_path / "ids-local", workers=1, **opts)
    assert dataset_files(tmp_path / "ids-ray") == dataset_files(tmp_path / "ids-local")
    assert read_token_dataset(tmp_path / "ids-ray") == expected_documents(tok, texts, eos)


@pytest.mark.ray
def test_cli_engine_ray(ray_local, corpus, tmp_path, capsys):
    texts, tok, _ = corpus
    files, _ = _inputs(tmp_path, texts, tok)
    tok.save(str(tmp_path / "tokenizer.json"))
    args = [*files, "--tokenizer", str(tmp_path / "tokenizer.json"), "--part-bytes", "4K", "-q"]
    assert main(["pack-tokens", *args[:3], str(tmp_path / "ray"), *args[3:], "--engine", "ray"]) == 0
    assert f"packed {len(texts):,} documents" in capsys.readouterr().out
    assert main(["pack-tokens", *args[:3], str(tmp_path / "local"), *args[3:]]) == 0
    assert dataset_files(tmp_path / "ray") == dataset_files(tmp_path / "local")
    assert main(["pack-tokens", *args[:3], str(tmp_path / "w"), *args[3:], "--engine", "ray", "--workers", "2"]) == 2
    assert "workers=2: an option of engine='local'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.ray
def test_a_sigkilled_task_is_retried_into_the_same_parts(ray_local, corpus, tmp_path, monkeypatch):
    """The worker of piece 1's task SIGKILLs itself on the first attempt, after its parts
    are published and before the driver has journaled them; Ray runs the task again."""
    texts, tok, _ = corpus
    files, _ = _inputs(tmp_path, texts, tok)
    marker, dest = tmp_path / "killed", tmp_path / "out"
    import datapipe.tokens.pack as token_pack

    def killed_once(task):  # defined here: Ray sends it to the workers by value
        res = datapipe.tokens.pack_piece(task)
        if task.piece.index == 1 and not marker.exists():
            marker.write_text(json.dumps({"pid": os.getpid(), "files": sorted(os.listdir(dest))}))
            os.kill(os.getpid(), signal.SIGKILL)
        return res

    monkeypatch.setattr(token_pack, "pack_piece_alone", killed_once)
    r = datapipe.pack_tokens(files, dest, tokenizer=tok, part_bytes=4096, engine="ray")
    killed = json.loads(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)  # the worker really died
    assert "part-00001-000.bin" in killed["files"]  # ... with its piece's parts published
    datapipe.pack_tokens(files, tmp_path / "local", tokenizer=tok, part_bytes=4096, workers=1)
    assert dataset_files(dest) == dataset_files(tmp_path / "local")  # no other name, no temporary, no journal
    assert r.documents == len(texts)


class _Stop(Exception):
    pass


@pytest.mark.ray
@pytest.mark.parametrize("first,then", [("local", "ray"), ("ray", "local")])
def test_a_pack_one_engine_began_the_other_finishes(ray_local, corpus, tmp_path, monkeypatch, first, then):
    texts, tok, _ = corpus
    files, _ = _inputs(tmp_path, texts, tok)
    dest = tmp_path / "out"
    record, recorded = Journal.record, []

    def record_then_stop(self, name, result):  # the driver stops (Ctrl-C, say) with pieces left
        record(self, name, result)
        recorded.append(name)
        if len(recorded) == 3:
            raise _Stop

    engine = {"local": {"workers": 2}, "ray": {"engine": "ray"}}
    with monkeypatch.context() as m:
        m.setattr(Journal, "record", record_then_stop)
        with pytest.raises(_Stop):
            datapipe.pack_tokens(files, dest, tokenizer=tok, part_bytes=4096, **engine[first])
    assert not (dest / MANIFEST).exists()
    r = datapipe.pack_tokens(files, dest, tokenizer=tok, part_bytes=4096, **engine[then])
    assert r.resumed_parts >= 3
    datapipe.pack_tokens(files, tmp_path / "whole", tokenizer=tok, part_bytes=4096, workers=1)
    assert dataset_files(dest) == dataset_files(tmp_path / "whole")


@pytest.mark.ray
def test_a_failing_piece_is_a_named_error_and_nothing_is_committed(ray_local, tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2, 3]}] * 50)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [1]}, {"input_ids": [5, 99]}])
    with pytest.raises(InputFileError, match=r"b\.jsonl line 2: token id 99 lies outside the vocabulary"):
        datapipe.pack_tokens([good, bad], tmp_path / "out", eos_id=0, vocab_size=10, engine="ray")
    assert not (tmp_path / "out" / MANIFEST).exists()
    with pytest.raises(PackOptionError, match="memory store"):
        datapipe.pack_tokens(good, "memory://tokens-ray", eos_id=0, vocab_size=10, engine="ray")


@pytest.mark.ray
def test_s3_source_and_destination_through_ray_tasks(ray_local, corpus, s3, tmp_path):
    texts, tok, _ = corpus
    root, opts = s3
    from datapipe.storage import open_store

    store = open_store(root, opts)
    files, _ = _inputs(tmp_path, texts, tok)
    for f in files[:2]:
        store.put(f"in/{os.path.basename(f)}", open(f, "rb").read())
    for name, engine in (("ray", {"engine": "ray"}), ("local", {"workers": 1})):
        datapipe.pack_tokens(root + "/in", f"{root}/{name}", tokenizer=tok, part_bytes=4096, storage_options=opts,
                             **engine)

    def objects(prefix):
        return {k[len(prefix):]: store.get(k) for k in store.list(prefix)}

    on_ray = objects("ray/")
    assert MANIFEST in on_ray and len(on_ray) > 2 * 3
    assert on_ray == objects("local/")  # uploaded from the Ray workers, no journal or lock left


@pytest.mark.ray
def test_a_task_that_breaks_or_keeps_dying_is_a_pack_error_naming_its_piece(ray_local, tmp_path, monkeypatch):
    import datapipe.ray.tokens as ray_tokens
    import datapipe.tokens.pack as token_pack

    src = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2, 3]}] * 20)

    def breaks(task):  # a bug, not a DatapipeError
        raise KeyError("no such thing")

    def always_killed(task):
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(token_pack, "pack_piece_alone", breaks)
    with pytest.raises(PackError, match=r"piece-00000 \(.*a\.jsonl\).*raised KeyError: 'no such thing'.*resume"):
        datapipe.pack_tokens(src, tmp_path / "out", eos_id=0, vocab_size=10, engine="ray")
    monkeypatch.setattr(token_pack, "pack_piece_alone", always_killed)
    with pytest.raises(PackError, match=rf"piece-00000 .*lost its worker {ray_tokens.MAX_RETRIES + 1} times"):
        datapipe.pack_tokens(src, tmp_path / "out", eos_id=0, vocab_size=10, engine="ray")
    assert not (tmp_path / "out" / MANIFEST).exists()
    monkeypatch.undo()
    datapipe.pack_tokens(src, tmp_path / "out", eos_id=0, vocab_size=10, engine="ray")  # the rerun finishes
    assert read_token_dataset(tmp_path / "out") == [[1, 2, 3, 0]] * 20


@pytest.mark.parametrize("kwargs,says", [
    ({"engine": "spark"}, "engine='spark': expected one of 'local', 'ray'"),
    ({"engine": None}, "engine=None"),
    ({"address": "auto"}, "address='auto': applies to engine='ray' only"),
    ({"engine": "ray", "workers": 2}, "workers=2: an option of engine='local'"),
])
def test_engine_options_name_themselves(tmp_path, kwargs, says):
    src = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2]}])
    with pytest.raises(PackOptionError) as e:
        datapipe.pack_tokens(src, tmp_path / "out", eos_id=0, vocab_size=10, **kwargs)
    assert says in str(e.value)
    assert not (tmp_path / "out").exists()


_NO_RAY = "import sys; sys.modules['ray'] = None\n"


def test_without_ray_the_error_names_the_extra(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2]}])
    code = _NO_RAY + (
        "import datapipe\n"
        "from datapipe.errors import MissingDependencyError\n"
        "try:\n"
        f"    datapipe.pack_tokens({src!r}, {str(tmp_path / 'out')!r}, eos_id=0, vocab_size=10, engine='ray')\n"
        "except MissingDependencyError as e:\n"
        "    print('MissingDependencyError:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MissingDependencyError: engine='ray'" in out.stdout and "pip install 'datapipe[ray]'" in out.stdout
    assert issubclass(MissingDependencyError, ImportError)
    cli = _NO_RAY + "from datapipe.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", cli, "pack-tokens", src, str(tmp_path / "out"), "--eos-id", "0",
                          "--vocab-size", "10", "--engine", "ray", "-q"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert out.returncode == 2 and "pip install 'datapipe[ray]'" in out.stderr
    assert not (tmp_path / "out").exists()
    out = subprocess.run([sys.executable, "-c", cli, "pack-tokens", src, str(tmp_path / "out"), "--eos-id", "0",
                          "--vocab-size", "10", "-q"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr  # the default engine needs no Ray
