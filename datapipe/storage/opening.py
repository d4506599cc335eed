"""`open_store`: the backend for a URL."""

from __future__ import annotations

from typing import Any

from .local import LocalStore
from .remote import FsspecStore
from .store import Store, is_local_url

__all__ = ["open_store"]


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store rooted at ``url``: a local directory for plain paths and ``file://``,
    fsspec for every other protocol."""
    if is_local_url(url):
        return LocalStore(url)
    return FsspecStore(url, storage_options)
