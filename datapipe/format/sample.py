"""One sample's bytes in a shard: its tar members, optionally one zstd frame.

``encode_sample`` turns ``{"__key__": key, field: value, ...}`` into the member bytes;
``decode_sample`` reads them back (from the range the index records) into a dict of bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import zstandard

from ..errors import CorruptShardError, FormatError, InvalidMemberNameError
from .tar import check_key, member_header, member_name, padding, split_member_name, walk_members

__all__ = ["COMPRESSIONS", "field_bytes", "encode_sample", "decode_sample", "decompress_frame"]

COMPRESSIONS = ("none", "zstd")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def field_bytes(key: str, field: str, value: Any) -> bytes | bytearray | memoryview:
    """Bytes stored for one field: bytes-likes as they are, str as UTF-8, numbers as text,
    dicts and lists as JSON."""
    if isinstance(value, (bytes, bytearray)):
        return value
    if isinstance(value, memoryview):
        return value.cast("B") if value.format != "B" else value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool) or value is None:
        return json.dumps(value).encode()
    if isinstance(value, (int, float)):
        return str(value).encode()
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as e:  # bytes or a datetime inside; a cycle
            raise InvalidMemberNameError(
                f"sample {key!r} field {field!r}: a {type(value).__name__} is stored as JSON, and this one "
                f"cannot be ({e}); store bytes as a field of their own, or encode them (e.g. base64 text)"
            ) from None
    raise InvalidMemberNameError(
        f"sample {key!r} field {field!r}: cannot store a {type(value).__name__}; "
        "pass bytes, str, a number, or a dict/list (stored as JSON)"
    )


def encode_sample(sample: Mapping[str, Any]) -> tuple[str, list[bytes | bytearray | memoryview]]:
    """``(key, parts)``: the tar members of one sample as a list of byte pieces (headers,
    data, padding) whose concatenation is the sample's stored bytes. Fields are written in
    sorted order so a shard's bytes depend only on its samples."""
    key = sample.get("__key__")
    if not isinstance(key, str):
        raise InvalidMemberNameError(f"a sample needs a str '__key__', got {key!r}")
    check_key(key)
    fields = sorted(k for k in sample if not k.startswith("__"))
    if not fields:
        raise FormatError(f"sample {key!r} has no field to store")
    parts: list[bytes | bytearray | memoryview] = []
    for field in fields:
        data = field_bytes(key, field, sample[field])
        name = member_name(key, field)
        if split_member_name(name) != (key, field):
            raise InvalidMemberNameError(f"member {name!r} would not cut back to key {key!r}")
        parts.append(member_header(name, len(data)))
        parts.append(data)
        pad = padding(len(data))
        if pad:
            parts.append(b"\0" * pad)
    return key, parts


def _frame_size(frame: memoryview, where: str) -> int:
    """Compressed size of the zstd frame at the start of ``frame``, walked block by block
    (python-zstandard's one-shot decompression ignores what follows the first frame)."""
    if bytes(frame[:4]) != _ZSTD_MAGIC:
        raise CorruptShardError(f"{where}: not a zstd frame (starts with {bytes(frame[:4])!r})")
    try:
        pos = zstandard.frame_header_size(frame)
        has_checksum = zstandard.get_frame_parameters(frame).has_checksum
    except zstandard.ZstdError as e:
        raise CorruptShardError(f"{where}: not a zstd frame: {e}") from None
    n = len(frame)
    while True:
        if pos + 3 > n:
            raise CorruptShardError(f"{where}: zstd frame is truncated")
        head = int.from_bytes(frame[pos : pos + 3], "little")
        kind, size = (head >> 1) & 3, head >> 3
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        if kind == 3:
            raise CorruptShardError(f"{where}: zstd frame holds a reserved block type")
        if head & 1:
            return pos + (4 if has_checksum else 0)


def decompress_frame(frame: bytes | memoryview, where: str, limit: int) -> bytes:
    """The one zstd frame that ``frame`` must be, decompressed to at most ``limit`` bytes
    (what the index records for its shard): a frame that claims more, holds more, or is
    followed by other bytes is a :class:`CorruptShardError`, with memory bounded by
    ``limit`` whatever the frame says."""
    mv = memoryview(frame).cast("B")
    size = _frame_size(mv, where)
    if size != len(mv):
        raise CorruptShardError(f"{where}: the byte range holds {len(mv)} bytes, its zstd frame {size}")
    try:
        claimed = zstandard.frame_content_size(mv)
    except zstandard.ZstdError as e:
        raise CorruptShardError(f"{where}: not a zstd frame: {e}") from None
    if claimed > limit:
        raise CorruptShardError(
            f"{where}: zstd frame claims {claimed} bytes, more than the {limit} its shard holds "
            "(a decompression bomb or a damaged frame)"
        )
    try:
        if claimed >= 0:  # a one-shot decode into exactly the claimed size cannot grow past it
            out = zstandard.ZstdDecompressor().decompress(mv)
        else:
            out = zstandard.ZstdDecompressor().decompress(mv, max_output_size=max(limit, 1))
    except zstandard.ZstdError as e:
        raise CorruptShardError(f"{where}: zstd frame does not decompress within {limit} bytes: {e}") from None
    except MemoryError:
        raise CorruptShardError(f"{where}: no memory to decompress the zstd frame ({claimed} bytes)") from None
    return out


def decode_sample(
    buf: bytes | memoryview, compression: str = "none", where: str = "sample", limit: int = 1 << 30
) -> dict[str, Any]:
    """The stored bytes of one sample (as the index's offset/length cut them) back to
    ``{"__key__": key, field: bytes, ...}``. ``limit``: the most bytes a zstd sample may
    decompress to (its shard's ``tar_bytes``, from the index)."""
    if compression == "zstd":
        buf = decompress_frame(buf, where, limit)
    elif compression != "none":
        raise FormatError(f"{where}: unknown compression {compression!r}")
    out: dict[str, Any] = {}
    key = None
    mv, end = memoryview(buf), 0
    for name, start, stop, at in walk_members(mv, where):
        data, end = mv[start:stop], stop + padding(stop)
        cut = split_member_name(name)
        if cut is None:
            raise CorruptShardError(f"{where}: member {name[:200]!r} at byte {at} has no key.field shape")
        k, field = cut
        if key is None:
            try:
                check_key(k)
            except InvalidMemberNameError as e:
                raise CorruptShardError(f"{where}: member at byte {at}: {e}") from None
            key = k
            out["__key__"] = k
        elif k != key:
            raise CorruptShardError(
                f"{where}: member {name[:200]!r} at byte {at} belongs to another sample than {key!r}")
        if field in out:
            raise CorruptShardError(f"{where}: sample {key!r} holds field {field!r} twice")
        out[field] = bytes(data)
    if key is None:
        raise CorruptShardError(f"{where}: no tar member in the sample's byte range")
    if end != len(mv):  # the members stopped at a zero block: the rest of the range is unread
        raise CorruptShardError(f"{where}: a zero block at byte {end} ends the sample's members early "
                                f"({len(mv) - end} bytes of its range unread)")
    return out
