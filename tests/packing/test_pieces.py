"""A large shard written by several workers at once (``packing.pieces``), and the source
listed by several threads (``sources.list_in_pieces``): the same bytes, records and
listing as one process, every worker kept busy by a pack of few large shards, skipped
inputs, failures and kill -9 in the middle of a piece."""

import filecmp
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

import datapipe
from datapipe.errors import InvalidMemberNameError
from datapipe.format import ShardBuilder, members_tar_bytes
from datapipe.packing import FileSample, list_directory, plan_shards
from datapipe.packing.pieces import MIN_PIECE_COST, cut_pieces, tar_bytes
from datapipe.packing.sources import list_in_pieces
from tools.corpus import generate_corpus, read_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = "a-folder-name-that-is-long/" * 3  # member names past tar's 100 bytes: ustar prefix, PAX


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One default shard that is cut into pieces: 1,200 samples in 12 folders, some names long."""
    root = tmp_path_factory.mktemp("corpus")
    generate_corpus(str(root), 1200, seed=3, mean_bytes=2048, per_dir=100)
    for i in range(30):  # a long name with a '/' to split it at (ustar prefix) and one without (PAX)
        for name, data in ((f"{LONG}s{i:03d}.txt", b"p" * i), (f"{LONG}{'n' * 120}{i:03d}.txt", b"q" * (i + 1))):
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return str(root)


def _samples(url):
    return {s["__key__"]: s for s in datapipe.open_dataset(url)}


def _files(dest):
    return sorted(os.listdir(dest))


def _same_files(a, b):
    assert _files(a) == _files(b)
    assert [n for n in _files(a) if not filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)] == []


# --- the layout a piece is written at ---------------------------------------------------

_field = st.sampled_from(["jpg", "json", "cls", "seg.png", "tar.gz", "é"])
_key = st.builds(lambda folder, stem: folder + stem,
                 st.sampled_from(["", "d/", LONG, "x" * 99 + "/", "ü/" * 60]),
                 st.text("abcdefghij_-", min_size=1, max_size=130))


@given(key=_key, members=st.lists(st.tuples(_field, st.integers(0, 3000)), min_size=1, max_size=4,
                                  unique_by=lambda m: m[0]))
def test_members_tar_bytes_is_what_the_builder_writes(key, members):
    out = io.BytesIO()
    b = ShardBuilder(out, "x")
    fills = [(f, n, lambda view, n=n: len(view[:n])) for f, n in members]
    try:
        b.add_members(key, fills)
    except InvalidMemberNameError:
        return  # a name no tar can hold: refused by the listing before any layout
    b.flush()
    assert members_tar_bytes(key, members) == len(out.getvalue()) == b.stored_bytes


@given(sizes=st.lists(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=3), min_size=1, max_size=300),
       long_every=st.integers(1, 50), workers=st.integers(1, 16), shard_mb=st.integers(1, 64))
def test_pieces_tile_their_shard(sizes, long_every, workers, shard_mb):
    samples = []
    for i, files in enumerate(sizes):
        key = (LONG if i % long_every == 0 else "") + f"k{i:06d}"
        fs = [(f"f{j}", f"/src/{key}.f{j}", n) for j, n in enumerate(files)]
        samples.append(FileSample(key, fs, sum(512 + n + (-n % 512) for _, _, n in fs)))
    plan = plan_shards(samples, shard_mb << 20, 100_000)
    pieces = cut_pieces(plan, list(range(len(plan))), workers)
    if workers < 2:
        assert pieces == {}
    for i, ps in pieces.items():
        assert len(ps) >= 2
        assert [p.shard for p in ps] == [i] * len(ps)
        assert ps[0].start == 0 and ps[-1].stop == len(plan[i]) and ps[0].offset == 0
        for a, b in itertools.pairwise(ps):
            assert a.stop == b.start and a.end == b.offset and a.start < a.stop
        for p in ps:
            assert p.end - p.offset == sum(tar_bytes(s) for s in plan[i][p.start : p.stop])
    if sum(s.tar_bytes + 8192 * len(s.files) for s in samples) < 1.5 * MIN_PIECE_COST:
        assert pieces == {}  # no piece costs less than MIN_PIECE_COST


# --- a pack of one large shard ----------------------------------------------------------

# A pack that records which processes wrote shard bytes (each ShardBuilder: its pid and
# whether it wrote a piece) and which process and thread listed folders, in files under argv[3].
_TRACED = """
import json, os, sys, threading
import datapipe
from datapipe.format import shard
from datapipe.packing import packer, sources

trace = sys.argv[3]
real_init, real_list = shard.ShardBuilder.__init__, sources.list_directory
def init(self, *a, piece_at=None, **k):
    with open(os.path.join(trace, "writers"), "a") as f:
        f.write(json.dumps([os.getpid(), piece_at is not None]) + "\\n")
    real_init(self, *a, piece_at=piece_at, **k)
def listing(*a, within="", recursive=True, **k):
    if recursive:
        with open(os.path.join(trace, "listers"), "a") as f:
            f.write(json.dumps([os.getpid(), threading.get_ident()]) + "\\n")
    return real_list(*a, within=within, recursive=recursive, **k)
shard.ShardBuilder.__init__ = init
sources.list_directory = packer.list_directory = listing
r = datapipe.pack(sys.argv[1], sys.argv[2], workers=int(sys.argv[4]))
print(json.dumps([r.shards, r.samples, os.getpid(), r.workers, threading.get_ident()]))
"""


def test_one_large_shard_is_written_by_every_worker_with_the_bytes_of_one(corpus, tmp_path):
    one = str(tmp_path / "one")
    datapipe.pack(corpus, one, workers=1)
    trace = tmp_path / "trace"
    trace.mkdir()
    par = str(tmp_path / "par")
    p = subprocess.run([sys.executable, "-c", _TRACED, corpus, par, str(trace), "3"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    shards, samples, me, workers, main = json.loads(p.stdout)
    assert (shards, samples, workers) == (1, 1260, 3)
    writers = [json.loads(line) for line in (trace / "writers").read_text().splitlines()]
    assert all(piece for _, piece in writers) and len(writers) >= 3  # the one shard, in pieces for 3 workers
    assert me not in {pid for pid, _ in writers}
    listers = {tuple(json.loads(line)) for line in (trace / "listers").read_text().splitlines()}
    # the folders, listed in the pack's own process (here, or on its threads where the
    # listing waits on storage: test_a_packs_listing_is_the_serial_one_on_threads_or_here):
    # no listing is pickled from another process, which unpickled alone took a third of the
    # listing's CPU
    assert {pid for pid, _ in listers} == {me} and main
    _same_files(one, par)
    assert _samples(par) == read_corpus(corpus)
    assert datapipe.verify_dataset(par).ok


# A pack in which the file argv[3] grows after the listing (argv[4]: "skip" for --skip-errors).
_GROWS = """
import sys
import threading
import datapipe
from datapipe.packing import packer

real = packer.plan_shards
def plan(*a, **k):
    with open(sys.argv[3], "ab") as f:
        f.write(b"grown")
    return real(*a, **k)
packer.plan_shards = plan
try:
    r = datapipe.pack(sys.argv[1], sys.argv[2], workers=int(sys.argv[5]), skip_errors=sys.argv[4] == "skip")
    print("SKIPPED", r.skipped, r.samples)
except datapipe.errors.DatapipeError as e:
    print(type(e).__name__, e)
"""


def _grows(src, dest, victim, mode, workers):
    p = subprocess.run([sys.executable, "-c", _GROWS, src, dest, victim, mode, str(workers)], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_an_input_skipped_in_a_piece_rewrites_its_shard_whole(corpus, tmp_path):
    src = str(tmp_path / "src")
    subprocess.run(["cp", "-a", corpus, src], check=True)
    victim = os.path.join(src, "00005", "sample00000550.json")
    out = {}
    for workers in (1, 3):
        subprocess.run(["cp", "-a", corpus + "/00005/sample00000550.json", victim], check=True)  # as listed
        out[workers] = _grows(src, str(tmp_path / f"w{workers}"), victim, "skip", workers)
    assert out[1] == out[3]
    assert out[3].startswith("SKIPPED") and victim in out[3] and "grew" in out[3] and out[3].endswith(" 1259\n")
    _same_files(str(tmp_path / "w1"), str(tmp_path / "w3"))
    assert datapipe.verify_dataset(str(tmp_path / "w3")).ok
    assert "00005/sample00000550" not in _samples(str(tmp_path / "w3"))


def test_a_failed_piece_leaves_nothing_half_written(corpus, tmp_path):
    src = str(tmp_path / "src")
    subprocess.run(["cp", "-a", corpus, src], check=True)
    victim = os.path.join(src, "00009", "sample00000901.jpg")
    dest = tmp_path / "ds"
    out = _grows(src, str(dest), victim, "raise", 3)
    assert out.startswith("InputFileError") and f"cannot read {victim}: changed while packing" in out
    assert not [n for n in os.listdir(dest) if n.startswith(".tmp-") or n.endswith((".tar", ".json"))]
    subprocess.run(["cp", "-a", corpus + "/00009/sample00000901.jpg", victim], check=True)
    r = datapipe.pack(src, str(dest), workers=3)  # the rerun resumes the same plan
    assert r.samples == 1260 and datapipe.verify_dataset(str(dest)).ok


# A pack killed (SIGKILL) when its first piece is reported, its others in flight.
_KILLED_MID_PIECES = """
import os, signal, sys
import datapipe
from datapipe.packing import pieces

def add(self, k, result):
    os.kill(os.getpid(), signal.SIGKILL)
pieces.ShardAssembly.add = add
datapipe.pack(sys.argv[1], sys.argv[2], workers=3)
"""


def test_pack_killed_mid_pieces_is_resumed_and_its_file_removed(corpus, tmp_path):
    dest = tmp_path / "ds"
    p = subprocess.run([sys.executable, "-c", _KILLED_MID_PIECES, corpus, str(dest)], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    token = json.loads((dest / "_pack" / "writer.lock").read_bytes())["token"]
    assert sorted(os.listdir(dest)) == [f".tmp-{token}-shard-000000.tar", "_pack"]  # no shard, no manifest
    with pytest.raises(datapipe.errors.DatapipeError):
        datapipe.open_dataset(str(dest))
    r = datapipe.pack(corpus, str(dest), workers=3)
    assert r.samples == 1260
    assert sorted(os.listdir(dest)) == ["manifest.json", "samples.parquet", "shard-000000.tar", "shards.parquet"]
    assert _samples(str(dest)) == read_corpus(corpus)


# --- the listing in pieces --------------------------------------------------------------


def _tree(root):
    """Folders in folders, with what the key rule drops, skips and passes over at each level."""
    files = ["a.txt", "z/b.txt", "z/.hidden.txt", "z/noext", "z/y/c.txt", "z/y/x/d.txt", "z/y/x/w/e.txt",
             "m/f.txt", "m/.dot/g.txt", "m/n/h.txt", "m/n/bad..txt", "q/i.txt", "q/j.json", "q/j.txt"]
    for f in files:
        path = os.path.join(root, f)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(f.encode())
    os.mkfifo(os.path.join(root, "m", "n", "fifo.txt"))
    os.symlink(os.path.join(root, "z"), os.path.join(root, "m", "link"))
    os.symlink("/etc/hostname", os.path.join(root, "q", "out.txt"))


def _serial(root, **k):
    return lambda folders: (list_directory(root, **k, within=f, allow_empty=True) for f in folders)


@pytest.mark.parametrize("pieces", [1, 2, 3, 8, 100])
def test_listing_in_pieces_is_the_serial_listing(tmp_path, pieces):
    root = str(tmp_path)
    _tree(root)
    whole = list_directory(root, skip_errors=True)
    parts = list_in_pieces(root, True, pieces=pieces, list_folders=_serial(root, skip_errors=True))
    assert parts.samples == whole.samples
    assert (parts.dropped, parts.bad, parts.passed_over) == (whole.dropped, whole.bad, whole.passed_over)
    assert whole.bad and whole.dropped and whole.passed_over
    with pytest.raises(InvalidMemberNameError) as serial:
        list_directory(root)
    with pytest.raises(InvalidMemberNameError) as in_pieces:
        list_in_pieces(root, pieces=pieces, list_folders=_serial(root))
    assert str(in_pieces.value) == str(serial.value)


def test_first_error_of_a_listing_in_pieces_is_the_serial_one(tmp_path):
    root = str(tmp_path)
    for f in ("a/x.txt", "a/b/y.txt", "c/z.txt"):
        os.makedirs(os.path.dirname(os.path.join(root, f)), exist_ok=True)
        open(os.path.join(root, f), "wb").close()
    for bad in ("a/b/bad..txt", "c/bad..txt", "a/bad..txt"):  # errors in three folders, met in this order
        open(os.path.join(root, bad), "wb").close()
        with pytest.raises(InvalidMemberNameError) as serial:
            list_directory(root)
        for pieces in (1, 2, 4):
            with pytest.raises(InvalidMemberNameError) as in_pieces:
                list_in_pieces(root, pieces=pieces, list_folders=_serial(root))
            assert str(in_pieces.value) == str(serial.value)


def test_a_listing_in_pieces_of_nothing_is_the_serial_error(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "noext").write_bytes(b"")
    with pytest.raises(datapipe.errors.EmptyInputError) as serial:
        list_directory(str(tmp_path))
    with pytest.raises(datapipe.errors.EmptyInputError) as in_pieces:
        list_in_pieces(str(tmp_path), pieces=4, list_folders=_serial(str(tmp_path)))
    assert str(in_pieces.value) == str(serial.value)


def test_input_error_in_a_folder_listed_by_a_worker_is_named(tmp_path):
    src = tmp_path / "src"
    for i in range(8):
        (src / f"d{i}").mkdir(parents=True)
        (src / f"d{i}" / "k.txt").write_bytes(b"x")
    (src / "d3" / "bad..txt").write_bytes(b"x")
    with pytest.raises(InvalidMemberNameError, match=r"d3/bad\.\.txt"):
        datapipe.pack(str(src), str(tmp_path / "ds"), workers=3)


@pytest.mark.parametrize("waits", [False, True])
def test_a_packs_listing_is_the_serial_one_on_threads_or_here(tmp_path, monkeypatch, waits):
    """A pack lists its first folders here, and the rest on its threads only where those
    waited on their storage: either way the serial listing, and its first error."""
    from datapipe.packing import packer

    root = str(tmp_path)
    _tree(root)
    for i in range(12):  # folders enough for the listing to be cut into pieces
        os.makedirs(os.path.join(root, f"p{i:02d}", "deep"))
        for j in range(3):
            open(os.path.join(root, f"p{i:02d}", "deep", f"s{j}.txt"), "wb").close()
    seen = []
    listed_by = packer._list_folder

    def watched(args):
        seen.append(threading.current_thread().name)
        return listed_by(args)

    monkeypatch.setattr(packer, "_list_folder", watched)
    monkeypatch.setattr(packer, "_TELLS_WAITS_S", 1e-9)  # decide after the first folder
    monkeypatch.setattr(packer, "_listing_waits", lambda wall, cpu: waits)
    whole = list_directory(root, skip_errors=True)
    got = packer._list_source(root, 4, True, False, None, "first-dot")
    assert got.samples == whole.samples
    assert (got.dropped, got.bad, got.passed_over) == (whole.dropped, whole.bad, whole.passed_over)
    here = threading.current_thread().name
    assert len(seen) > 2 and seen[0] == here
    assert all((name != here) == waits for name in seen[1:])
    with pytest.raises(InvalidMemberNameError) as serial:
        list_directory(root)
    with pytest.raises(InvalidMemberNameError) as listed:
        packer._list_source(root, 4, False, False, None, "first-dot")
    assert str(listed.value) == str(serial.value)


def test_a_listing_waits_when_its_wall_time_is_more_than_twice_its_cpu():
    from datapipe.packing.packer import _listing_waits

    assert _listing_waits(0.3, 0.1) and not _listing_waits(0.15, 0.1) and not _listing_waits(0.05, 0.05)
