"""The checks of a writer's arguments: ``pack()``, ``ShardWriter``, the Ray sink,
``index_shards`` and the ``datapipe pack``/``datapipe index`` commands. Each names the
argument (and its command-line flag), the value and what is allowed, as a
:class:`~datapipe.errors.PackOptionError`; none coerces (``workers=1.9`` is refused, not
read as 1)."""

from __future__ import annotations

import numbers
import os
import re
import reprlib
from collections.abc import Mapping
from typing import Any

from ..errors import PackOptionError
from ..format import COMPRESSIONS

__all__ = ["shown", "bad_option", "option_int", "option_flag", "option_path", "checked_compression", "checked_level",
           "checked_workers", "checked_storage_options", "parse_part", "ZSTD_LEVELS", "MAX_INT"]

#: the compression levels zstd takes (negative: its fast modes; 0: its default, 3)
ZSTD_LEVELS = (-(1 << 17), 22)
MAX_INT = 2**63 - 1  # offsets, sizes and counts are int64 in the index

_FLAGS = {"shard_bytes": "--shard-bytes", "shard_samples": "--shard-samples", "compression": "--compression",
          "level": "--level", "workers": "--workers", "part": "--part", "overwrite": "--overwrite",
          "skip_errors": "--skip-errors", "follow_links": "--follow-links", "keys": "--keys",
          "tars_as_files": "--tars-as-files", "storage_options": "--storage-options"}
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 60


def shown(value: object) -> str:
    """``repr(value)``, cut to a length a message can hold."""
    return _shown.repr(value)


def bad_option(name: str, value: object, allowed: str) -> PackOptionError:
    """The error for argument ``name`` given ``value``: ``allowed`` says what it may be."""
    flag = _FLAGS.get(name)
    named = f"{name} ({flag})" if flag else name
    return PackOptionError(f"{named}={shown(value)}: {allowed}")


def option_int(value: object, name: str, low: int, high: int = MAX_INT) -> int:
    """``value`` as an int in [low, high]: an integer (not a bool, not a float, not a
    numeric string), else :class:`PackOptionError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
        raise bad_option(name, value, f"must be an integer from {low:,} to {high:,}")
    return int(value)


def option_flag(value: object, name: str) -> bool:
    """``value`` if it is True or False (a string such as "no" would read as true)."""
    if not isinstance(value, bool):
        raise bad_option(name, value, "must be True or False")
    return value


def option_path(value: object, name: str) -> str:
    """A local path or URL: a non-empty str (or ``os.PathLike`` of str)."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path or "\0" in path:
        raise bad_option(name, value, "must be a non-empty path or URL (a str or os.PathLike)")
    return path


def checked_compression(compression: object) -> str:
    """``compression`` as a name in :data:`COMPRESSIONS` (None: ``"none"``), else
    :class:`PackOptionError`."""
    if compression is None:
        return "none"
    if not isinstance(compression, str) or compression not in COMPRESSIONS:
        raise bad_option("compression", compression, f"must be one of {', '.join(COMPRESSIONS)} (or None)")
    return compression


def checked_level(level: object) -> int:
    """A zstd compression level (checked whatever the compression: a typo stays visible)."""
    return option_int(level, "level", *ZSTD_LEVELS)


def checked_workers(workers: object) -> int | None:
    """None (the default count) or a number of worker processes >= 1."""
    return None if workers is None else option_int(workers, "workers", 1)


def checked_storage_options(options: object) -> dict[str, Any] | None:
    """None or a mapping of option names (str) to values, as a new dict."""
    if options is None:
        return None
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise bad_option("storage_options", options, "must be None or a dict of fsspec options by name (str)")
    return dict(options)


_PART = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*")


def parse_part(part: object) -> tuple[int, int] | None:
    """``"2/8" -> (2, 8)``: part 2 (0-based) of 8; a tuple ``(2, 8)`` is checked the same."""
    if part is None:
        return None
    if isinstance(part, str):
        m = _PART.fullmatch(part)
        if m is None:
            raise bad_option("part", part, "must look like I/N (e.g. 0/4): part I (from 0) of N")
        i, n = int(m.group(1)), int(m.group(2))
    elif (isinstance(part, tuple) and len(part) == 2
          and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in part)):
        i, n = int(part[0]), int(part[1])
    else:
        raise bad_option("part", part, "must be None, 'I/N' (e.g. '0/4') or a tuple (I, N) of integers")
    if not 0 <= i < n <= MAX_INT:
        raise bad_option("part", part, "needs 0 <= I < N: part I (from 0) of N")
    return i, n
