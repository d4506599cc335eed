"""Decoding a sample's fields by their extension, then an optional user map function.

``decode=`` takes (the same for :class:`~datapipe.StreamingDataset` and
:func:`~datapipe.open_dataset`):

- ``None`` or ``"raw"`` (the default): every field stays bytes, as WebDataset's default.
- ``"auto"``: ``json`` -> Python objects, ``txt``/``text`` -> str (UTF-8), ``cls``/``cls2``/
  ``index``/``id`` -> int, ``npy`` -> a numpy array (never with pickle: a file that needs it
  is an error); everything else, images included, stays bytes.
- ``"json"``, ``"txt"``, ``"cls"``, ``"npy"``: only those fields, as ``"auto"`` decodes them.
- an image spec, for the fields :data:`IMAGE_EXTENSIONS` (``jpg``, ``jpeg``, ``png``,
  ``webp``, ``bmp``, ``gif``, ``tif``, ``tiff``, ``ppm``, ``pgm``, ``pbm``, ``pnm``); other
  fields stay bytes. The names are WebDataset's where it has one:

  - ``"pil"`` / ``"pilrgb"``: a ``PIL.Image.Image`` in mode RGB, fully loaded (so the
    sample's bytes can be released); ``"pilrgba"``: mode RGBA; ``"pill"``: mode L.
  - ``"rgb8"``: a numpy ``uint8`` array, HWC, RGB; ``"l8"``: HW, grey.
  - ``"torch"`` / ``"torchvision"`` / ``"torchrgb8"``: a ``torch.uint8`` tensor, CHW, RGB
    (what ``torchvision.io.decode_image(..., mode=RGB)`` returns). Decoded by torchvision
    where it imports (JPEG, PNG, WEBP), else through PIL and numpy: the two agree in
    shape and dtype, pixel values only up to the JPEG decoders' rounding. WebDataset's
    ``"torch"`` gives float32 in [0, 1]: divide by 255 for that.

  An image larger than ``PIL.Image.MAX_IMAGE_PIXELS`` (Pillow's decompression-bomb limit,
  about 89 megapixels by default; it is left as the process sets it) is a
  :class:`~datapipe.errors.DecodeError`, checked from the header before any pixel is
  decoded, for every image spec.
- a list of the names above: the union, e.g. ``["pil", "auto"]`` (what WebDataset's
  ``.decode("pil")`` does: images and the basic types) or ``["torch", "json", "cls"]``. At
  most one image spec.
- a dict ``{ext: fn}``: ``"auto"`` plus these decoders of one field's bytes (added or
  overriding); a dict may also be an element of a list.
- a callable: replaces all of the above and receives the whole sample (a dict of bytes).

The decoders of a field's extension read bytes: a value that is not bytes (a column of a
Parquet table read in place is an int, a str, ... already) is left as it is.

A decoder that raises gives a :class:`~datapipe.errors.DecodeError` naming the shard URL,
the sample key, the field and the decoder: the field's content does not decode, which is
not corruption (the bytes passed their checksums before they were decoded).

A package a chosen decoder needs (Pillow for every image spec, torch for the ``torch``
specs) is imported when the decoder is made, in :func:`make_decoder`: where it does not
import, that is a :class:`~datapipe.errors.MissingDependencyError` naming the package and
the extra that installs it (``pip install 'datapipe[images]'``), raised once, not a
``DecodeError`` per sample. A decoder or function that finds a module missing while it runs
(a worker process without the package; a ``decode=`` function importing one) raises the
same error, which ``on_error="skip"`` never skips: no sample could decode. A ``decode=``
or ``map=`` that is none of the above is an :class:`~datapipe.errors.OptionError` naming it.
"""

from __future__ import annotations

import importlib
import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .errors import DatapipeError, DecodeError, MissingDependencyError, OptionError
from .options import check_callable, show

__all__ = ["DEFAULT_DECODERS", "IMAGE_EXTENSIONS", "IMAGE_SPECS", "DECODER_NAMES", "SampleDecoder",
           "make_decoder", "require_module"]

#: module -> (the package that installs it, datapipe's extra that brings it)
OPTIONAL_PACKAGES = {"PIL": ("Pillow", "images"), "torch": ("torch", "torch")}


def require_module(module: str, needed_by: str) -> Any:
    """``module`` imported, or :class:`MissingDependencyError` naming its package and the
    extra that installs it (``needed_by`` says what needs it, e.g. ``decode='pil'``)."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # not installed (ImportError), or installed and broken (anything)
        raise _missing(module.partition(".")[0], needed_by, e) from e


def _missing(top: str, needed_by: str, e: BaseException) -> MissingDependencyError:
    package, extra = OPTIONAL_PACKAGES.get(top, (top, None))
    how = f"pip install 'datapipe[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
    return MissingDependencyError(
        f"{needed_by} needs {package}, which does not import here ({type(e).__name__}: {e}): {how} in "
        "this environment (and in the DataLoader workers' one)")


def _text(b: bytes) -> str:
    return bytes(b).decode("utf-8")


def _int(b: bytes) -> int:
    return int(bytes(b).strip() or b"0")


def _npy(b: bytes) -> NDArray[Any]:
    out: NDArray[Any] = np.load(io.BytesIO(b), allow_pickle=False)
    return out


def _json(b: bytes) -> Any:
    return json.loads(b)


#: the basic types, by name: what "auto" decodes, and what each name alone decodes
BASIC_DECODERS: dict[str, dict[str, Callable[[bytes], Any]]] = {
    "json": {"json": _json},
    "txt": {"txt": _text, "text": _text},
    "cls": {"cls": _int, "cls2": _int, "index": _int, "id": _int},
    "npy": {"npy": _npy},
}

#: ``decode="auto"``: every basic type
DEFAULT_DECODERS: dict[str, Callable[[bytes], Any]] = {
    ext: fn for table in BASIC_DECODERS.values() for ext, fn in table.items()
}

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm")

#: image spec -> (what it returns: "pil", "numpy" or "torch", PIL mode)
IMAGE_SPECS: dict[str, tuple[str, str]] = {
    "pil": ("pil", "RGB"),
    "pilrgb": ("pil", "RGB"),
    "pilrgba": ("pil", "RGBA"),
    "pill": ("pil", "L"),
    "rgb8": ("numpy", "RGB"),
    "l8": ("numpy", "L"),
    "torch": ("torch", "RGB"),
    "torchvision": ("torch", "RGB"),
    "torchrgb8": ("torch", "RGB"),
}

DECODER_NAMES = ("raw", "auto", *BASIC_DECODERS, *IMAGE_SPECS)

# torchvision.io decodes these from a uint8 tensor (decode_image); others go through PIL (a
# GIF there would give every frame, PIL the first)
_TORCHVISION_FORMATS = frozenset({"JPEG", "PNG", "WEBP"})
_torchvision_io: Any = None  # the module once imported; False where it does not import


def _torchvision() -> Any:
    """``torchvision.io``, or None where torchvision is missing or does not load beside this
    torch (it raises RuntimeError, not ImportError, when its compiled operators do not match)."""
    global _torchvision_io
    if _torchvision_io is None:
        try:
            import torchvision.io as tvio
        except Exception:
            tvio = False
        _torchvision_io = tvio
    return _torchvision_io or None


class ImageDecoder:
    """One field's bytes -> an image as ``spec`` says (see the module docstring). Picklable:
    it holds only the spec; PIL (and torch) are imported when it is made, to fail there, and again
    where used (in each worker process)."""

    def __init__(self, spec: str) -> None:
        if spec not in IMAGE_SPECS:
            raise OptionError(f"decode={show(spec)}: unknown image spec; one of {', '.join(IMAGE_SPECS)}")
        self.spec = spec
        self.kind, self.mode = IMAGE_SPECS[spec]
        self.__name__ = spec  # named in DecodeError messages
        self._option = f"decode={spec!r}"
        # what the spec needs is imported now: the process that makes the decoder finds out
        # at once, not at the first sample
        require_module("PIL.Image", self._option)
        if self.kind == "torch":
            require_module("torch", self._option)

    def __call__(self, data: bytes) -> Any:
        # imported again here: a worker process may lack what the main process has
        Image = require_module("PIL.Image", self._option)
        img = Image.open(io.BytesIO(data))  # reads the header only
        limit = Image.MAX_IMAGE_PIXELS
        w, h = img.size
        if limit is not None and w * h > limit:
            raise ValueError(f"{w}x{h} = {w * h} pixels is more than PIL.Image.MAX_IMAGE_PIXELS = {limit} "
                             "(Pillow's decompression-bomb limit; raise it only for inputs you trust)")
        if self.kind == "torch":
            tvio = _torchvision() if img.format in _TORCHVISION_FORMATS else None
            if tvio is not None:
                torch = require_module("torch", self._option)
                raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                out = tvio.decode_image(raw, mode=tvio.ImageReadMode.RGB)
                if out.dtype == torch.uint8 and out.ndim == 3:
                    return out
                # else (a 16-bit PNG decodes to uint16): PIL below gives the uint8 RGB promised
        img.load()
        out = img if img.mode == self.mode else img.convert(self.mode)
        if self.kind == "pil":
            return out
        arr = np.asarray(out)
        if self.kind == "numpy":
            return arr
        torch = require_module("torch", self._option)
        return torch.from_numpy(arr.transpose(2, 0, 1).copy())  # a writable copy, CHW-contiguous


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
        except ModuleNotFoundError as e:  # the environment's fault, the same for every sample
            raise _missing(e.name or "?", f"the {what}= function (at {where} sample {sample.get('__key__')!r})",
                           e) from e
        except Exception as e:  # a user function can raise anything
            why = "; the sample does not decode (its bytes passed their checks)" if what == "decode" else ""
            raise DecodeError(f"{where} sample {sample.get('__key__')!r}: the {what}= function raised "
                              f"{type(e).__name__}: {e}{why}") from e

    def _by_extension(self, sample: dict[str, Any], where: str) -> None:
        table = self.table
        if table is None:
            return
        for field, value in sample.items():
            if field[:2] == "__":
                continue
            ext = field.rpartition(".")[2].lower()
            fn = table.get(ext)
            if fn is None or not _is_bytes(value):
                continue  # a value a table already typed (an int, a str) is no encoding to decode
            try:
                sample[field] = fn(value)
            except MissingDependencyError:
                raise  # no sample can decode: never one sample's fault
            except ModuleNotFoundError as e:
                raise _missing(e.name or "?", f"the decoder for .{ext}", e) from e
            except Exception as e:  # a decoder of user data can raise anything
                name = getattr(fn, "__name__", type(fn).__name__).lstrip("_")
                raise DecodeError(
                    f"{where} sample {sample.get('__key__')!r}: field {field!r} does not decode with the "
                    f"{name!r} decoder for .{ext} ({type(e).__name__}: {e}); the bytes are as stored, "
                    "not damaged: decode=None reads them raw"
                ) from e


def _is_bytes(value: Any) -> bool:
    """Whether a field holds bytes (a shard's, a table's binary column), not a typed value."""
    return isinstance(value, (bytes, bytearray, memoryview))


def _table(decode: Any) -> dict[str, Callable[[bytes], Any]]:
    """The extension table of one element of ``decode=`` (a name or a dict)."""
    if isinstance(decode, Mapping):
        return {**DEFAULT_DECODERS, **{str(k).lower(): v for k, v in decode.items()}}
    if isinstance(decode, str) and decode == "auto":
        return dict(DEFAULT_DECODERS)
    if isinstance(decode, str) and decode == "raw":
        return {}
    if isinstance(decode, str) and decode in BASIC_DECODERS:
        return dict(BASIC_DECODERS[decode])
    if isinstance(decode, str) and decode in IMAGE_SPECS:
        image = ImageDecoder(decode)
        return {ext: image for ext in IMAGE_EXTENSIONS}
    raise OptionError(f"decode={show(decode)}: expected None, one of {', '.join(map(repr, DECODER_NAMES))}, a "
                      "list of those, a dict of ext -> fn or a callable")


def _check_table(decode: Mapping[Any, Any]) -> None:
    """A dict ``{ext: fn}``: str extensions, callable decoders."""
    for k, fn in decode.items():
        if not isinstance(k, str) or not k:
            raise OptionError(f"decode={show(decode)}: the key {show(k)} is not an extension (a non-empty str "
                              "such as 'jpg')")
        check_callable(f"decode[{k!r}]", fn, hint="the decoder of one field's bytes")


def make_decoder(decode: Any = None, map_fn: Callable[[Any], Any] | None = None) -> SampleDecoder:
    """A picklable function ``(sample, where) -> item`` applying ``decode`` (see the module
    docstring) then ``map_fn``: :class:`OptionError` for a ``decode`` or ``map`` it does
    not know, :class:`MissingDependencyError` where a package the decoders need does not
    import. A :class:`SampleDecoder` (made already) is taken as it is when no ``map_fn`` is
    given."""
    if map_fn is not None:
        check_callable("map", map_fn, hint="a function applied to each decoded sample, or None")
    if isinstance(decode, SampleDecoder) and map_fn is None:
        return decode
    if decode is None:
        return SampleDecoder(None, None, map_fn)
    if isinstance(decode, (list, tuple)):
        if len(decode) > len(DECODER_NAMES) + 16:
            raise OptionError(f"decode= is a list of {len(decode)} elements; it combines at most one of each "
                              "decoder name (and a few dicts)")
        images = [d for d in decode if isinstance(d, str) and d in IMAGE_SPECS]
        if len(images) > 1:
            raise OptionError(f"decode={show(list(decode))} names {len(images)} image specs "
                              f"({', '.join(images)}); give one")
        table: dict[str, Callable[[bytes], Any]] = {}
        for d in decode:
            if callable(d) and not isinstance(d, Mapping):
                raise OptionError(f"decode={show(list(decode))}: a callable replaces every decoder; pass it alone")
            if isinstance(d, Mapping):
                _check_table(d)
            table.update(_table(d))
        return SampleDecoder(table, None, map_fn)
    if callable(decode) and not isinstance(decode, Mapping):
        return SampleDecoder(None, decode, map_fn)
    if isinstance(decode, Mapping):
        _check_table(decode)
    return SampleDecoder(_table(decode), None, map_fn)
