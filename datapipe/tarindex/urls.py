"""Which shards a list of URLs names: brace patterns (``shard-{000000..000999}.tar``, as
webdataset's braceexpand reads them), globs (``*``, ``?``, ``[...]``), plain URLs; and each
shard's size and version (mtime/inode locally, the ETag on S3), one stat per shard."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import DatapipeError, ObjectNotFoundError, PackOptionError, StorageError
from ..storage import Store, expand_braces, glob_urls, has_glob, is_local_url, open_store, split_url

__all__ = ["ShardRef", "expand_braces", "expand_urls", "is_tar_source", "stat_shards", "COMPRESSED_TAR"]

#: whole-file compressed tars: no sample of them can be reached by offset
COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.zst", ".tar.zstd", ".tar.bz2", ".tar.xz")
_TAR = (".tar", *COMPRESSED_TAR)


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
            if has_glob(name.split("://", 1)[-1]):
                found.extend(glob_urls(name, storage_options))
            elif not is_tar_source(name):  # a folder: the tar shards directly inside it
                found.extend(u for u in glob_urls(name.rstrip("/") + "/*", storage_options) if is_tar_source(u))
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
