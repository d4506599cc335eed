"""One sample's bytes in a shard: its tar members, optionally one zstd frame.

``encode_sample`` turns ``{"__key__": key, field: value, ...}`` into the member bytes;
``decode_sample`` reads them back (from the range the index records) into a dict of bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import zstandard

from ..errors import CorruptShardError, DuplicateKeyError, FormatError, InvalidMemberNameError
from .tar import check_key, iter_members, member_header, member_name, padding, split_member_name

__all__ = ["COMPRESSIONS", "field_bytes", "encode_sample", "decode_sample", "decompress_frame"]

COMPRESSIONS = ("none", "zstd")


def field_bytes(key: str, field: str, value: Any) -> bytes | memoryview:
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
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    raise InvalidMemberNameError(
        f"sample {key!r} field {field!r}: cannot store a {type(value).__name__}; "
        "pass bytes, str, a number, or a dict/list (stored as JSON)"
    )


def encode_sample(sample: Mapping[str, Any]) -> tuple[str, list[bytes | memoryview]]:
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
    parts: list[bytes | memoryview] = []
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


def decompress_frame(frame: bytes | memoryview, where: str) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as e:
        raise CorruptShardError(f"{where}: zstd frame does not decompress: {e}") from None


def decode_sample(
    buf: bytes | memoryview, compression: str = "none", where: str = "sample"
) -> dict[str, Any]:
    """The stored bytes of one sample (as the index's offset/length cut them) back to
    ``{"__key__": key, field: bytes, ...}``. Field values are zero-copy memoryview slices
    for uncompressed shards converted to bytes."""
    if compression == "zstd":
        buf = decompress_frame(buf, where)
    elif compression != "none":
        raise FormatError(f"{where}: unknown compression {compression!r}")
    out: dict[str, Any] = {}
    key = None
    for name, data, _ in iter_members(buf, where):
        cut = split_member_name(name)
        if cut is None:
            raise CorruptShardError(f"{where}: member {name!r} has no key.field shape")
        k, field = cut
        if key is None:
            key = k
            out["__key__"] = k
        elif k != key:
            raise CorruptShardError(f"{where}: member {name!r} belongs to another sample than {key!r}")
        if field in out:
            raise DuplicateKeyError(f"{where}: sample {key!r} holds field {field!r} twice")
        out[field] = bytes(data)
    if key is None:
        raise CorruptShardError(f"{where}: no tar member in the sample's byte range")
    return out
