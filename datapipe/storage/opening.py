"""`open_store`: the backend for a URL."""

from __future__ import annotations

import os
from typing import Any

from ..errors import StorageError
from .local import LocalStore
from .memory import MemoryStore
from .options import storage_options_for
from .remote import FsspecStore
from .store import Store, is_local_url

__all__ = ["open_store", "refuse_chained_url", "in_this_process"]


def refuse_chained_url(url: str) -> None:
    """:class:`StorageError` for an fsspec chained URL (``simplecache::s3://...``), naming
    the plain URL to open instead."""
    if "::" in url:
        raise StorageError(
            f"{url}: chained fsspec URLs (simplecache::, filecache::, blockcache::, ...) are not supported: "
            "datapipe checks every byte it reads against its index and keeps its own local copies; open the "
            f"plain URL ({url.rsplit('::', 1)[-1]}) and give StreamingDataset a "
            "TieredCache(warm_dir=...) for a local copy")


def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """The store rooted at ``url``: a local directory for plain paths and ``file://``,
    fsspec for every other protocol, with the options set for its prefix (see
    :mod:`.options`) under ``storage_options``."""
    url = os.fspath(url)
    refuse_chained_url(url)
    if is_local_url(url):
        return LocalStore(url)
    return FsspecStore(url, storage_options_for(url, storage_options))


def in_this_process(store: Store) -> bool:
    """Whether ``store`` lives in this process's memory (a :class:`MemoryStore`, fsspec's
    ``memory://``): another process that opens the same URL sees other objects, so work on
    it cannot move to a worker or writer process."""
    return isinstance(store, MemoryStore) or getattr(store, "protocol", None) == "memory"
