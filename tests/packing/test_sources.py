"""Packing a general file tree: what WebDataset's first-dot rule drops and merges is reported
(counts and examples, in PackResult, its summary and the CLI output), and ``keys="file"``
packs one sample per file, read back byte-exact by datapipe and by the webdataset library."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.errors import PackOptionError
from datapipe.format.tar import split_member_name
from datapipe.packing import file_key
from datapipe.packing.sources import DOT_FILE, DOT_FOLDER, LINKED_FOLDER, NO_EXTENSION

# relative path -> content: the kinds of names a real /usr/share tree holds
TREE = {
    "doc/git/copyright": b"Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n",
    "doc/git/README.md": b"# Git\n",
    "doc/git/README.Debian": b"Debian notes\n",
    "doc/git/RelNotes/2.0.0.txt": b"Git v2.0 Release Notes\n",
    "doc/git/RelNotes/2.0.1.txt": b"Git v2.0.1 Release Notes\n",
    "doc/git/RelNotes/2.1.0.txt": b"Git v2.1 Release Notes\n",
    "doc/git/changelog.Debian.gz": b"\x1f\x8b\x08\x00 not really gzip",
    "zoneinfo/UTC": b"TZif2 utc",
    "zoneinfo/America/Port-au-Prince": b"TZif2 haiti",
    "lib/libfoo.so.1.2": b"\x7fELF",
    "odd/trailing.": b"a name that ends with a dot",
    "odd/100%.txt": b"percent",
    "odd/100%2E.txt": b"looks escaped already",
    "img/a.jpg": b"\xff\xd8jpeg",
    "img/a.json": b'{"caption": "a"}',
}
HIDDEN = {".bashrc": b"export X=1\n", "doc/.keep": b"", ".git/config": b"[core]\n"}


def _make_tree(root):
    for rel, data in {**TREE, **HIDDEN}.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.symlink(os.path.join(root, "doc"), os.path.join(root, "doc-link"))  # a link to a folder
    return str(root)


def _unescape(key: str) -> str:
    folder, slash, base = key.rpartition("/")
    return folder + slash + base.replace("%2E", ".").replace("%25", "%")


@pytest.fixture
def tree(tmp_path):
    return _make_tree(tmp_path / "share")


def test_first_dot_rule_reports_what_it_dropped_and_merged(tree, tmp_path):
    r = datapipe.pack(tree, str(tmp_path / "ds"), workers=1)
    no_ext = sorted(rel for rel in TREE if split_member_name(rel) is None)  # "trailing." too
    assert r.dropped == {DOT_FOLDER: 1, DOT_FILE: 2, LINKED_FOLDER: 1, NO_EXTENSION: len(no_ext)}
    examples = {path for path, _ in r.dropped_examples}
    assert {".bashrc", os.path.join("doc", ".keep"), ".git", "doc-link"} <= examples
    assert {p for p, why in r.dropped_examples if why == NO_EXTENSION} <= set(no_ext)
    # the samples the rule made of several files, computed here from the names
    groups: dict[str, list[str]] = {}
    for rel in TREE:
        cut = split_member_name(rel)
        if cut is not None:
            groups.setdefault(cut[0], []).append(rel)
    merged = {k: sorted(v) for k, v in groups.items() if len(v) > 1}
    assert (r.merged_samples, r.merged_files) == (len(merged), sum(map(len, merged.values())))
    assert all(n == len(merged[key]) and files == merged[key][:4] for key, files, n in r.merged_examples)
    assert "doc/git/RelNotes/2" in merged and r.samples == len(groups)
    text = r.summary()
    assert f"dropped {len(no_ext) + 4} (not packed):" in text
    assert f"{len(no_ext)} {NO_EXTENSION}, e.g." in text and "--keys file" in text
    assert f"merged {r.merged_files} files into {r.merged_samples} samples" in text


def test_keys_file_packs_one_sample_per_file_read_back_exactly(tree, tmp_path):
    dest = str(tmp_path / "ds")
    r = datapipe.pack(tree, dest, workers=1, keys="file")
    assert r.samples == len(TREE) and r.merged_samples == 0
    assert r.dropped == {DOT_FOLDER: 1, DOT_FILE: 2, LINKED_FOLDER: 1}
    ds = datapipe.open_dataset(dest)
    got = {}
    for s in ds:
        (fld,) = [k for k in s if not k.startswith("__")]
        rel = _unescape(s["__key__"])
        ext = rel.rpartition(".")[2] if "." in os.path.basename(rel).rstrip(".")[1:] else "bin"
        assert fld == ext.lower(), rel
        got[rel] = s[fld]
    assert got == TREE
    assert ds.get(file_key("doc/git/RelNotes/2.0.0.txt")[0])["txt"] == TREE["doc/git/RelNotes/2.0.0.txt"]
    assert ds.get("doc/git/copyright")["bin"] == TREE["doc/git/copyright"]


def test_keys_file_shards_read_the_same_in_webdataset(tree, tmp_path):
    import webdataset as wds

    dest = str(tmp_path / "ds")
    datapipe.pack(tree, dest, workers=1, keys="file", shard_samples=4)
    shards = sorted(glob.glob(os.path.join(dest, "*.tar")))
    assert len(shards) == -(-len(TREE) // 4)
    theirs = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")}
              for s in wds.WebDataset(shards, shardshuffle=False, empty_check=False)}
    ours = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in datapipe.open_dataset(dest)}
    assert theirs == ours and len(ours) == len(TREE)


def test_cli_prints_dropped_and_merged(tree, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "pack", tree, str(tmp_path / "a"), "-q"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert "dropped" in out and NO_EXTENSION in out and "merged" in out and "doc/git/RelNotes/2:" in out
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "pack", tree, str(tmp_path / "b"), "-q",
                          "--keys", "file"], capture_output=True, text=True, env=env, check=True).stdout
    assert f"packed {len(TREE)} samples" in out and NO_EXTENSION not in out and "merged" not in out


def test_keys_file_is_refused_for_tables_and_unknown_rules(tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text('{"txt": "a"}\n')
    with pytest.raises(PackOptionError, match="directory"):
        datapipe.pack(str(src), str(tmp_path / "ds"), keys="file")
    with pytest.raises(PackOptionError, match="keys"):
        datapipe.pack(str(tmp_path), str(tmp_path / "ds2"), keys="last-dot")


_segment = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\"),
                   min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))


@given(st.lists(_segment, min_size=1, max_size=4), st.lists(_segment, min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_file_keys_cut_back_and_are_distinct(a, b):
    rel_a, rel_b = "/".join(a), "/".join(b)
    ka, kb = file_key(rel_a), file_key(rel_b)
    if a[-1].startswith("."):
        assert ka is None
        return
    key, fld = ka
    assert split_member_name(f"{key}.{fld}") == (key, fld)  # WebDataset's cut gives them back
    assert _unescape(key) == rel_a
    if kb is not None and rel_a != rel_b:
        assert kb[0] != key


REAL_TREE = "/usr/share/doc/git"  # the tree issue 13 names (RelNotes, copyright, README.*)


@pytest.mark.skipif(not os.path.isdir(os.path.join(REAL_TREE, "RelNotes")), reason=f"{REAL_TREE} is not installed")
def test_a_real_doc_tree_packs_every_file_with_keys_file(tmp_path):
    root = os.path.realpath(REAL_TREE)
    expected = {}
    for dirpath, dirnames, filenames in os.walk(root):  # the packer's rules: no hidden, links stay inside
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.startswith(".") or not os.path.realpath(path).startswith(root + os.sep):
                continue
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    expected[os.path.relpath(path, root)] = f.read()
    default = datapipe.pack(root, str(tmp_path / "first-dot"))
    assert default.merged_samples > 0  # RelNotes/1.5.0.1.txt, 1.5.0.2.txt, ... share key RelNotes/1
    assert sum(default.dropped.values()) > 0 and "--keys file" in default.summary()
    r = datapipe.pack(root, str(tmp_path / "file"), keys="file")
    assert r.samples == len(expected) and r.merged_samples == 0
    got = {}
    for s in datapipe.open_dataset(str(tmp_path / "file")):
        (fld,) = [k for k in s if not k.startswith("__")]
        got[_unescape(s["__key__"])] = s[fld]
    assert got == expected
