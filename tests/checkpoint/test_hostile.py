"""Hostile checkpoint metadata: manifests and parts edited by someone who can recompute
checksums. A load returns the saved state of some complete step or raises a
DatapipeError; it never opens a file outside the checkpoint folder and never allocates
more than the folder's files hold (checked under an address-space limit)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.checkpoint import CheckpointWriter, list_checkpoints, load_checkpoint
from datapipe.checkpoint.format import MAX_JSON_DEPTH, encode_doc, json_depth, manifest_key
from datapipe.checksum import checksum
from datapipe.errors import CorruptCheckpointError, DatapipeError
from datapipe.storage import open_store

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None


# -- observing the loader --------------------------------------------------------------------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only inside opened_files()


@contextlib.contextmanager
def opened_files():
    """Every path this process opens inside the block (CPython audit events)."""
    global _OPENED
    _OPENED = seen = []
    try:
        yield seen
    finally:
        _OPENED = None


def assert_inside(paths: list[str], root: str) -> None:
    root = os.path.realpath(root)
    outside = [p for p in paths if os.path.isabs(p) and os.path.commonpath([root, os.path.realpath(p)]) != root
               and not p.startswith(("/proc", "/sys", "/dev"))]
    ckpt_like = [p for p in outside if "step-" in p or "part" in p or "outside" in p or "chunk" in p]
    assert not ckpt_like, f"the loader opened files outside {root}: {ckpt_like}"


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


@contextlib.contextmanager
def address_space_headroom(nbytes: int):
    """Lower this process's address-space limit to what it maps now plus ``nbytes``: an
    allocation the files cannot justify fails with a foreign error instead of silently
    reserving memory."""
    if resource is None or not os.path.exists("/proc/self/status"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- editing documents as an attacker would ---------------------------------------------------

def read_json(store, key):
    return json.loads(store.get(key))


def reseal(store, step: int, manifest: dict, part: dict | None = None, pkey: str | None = None) -> None:
    """Write ``part`` (if given) at ``pkey``, then the manifest naming that part's
    checksum: every self-checksum valid, as an attacker who knows the format leaves them."""
    if part is not None:
        data = encode_doc(part, "part")
        store.put(pkey, data)
        with contextlib.suppress(KeyError, IndexError, TypeError):
            manifest["parts"][0]["checksum"] = checksum(data)
    store.put(manifest_key(step), encode_doc(manifest, "manifest"))


def state_of(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3000, generator=g), "step": step, "name": f"s{step}"}


def same(a, b) -> bool:
    return (a["step"] == b["step"] and a["name"] == b["name"]
            and torch.equal(a["w"].view(torch.int32), b["w"].view(torch.int32)))


def make_checkpoints(url, steps=(1, 2, 3), **kw):
    with CheckpointWriter(url, keep_last=10, chunk_bytes=4096, **kw) as w:
        for s in steps:
            w.save(s, state_of(s)).wait()


def load_quietly(url, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_checkpoint(url, **kw)


# -- item 3: keys outside the folder ------------------------------------------------------------

ESCAPES = [
    "../outside/part-00000.json",
    "step-000000000003/../../outside/part-00000.json",
    "{abs}",
    "step-000000000003//part-00000.json",
    "step-000000000003\\..\\..\\outside\\part-00000.json",
    "",
]


@pytest.mark.parametrize("escape", ESCAPES)
def test_manifest_part_key_outside_the_folder_is_never_opened(tmp_path, escape):
    url = str(tmp_path / "ckpt")
    make_checkpoints(url)
    store = open_store(url)
    m = read_json(store, manifest_key(3))
    part = read_json(store, m["parts"][0]["key"])
    # A valid part for step 3 planted outside the folder: its chunks are real, with the
    # state of "evil" (step 2's bytes relabelled); the original loader loaded it.
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = dict(part, tree={"dict": [["w", {"leaf": 0}], ["step", 666], ["name", "evil"]]})
    data = encode_doc(evil, "part")
    (outside / "part-00000.json").write_bytes(data)
    key = escape.replace("{abs}", str(outside / "part-00000.json"))
    m["parts"][0]["key"] = key
    m["parts"][0]["checksum"] = checksum(data)
    store.put(manifest_key(3), encode_doc(m, "manifest"))

    with opened_files() as seen:
        with pytest.warns(UserWarning, match="step 3"):
            got = load_checkpoint(url)
        with pytest.raises(CorruptCheckpointError, match=r"part-00000|key"):
            load_checkpoint(url, step=3)
    assert got["name"] == "s2" and same(got, state_of(2))
    assert_inside(seen, url)
    assert [(s, c) for s, c in list_checkpoints(url)] == [(1, True), (2, True), (3, False)]


def test_chunk_symlink_out_of_the_folder_is_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    make_checkpoints(url)
    store = open_store(url)
    chunk = next(k for k in store.list("step-000000000003/") if k.endswith("chunk-000001.bin"))
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(store.get(chunk))  # the same bytes: only the location is wrong
    os.unlink(store.path(chunk))
    os.symlink(outside, store.path(chunk))
    with opened_files() as seen:
        with pytest.warns(UserWarning, match=r"step 3.*outside the checkpoint folder"):
            assert load_checkpoint(url)["step"] == 2
    assert str(outside) not in seen


def test_s3_part_key_with_dot_segments_is_refused(s3):
    """S3 keys may literally contain '..': a part planted at such a key, which the original
    loader fetched, is refused by name before any request."""
    root, opts = s3
    url = f"{root}/run/ckpt"
    make_checkpoints(url, storage_options=opts)
    store = open_store(url, opts)
    m = json.loads(store.get(manifest_key(3)))
    part = json.loads(store.get(m["parts"][0]["key"]))
    evil = dict(part, tree={"dict": [["w", {"leaf": 0}], ["step", 666], ["name", "evil"]]})
    key = "step-000000000003/../../planted/part-00000.json"
    m["parts"][0]["key"] = key
    reseal(store, 3, m, evil, key)
    with pytest.warns(UserWarning, match=r"step 3.*planted"):
        got = load_checkpoint(url, storage_options=opts)
    assert got["name"] == "s2"


# -- item 8: shapes and sizes before allocation ---------------------------------------------------

def _inflate(m, p, n=10**12):
    """A layout that adds up: the last chunk claims the rest of ``n`` bytes."""
    last = p["chunks"][-1]
    extra = n - p["data_bytes"]
    last["bytes"] += extra
    last["stored_bytes"] += extra
    p["data_bytes"] = p["stored_bytes"] = n
    p["chunk_bytes"] = max(p["chunk_bytes"], last["bytes"])
    m["parts"][0]["data_bytes"] = m["parts"][0]["stored_bytes"] = n
    m["data_bytes"] = m["stored_bytes"] = n


BAD_MANIFESTS = {
    "terabyte": lambda m, p: _inflate(m, p),
    "parts_wrong_type": lambda m, p: m.update(parts=[1]),
    "part_entry_missing_fields": lambda m, p: m.update(parts=[{"rank": 0}]),
    "parts_a_dict": lambda m, p: m.update(parts={"0": m["parts"][0]}),
    "world_size_bool": lambda m, p: m.update(world_size=True),
    "data_bytes_str": lambda m, p: m["parts"][0].update(data_bytes="1"),
    "chunks_wrong_type": lambda m, p: p.update(chunks=[[1, 2]]),
    "chunk_offset_float": lambda m, p: p["chunks"][0].update(offset=0.0),
    "leaf_shape_str": lambda m, p: p["leaves"][0].update(shape="3000"),
    "leaf_huge_strides": lambda m, p: p["leaves"][0].update(strides=[10**12]),
    "leaf_dtype_int": lambda m, p: p["leaves"][0].update(dtype=5),
    "tree_bad_base64": lambda m, p: p.update(tree={"bytes": "abc"}),
}


@pytest.mark.parametrize("edit", sorted(BAD_MANIFESTS))
def test_bad_manifest_is_a_skipped_checkpoint(tmp_path, edit):
    url = str(tmp_path / "ckpt")
    make_checkpoints(url)
    store = open_store(url)
    m = read_json(store, manifest_key(3))
    pkey = m["parts"][0]["key"]
    p = read_json(store, pkey)
    BAD_MANIFESTS[edit](m, p)
    reseal(store, 3, m, p, pkey)
    with address_space_headroom(1 << 30):
        with pytest.warns(UserWarning, match=r"skipping checkpoint step 3"):
            got = load_checkpoint(url)
        assert same(got, state_of(2))
        with pytest.raises(CorruptCheckpointError, match=r"step-000000000003|step 3"):
            load_checkpoint(url, step=3)
    infos = list_checkpoints(url)
    assert [i.step for i in infos] == [1, 2, 3]


def test_deep_json_manifest_is_skipped_and_listed(tmp_path):
    url = str(tmp_path / "ckpt")
    make_checkpoints(url)
    store = open_store(url)
    store.put(manifest_key(3), b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    store.put(manifest_key(2), b"[" * 100_000 + b"]" * 100_000)
    with pytest.warns(UserWarning) as rec:
        assert same(load_checkpoint(url), state_of(1))
    assert {"step 3", "step 2"} <= {m for w in rec for m in ("step 3", "step 2") if m in str(w.message)}
    infos = list_checkpoints(url)
    assert [(i.step, i.complete) for i in infos] == [(1, True), (2, False), (3, False)]
    assert "JSON" in infos[1].reason and "JSON" in infos[2].reason


def _walk_depth(doc) -> int:
    if isinstance(doc, dict):
        return 1 + max((_walk_depth(v) for v in doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max((_walk_depth(v) for v in doc), default=0)
    return 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\/ab\x00\u00e9\n'),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(alphabet='[]{}"\\a'), kids, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_json, st.booleans())
def test_json_depth_of_the_text_is_the_depth_of_the_document(doc, ascii_only):
    """The depth is read from the text (strings dropped, brackets counted): strings full
    of brackets, quotes and backslashes, escaped or not, do not count."""
    text = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert json_depth(text) == _walk_depth(doc)


def test_manifest_nested_deeper_than_the_limit_but_parseable_is_skipped(tmp_path):
    url = str(tmp_path / "ckpt")
    make_checkpoints(url)
    store = open_store(url)
    deep = MAX_JSON_DEPTH + 1  # json.loads parses it; our walks over the tree must not see it
    store.put(manifest_key(3), b'{"a":' * (deep - 1) + b'{"s":"]]]}}}"}' + b"}" * (deep - 1))
    with pytest.warns(UserWarning, match="nested deeper"):
        assert same(load_checkpoint(url), state_of(2))


def test_zstd_chunk_declaring_more_than_its_frame_is_refused_before_allocating(tmp_path):
    url = str(tmp_path / "ckpt")
    make_checkpoints(url, compression="zstd")
    store = open_store(url)
    m = read_json(store, manifest_key(3))
    pkey = m["parts"][0]["key"]
    p = read_json(store, pkey)
    last = p["chunks"][-1]
    extra = 3 << 30  # more than the address-space headroom below
    last["bytes"] += extra  # stored bytes unchanged: only the frame header can tell
    p["data_bytes"] += extra
    p["chunk_bytes"] = max(p["chunk_bytes"], last["bytes"])
    m["parts"][0]["data_bytes"] = m["data_bytes"] = p["data_bytes"]
    reseal(store, 3, m, p, pkey)
    with address_space_headroom(1 << 30):
        with pytest.warns(UserWarning, match=r"step 3.*zstd frame declares"):
            assert same(load_checkpoint(url), state_of(2))


# -- the property: any edit of the newest step's documents -------------------------------------

HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**12, 3000 * 4, 4096, 4097]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "..", "../outside/part-00000.json", "/etc/hostname", "step-000000000003/../../x",
                     "zstd", "float32", "<f4", "|O", "V8", "int4", "numpy", "torch", "npscalar",
                     "step-000000000002/a-0/part-00000.json", "\\..\\x", "a" * 300]),
    st.text(max_size=20),
    st.lists(st.integers(-3, 5000), max_size=4),
    # fresh objects for every draw (copies): an edit that placed one shared dict inside
    # itself (chunks[0] := D, then chunks[0]["bytes"] := D) made a document no JSON holds
    st.sampled_from([{"leaf": 0}, {"bytes": "%%%"}, [[[[[[[[]]]]]]]]]).map(copy.deepcopy),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _set(doc, path, value, delete=False):
    node = doc
    for k in path[:-1]:
        node = node[k]
    if isinstance(node, dict) and not isinstance(path[-1], str):
        # an earlier edit made a list of the original a dict: a list index is no JSON key
        # (a document with one would be the test's failure, not the loader's)
        raise TypeError("a JSON object's keys are strings")
    if delete and isinstance(node, dict):
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


# What an edit may touch. Someone who recomputes every checksum can also relabel the
# state itself (the tree's values, a leaf's dtype or shape); no reader can tell that from
# a save, so the property covers what the loader trusts for *where* and *how much* to
# read: the whole manifest, and the part's identity, sizes, chunk list and leaf extents.
_PART_FIELDS = ("step", "attempt", "rank", "world_size", "compression", "chunk_bytes", "data_bytes",
                "stored_bytes", "chunks")


def _editable(which, path):
    if not path or path[0] in ("format", "kind", "version", "checksum"):
        return False
    if which == "manifest":
        return True
    return path[0] in _PART_FIELDS or (path[0] == "leaves" and len(path) == 3
                                        and path[2] in ("offset", "nbytes", "strides"))


@st.composite
def edits(draw, docs):
    """A list of (document, path, value | DELETE) edits, or a consistent size inflation."""
    n = draw(st.integers(1, 3))
    out = []
    for _ in range(n):
        which = draw(st.sampled_from(["manifest", "part"]))
        paths = [p for p in _paths(docs[which]) if _editable(which, p)]
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(["set", "set", "delete", "inflate"]))
        if kind == "inflate":
            out.append(("inflate", None, draw(st.sampled_from([2**31, 2**33, 10**12, 2**62]))))
        else:
            out.append((which, path, None if kind == "delete" else draw(HOSTILE_VALUES), kind == "delete"))
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("pristine")
    out = {}
    for comp in (None, "zstd"):
        url = str(base / f"ckpt-{comp}")
        make_checkpoints(url, compression=comp)
        store = open_store(url)
        m = read_json(store, manifest_key(3))
        out[comp] = (url, m, read_json(store, m["parts"][0]["key"]))
    return out


@pytest.mark.parametrize("comp", [None, "zstd"])
@settings(deadline=None, max_examples=int(os.environ.get("DATAPIPE_HYPOTHESIS_EXAMPLES", "60")),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_edit_loads_a_saved_state_or_raises_a_datapipe_error(pristine, tmp_path, comp, data):
    src, m0, p0 = pristine[comp]
    url = str(tmp_path / "ckpt")
    shutil.rmtree(url, ignore_errors=True)
    shutil.copytree(src, url)
    m, p = json.loads(json.dumps(m0)), json.loads(json.dumps(p0))
    for e in data.draw(edits({"manifest": m, "part": p})):
        try:
            if e[0] == "inflate":
                _inflate(m, p, e[2])
            else:
                which, path, value, delete = e
                _set(m if which == "manifest" else p, path, value, delete)
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # an earlier edit removed or retyped the path
    store = open_store(url)
    part_key = m0["parts"][0]["key"]
    store.put(part_key, encode_doc(p, "part"))
    if isinstance(m.get("parts"), list) and m["parts"] and isinstance(m["parts"][0], dict):
        m["parts"][0]["checksum"] = checksum(store.get(part_key))
    store.put(manifest_key(3), encode_doc(m, "manifest"))

    with opened_files() as seen, address_space_headroom(1 << 30):
        try:
            got = load_quietly(url)
        except DatapipeError:
            got = None
        infos = list_checkpoints(url)
    assert_inside(seen, url)
    assert [i.step for i in infos] == [1, 2, 3]
    if got is not None:
        assert isinstance(got, dict) and got.get("step") in (1, 2, 3)
        assert same(got, state_of(got["step"])), f"loaded a state no step saved: {got!r:.200}"


def _signed_doc_text(body: dict) -> str:
    """``body`` as a part document with a valid self-checksum, not ASCII-escaped."""
    from datapipe.checkpoint.format import FORMAT, VERSION
    from datapipe.checksum import canonical_json

    doc = dict(body, format=FORMAT, kind="part", version=VERSION)
    doc["checksum"] = checksum(canonical_json(doc))
    return json.dumps(doc, ensure_ascii=False, sort_keys=True)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16", "utf-32"])
def test_deep_document_in_utf16_or_32_is_refused(encoding):
    """json.loads reads bytes in UTF-16/32 too: there U+2200 has a quote byte (0x22), which
    upset the strings a text-depth count drops and hid a document 450 deep."""
    from datapipe.checkpoint.format import decode_doc

    deep = MAX_JSON_DEPTH + 50
    data = _signed_doc_text({"a": "\u2200\u5d5d", "deep": json.loads("[" * deep + "]" * deep)}).encode(encoding)
    with pytest.raises(CorruptCheckpointError):
        decode_doc(data, "part", "part 0")


@settings(max_examples=200, deadline=None)
@given(_json, st.sampled_from(["utf-8", "utf-8-sig", "utf-16-le", "utf-16-be", "utf-32-le"]))
def test_decoded_document_is_never_deeper_than_the_limit(doc, encoding):
    """Whatever the encoding and strings, a document decode_doc returns is no deeper than
    MAX_JSON_DEPTH; anything else is a CorruptCheckpointError."""
    from datapipe.checkpoint.format import decode_doc

    deep = MAX_JSON_DEPTH + 1
    wrapped = json.loads("[" * deep + "0" + "]" * deep)
    data = _signed_doc_text({"a": doc, "b": wrapped, "c": doc}).encode(encoding)
    with pytest.raises(CorruptCheckpointError):
        decode_doc(data, "part", "part 0")
    shallow = _signed_doc_text({"a": doc}).encode(encoding)
    try:
        got = decode_doc(shallow, "part", "part 0")
    except CorruptCheckpointError:
        assert encoding != "utf-8"
    else:
        assert _walk_depth(got) <= MAX_JSON_DEPTH
