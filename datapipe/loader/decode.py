"""Decoding a sample's fields by their extension, then an optional user map function.

``decode="auto"`` turns ``json`` into Python objects, ``txt``/``text`` into str, ``cls``/
``index``/``id`` into int, ``npy`` into a numpy array (never with pickle: a file that needs
it is an error), and leaves everything else as bytes. ``decode=None`` (or ``"raw"``) leaves
every field as bytes. A dict ``{ext: fn}`` adds or overrides decoders; a callable replaces
them and receives the whole sample.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import CorruptShardError

__all__ = ["DEFAULT_DECODERS", "SampleDecoder", "make_decoder", "split_plain_members"]


def _text(b: bytes) -> str:
    return bytes(b).decode("utf-8")


def _int(b: bytes) -> int:
    return int(bytes(b).strip() or b"0")


def _npy(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)


DEFAULT_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "json": json.loads,
    "txt": _text,
    "text": _text,
    "cls": _int,
    "cls2": _int,
    "index": _int,
    "id": _int,
    "npy": _npy,
}


class SampleDecoder:
    """``decoder(sample, where) -> item``: picklable, so it travels into spawned workers."""

    def __init__(self, table: Mapping[str, Callable[[bytes], Any]] | None,
                 user: Callable[[dict[str, Any]], Any] | None = None,
                 map_fn: Callable[[Any], Any] | None = None) -> None:
        self.table = dict(table) if table is not None else None
        self.user = user
        self.map_fn = map_fn
        #: returns samples unchanged: the reader may skip calling it
        self.is_identity = not self.table and user is None and map_fn is None

    def __call__(self, sample: dict[str, Any], where: str) -> Any:
        if self.user is not None:
            item = self.user(sample)
        else:
            item = sample
            if self.table:
                self._by_extension(sample, where)
        return item if self.map_fn is None else self.map_fn(item)

    def _by_extension(self, sample: dict[str, Any], where: str) -> None:
        table = self.table
        for field, value in sample.items():
            if field[:2] == "__":
                continue
            ext = field.rpartition(".")[2].lower()
            fn = table.get(ext)
            if fn is None:
                continue
            try:
                sample[field] = fn(value)
            except Exception as e:  # a decoder of user data can raise anything
                raise CorruptShardError(
                    f"{where} sample {sample.get('__key__')!r}: field {field!r} does not decode as "
                    f".{ext}: {type(e).__name__}: {e}"
                ) from e


def make_decoder(decode: Any = "auto", map_fn: Callable[[Any], Any] | None = None) -> SampleDecoder:
    """A picklable function ``(sample, where) -> item`` applying ``decode`` then ``map_fn``."""
    if map_fn is not None and not callable(map_fn):
        raise ValueError(f"map must be callable, got {map_fn!r}")
    if decode == "auto":
        return SampleDecoder(DEFAULT_DECODERS, None, map_fn)
    if decode is None or decode == "raw":
        return SampleDecoder(None, None, map_fn)
    if isinstance(decode, Mapping):
        return SampleDecoder({**DEFAULT_DECODERS, **{k.lower(): v for k, v in decode.items()}}, None, map_fn)
    if callable(decode):
        return SampleDecoder(None, decode, map_fn)
    raise ValueError(f"decode must be 'auto', 'raw', None, a dict of ext -> fn or a callable, got {decode!r}")


def split_plain_members(src: Any, pos: int = 0, n: int | None = None) -> dict[str, Any] | None:
    """``{"__key__": key, field: bytes}`` of the sample in ``src[pos:n]`` (``src``: bytes or
    an mmap, anything with ``find`` and slicing to bytes) if it is made only of plain ustar
    members without a name prefix (what the packer writes for names up to 100 bytes), else
    ``None``: the caller then hands the bytes to :func:`datapipe.format.decode_sample`.

    This fast path skips the tar header checksums: it is only used on bytes already
    verified against the index's xxh3 checksum of the sample or of the whole shard, which
    is a stronger check.
    Each field is copied once, straight from ``src``.
    """
    out: dict[str, Any] = {"__key__": None}  # first, as decode_sample orders it
    n = len(src) if n is None else n
    keydot = None
    find = src.find
    while pos + 512 <= n:
        if src[pos + 156] != 48 or src[pos + 345] != 0:
            return None  # PAX, GNU long names, prefixed names, non-files: the general path
        cut = find(b"\0", pos, pos + 100)
        if cut == pos:
            break  # end-of-archive block
        try:
            size = int(src[pos + 124 : pos + 135], 8)  # 11 octal digits, as the packer writes
            name = src[pos : cut if cut > 0 else pos + 100].decode("utf-8")
        except ValueError:
            return None
        if keydot is None:
            slash = name.rfind("/")
            dot = name.find(".", slash + 1)
            if dot <= slash + 1:
                return None
            keydot = name[: dot + 1]
            out["__key__"] = name[:dot]
        elif not name.startswith(keydot):
            return None  # another sample's member: let the general path name the problem
        field = name[len(keydot) :]
        if not field or "/" in field or field in out:
            return None
        pos += 512
        end = pos + size
        if end > n:
            return None
        out[field] = src[pos:end]
        pos = end + (-size % 512)
    return out if keydot is not None else None
