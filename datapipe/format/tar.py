"""Tar members as WebDataset writes and reads them, without the `tarfile` module's overhead.

A sample is the run of consecutive members that share a key; the key and the field are cut
from a member name by WebDataset's rule (``webdataset.tariterators.base_plus_ext``):

    key   = the directory part + the basename up to its FIRST dot
    field = the rest of the basename after that dot

so ``a/b.c/img001.seg.png`` is key ``a/b.c/img001``, field ``seg.png``: dots in directory
names are fine, a dot in a basename ends the key. A basename that starts with a dot, or
has none, names no sample (WebDataset skips it; the packer refuses it).
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator
from zlib import adler32

from ..errors import CorruptShardError, InvalidMemberNameError

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "split_member_name",
    "member_name",
    "check_key",
    "member_header",
    "padding",
    "walk_members",
    "next_member_name",
]

BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
_ZERO_BLOCK = b"\0" * BLOCK
_MAX_SIZE = 8**11 - 1  # 11 octal digits in the ustar size field


def split_member_name(name: str) -> tuple[str, str] | None:
    r"""``'dir/x.y/img1.seg.png' -> ('dir/x.y/img1', 'seg.png')``: the key is the folders and
    the basename up to its first dot, the field the rest. ``None`` if the name has no
    key/field shape: no dot in the basename, a leading dot (a dot-file), nothing after the
    dot, or a newline in the folders (the rule as the expression
    ``^((?:.*/|)[^./][^./]*)\.([^/]*)$`` states it, whose ``.`` matches no newline; string
    operations here: a listing cuts every file's name, a tar scan every member's)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1 or "\n" in name[:slash]:
        return None
    return name[:dot], name[dot + 1 :]


def check_key(key: str) -> None:
    """Refuse keys that cannot be a safe, relative tar member name, or that would not cut
    back to themselves."""
    if not key:
        raise InvalidMemberNameError("empty sample key")
    if "\0" in key or "\\" in key:
        raise InvalidMemberNameError(f"sample key {key!r} contains NUL or a backslash")
    if key.startswith("/"):
        raise InvalidMemberNameError(f"sample key {key!r} is absolute; keys must be relative")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidMemberNameError(
            f"sample key {key!r} has an empty, '.' or '..' path component"
        )
    if "." in parts[-1]:
        raise InvalidMemberNameError(
            f"sample key {key!r} has a dot in its last component; WebDataset would cut the "
            "key at that dot (rename it, e.g. replace '.' with '_')"
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidMemberNameError(f"sample key {key!r} is not valid UTF-8: {e}") from None


def member_name(key: str, field: str) -> str:
    if not field or "/" in field or "\0" in field or field.startswith("."):
        raise InvalidMemberNameError(
            f"field {field!r} of sample {key!r}: a field must be non-empty, without '/' or NUL, "
            "and not start with a dot"
        )
    return f"{key}.{field}"


def padding(size: int) -> int:
    return -size % BLOCK


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


_MODE_IDS = _octal(0o644, 8) + _octal(0, 8) + _octal(0, 8)
_MTIME0 = _octal(0, 12)
_TAIL = b"0" + bytes(100) + b"ustar\x0000" + bytes(BLOCK - 265)
_CONST_SUM = sum(_MODE_IDS) + sum(_MTIME0) + 8 * 32 + sum(_TAIL)  # checksum field as spaces
_NUL100 = bytes(100)


def member_header(name: str, size: int, mtime: int = 0) -> bytes:
    """The header block(s) of one regular-file member: plain ustar when the name fits,
    else ustar with a split prefix, else a PAX header (as `tarfile` writes it)."""
    if size > _MAX_SIZE:
        raise InvalidMemberNameError(f"member {name!r} is larger than tar's 8 GiB ustar limit")
    raw = name.encode("utf-8")
    if len(raw) <= 100 and mtime == 0:  # the common case, from precomputed pieces
        size_field = b"%011o\0" % size
        chk = _CONST_SUM + sum(raw) + sum(size_field)
        return b"".join((raw, _NUL100[len(raw) :], _MODE_IDS, size_field, _MTIME0, b"%06o\0 " % chk, _TAIL))
    prefix = b""
    if len(raw) > 100:
        cut = raw.rfind(b"/", 0, 156)
        if 0 < cut and len(raw) - cut - 1 <= 100:
            prefix, raw = raw[:cut], raw[cut + 1 :]
        else:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = size, mtime, 0o644
            info.uname = info.gname = ""
            return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8")
    header = bytearray(BLOCK)
    header[0 : len(raw)] = raw
    header[100:108] = _octal(0o644, 8)
    header[108:116] = _octal(0, 8)
    header[116:124] = _octal(0, 8)
    header[124:136] = _octal(size, 12)
    header[136:148] = _octal(mtime, 12)
    header[148:156] = b"        "
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    header[345 : 345 + len(prefix)] = prefix
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


_OCTAL_DIGITS = frozenset(b"01234567")


def _parse_octal(field: bytes, where: str, at: int) -> int:
    """A non-negative number field of the header at byte ``at``: octal digits (padded with
    spaces, ended by NUL or space), or GNU base-256 (first byte 0x80, the rest of the field
    big-endian). A sign, a ``0o`` prefix, an underscore or a negative base-256 value (which
    ``int()`` would take, and which could make the parser go back or stand still) is an
    error."""
    if field[:1] == b"\x80":  # GNU base-256: every byte after the marker is the value
        return int.from_bytes(field[1:], "big")
    digits = field.rstrip(b"\0 ").lstrip(b" ")
    if not _OCTAL_DIGITS.issuperset(digits):
        raise CorruptShardError(f"{where} @{at}: bad number {field!r} in a tar header")
    return int(digits or b"0", 8)


def _byte_sum(block: bytes) -> int:
    """The sum of a 512-byte block's bytes (what a tar header checksum is), from the A half
    of Adler-32 over each 256-byte half: each half sums to at most 65,280, below Adler's
    modulus 65,521, so A - 1 is that sum exactly. Four times faster than ``sum()`` here, and
    the strict parser computes it for every header it reads."""
    return (adler32(block[:256]) & 0xFFFF) + (adler32(block[256:]) & 0xFFFF) - 2


def _parse_pax(data: bytes, where: str, at: int) -> dict[str, str]:
    """PAX records ``"<len> <key>=<value>\\n"``; any record that does not parse is an error
    (a length of 0 or less would never advance, a non-numeric one is not PAX)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:  # NUL padding after the last record
            break
        sp = data.find(b" ", pos, pos + 21)
        digits = data[pos:sp] if sp > pos else b""
        length = int(digits) if digits.isdigit() else -1
        if length <= sp - pos + 1 or pos + length > len(data) or data[pos + length - 1] != 0x0A:
            raise CorruptShardError(
                f"{where}: malformed PAX record at byte {at + pos} (length {digits[:20]!r})"
            )
        k, eq, v = data[sp + 1 : pos + length - 1].partition(b"=")
        try:
            key, value = k.decode("utf-8"), v.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptShardError(f"{where}: PAX record at byte {at + pos} is not valid UTF-8") from None
        if not eq or not key:
            raise CorruptShardError(f"{where}: malformed PAX record at byte {at + pos} (no key=value)")
        out[key] = value
        pos += length
    return out


def _decode_name(raw: bytes | str, where: str, at: int) -> str:
    """A member name as text. A NUL inside it is an error: tarfile keeps what follows it in
    a PAX path and GNU tar cuts the name there, so they would read different names."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptShardError(f"{where}: member name at byte {at} is not valid UTF-8: {raw[:120]!r}") from None
    if "\0" in raw:
        raise CorruptShardError(f"{where}: the name of the member at byte {at} holds a NUL byte ({raw[:120]!r}): "
                                "tar readers disagree on where such a name ends")
    return raw


def _header_sum(header: bytes) -> int:
    """The checksum a tar header should record: its bytes summed, the checksum field as spaces."""
    return _byte_sum(header) - sum(header[148:156]) + 8 * 32


def _header_ok(header: bytes) -> bool:
    """Whether a block is a tar header by its checksum."""
    try:
        stored = _parse_octal(header[148:156], "", 0)
    except CorruptShardError:
        return False
    return stored == _header_sum(header)


def _member_name(header: bytes, pax: dict[str, str], long_name: str | None, where: str, at: int) -> str:
    """The name of the member of ``header``: its PAX path, else its GNU long name, else the
    header's name field (after the ustar prefix when the header is POSIX ustar). tarfile
    joins a prefix whatever the magic, GNU tar only in a POSIX ustar header (a GNU header
    keeps times there), so any other header with bytes there is an error. A name ending in
    ``/`` on a member not typed a directory is one to GNU tar; tarfile reads a file (and
    drops that ``/`` from a PAX path): with data, or as a PAX path, it is an error, else
    (empty) the caller takes it for a directory."""
    kind = header[156:157]
    field = header[0:100].split(b"\0", 1)[0]
    if "path" in pax:
        name = _decode_name(pax["path"], where, at)
    elif long_name is not None:
        name = long_name
    else:
        magic = header[257:265]
        if magic[:6] != b"ustar\0" and header[345] != 0:
            form = "GNU tar header" if magic == b"ustar  \0" else "tar header without ustar magic"
            raise CorruptShardError(f"{where}: the {form} at byte {at} holds bytes where a ustar header keeps "
                                    "its name prefix: tarfile and GNU tar would read different names")
        prefix = header[345:500].split(b"\0", 1)[0] if magic[:6] == b"ustar\0" else b""
        name = _decode_name((prefix + b"/" + field) if prefix else field, where, at)
    directory = kind == b"5" or (kind == b"\0" and field.endswith(b"/"))  # the V7 form: see walk_members
    if name.endswith("/") and not directory and (
            "path" in pax or _parse_octal(header[124:136], where, at)):
        raise CorruptShardError(
            f"{where}: the member at byte {at} is of a file's tar type {kind!r} but named like a directory "
            f"({name[:200]!r}): GNU tar reads a directory there, tarfile a file"
            f"{' ' + repr(name.rstrip('/')[:200]) if 'path' in pax else ''}: readers disagree on it "
            "(re-create the tar)")
    return name


#: the most bytes :func:`next_member_name` reads of an extended header (PAX records, a GNU
#: long name) to find the name of the member after a sample
_MAX_EXTENDED = 1 << 20


def next_member_name(first: bytes, read: Callable[[int, int], bytes], pos: int, end: int,
                     where: str) -> str | None:
    """The whole name of the member whose header starts at byte ``pos`` of a shard of
    ``end`` bytes (``first``: the block there; ``read(a, b)``: bytes ``a..b`` of the shard,
    asked for only behind a PAX or GNU long-name header): through its extended header and
    ustar prefix, as :func:`walk_members` names it. None where no member header starts
    there (the end-of-archive blocks, bytes that fail the header checksum, an extended
    header larger than ``_MAX_EXTENDED`` or past the end)."""
    header = bytes(first)
    pax: dict[str, str] = {}
    long_name: str | None = None
    at = pos
    for _ in range(2):  # at most one extended header, then the member's own
        if len(header) < BLOCK or header == _ZERO_BLOCK or not _header_ok(header):
            return None
        kind = header[156:157]
        if kind not in (b"x", b"L"):
            return _member_name(header, pax, long_name, where, at)
        size = _parse_octal(header[124:136], where, pos)
        data_start = pos + BLOCK
        after = data_start + size + padding(size)
        if size > _MAX_EXTENDED or after + BLOCK > end:
            return None
        more = bytes(read(data_start, after + BLOCK))
        if len(more) != after + BLOCK - data_start:
            return None
        data, header = more[:size], more[after - data_start :]
        if kind == b"x":
            pax = _parse_pax(data, where, data_start)
        else:
            long_name = _decode_name(data.rstrip(b"\0"), where, pos)
        pos = after
    return None


def walk_members(buf: bytes | memoryview, where: str = "tar",
                 directories: bool = False) -> Iterator[tuple[str, int, int, int]]:
    """The strict tar parser, which every reader's slow path uses: yield ``(name,
    data_start, data_end, header_offset)`` of each regular-file member of a tar byte buffer,
    stopping at the end-of-archive blocks or the end of the buffer. ``where`` names the
    shard (and sample) in errors; offsets in them are of ``buf``. Header checksums are
    checked.

    Only what the packer writes is accepted: regular files, their PAX or GNU long-name
    headers. Links, directories, devices, and PAX records that would make another tar
    reader see other bytes (a ``size`` that differs from the header's, GNU sparse maps) are errors, so that
    no reader of the shard sees a sample this one does not.

    ``directories``: yield directory members too (their names ending in ``/``, so that no
    key can be cut from them), as ``tar -cf shard.tar folder/`` writes them; only the
    indexer of existing tars asks for them. A directory with data is an error either way
    (``tarfile`` reads no data after a directory header, GNU tar skips it: they disagree)."""
    mv = memoryview(buf)
    pos, n = 0, len(mv)
    pax: dict[str, str] = {}
    long_name: str | None = None
    member_start = 0
    while pos + BLOCK <= n:
        header = bytes(mv[pos : pos + BLOCK])
        if header == _ZERO_BLOCK:
            return
        if not pax and long_name is None:
            member_start = pos
        if _parse_octal(header[148:156], where, pos) != _header_sum(header):
            raise CorruptShardError(
                f"{where}: tar header checksum mismatch at byte {pos} (corrupt or not a tar)"
            )
        size = _parse_octal(header[124:136], where, pos)
        kind = header[156:157]
        data_start = pos + BLOCK
        data_end = data_start + size
        if data_end > n:
            raise CorruptShardError(
                f"{where}: member at byte {pos} needs {size} bytes, the shard ends at {n} "
                "(truncated)"
            )
        at, pos = pos, data_end + padding(size)
        if kind == b"x":
            if pax or long_name is not None:
                raise CorruptShardError(f"{where}: two extended headers in a row at byte {at}")
            pax = _parse_pax(bytes(mv[data_start:data_end]), where, data_start)
            continue
        if kind == b"L":
            if pax or long_name is not None:
                raise CorruptShardError(f"{where}: two extended headers in a row at byte {at}")
            long_name = _decode_name(bytes(mv[data_start:data_end]).rstrip(b"\0"), where, at)
            continue
        if kind == b"\0" and header[0:100].split(b"\0", 1)[0].endswith(b"/"):
            # an old (V7) directory: no type, a name ending in "/". tarfile reads no data
            # after it, whatever its size says, so it is one: refused, or passed over empty
            kind = b"5"
        is_dir = directories and kind == b"5"
        if is_dir and size:
            raise CorruptShardError(f"{where}: directory member at byte {at} claims {size} bytes of data")
        if kind not in (b"0", b"\0") and not is_dir:
            raise CorruptShardError(
                f"{where}: member at byte {at} is of tar type {kind!r} (a link, directory, device or "
                "global header): datapipe shards hold regular files only"
            )
        sparse = next((k for k in pax if k.startswith("GNU.sparse.")), None)
        if sparse is not None:
            raise CorruptShardError(
                f"{where}: the member at byte {at} is a GNU sparse file (PAX record {sparse[:40]!r}): "
                "its stored bytes are not the file's, and readers disagree on them; write the tar "
                "without --sparse"
            )
        if "size" in pax and pax["size"] != str(size):
            raise CorruptShardError(
                f"{where}: PAX size {pax['size'][:30]!r} of the member at byte {at} differs from its "
                f"header's {size}: other tar readers would see other bytes"
            )
        name = _member_name(header, pax, long_name, where, at)
        pax, long_name = {}, None
        if name.endswith("/") and not is_dir:  # empty (else refused above): a directory to every reader
            if not directories:
                raise CorruptShardError(f"{where}: member at byte {at} is a directory ({name[:200]!r}): datapipe "
                                        "shards hold regular files only")
            is_dir = True
        if is_dir and not name.endswith("/"):
            name += "/"
        yield name, data_start, data_end, member_start
    if pax or long_name is not None:
        raise CorruptShardError(f"{where}: an extended header at byte {member_start} has no member after it")
    if pos < n:
        raise CorruptShardError(f"{where}: {n - pos} stray bytes at byte {pos}, less than a tar block")
