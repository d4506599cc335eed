"""Checking public arguments: one function per kind of value, each returning the value as
its plain Python type or raising :class:`~datapipe.errors.OptionError` (or the subclass the
caller names with ``error=``) that names the argument, shows the value given and says what
is allowed.

    batch_size = check_int("batch_size", batch_size, min=1, max=MAX_COUNT)
    window = None if window is None else check_int("window", window, min=1, hint="or None for all shards")
    timeout = check_float("timeout_s", timeout, min=0, min_open=True)
    on_error = check_choice("on_error", on_error, ("raise", "skip"))

Nothing is coerced: a float is not an int (``window=1.9`` is refused, not cut to 1), a
bool is not a number (``True`` is an int to Python), a string is not a number, NaN and
infinities are not finite floats. Integer types of other libraries (numpy's) are taken as
the ints they are. A value is shown bounded (a long repr is cut, a huge int is shown by its
size), so a message never costs more than its text.

A leaf: imports only :mod:`datapipe.errors`, so every package may use it.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from .errors import OptionError

__all__ = ["MAX_COUNT", "show", "check_int", "check_float", "check_bool", "check_choice", "check_bytes",
           "check_callable", "check_path", "check_mapping"]

#: a bound for counts that size memory or threads (batch sizes, chunk sizes): larger values
#: are refused before anything is allocated for them
MAX_COUNT = 1 << 24

_T = TypeVar("_T")

_SHOW_CHARS = 80


def show(value: Any) -> str:
    """``repr(value)``, bounded: at most 80 characters; an int of more than 64 bits shown
    by its size (its repr alone can take seconds, and Python refuses past 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception as e:  # a user object whose __repr__ fails is still named
        text = f"<{type(value).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def _fail(error: type[OptionError], name: str, value: Any, allowed: str, hint: str) -> OptionError:
    return error(f"{name}={show(value)}: expected {allowed}{'; ' + hint if hint else ''}")


def _number(x: float) -> str:
    """``x`` as a reader takes it in: ``2**62`` and ``2**64 - 1`` rather than their digits."""
    if isinstance(x, int) and x >= 1 << 20:
        if x & (x - 1) == 0:
            return f"2**{x.bit_length() - 1}"
        if (x + 1) & x == 0:
            return f"2**{x.bit_length()} - 1"
    return str(x)


def _range_text(low: float | None, high: float | None, low_open: bool = False) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {_number(low)}")
    if high is not None:
        parts.append(f"<= {_number(high)}")
    return " " + " and ".join(parts) if parts else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) \
        and type(value).__name__ not in ("bool_", "bool")  # numpy's bool is no Integral today; stay sure


def check_int(name: str, value: Any, *, min: int | None = None, max: int | None = None, hint: str = "",
              error: type[OptionError] = OptionError) -> int:
    """``value`` as an int inside ``[min, max]``: an int (not a bool, not a float, not a
    str), else ``error``."""
    if not _is_int(value):
        raise _fail(error, name, value, f"an int{_range_text(min, max)}", hint)
    n = int(value)
    if (min is not None and n < min) or (max is not None and n > max):
        raise _fail(error, name, value, f"an int{_range_text(min, max)}", hint)
    return n


def check_bytes(name: str, value: Any, *, min: int = 0, max: int = 1 << 62, hint: str = "",
                error: type[OptionError] = OptionError) -> int:
    """A number of bytes: an int inside ``[min, max]`` (write ``512 << 20``, not ``5e8``)."""
    if not _is_int(value) or not min <= int(value) <= max:
        raise _fail(error, name, value, f"a number of bytes, an int{_range_text(min, max)} (e.g. 512 << 20)", hint)
    return int(value)


def check_float(name: str, value: Any, *, min: float | None = None, max: float | None = None,
                min_open: bool = False, hint: str = "", error: type[OptionError] = OptionError) -> float:
    """``value`` as a finite float inside the range (``min`` excluded with ``min_open``):
    an int or a float, not a bool, not NaN or an infinity."""
    allowed = f"a finite number{_range_text(min, max, min_open)}"
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or _is_numpy_bool(value):
        raise _fail(error, name, value, allowed, hint)
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        raise _fail(error, name, value, allowed, hint) from None
    if not math.isfinite(x) or (min is not None and (x <= min if min_open else x < min)) \
            or (max is not None and x > max):
        raise _fail(error, name, value, allowed, hint)
    return x


def _is_numpy_bool(value: Any) -> bool:
    return type(value).__name__ in ("bool_", "bool") and not isinstance(value, bool)


def check_bool(name: str, value: Any, *, hint: str = "", error: type[OptionError] = OptionError) -> bool:
    """``value`` as a bool: True or False only (``"no"`` is not False)."""
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise _fail(error, name, value, "True or False", hint)


def check_choice(name: str, value: Any, choices: Collection[_T], *, hint: str = "",
                 error: type[OptionError] = OptionError) -> _T:
    """``value`` if it is one of ``choices`` (compared by equality, of the same type)."""
    for c in choices:
        if type(value) is type(c) and value == c:
            return c
    raise _fail(error, name, value, "one of " + ", ".join(map(repr, choices)), hint)


def check_callable(name: str, value: Any, *, hint: str = "", error: type[OptionError] = OptionError
                   ) -> Callable[..., Any]:
    """``value`` if it is callable."""
    if not callable(value):
        raise _fail(error, name, value, "a function (a callable)", hint)
    return value  # type: ignore[no-any-return]  # callable() narrows to a Callable of unknown type


def check_path(name: str, value: Any, *, hint: str = "", error: type[OptionError] = OptionError) -> str:
    """A path or URL: a non-empty str or an ``os.PathLike``, as a str."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise _fail(error, name, value, "a path or URL (a non-empty str or os.PathLike, without NUL)", hint)
    return value


def check_mapping(name: str, value: Any, *, hint: str = "", error: type[OptionError] = OptionError
                  ) -> dict[str, Any]:
    """A dict with str keys (storage options, say), copied."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _fail(error, name, value, "a dict with str keys", hint)
    return dict(value)
