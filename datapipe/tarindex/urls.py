"""Which shards a list of URLs names: brace patterns (``shard-{000000..000999}.tar``, as
webdataset's braceexpand reads them), globs (``*``, ``?``, ``[...]``), plain URLs; and each
shard's size and version (mtime/inode locally, the ETag on S3), one stat per shard."""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import DatapipeError, ObjectNotFoundError, PackOptionError, StorageError
from ..storage import Store, is_local_url, open_store, split_url

__all__ = ["ShardRef", "expand_braces", "expand_urls", "is_tar_source", "stat_shards", "COMPRESSED_TAR"]

#: whole-file compressed tars: no sample of them can be reached by offset
COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.zst", ".tar.zstd", ".tar.bz2", ".tar.xz")
_TAR = (".tar", *COMPRESSED_TAR)
_GLOB = re.compile(r"[*?\[]")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_MAX_EXPANSION = 10_000_000
# bounds on a brace pattern, checked before it is read (its reading recurses once per group
# and per level of nesting): far above any list of shards, far below Python's limits
_MAX_PATTERN = 65_536  # characters
_MAX_GROUPS = 256
_MAX_DEPTH = 32
_MAX_DIGITS = 18  # of a range's ends (int64)


@dataclass(frozen=True)
class ShardRef:
    """One existing shard: its URL (an absolute path locally), stored size and version."""

    url: str
    bytes: int
    version: str | None


def is_tar_source(url: str) -> bool:
    """Whether ``url`` names tar shards (a shard, or a brace/glob pattern of them) rather
    than a dataset folder."""
    return url.rstrip("/").lower().endswith(_TAR)


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


def _glob(pattern: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The objects matching a glob, sorted; ``*`` and ``?`` do not cross a ``/``."""
    cut = _GLOB.search(pattern)
    first = cut.start() if cut is not None else len(pattern)
    root = pattern[: pattern.rfind("/", 0, first) + 1].rstrip("/") or "."
    rest = pattern[len(root) + 1 :] if root != "." else pattern
    store = open_store(root, storage_options)
    depth = rest.count("/")
    try:
        keys = store.list()
    except ObjectNotFoundError:
        keys = []
    return [store.url(k) for k in keys if k.count("/") == depth and fnmatch.fnmatchcase(k, rest)]


def expand_urls(urls: str | list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every shard URL that ``urls`` names, in order (brace patterns in their order, globs
    and folders sorted; a folder names the tar files directly inside it); local paths made
    absolute. A pattern that names nothing, a URL named twice, a
    whole-file compressed tar or a name that is not a ``.tar`` is an error."""
    out: list[str] = []
    for pattern in [urls] if isinstance(urls, str) else list(urls):
        pattern = os.fspath(pattern)
        found: list[str] = []
        for name in expand_braces(pattern):
            if _GLOB.search(name.split("://", 1)[-1]):
                found.extend(_glob(name, storage_options))
            elif not is_tar_source(name):  # a folder: the tar shards directly inside it
                found.extend(u for u in _glob(name.rstrip("/") + "/*", storage_options) if is_tar_source(u))
            else:
                found.append(name)
        if not found:
            raise ObjectNotFoundError(f"{pattern!r} names no shard (nothing matches the pattern)")
        out.extend(found)
    out = [os.path.abspath(u) if is_local_url(u) and not u.startswith("file://") else u for u in out]
    seen: set[str] = set()
    for u in out:
        low = u.lower()
        if low.endswith(COMPRESSED_TAR):
            raise PackOptionError(
                f"{u} is compressed as a whole, so no sample of it can be reached by offset and it cannot be "
                "indexed for random access, global shuffle or exact resume. Decompress it first (`gunzip "
                "x.tar.gz`, `zstd -d x.tar.zst`) and index the .tar, or read it as a stream with webdataset"
            )
        if not low.endswith(".tar"):
            raise PackOptionError(f"{u} is not a .tar shard (datapipe index reads uncompressed tar shards)")
        if u in seen:
            raise PackOptionError(f"{u} is named twice")
        seen.add(u)
    return out


def _store_of(folder: str, storage_options: dict[str, Any] | None, stores: dict[str, Store]) -> Store:
    store = stores.get(folder)
    if store is None:
        store = stores[folder] = open_store(folder, None if is_local_url(folder) else storage_options)
    return store


def stat_shards(urls: list[str], storage_options: dict[str, Any] | None = None,
                threads: int = 32) -> list[ShardRef]:
    """Size and version of each shard (stat calls in ``threads`` threads: on object stores
    each is a round trip). A missing shard, or a local name that is not a regular file, is
    an error naming it."""
    stores: dict[str, Store] = {}
    for u in urls:  # stores opened here, once per folder, before the threads share them
        _store_of(split_url(u)[0], storage_options, stores)

    def one(url: str) -> ShardRef:
        folder, key = split_url(url)
        path = stores[folder].local_path(key)
        try:
            # a folder, a FIFO (opening one blocks until a writer comes) or a device: never opened
            if path is not None and os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
                raise PackOptionError(f"shard {url} is not a regular file (a folder, a FIFO or a device); "
                                      "datapipe index reads tar files")
            size, version = stores[folder].stat(key)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(f"shard {url} does not exist") from None
        except DatapipeError:
            raise
        except OSError as e:
            raise StorageError(f"cannot stat shard {url}: {e}") from e
        return ShardRef(url, size, version)

    if len(urls) <= 4 or all(is_local_url(u) for u in urls):
        return [one(u) for u in urls]
    with ThreadPoolExecutor(min(threads, len(urls))) as pool:
        return list(pool.map(one, urls))
