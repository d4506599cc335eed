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

__all__ = ["DEFAULT_DECODERS", "make_decoder"]


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


Decoder = Callable[[dict[str, Any], str], dict[str, Any]]


def _by_extension(table: Mapping[str, Callable[[bytes], Any]]) -> Decoder:
    def decode(sample: dict[str, Any], where: str) -> dict[str, Any]:
        for field, value in sample.items():
            if field[:2] == "__":
                continue
            fn = table.get(field.rpartition(".")[2].lower())
            if fn is None:
                continue
            try:
                sample[field] = fn(value)
            except Exception as e:  # a decoder of user data can raise anything
                raise CorruptShardError(
                    f"{where}: field {field!r} does not decode as .{field.rpartition('.')[2]}: "
                    f"{type(e).__name__}: {e}"
                ) from e
        return sample

    return decode


def _identity(sample: dict[str, Any], where: str) -> dict[str, Any]:
    return sample


def make_decoder(decode: Any = "auto", map_fn: Callable[[dict[str, Any]], Any] | None = None) -> Callable[
        [dict[str, Any], str], Any]:
    """A function ``(sample, where) -> item`` applying ``decode`` then ``map_fn``."""
    if decode == "auto":
        base = _by_extension(DEFAULT_DECODERS)
    elif decode is None or decode == "raw":
        base = _identity
    elif isinstance(decode, Mapping):
        base = _by_extension({**DEFAULT_DECODERS, **{k.lower(): v for k, v in decode.items()}})
    elif callable(decode):
        user = decode

        def base(sample: dict[str, Any], where: str) -> Any:
            return user(sample)
    else:
        raise ValueError(f"decode must be 'auto', 'raw', None, a dict of ext -> fn or a callable, got {decode!r}")
    if map_fn is None:
        return base
    if not callable(map_fn):
        raise ValueError(f"map must be callable, got {map_fn!r}")

    def decode_and_map(sample: dict[str, Any], where: str) -> Any:
        return map_fn(base(sample, where))

    return decode_and_map
