"""Hostile or odd source trees: FIFOs and devices, symbolic links out of the source, files
that change while packed, and a destination that runs out of space."""

import importlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.errors import InputFileError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _samples(url):
    return {s["__key__"]: {k: v for k, v in s.items() if k != "__key__"} for s in datapipe.open_dataset(url)}


def _cli(args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "datapipe.cli", *args], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


# --- item 6: FIFOs and other non-regular files --------------------------------------------


@pytest.mark.parametrize("skip_errors", [False, True])
def test_fifo_in_source_is_passed_over_not_opened(tmp_path, skip_errors):
    src = str(tmp_path / "src")
    _write(os.path.join(src, "a.txt"), b"a")
    _write(os.path.join(src, "sub", "b.txt"), b"b")
    os.mkfifo(os.path.join(src, "c.txt"))  # no writer: opening it to read blocks forever
    os.symlink(os.path.join(src, "c.txt"), os.path.join(src, "d.txt"))  # a link to it, inside
    try:
        p = _cli(["pack", src, str(tmp_path / "ds"), "-q"] + (["--skip-errors"] if skip_errors else []))
    except subprocess.TimeoutExpired:
        pytest.fail("pack hung on a FIFO in its source")
    assert p.returncode == 0, p.stderr
    assert _samples(str(tmp_path / "ds")) == {"a": {"txt": b"a"}, "sub/b": {"txt": b"b"}}
    for name in ("c.txt", "d.txt"):
        line = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith(os.path.join(src, name)))
        assert "a FIFO, not a regular file" in line


# A pack whose listed file is replaced by a FIFO after the listing, before it is read.
_SWAP_AFTER_LISTING = """
import os, sys
import importlib
import datapipe
packer = importlib.import_module("datapipe.packing.packer")

real = packer.list_directory
def listing(*a, **k):
    out = real(*a, **k)
    victim = os.path.join(sys.argv[1], "b.txt")
    os.unlink(victim)
    os.mkfifo(victim)
    return out
packer.list_directory = listing
try:
    r = datapipe.pack(sys.argv[1], sys.argv[2], workers=1, skip_errors=sys.argv[3] == "skip")
    print("SKIPPED", r.skipped)
except datapipe.errors.DatapipeError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_file_replaced_by_fifo_while_packing_is_not_opened(tmp_path, mode):
    src = str(tmp_path / "src")
    for k in "abc":
        _write(os.path.join(src, f"{k}.txt"), k.encode())
    try:
        p = subprocess.run([sys.executable, "-c", _SWAP_AFTER_LISTING, src, str(tmp_path / "ds"), mode],
                           env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("pack hung opening a FIFO")
    assert p.returncode == 0, p.stderr
    b = os.path.join(src, "b.txt")
    if mode == "raise":
        assert p.stdout.startswith("InputFileError") and f"cannot read {b}: no longer a regular file" in p.stdout
    else:
        assert p.stdout.strip() == f"SKIPPED {[(b, 'no longer a regular file')]}"
        assert _samples(str(tmp_path / "ds")) == {"a": {"txt": b"a"}, "c": {"txt": b"c"}}


# --- item 13: symbolic links ----------------------------------------------------------------


def _linked_tree(tmp_path):
    outside = tmp_path / "outside"
    _write(str(outside / "secret.txt"), b"secret")
    src = tmp_path / "src"
    _write(str(src / "a.txt"), b"a")
    os.symlink(str(outside / "secret.txt"), src / "b.txt")  # absolute, out
    os.symlink("../outside/secret.txt", src / "c.txt")  # relative, out
    os.symlink("a.txt", src / "d.txt")  # inside: followed
    os.symlink(str(outside / "secret.txt"), src / "hop")  # no field: not a sample itself ...
    os.symlink("hop", src / "e.txt")  # ... but a chain through it leads out
    return str(src)


def test_links_out_of_the_source_are_not_followed(tmp_path):
    src = _linked_tree(tmp_path)
    r = datapipe.pack(src, str(tmp_path / "ds"))
    assert _samples(str(tmp_path / "ds")) == {"a": {"txt": b"a"}, "d": {"txt": b"a"}}
    assert sorted(os.path.basename(p) for p, _ in r.skipped) == ["b.txt", "c.txt", "e.txt"]
    assert all("outside" in why and "--follow-links" in why for _, why in r.skipped)
    assert "SKIPPED 3" in r.summary() and "--follow-links" in r.summary()


def test_follow_links_packs_what_links_point_to(tmp_path):
    src = _linked_tree(tmp_path)
    p = _cli(["pack", src, str(tmp_path / "ds"), "-q", "--follow-links"])
    assert p.returncode == 0, p.stderr
    got = _samples(str(tmp_path / "ds"))
    assert got == {"a": {"txt": b"a"}, "b": {"txt": b"secret"}, "c": {"txt": b"secret"},
                   "d": {"txt": b"a"}, "e": {"txt": b"secret"}}


_KINDS = ["file", "link_in", "link_out", "link_rel_out", "dangling_in", "fifo", "link_fifo", "link_dir", "chain_out"]


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(_KINDS), min_size=1, max_size=8), follow=st.booleans())
def test_any_tree_of_links_and_special_files_packs_exactly_its_regular_files(kinds, follow):
    base = tempfile.mkdtemp(prefix="dp-tree-")
    try:
        src, out = os.path.join(base, "src"), os.path.join(base, "out")
        _write(os.path.join(out, "o.bin"), b"outside")
        os.makedirs(os.path.join(src, "dir"))
        os.mkfifo(os.path.join(out, "pipe"))
        expect, passed, bad = {}, set(), set()
        for i, kind in enumerate(kinds):
            name = os.path.join(src, f"k{i}.bin")
            own = f"data{i}".encode()
            if kind == "file":
                _write(name, own)
                expect[f"k{i}"] = own
            elif kind == "link_in":
                _write(os.path.join(src, "dir", f"t{i}.bin"), own)
                os.symlink(os.path.join("dir", f"t{i}.bin"), name)
                expect[f"k{i}"] = expect[f"dir/t{i}"] = own
            elif kind in ("link_out", "link_rel_out", "chain_out"):
                target = os.path.join(out, "o.bin") if kind == "link_out" else os.path.join("..", "out", "o.bin")
                if kind == "chain_out":
                    os.symlink(target, os.path.join(src, f"hop{i}"))
                    target = f"hop{i}"
                os.symlink(target, name)
                if follow:
                    expect[f"k{i}"] = b"outside"
                else:
                    passed.add(name)
            elif kind == "dangling_in":
                os.symlink(os.path.join(src, f"gone{i}"), name)
                bad.add(name)
            elif kind == "fifo":
                os.mkfifo(name)
                passed.add(name)
            elif kind == "link_fifo":
                os.symlink(os.path.join(out, "pipe"), name)
                passed.add(name)  # outside (not followed) or a FIFO (not opened): never read
            elif kind == "link_dir":
                os.symlink(os.path.join(src, "dir"), name)  # a link to a directory is not walked
        dest = os.path.join(base, f"ds-{uuid.uuid4().hex[:6]}")
        if not expect:
            with pytest.raises(datapipe.errors.PackError):
                datapipe.pack(src, dest, workers=1, skip_errors=True, follow_links=follow)
            return
        r = datapipe.pack(src, dest, workers=1, skip_errors=True, follow_links=follow)
        assert {k: v["bin"] for k, v in _samples(dest).items()} == expect
        assert {p for p, _ in r.skipped} == passed | bad
    finally:
        shutil.rmtree(base)


# --- unclear errors: the changed file of a sample, a full disk ------------------------------


@pytest.mark.parametrize("change", [b"grown!", b""])
def test_changed_input_names_the_file_that_changed(tmp_path, monkeypatch, change):
    packer = importlib.import_module("datapipe.packing.packer")
    src = str(tmp_path / "src")
    for field in ("cls", "jpg", "json"):
        _write(os.path.join(src, f"k.{field}"), b"0123456789")
    real = packer.list_directory

    def listing(*a, **k):  # the middle file of the sample changes after it was listed
        out = real(*a, **k)
        with open(os.path.join(src, "k.jpg"), "ab" if change else "wb") as f:
            f.write(change)
        return out

    monkeypatch.setattr(packer, "list_directory", listing)
    with pytest.raises(InputFileError) as e:
        datapipe.pack(src, str(tmp_path / "ds"), workers=1)
    msg = str(e.value)
    assert f"cannot read {os.path.join(src, 'k.jpg')}: changed while packing" in msg
    assert "k.cls" not in msg and "k.json" not in msg
    assert ("grew" if change else "shrank") in msg and "--skip-errors" in msg


@pytest.fixture
def small_disk(tmpfs):
    """A 1 MiB tmpfs (needs root); else None, and the caller limits file size instead."""
    disk = tmpfs("1m", optional=True)
    return None if disk is None else str(disk.path)


def _limit_file_size():  # the fallback: files over 512 KiB fail with EFBIG instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, 512 << 10))


def test_full_disk_names_the_path_and_the_fix(tmp_path, small_disk):
    src = str(tmp_path / "src")
    for i in range(40):
        _write(os.path.join(src, f"s{i:03d}.bin"), os.urandom(64 << 10))  # 2.5 MiB in all
    if small_disk is not None:
        dest, kw = os.path.join(small_disk, "ds"), {}
    elif hasattr(resource, "RLIMIT_FSIZE"):
        dest, kw = str(tmp_path / "ds"), {"preexec_fn": _limit_file_size}
    else:
        pytest.skip("no way to fill a disk here: cannot mount a tmpfs (not root) and no RLIMIT_FSIZE")
    p = _cli(["pack", src, dest, "-q", "--workers", "1"], **kw)
    assert p.returncode == 2, p.stderr
    err = p.stderr
    assert "Traceback" not in err and "error::" not in err
    assert f"cannot write {os.path.join(dest, 'shard-000000.tar')}" in err
    assert "free space there or choose another destination" in err and "run the same command again" in err
    assert not os.path.exists(os.path.join(dest, "manifest.json"))
    assert not [n for n in os.listdir(dest) if n.startswith(".tmp-")]  # nothing half-written left


@pytest.mark.parametrize("parts", [None, 2])
def test_destination_inside_the_source_is_not_packed(tmp_path, parts):
    """DEST inside SRC: the pack listed its own lock file (``_pack/writer.lock``, key
    ``out/_pack/writer``, field ``lock``) as a sample, and with ``--part`` a later part
    packed the shards, journal and lock of the earlier ones."""
    src = tmp_path / "src"
    for i in range(6):
        _write(os.path.join(src, f"k{i}.txt"), b"x" * (i + 1))
    dest = str(src / "out")
    if parts is None:
        datapipe.pack(str(src), dest, workers=1)
    else:
        for i in range(parts):
            datapipe.pack(str(src), dest, workers=1, part=(i, parts))
        datapipe.join_parts(dest)
    ds = datapipe.open_dataset(dest)
    assert sorted(ds.index.keys()) == [f"k{i}" for i in range(6)]
    assert ds.index.manifest["fields"] == ["txt"]
    assert datapipe.verify_dataset(dest).ok


def test_damaged_journal_is_a_named_error_or_repacked(tmp_path):
    """A damaged ``_pack/plan.json`` gave a raw JSONDecodeError / AttributeError; a damaged
    shard record a raw JSONDecodeError. The plan names itself and says what to do; a
    damaged record is a shard not yet done, packed again by the rerun."""
    from datapipe.errors import DestinationExistsError

    src = tmp_path / "src"
    for i in range(6):
        _write(os.path.join(src, f"k{i}.txt"), b"x" * (i + 1))
    dest = tmp_path / "ds"
    (dest / "_pack").mkdir(parents=True)
    for bad in (b'{"fingerp', b"[1]", b"\xff\xfe"):
        (dest / "_pack" / "plan.json").write_bytes(bad)
        with pytest.raises(DestinationExistsError, match=r"_pack/plan.json is damaged.*--overwrite"):
            datapipe.pack(str(src), str(dest), workers=1)
    datapipe.pack(str(src), str(dest), workers=1, overwrite=True)
    assert datapipe.verify_dataset(str(dest)).ok
    # a pack stopped after recording its shards, before its index; one record then damaged
    shutil.rmtree(dest)
    packer = importlib.import_module("datapipe.packing.packer")

    def killed(*a, **k):
        raise KeyboardInterrupt

    real_commit = packer.commit_shards
    packer.commit_shards = killed
    try:
        with pytest.raises(KeyboardInterrupt):
            datapipe.pack(str(src), str(dest), workers=1, shard_samples=2)
    finally:
        packer.commit_shards = real_commit
    assert sorted(os.listdir(dest / "_pack")) == ["plan.json", "shard-000000.tar.json", "shard-000001.tar.json",
                                                  "shard-000002.tar.json", "writer.lock"]
    (dest / "_pack" / "shard-000001.tar.json").write_bytes(b'{"record": ')
    r = datapipe.pack(str(src), str(dest), workers=1, shard_samples=2)
    assert r.resumed_shards == 2 and r.samples == 6
    assert datapipe.verify_dataset(str(dest)).ok
