"""datapipe.publish serves a writer of any file kind: here a writer of plain ``.bin`` part
files and a JSON index (as the token packer writes Megatron ``.bin``/``.idx`` parts) takes
the destination's one writer lock, journals its plan and finished parts, names its
temporaries by its token, and commits with its manifest last; a killed run is resumed,
and ``overwrite`` deletes only the names that kind of writer publishes."""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datapipe.checksum import checksum
from datapipe.errors import DestinationBusyError, DestinationExistsError
from datapipe.publish import (
    SHARD_FILES,
    WORK,
    DatasetFiles,
    Journal,
    WriterLock,
    check_destination,
    commit,
    fingerprint,
    journal_name,
    part_dir,
)
from datapipe.storage import LocalStore, MemoryStore, open_store, temporary_name

PART_FILES = DatasetFiles(parts=r"part-\d{5}\.bin", index=("parts.json",))
PARTS = {f"part-{i:05d}.bin": bytes([i]) * (1000 + i) for i in range(4)}


class Killed(Exception):
    pass


def write_parts(dest, parts, *, kill_at=None, overwrite=False, storage_options=None, store=None):
    """A writer of another kind of file, through the publish face only: each part a plain
    file written by hand under its temporary name and renamed into place (or uploaded
    where the store has no local path), recorded when done; the index and manifest last."""
    plan = sorted(parts)
    with WriterLock(store or open_store(dest, storage_options)) as lock:
        store = lock.store
        check_destination(store, overwrite, resumable=True, files=PART_FILES)
        work = Journal(store, fingerprint({n: checksum(parts[n]) for n in plan}), overwrite, files=PART_FILES)
        if not work.committed:
            done = work.done()
            for i, name in enumerate(plan):
                if name in done:
                    continue
                root = store.local_path("")
                if root is not None:
                    tmp = os.path.join(root, temporary_name(lock.token, name))
                    with open(tmp, "wb") as f:
                        f.write(parts[name][:500])
                        if i == kill_at:
                            raise Killed(name)  # a temporary half written, its token journaled
                        f.write(parts[name][500:])
                    os.replace(tmp, os.path.join(root, name))
                else:
                    with store.open_writer(name) as f:
                        f.write(parts[name])
                work.record(name, {"record": {"bytes": len(parts[name])}})

            def index(s):
                s.put("parts.json", json.dumps(plan).encode())
                return json.dumps({"parts": {n: len(parts[n]) for n in plan}}).encode()

            commit(lock, index, manifest=PART_FILES.manifest)
        work.remove()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_writer_of_other_files_publishes_through_the_face(tmp_path, request, where):
    if where == "s3":
        root, opts = request.getfixturevalue("s3")
        dest = root + "/ds"
    else:
        dest, opts = str(tmp_path / "ds"), None
    write_parts(dest, PARTS, storage_options=opts)
    store = open_store(dest, opts)
    assert sorted(store.list()) == sorted([*PARTS, "parts.json", "manifest.json"])  # no journal, no temporary
    assert all(store.get(n) == b for n, b in PARTS.items())
    assert json.loads(store.get("manifest.json")) == {"parts": {n: len(b) for n, b in PARTS.items()}}


class RecordingStore(MemoryStore):
    """A memory store that notes every key as it is published, in order (no local path:
    the writer uploads each part through ``open_writer``, which publishes by ``put``)."""

    def __init__(self, root):
        super().__init__(root)
        self.written = []

    def put(self, key, data):
        self.written.append(key)
        super().put(key, data)


def test_the_manifest_is_written_after_every_part_and_index_file():
    store = RecordingStore("memory://publish-order")
    write_parts(store.root, PARTS, store=store)
    data = [k for k in store.written if not k.startswith(WORK + "/")]
    assert data[-1] == "manifest.json" and sorted(data[:-1]) == sorted([*PARTS, "parts.json"])
    first_part = min(store.written.index(n) for n in PARTS)
    assert store.written.index(f"{WORK}/plan.json") < first_part  # the plan before the first byte
    assert all(store.written.index(f"{WORK}/{n}.json") > store.written.index(n) for n in PARTS)  # records after


def test_a_killed_writer_is_resumed_and_its_temporary_removed(tmp_path):
    dest = tmp_path / "ds"
    with pytest.raises(Killed):
        write_parts(str(dest), PARTS, kill_at=2)
    names = sorted(os.listdir(dest))
    assert "manifest.json" not in names  # nothing half-written is visible as a dataset
    assert [n for n in names if n.startswith(".tmp-")]  # the killed part's temporary
    before = {n: os.stat(dest / n).st_ino for n in sorted(PARTS)[:2]}
    write_parts(str(dest), PARTS)
    assert {n: os.stat(dest / n).st_ino for n in before} == before  # finished parts not written again
    assert sorted(os.listdir(dest)) == sorted([*PARTS, "parts.json", "manifest.json"])


def test_another_writer_is_refused_while_one_holds_the_destination(tmp_path):
    dest = str(tmp_path / "ds")
    with WriterLock(open_store(dest)):
        with pytest.raises(DestinationBusyError):
            write_parts(dest, PARTS)


def test_overwrite_deletes_only_the_names_this_kind_of_writer_publishes(tmp_path):
    dest = tmp_path / "ds"
    write_parts(str(dest), PARTS)
    (dest / "notes.txt").write_text("mine")
    (dest / "shard-000000.tar").write_bytes(b"a shard, not a part")
    with pytest.raises(DestinationExistsError, match=r"manifest\.json exists"):
        write_parts(str(dest), {"part-00009.bin": b"new"})
    write_parts(str(dest), {"part-00009.bin": b"new"}, overwrite=True)
    assert sorted(os.listdir(dest)) == ["manifest.json", "notes.txt", "part-00009.bin", "parts.json",
                                        "shard-000000.tar"]


def test_files_at_its_names_without_a_journal_are_refused(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    (dest / "part-00001.bin").write_bytes(b"someone's")
    with pytest.raises(DestinationExistsError, match=r"part-00001\.bin"):
        write_parts(str(dest), PARTS)
    assert (dest / "part-00001.bin").read_bytes() == b"someone's"


def test_names_journaled_before_their_first_byte_are_discarded_unless_kept(tmp_path):
    dest = tmp_path / "ds"
    with WriterLock(LocalStore(str(dest))) as lock:
        store = lock.store
        work = Journal(store, fingerprint("plan"), overwrite=False, files=PART_FILES)
        for name in ("part-00001.bin", "part-00002.bin", "manifest.json"):
            journal_name(store, name, lock.token, task=3)
            store.put(name, b"x")
        journal_name(store, "part-00003.bin", "someone0else", task=4)
        store.put("part-00003.bin", b"theirs")
        names = re.compile(r"part-\d{5}\.bin")
        assert sorted(work.journaled(lock.token, names)) == ["part-00001.bin", "part-00002.bin"]
        work.discard(lock.token, names, keep={"part-00001.bin"})
        assert sorted(k for k in store.list() if not k.startswith(WORK + "/")) == \
            ["manifest.json", "part-00001.bin", "part-00003.bin"]
        work.remove()


def test_the_next_holder_removes_a_killed_holders_temporaries_and_no_others(tmp_path):
    dest = tmp_path / "ds"
    first = WriterLock(LocalStore(str(dest))).__enter__()
    Journal(first.store, fingerprint("plan"), overwrite=False, files=PART_FILES)  # an unfinished write
    (dest / temporary_name(first.token, "part-00000.bin")).write_bytes(b"half")
    (dest / WORK / temporary_name(first.token, "part-00000.bin.json")).write_bytes(b"half")
    (dest / temporary_name("neverjournaled", "part-00001.bin")).write_bytes(b"another writer's")
    first.release()  # as a kill leaves it: the journal, the lock file and its tokens stay
    with WriterLock(LocalStore(str(dest))) as second:
        left = sorted(os.listdir(dest))
        assert left == sorted([WORK, temporary_name("neverjournaled", "part-00001.bin")])
        own = dest / temporary_name(second.token, "part-00002.bin")
        own.write_bytes(b"mine")
        second.remove_temporaries()
        assert not own.exists() and (dest / temporary_name("neverjournaled", "part-00001.bin")).exists()


# the names `--overwrite` of a sample dataset deleted before publish existed (pack.commit._OWN),
# as a whole key
_OLD_OWN = re.compile(r"(part-\d{5}-of-\d{5}/)?(shard-(\d{6,}-)?\d{6}\.tar(\.zst)?|manifest\.json|shards\.parquet"
                      r"|samples\.parquet|_pack/.*)")
_PIECES = st.sampled_from(["shard-", "000001", "-", "0000012", ".tar", ".zst", "manifest.json", "shards.parquet",
                           "samples.parquet", "_pack/", "x", ".json", "part-00000-of-00002/", "part-1-of-2/", "/",
                           "notes.txt", "\n", ".", "manifest", "json"])


@given(st.lists(_PIECES, max_size=6).map("".join) | st.text(max_size=30))
def test_a_sample_dataset_owns_exactly_the_names_it_did(key):
    assert SHARD_FILES.owns(key) == bool(_OLD_OWN.fullmatch(key))
    assert SHARD_FILES.owns(f"{part_dir(3, 8)}/{key}") == bool(_OLD_OWN.fullmatch(f"{part_dir(3, 8)}/{key}"))


@given(st.text(max_size=20))
def test_a_kind_of_writer_owns_its_parts_its_index_its_manifest_and_its_journal(name):
    assert PART_FILES.owns("part-00042.bin") and PART_FILES.owns("parts.json") and PART_FILES.owns("manifest.json")
    assert PART_FILES.owns(f"{WORK}/{name}") == ("\n" not in name)
    assert not PART_FILES.owns("shard-000000.tar") and not PART_FILES.owns("part-00042.bin.bak")
    assert PART_FILES.owns(name) == bool(re.fullmatch(r"part-\d{5}\.bin|parts\.json|manifest\.json|_pack/.*", name))
