"""The parts index: a load onto another world size reads every part document of the saved
step, and gets them from one object (``<attempt>/parts-index.json``, written by rank 0
before the manifest) instead of one request per saved rank. Every slice of it is checked
against the part's checksum in the manifest before it is used; an index that is lost,
damaged or lied about (slice boundaries, a forged part with its checksums recomputed) is a
warning naming it, and the load reads the part files one by one and gets the saved data.

Four writers of one 4-rank checkpoint in this process (as four ranks would write it, each
with its rank=/world_size=), loaded by "ranks" 0 and 1 of a 2-rank job (rank=, into= a
LocalShard of the new layout): the reading code is the same as under torch.distributed,
without the cost of spawning a process group. Reads are counted by wrapping LocalStore's
read methods: the real methods run and return their real bytes."""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, LocalShard, Replicated, list_checkpoints, load_checkpoint
from datapipe.checkpoint.format import encode_doc, encode_parts_index, manifest_key
from datapipe.checksum import checksum
from datapipe.errors import NoCheckpointError
from datapipe.storage import open_store
from datapipe.storage.local import LocalStore
from datapipe.storage.remote import FsspecStore

WORLD = 4
W = torch.arange(16 * 5, dtype=torch.float32).reshape(16, 5)  # Shard(0): 4 rows per saving rank
R = np.linspace(0, 1, 33)
INDEX = "parts-index.json"


def _state(r: int) -> dict:
    return {"w": LocalShard(W[4 * r : 4 * r + 4], W.shape, (4 * r, 0)), "r": Replicated(R),
            "loader": {"epoch": 1, "pos": [r, 5]}}


def _save(url: str, steps: tuple[int, ...] = (1,), run_id: str = "fixed", **kw: Any) -> None:
    writers = [CheckpointWriter(url, rank=r, world_size=WORLD, run_id=run_id, **kw) for r in range(WORLD)]
    try:
        for step in steps:
            for h in [w.save(step, _state(r)) for r, w in enumerate(writers)]:
                h.wait()
    finally:
        for w in writers:
            w.close()


def _into(rank: int) -> dict:
    """Rank ``rank``'s state on 2 ranks: 8 rows of W each."""
    return {"w": LocalShard(torch.zeros(8, 5), W.shape, (8 * rank, 0)), "r": np.zeros(33), "loader": None}


def _check(out: dict, into: dict, rank: int) -> None:
    assert torch.equal(into["w"].tensor, W[8 * rank : 8 * rank + 8])
    assert np.array_equal(into["r"], R)
    assert out["loader"] == {"epoch": 1, "pos": [0, 5]}  # rank 0's, as saved


class Reads:
    """Every call of a store class's read methods (get, get_range, readinto) by key."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type = LocalStore) -> None:
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        for name in ("get", "get_range", "readinto"):
            real = getattr(cls, name)

            def counted(store, key, *a, _real=real, _name=name, **k):
                with self._lock:
                    self.calls.append((_name, key))
                return _real(store, key, *a, **k)

            monkeypatch.setattr(cls, name, counted)

    def clear(self) -> None:
        self.calls.clear()

    def of_parts(self) -> list[str]:
        return [k for _m, k in self.calls if os.path.basename(k).startswith("part-")]

    def of_index(self) -> list[str]:
        return [k for _m, k in self.calls if k.endswith("/" + INDEX)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("pi") / "c")
    _save(url)
    return url


@pytest.fixture
def url(pristine, tmp_path):
    dst = str(tmp_path / "c")
    shutil.copytree(pristine, dst)
    return dst


def _manifest(url: str) -> dict:
    with open(os.path.join(url, manifest_key(1)), "rb") as f:
        return json.loads(f.read())


def _put_manifest(url: str, doc: dict) -> None:
    """Rewrite the manifest with a valid checksum (an edit a checksum does not catch)."""
    doc = dict(doc)
    doc.pop("checksum", None)
    open_store(url).put(manifest_key(1), encode_doc(doc, "manifest"))


def _index_path(url: str) -> str:
    m = _manifest(url)
    return os.path.join(url, m["parts_index"]["key"])


def _load_warned(url: str, rank: int = 0) -> tuple[dict, dict, list[str]]:
    into = _into(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = load_checkpoint(url, step=1, into=into, rank=rank)
    return out, into, [str(w.message) for w in caught]


# -- the format -------------------------------------------------------------------------------

def test_the_manifest_names_the_index_and_its_slices_are_the_part_files(url):
    m = _manifest(url)
    rec = m["parts_index"]
    with open(os.path.join(url, rec["key"]), "rb") as f:
        data = f.read()
    assert rec["key"] == f"step-000000000001/{m['attempt']}/{INDEX}"
    assert (rec["bytes"], rec["checksum"]) == (len(data), checksum(data))
    for e in m["parts"]:
        with open(os.path.join(url, e["key"]), "rb") as f:
            assert data[e["index_offset"] : e["index_offset"] + e["doc_bytes"]] == f.read()
    doc = json.loads(data)  # one JSON object for tools; readers slice it, never parse it whole
    assert (doc["kind"], doc["world_size"], [p["rank"] for p in doc["parts"]]) == ("parts_index", WORLD,
                                                                                    [0, 1, 2, 3])


# -- (1) one request for every part -----------------------------------------------------------

def test_a_resharding_load_reads_the_parts_through_one_index_request(url, monkeypatch):
    reads = Reads(monkeypatch)
    for rank in (0, 1):  # the two ranks of the new world size
        reads.clear()
        into = _into(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback on a good checkpoint
            out = load_checkpoint(url, into=into, rank=rank)
        _check(out, into, rank)
        print(f"loading rank {rank}: {len(reads.of_parts())} part-document reads, "
              f"{len(reads.of_index())} parts-index reads")
        assert reads.of_parts() == []
        assert len(reads.of_index()) == 1


def test_on_s3_a_resharding_load_makes_one_request_for_the_parts(s3, monkeypatch):
    root, opts = s3
    url = f"{root}/ckpt"
    _save(url, storage_options=opts)
    reads = Reads(monkeypatch, FsspecStore)
    for rank in (0, 1):
        reads.clear()
        into = _into(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            out = load_checkpoint(url, into=into, rank=rank, storage_options=opts)
        _check(out, into, rank)
        assert reads.of_parts() == [] and len(reads.of_index()) == 1


# -- (2) a damaged index ------------------------------------------------------------------------

def test_a_flipped_byte_in_the_index_falls_back_to_the_part_files_and_warns(url, monkeypatch):
    path = _index_path(url)
    m = _manifest(url)
    at = m["parts"][2]["index_offset"] + m["parts"][2]["doc_bytes"] // 2  # inside rank 2's document
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    reads = Reads(monkeypatch)
    out, into, msgs = _load_warned(url)
    _check(out, into, 0)
    assert any(path in msg and "manifest checksum" in msg for msg in msgs), msgs
    assert sorted(set(reads.of_parts())) == [e["key"] for e in m["parts"]]


# -- (3) an index that lies ---------------------------------------------------------------------

def _forged_index(url: str) -> tuple[dict, bytes]:
    """The manifest and an index whose rank-0 document says epoch 99, made by someone who
    recomputed the part's own checksum, the index's checksum and size and every offset in
    the manifest, but could not change the part file's checksum the manifest records
    without making it disagree with the part file itself."""
    m = _manifest(url)
    docs = []
    for e in m["parts"]:
        with open(os.path.join(url, e["key"]), "rb") as f:
            docs.append(f.read())
    part0 = json.loads(docs[0])
    part0.pop("checksum")
    loader = next(v for k, v in part0["tree"]["dict"] if k == "loader")
    loader["dict"][0][1] = 99  # [["epoch", 1], ...]
    docs[0] = encode_doc(part0, "part")
    data, offsets = encode_parts_index(1, m["attempt"], docs)
    m["parts_index"].update(bytes=len(data), checksum=checksum(data))
    for e, off, doc in zip(m["parts"], offsets, docs):
        e.update(index_offset=off, doc_bytes=len(doc))
    return m, data


def test_a_forged_part_in_a_consistent_index_is_never_used(url, monkeypatch):
    m, data = _forged_index(url)
    with open(os.path.join(url, m["parts_index"]["key"]), "wb") as f:
        f.write(data)
    _put_manifest(url, m)
    reads = Reads(monkeypatch)
    out, into, msgs = _load_warned(url)
    _check(out, into, 0)  # epoch 1, from the part file: the forged document was refused
    assert any(_index_path(url) in msg and "part 0" in msg for msg in msgs), msgs
    assert len(reads.of_parts()) == WORLD


edits = st.lists(st.tuples(st.integers(0, WORLD - 1), st.sampled_from(["index_offset", "doc_bytes"]),
                           st.integers(-300, 300)), max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(moves=edits, size_delta=st.sampled_from([-2, -1, 0, 1, 2, 10_000]), restate_size=st.booleans(),
       rehash=st.booleans())
def test_lying_slice_boundaries_never_yield_an_unchecked_part(pristine, tmp_path_factory, moves, size_delta,
                                                              restate_size, rehash):
    """Slice boundaries moved (slices overlapping, gaps, past the end, sizes that do not
    add up), the index's recorded size changed, the index cut or padded to the size the
    manifest claims, its checksum recomputed: the load reads the saved data, and warns
    about the index whenever a check of it fails."""
    url = str(tmp_path_factory.mktemp("lie") / "c")
    shutil.copytree(pristine, url)
    m = _manifest(url)
    for r, field, delta in moves:
        m["parts"][r][field] = max(0, m["parts"][r][field] + delta)
    m["parts_index"]["bytes"] = max(0, m["parts_index"]["bytes"] + size_delta)
    path = _index_path(url)
    if restate_size:  # make the file the size the manifest claims
        with open(path, "r+b") as f:
            f.truncate(m["parts_index"]["bytes"])
    if rehash:  # and its checksum what the file holds: only the slices' checks are left
        with open(path, "rb") as f:
            m["parts_index"]["checksum"] = checksum(f.read())
    slices_moved = m["parts"] != _manifest(url)["parts"]
    size_ok = size_delta == 0 or restate_size
    checksum_ok = rehash or size_delta == 0 or not restate_size
    _put_manifest(url, m)
    out, into, msgs = _load_warned(url)
    _check(out, into, 0)  # the saved data, whatever the index said
    # Refused, with a warning naming it, unless every check holds (then it holds each part
    # file's bytes: a cut of its closing "]}" is harmless, since readers slice, not parse)
    refused = slices_moved or not size_ok or not checksum_ok or size_delta > 4096
    assert any(INDEX in msg for msg in msgs) == refused, msgs


# -- (4) no index -------------------------------------------------------------------------------

def test_a_lost_index_falls_back_to_the_part_files(url, monkeypatch):
    path = _index_path(url)
    os.unlink(path)
    reads = Reads(monkeypatch)
    for rank in (0, 1):
        out, into, msgs = _load_warned(url, rank)
        _check(out, into, rank)
        assert any(path in msg for msg in msgs), msgs
    assert len(reads.of_parts()) == 2 * WORLD


def test_a_checkpoint_written_before_the_index_loads_without_a_word(url, monkeypatch):
    """What a writer without the index committed: no parts_index, no offsets, no file."""
    m = _manifest(url)
    os.unlink(os.path.join(url, m.pop("parts_index")["key"]))
    for e in m["parts"]:
        del e["index_offset"], e["doc_bytes"]
    _put_manifest(url, m)
    reads = Reads(monkeypatch)
    out, into, msgs = _load_warned(url)
    _check(out, into, 0)
    assert msgs == []
    assert sorted(reads.of_parts()) == [e["key"] for e in m["parts"]]


# -- retention and killed saves -----------------------------------------------------------------

def test_retention_deletes_the_index_and_an_uncommitted_index_is_not_a_checkpoint(tmp_path):
    url = str(tmp_path / "c")
    _save(url, steps=(1, 2), keep_last=1)
    assert not os.path.exists(os.path.join(url, "step-000000000001"))  # index and folder gone
    # a save killed after its index and before its manifest: incomplete, skipped
    os.unlink(os.path.join(url, manifest_key(2)))
    assert os.path.exists(_index_path_of(url, 2))
    assert [(c.step, c.complete) for c in list_checkpoints(url)] == [(2, False)]
    with pytest.warns(UserWarning, match="incomplete checkpoint step 2"), pytest.raises(NoCheckpointError):
        load_checkpoint(url, into=_into(0), rank=0)
    # the next run's first commit deletes the leftover (index included) and its folder
    _save(url, steps=(3,), run_id="next", keep_last=1)
    assert sorted(os.listdir(url)) == ["latest", "step-000000000003"]
    into = _into(1)
    _check(load_checkpoint(url, into=into, rank=1), into, 1)


def _index_path_of(url: str, step: int) -> str:
    sdir = os.path.join(url, f"step-{step:012d}")
    (attempt,) = [d for d in os.listdir(sdir) if os.path.isdir(os.path.join(sdir, d))]
    return os.path.join(sdir, attempt, INDEX)


def test_an_unreadable_index_falls_back_to_the_part_files(url, monkeypatch):
    """An I/O error on the index itself (EIO, EACCES on a local disk: a plain OSError)
    costs requests, not the load."""
    import errno

    real = LocalStore.get_range

    def get_range(store, key, *a, **k):
        if key.endswith("/" + INDEX):
            raise OSError(errno.EIO, "injected: Input/output error")
        return real(store, key, *a, **k)

    monkeypatch.setattr(LocalStore, "get_range", get_range)
    reads = Reads(monkeypatch)
    out, into, msgs = _load_warned(url, 0)
    _check(out, into, 0)
    assert any("injected" in m and INDEX in m for m in msgs), msgs
    assert len(reads.of_parts()) == WORLD


def test_an_index_that_cannot_be_written_does_not_cost_the_save(tmp_path, monkeypatch):
    """The index is a copy for speed: a save whose index write fails (a full disk) commits
    without it, with a warning, and loads through the part files."""
    import errno

    real = LocalStore.put

    def put(store, key, data, *a, **k):
        if key.endswith("/" + INDEX):
            raise OSError(errno.ENOSPC, "injected: No space left on device")
        return real(store, key, data, *a, **k)

    monkeypatch.setattr(LocalStore, "put", put)
    url = str(tmp_path / "c")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _save(url, background="thread")  # the failing put is patched into this process
    assert any("parts index could not be written" in str(w.message) for w in caught)
    assert [(c.step, c.complete) for c in list_checkpoints(url)] == [(1, True)]
    m = _manifest(url)
    assert "parts_index" not in m and all("index_offset" not in p for p in m["parts"])
    out, into, msgs = _load_warned(url, 1)
    _check(out, into, 1)
    assert not msgs


def test_part_documents_past_the_cap_get_no_index(tmp_path, monkeypatch):
    """Above PARTS_INDEX_MAX_BYTES of part documents rank 0 keeps none of them in memory
    and writes no index (here the cap is set below this step's documents)."""
    from datapipe.checkpoint import persist

    monkeypatch.setattr(persist, "PARTS_INDEX_MAX_BYTES", 100)
    url = str(tmp_path / "c")
    _save(url, background="thread")  # the cap is patched into this process
    m = _manifest(url)
    assert "parts_index" not in m and sum(p["doc_bytes"] for p in m["parts"]) > 100
    assert not any(f == INDEX for _d, _s, fs in os.walk(url) for f in fs)
    out, into, msgs = _load_warned(url, 0)
    _check(out, into, 0)
    assert not msgs
