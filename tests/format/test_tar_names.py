"""Member names as every tar reader sees them: old (V7) directories, NULs inside names, GNU
and pre-POSIX headers with bytes where ustar keeps a prefix, files named like directories,
and the check of random access that the member after a sample does not continue it,
through PAX paths, GNU long names and ustar prefixes (tars written here block by block,
by tarfile, and by datapipe.pack)."""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import datapipe
from datapipe.errors import CorruptShardError
from datapipe.format.tar import split_member_name, walk_members
from datapipe.loader import StreamingDataset


def _header(name: bytes, size: int, kind: bytes = b"0", magic: bytes = b"ustar\x0000",
            at: dict[int, bytes] | None = None) -> bytes:
    h = bytearray(512)
    h[0 : len(name)] = name
    h[100:108], h[108:116], h[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    h[124:136], h[136:148], h[148:156] = b"%011o\0" % size, b"00000000000\0", b" " * 8
    h[156:157], h[257:265] = kind, magic
    for off, val in (at or {}).items():
        h[off : off + len(val)] = val
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _member(name: bytes, data: bytes, **kw) -> bytes:
    return _header(name, len(data), **kw) + data + b"\0" * (-len(data) % 512)


def _pax(path: bytes) -> bytes:
    rec = b" path=" + path + b"\n"
    n = len(rec) + 2
    return _member(b"PaxHeader", b"%d" % n + rec, kind=b"x")


def _long(name: bytes) -> bytes:
    return _member(b"././@LongLink", name + b"\0", kind=b"L", magic=b"ustar  \0")


def _tar(*members: bytes) -> bytes:
    t = b"".join(members) + b"\0" * 1024
    return t + b"\0" * (-len(t) % 10240)


def _names(buf: bytes, directories: bool = True) -> list[str]:
    return [name for name, *_ in walk_members(buf, "t.tar", directories=directories)]


def test_an_old_style_directory_holding_data_is_refused():
    """No type and a name ending in "/" is a directory to tarfile (which then reads the
    bytes after the header as the next member: here a sample GNU tar and datapipe never
    see) and to GNU tar: with data, readers disagree, so the tar is refused."""
    hidden = _member(b"b.txt", b"HIDDEN")
    buf = _tar(_member(b"a.txt", b"visible"), _header(b"folder/", len(hidden), kind=b"\0") + hidden,
               _member(b"c.txt", b"third"))
    with tarfile.open(fileobj=io.BytesIO(buf)) as t:
        assert "b.txt" in t.getnames()  # what WebDataset's reader makes of it
    with pytest.raises(CorruptShardError, match="directory member at byte 1024 claims 1024 bytes"):
        _names(buf)
    # without data it is an ordinary directory: passed over by the indexer, refused in a shard
    empty = _tar(_member(b"a.txt", b"x"), _header(b"folder/", 0, kind=b"\0"), _member(b"c.txt", b"y"))
    assert _names(empty) == ["a.txt", "folder/", "c.txt"]
    with pytest.raises(CorruptShardError, match="regular files only"):
        _names(empty, directories=False)


@pytest.mark.parametrize("form", ["gnu long name", "pax path", "name field"])
def test_a_nul_inside_a_name_is_refused(form):
    """GNU tar cuts a name at its first NUL, tarfile keeps what follows in a PAX path: the
    field would be "txt" to one and "txt\\0junk" to the other."""
    if form == "gnu long name":
        buf = _tar(_long(b"a.txt\0junk"), _member(b"a.txt", b"hello"))
    elif form == "pax path":
        buf = _tar(_pax(b"a.txt\0junk"), _member(b"a.txt", b"hello"))
    else:  # a NUL in the 100-byte field ends the name there for everyone: nothing to refuse
        buf = _tar(_member(b"a.txt\0junk", b"hello"))
        assert _names(buf) == ["a.txt"]
        return
    with pytest.raises(CorruptShardError, match="holds a NUL byte"):
        _names(buf)


def test_a_gnu_header_with_bytes_where_ustar_keeps_a_prefix_is_refused():
    """The GNU format keeps access and change times at byte 345, where ustar keeps the name
    prefix: tarfile reads them as a prefix ("00000001234/a.txt"), GNU tar does not."""
    buf = _tar(_member(b"a.txt", b"hi", magic=b"ustar  \0", at={345: b"00000001234\0"}))
    with tarfile.open(fileobj=io.BytesIO(buf)) as t:
        assert t.getnames() == ["00000001234/a.txt"]
    with pytest.raises(CorruptShardError, match="GNU tar header at byte 0"):
        _names(buf)
    # the same times zeroed (what GNU tar writes by default) and a POSIX prefix both read
    assert _names(_tar(_member(b"a.txt", b"hi", magic=b"ustar  \0"))) == ["a.txt"]
    assert _names(_tar(_member(b"a.txt", b"hi", at={345: b"dir\0"}))) == ["dir/a.txt"]


def test_a_header_without_ustar_magic_but_bytes_where_the_prefix_lives_is_refused(tmp_path):
    """A pre-POSIX (V7) header has no magic; tarfile still joins bytes at 345 as a prefix
    ("dir/a.txt": WebDataset's key "dir/a"), GNU tar reads "a.txt"."""
    buf = _tar(_member(b"a.txt", b"hi", magic=b"\0" * 8, at={345: b"dir\0"}))
    with tarfile.open(fileobj=io.BytesIO(buf)) as t:
        assert t.getnames() == ["dir/a.txt"]
    with pytest.raises(CorruptShardError, match="tar header without ustar magic at byte 0 holds bytes where"):
        _names(buf)
    shard = tmp_path / "v7.tar"
    shard.write_bytes(buf)
    with pytest.raises(CorruptShardError, match="without ustar magic"):
        datapipe.index_shards([str(shard)], str(tmp_path / "ix"), workers=1, progress=False)
    # the same header without those bytes (what a V7 tar holds there) reads as every reader reads it
    assert _names(_tar(_member(b"a.txt", b"hi", magic=b"\0" * 8))) == ["a.txt"]


@pytest.mark.parametrize("form", ["pax path", "gnu long name", "name field"])
def test_a_file_named_like_a_directory_holding_data_is_refused(tmp_path, form):
    """A regular member (type "0") named "a.jpg/": GNU tar lists a directory holding 320
    bytes; tarfile reads a file (from a PAX path without the "/": WebDataset's field "jpg"
    of sample "a"); datapipe passed over it. Refused, as a directory holding data is."""
    named = {"pax path": lambda d: _pax(b"a.jpg/") + _member(b"x", d),
             "gnu long name": lambda d: _long(b"a.jpg/") + _member(b"x", d),
             "name field": lambda d: _member(b"a.jpg/", d)}[form]
    buf = _tar(_member(b"a.txt", b"caption"), named(b"z" * 320), _member(b"b.txt", b"bee"))
    with tarfile.open(fileobj=io.BytesIO(buf)) as t:
        member = t.getmembers()[1]
        assert member.isreg() and member.size == 320
        assert member.name == ("a.jpg" if form == "pax path" else "a.jpg/")
    at = 1024 if form == "name field" else 2048  # the member's own header, after its extended one
    with pytest.raises(CorruptShardError, match=f"at byte {at} is of a file's tar type b'0' but named like a dir"):
        _names(buf)
    shard = tmp_path / "shard.tar"
    shard.write_bytes(buf)
    with pytest.raises(CorruptShardError, match="named like a directory"):
        datapipe.index_shards([str(shard)], str(tmp_path / "ix"), workers=1, progress=False)
    empty = _tar(_member(b"a.txt", b"caption"), named(b""), _member(b"b.txt", b"bee"))
    if form == "pax path":  # tarfile still reads a file "a.jpg", of 0 bytes: WebDataset's empty field
        with tarfile.open(fileobj=io.BytesIO(empty)) as t:
            assert t.getmembers()[1].name == "a.jpg" and t.getmembers()[1].isreg()
        with pytest.raises(CorruptShardError, match="named like a directory"):
            _names(empty)
    else:  # empty, it is a directory to GNU tar and no sample to tarfile: passed over as one
        assert _names(empty) == ["a.txt", "a.jpg/", "b.txt"]
        with pytest.raises(CorruptShardError, match="regular files only"):
            _names(empty, directories=False)


@pytest.mark.parametrize("form", ["name field", "pax path", "gnu long name", "ustar prefix", "pax path with a slash"])
def test_random_access_sees_a_field_of_the_sample_after_its_range(tmp_path, form):
    """The index says sample "a" is "a.txt"; the member after it was changed in place (same
    size, outside every indexed sample) into "a.jpg", in each of the ways a tar can spell
    that name. Every tar reader now sees a second field of "a": ``ds[0]`` must not hand
    out "a" without it, whichever way the name is written."""
    prefix = b"dir/" if form == "ustar prefix" else b""

    def first(n: bytes) -> bytes:
        return _member(n, b"hello", at={345: b"dir\0"}) if prefix else _member(n, b"hello")

    gap = _member(b"README", b"z" * 1500)  # a member that names no sample (no extension)
    shard = tmp_path / "shard.tar"
    shard.write_bytes(_tar(first(b"a.txt"), gap, _member(b"b.txt", b"bee")))
    datapipe.index_shards([str(shard)], str(tmp_path / "ix"), workers=1, progress=False)
    field = {"name field": _member(b"a.jpg", b"z" * 475), "pax path": _pax(b"a.jpg") + _member(b"x", b"z" * 1),
             "gnu long name": _long(b"a.jpg") + _member(b"x", b"z" * 1),
             "ustar prefix": _member(b"a.jpg", b"z" * 475, at={345: b"dir\0"}),
             "pax path with a slash": _pax(b"a.jpg/") + _member(b"x", b"z" * 1)}[form]
    assert len(field) <= len(gap)
    with open(shard, "r+b") as f:
        f.seek(512 + 512)  # a.txt's header and one block of data, then the gap member
        f.write(field + _member(b"README", b"z" * (len(gap) - len(field) - 512)) if len(field) < len(gap) else field)
    with tarfile.open(shard) as t:
        assert (prefix + b"a.jpg").decode() in t.getnames()
    ds = datapipe.open_dataset(str(tmp_path / "ix"))
    with pytest.raises(CorruptShardError, match="named like a directory" if form.endswith("slash") else
                       "cuts the sample short"):
        ds[0]


def test_a_long_name_ending_like_the_key_is_another_sample(tmp_path):
    """Sample "a" followed by "<101 characters>/a": the second name needs the ustar
    prefix, and its name field alone reads "a.txt". Random access reads both (it read "a"
    as cut short before), from datapipe's own pack and from a tar indexed in place."""
    folder = "a" * 101
    src = tmp_path / "src"
    (src / folder).mkdir(parents=True)
    (src / "a.txt").write_text("top-level a")
    (src / folder / "a.txt").write_text("a in the long folder")
    datapipe.pack(str(src), str(tmp_path / "packed"), workers=1, progress=False)
    shard = tmp_path / "shard.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as t:
        for name in ("a.txt", f"{folder}/a.txt"):
            data = (src / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    datapipe.index_shards([str(shard)], str(tmp_path / "ix"), workers=1, progress=False)
    for url in (tmp_path / "packed", tmp_path / "ix"):
        ds = datapipe.open_dataset(str(url))
        got = {ds[i]["__key__"]: ds[i]["txt"] for i in range(len(ds))}
        assert got == {"a": b"top-level a", f"{folder}/a": b"a in the long folder"}
        assert ds.get("a")["txt"] == b"top-level a"
        assert sorted(s["__key__"] for s in StreamingDataset(str(url), shuffle=False)) == sorted(got)


_MEMBER = st.tuples(
    st.sampled_from([b"a.txt", b"a.jpg", b"b.txt", b"dir/c.txt", b"a.jpg/", b"dir/", b"x"]),  # the name
    st.sampled_from(["name field", "pax path", "gnu long name", "ustar prefix"]),  # how it is spelled
    st.sampled_from([b"0", b"\0", b"5"]),  # the type
    st.sampled_from([b"ustar\x0000", b"ustar  \0", b"\0" * 8]),  # the magic
    st.sampled_from([b"", b"data", b"z" * 600]),
)


def _spelled(name: bytes, form: str, kind: bytes, magic: bytes, data: bytes) -> bytes:
    if form == "pax path":
        return _pax(name) + _member(b"x", data, kind=kind, magic=magic)
    if form == "gnu long name":
        return _long(name) + _member(b"x", data, kind=kind, magic=magic)
    if form == "ustar prefix" and b"/" in name.rstrip(b"/"):
        folder, _, base = name.rstrip(b"/").rpartition(b"/")
        return _member(base + name[len(name.rstrip(b"/")):], data, kind=kind, magic=magic, at={345: folder + b"\0"})
    return _member(name, data, kind=kind, magic=magic)


@settings(max_examples=400)
@given(members=st.lists(_MEMBER, min_size=1, max_size=4))
def test_the_samples_datapipe_reads_are_those_tarfile_reads(members):
    """Whatever names, spellings, types and magics: either datapipe refuses the tar, or
    the fields it reads (regular members named key.field) are exactly those tarfile, and
    so WebDataset, reads, with the same bytes."""
    buf = _tar(*(_spelled(*m) for m in members))
    try:
        ours = [(name, bytes(buf[a:b])) for name, a, b, _ in walk_members(buf, "t.tar", directories=True)]
    except CorruptShardError:
        return
    with tarfile.open(fileobj=io.BytesIO(buf)) as t:
        theirs = [(m.name, t.extractfile(m).read()) for m in t.getmembers() if m.isreg()]
    assert [(n, d) for n, d in ours if split_member_name(n)] == [(n, d) for n, d in theirs if split_member_name(n)]
