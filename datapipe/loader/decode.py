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
from numpy.typing import NDArray

from ..errors import DatapipeError, DecodeError

__all__ = ["DEFAULT_DECODERS", "SampleDecoder", "make_decoder"]


def _text(b: bytes) -> str:
    return bytes(b).decode("utf-8")


def _int(b: bytes) -> int:
    return int(bytes(b).strip() or b"0")


def _npy(b: bytes) -> NDArray[Any]:
    out: NDArray[Any] = np.load(io.BytesIO(b), allow_pickle=False)
    return out


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
            item = self._apply(self.user, sample, sample, where, "decode")
        else:
            item = sample
            if self.table:
                self._by_extension(sample, where)
        return item if self.map_fn is None else self._apply(self.map_fn, item, sample, where, "map")

    @staticmethod
    def _apply(fn: Callable[[Any], Any], arg: Any, sample: dict[str, Any], where: str, what: str) -> Any:
        try:
            return fn(arg)
        except DatapipeError:
            raise  # already says what and where
        except Exception as e:  # a user function can raise anything
            raise DecodeError(f"{where} sample {sample.get('__key__')!r}: the {what}= function raised "
                              f"{type(e).__name__}: {e}") from e

    def _by_extension(self, sample: dict[str, Any], where: str) -> None:
        table = self.table
        if table is None:
            return
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
                raise DecodeError(
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
