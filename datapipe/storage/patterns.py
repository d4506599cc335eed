"""Patterns in URLs: brace patterns (``shard-{000000..000999}.tar``), expanded as webdataset's
braceexpand reads them: ``{a,b}`` lists, nested groups, ranges that keep the width of their
zero-padded ends, bounded before anything is read or recursed over; and globs (``*``,
``?``, ``[...]``) matched against a store's listing."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from ..errors import ObjectNotFoundError, PackOptionError
from .opening import open_store

__all__ = ["expand_braces", "has_glob", "glob_urls"]

_GLOB = re.compile(r"[*?\[]")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_MAX_EXPANSION = 10_000_000
# bounds on a brace pattern, checked before it is read (its reading recurses once per group
# and per level of nesting): far above any list of shards, far below Python's limits
_MAX_PATTERN = 65_536  # characters
_MAX_GROUPS = 256
_MAX_DEPTH = 32
_MAX_DIGITS = 18  # of a range's ends (int64)


def _close_of(text: str, i: int) -> int:
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def _split_top(body: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    return [*parts, cur]


def expand_braces(pattern: str) -> list[str]:
    """``'a-{000..002}.tar' -> ['a-000.tar', 'a-001.tar', 'a-002.tar']``; ``{x,y}`` lists,
    nested groups; a range keeps the width of its zero-padded ends (braceexpand's rule).
    A ``{`` without a matching ``}`` or a pattern of more than 10^7 names is an error,
    raised before any name is made (the groups of a pattern multiply); so is one beyond
    the bounds of a list of shards (64 Ki characters, 256 groups, 32 levels of nesting, range
    ends of 18 digits), checked before it is read."""
    if "{" in pattern:
        _check_bounds(pattern)
    count = _count_names(pattern)
    if count > _MAX_EXPANSION:
        raise PackOptionError(f"{pattern!r} names {count:,} shards, more than {_MAX_EXPANSION:,}: give a "
                              "narrower pattern (or several), or run `datapipe index` over parts of the list")
    return _expand(pattern)


def _check_bounds(pattern: str) -> None:
    """Refuse a brace pattern too long, with too many groups or nested too deep to be a
    list of shards (in one pass, before anything recurses over it)."""
    def refuse(what: str) -> PackOptionError:
        return PackOptionError(f"{pattern[:100]!r}{'...' if len(pattern) > 100 else ''}: {what}; a shard pattern "
                               "needs a few brace groups: give a simpler pattern, or the shard URLs as a list")

    if len(pattern) > _MAX_PATTERN:
        raise refuse(f"a brace pattern of {len(pattern):,} characters, more than {_MAX_PATTERN:,}")
    groups = depth = 0
    for ch in pattern:
        if ch == "{":
            groups += 1
            depth += 1
            if groups > _MAX_GROUPS:
                raise refuse(f"more than {_MAX_GROUPS} brace groups")
            if depth > _MAX_DEPTH:
                raise refuse(f"brace groups nested more than {_MAX_DEPTH} deep")
        elif ch == "}" and depth:
            depth -= 1


def _range_ends(m: re.Match[str], pattern: str) -> tuple[int, int]:
    """The two ends of the range ``m`` matched in ``pattern``, as integers."""
    for end in m.groups():
        if len(end.lstrip("-")) > _MAX_DIGITS:
            raise PackOptionError(f"{pattern[:100]!r}: a range end of {len(end.lstrip('-')):,} digits, more than "
                                  f"{_MAX_DIGITS}: shard numbers are shorter")
    return int(m.group(1)), int(m.group(2))


def _count_names(pattern: str) -> int:
    """How many names ``pattern`` expands to (counted, not made)."""
    i = pattern.find("{")
    if i < 0:
        return 1
    j = _close_of(pattern, i)
    if j < 0:
        return 1  # refused by _expand, with its own message
    body, rest = pattern[i + 1 : j], _count_names(pattern[j + 1 :])
    m = _RANGE.match(body)
    if m:
        lo, hi = _range_ends(m, pattern)
        return (abs(hi - lo) + 1) * rest
    if "," in body or "{" in body:
        return sum(_count_names(part) for part in _split_top(body)) * rest
    return rest


def _expand(pattern: str) -> list[str]:
    i = pattern.find("{")
    if i < 0:
        return [pattern]
    j = _close_of(pattern, i)
    if j < 0:
        raise PackOptionError(f"{pattern!r}: a '{{' without its '}}'")
    head, body, rest = pattern[:i], pattern[i + 1 : j], _expand(pattern[j + 1 :])
    m = _RANGE.match(body)
    if m:
        lo, hi = _range_ends(m, pattern)
        width = len(m.group(1)) if m.group(1).startswith("0") or m.group(2).startswith("0") else 0
        step = 1 if hi >= lo else -1
        choices = [f"{v:0{width}d}" for v in range(lo, hi + step, step)]
    elif "," in body or "{" in body:
        choices = [c for part in _split_top(body) for c in _expand(part)]
    else:  # a literal {x}: braceexpand leaves it as it is
        choices = ["{" + body + "}"]
    return [head + c + r for c in choices for r in rest]


def has_glob(text: str) -> bool:
    """Whether ``text`` is a glob pattern (``*``, ``?`` or ``[``)."""
    return _GLOB.search(text) is not None


def glob_urls(pattern: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The URLs of the objects matching a glob, sorted; ``*`` and ``?`` do not cross a ``/``.
    The store is opened at the folder above the first wildcard and listed once."""
    cut = _GLOB.search(pattern)
    first = cut.start() if cut is not None else len(pattern)
    root = pattern[: pattern.rfind("/", 0, first) + 1].rstrip("/") or "."
    rest = pattern[len(root) + 1 :] if root != "." else pattern
    store = open_store(root, storage_options)
    try:
        keys = store.list()
    except ObjectNotFoundError:
        keys = []
    depth = rest.count("/")
    return [store.url(k) for k in keys if k.count("/") == depth and fnmatch.fnmatchcase(k, rest)]
