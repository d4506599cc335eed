"""Tar shards given where a dataset URL is expected (``open_dataset``, ``StreamingDataset``,
``datapipe inspect/verify``): indexed on first use, the index cached and reused.

The cache key is a checksum of every shard's URL, size and version (mtime and inode
locally, the ETag on S3), so a shard that changes gets a new index, never a stale one;
an index found at that folder is used only if it lists exactly those shards.
The index goes into ``<warm_dir>/tar-index/<key>`` when a cache with a warm tier is
given, else into ``$DATAPIPE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/datapipe``, else
``~/.cache/datapipe``) ``/tar-index/<key>``. Processes that start together (ranks on one
node) index once: the others wait for the writer's manifest. Listing costs one stat per
shard and process: for large shard sets run ``datapipe index`` once and pass the index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any, TypeVar, cast

from ..dataset import Dataset, open_index
from ..decode import make_decoder
from ..errors import CorruptIndexError, DestinationBusyError, PlanError, StorageError
from ..format import MANIFEST, TAR_INDEX
from ..options import check_mapping
from ..storage import refuse_mistyped_url
from .build import index_shards
from .urls import ShardRef, expand_urls, is_tar_source, stat_shards

__all__ = ["index_location", "resolve_source", "open_dataset", "user_cache_dir"]

#: how long a process waits for another one indexing the same shards
WAIT_S = 3600.0


def user_cache_dir() -> str:
    base = os.environ.get("DATAPIPE_CACHE_DIR")
    if base:
        return base
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "datapipe")


def index_location(urls: str | list[str], storage_options: dict[str, Any] | None = None, cache: Any = None) -> str:
    """The folder of an index of the tar shards ``urls`` (built now if there is none)."""
    refs = stat_shards(expand_urls(urls, storage_options), storage_options)
    key = hashlib.sha256(json.dumps([[r.url, r.bytes, r.version] for r in refs]).encode()).hexdigest()[:32]
    warm = getattr(cache, "warm_dir", None)
    dest = os.path.join(warm if warm else user_cache_dir(), "tar-index", key)
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(os.path.join(dest, MANIFEST)):
        try:
            # worker processes only where they can fork: a forkserver child would re-run a
            # caller's script that has no `if __name__ == "__main__"` guard
            index_shards([r.url for r in refs], dest, storage_options=storage_options, shards=refs,
                         workers=None if threading.active_count() == 1 else 1, progress=sys.stderr.isatty())
        except DestinationBusyError:  # another process indexes these shards now: wait for it
            if time.monotonic() > deadline:
                raise StorageError(f"waited {WAIT_S:.0f} s for another process indexing into {dest}") from None
            time.sleep(0.5)
        except OSError as e:
            raise StorageError(f"cannot write the index of {len(refs)} tar shards to {dest} ({e}); set "
                               "DATAPIPE_CACHE_DIR to a writable folder, or run `datapipe index` and pass the index"
                               ) from e
    _check_lists(dest, refs)
    return dest


def _check_lists(dest: str, refs: list[ShardRef]) -> None:
    """:class:`CorruptIndexError` unless the index at ``dest`` is an index of tars that lists
    exactly the shards ``refs`` (URL and size) in order: the cache folder is found by its
    name alone, and whatever lies there (copied, planted in a shared cache dir) is not
    trusted for it. The folder is not ours to delete: the message says what to do."""
    ix = open_index(dest)
    if ix.manifest.get("origin") == TAR_INDEX and \
            [(s.url, s.bytes) for s in ix.shards] == [(r.url, r.bytes) for r in refs]:
        return
    raise CorruptIndexError(f"{dest}: the index cached here does not list the {len(refs)} shards asked for "
                            f"(first: {refs[0].url}); remove this folder (or set DATAPIPE_CACHE_DIR to another "
                            "one) and open the shards again")


_Source = TypeVar("_Source")


def resolve_source(source: _Source, storage_options: dict[str, Any] | None = None, cache: Any = None) -> _Source:
    """``source`` with tar shards in it replaced by the location of their index, in the
    same shape: a shard URL or pattern (a str or path), a list of them (one index for the
    whole list: a list of one), a :class:`~datapipe.Stream` of them, or a list of such.
    Dataset URLs pass unchanged."""
    return cast(_Source, _resolve(source, storage_options, cache))


def _resolve(source: Any, storage_options: dict[str, Any] | None, cache: Any) -> Any:
    if isinstance(source, (str, os.PathLike)):
        url = os.fspath(source)
        refuse_mistyped_url(url)  # before a tar pattern's local path is made absolute
        return index_location(url, storage_options, cache) if is_tar_source(url) else url
    if isinstance(source, (list, tuple)):
        items = list(source)
        for s in items:
            if isinstance(s, (str, os.PathLike)):
                refuse_mistyped_url(os.fspath(s))
        if items and all(isinstance(s, (str, os.PathLike)) and is_tar_source(os.fspath(s)) for s in items):
            return [index_location([os.fspath(s) for s in items], storage_options, cache)]
        return [_resolve(s, storage_options, cache) for s in items]
    url = getattr(source, "url", None)
    if isinstance(url, str):
        refuse_mistyped_url(url)
    if dataclasses.is_dataclass(source) and isinstance(url, str) and is_tar_source(url):
        opts = getattr(source, "storage_options", None) or storage_options
        return dataclasses.replace(source, url=index_location(url, opts, cache))  # type: ignore[type-var]  # a Stream
    return source


def open_dataset(source: Any, storage_options: dict[str, Any] | None = None, cache: Any = None, *,
                 decode: Any = None) -> Dataset:
    """Random access to a dataset: a packed dataset's URL, the location of an index that
    `datapipe index` wrote, or tar shards themselves (a URL, a brace pattern such as
    ``s3://b/shard-{000000..000099}.tar``, a glob, or a list), indexed on first use (see
    :func:`index_location`). ``decode``: what each sample's fields become, as for
    :class:`~datapipe.StreamingDataset` (None: bytes; "auto", "pil", "torch", ...: see
    :mod:`datapipe.decode`)."""
    decoder = make_decoder(decode)  # a bad decode= (or a package it needs missing) before any indexing
    if storage_options is not None:
        storage_options = check_mapping("storage_options", storage_options)
    url = resolve_source(source, storage_options, cache)
    if isinstance(url, list):
        if len(url) != 1:
            raise PlanError(f"open_dataset opens one dataset; got {len(url)} dataset URLs ({url[:3]}...): open "
                            "each on its own, or give tar shards (a list of them is indexed as one dataset)")
        url = url[0]
    from ..tables import is_parquet_source

    if is_parquet_source(url, storage_options):
        raise PlanError(f"{url} is a Parquet table: StreamingDataset reads it in place (by row group); "
                        f"open_dataset's random access needs it packed first: `datapipe pack {url} DEST`, "
                        "then open_dataset(DEST)")
    return Dataset(open_index(url, storage_options), decoder)
