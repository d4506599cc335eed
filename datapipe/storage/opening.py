"""`open_store`: the backend for a URL."""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import UrlError
from .local import LocalStore
from .memory import MemoryStore
from .options import storage_options_for
from .remote import FsspecStore
from .store import Store, is_local_url

__all__ = ["open_store", "refuse_chained_url", "refuse_mistyped_url", "in_this_process"]

#: "scheme:" not followed by "//": what a URL with a slash missing looks like
_SCHEME_WITHOUT_SLASHES = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)(.*)", re.S)


def _known_protocols() -> set[str]:
    # only for a path that looks like a mistyped URL
    from fsspec.registry import known_implementations, registry

    return set(known_implementations) | set(registry)


def refuse_mistyped_url(url: str) -> None:
    """:class:`UrlError` for a local path that is a URL with its slashes missing:
    ``s3:/bucket/x`` or ``s3:bucket/x`` where ``s3`` is a protocol fsspec knows (to Python
    and to fsspec these are local paths) and nothing exists at that local path; names the
    URL meant. A path that exists is left alone (a folder may be named ``s3:``)."""
    m = _SCHEME_WITHOUT_SLASHES.fullmatch(url)
    if m is None or "::" in url or os.path.lexists(url):  # a chained URL: refuse_chained_url names it
        return
    proto, rest = m.group(1).lower(), m.group(2).lstrip("/")
    if proto not in _known_protocols():
        return
    meant = f"/{rest} (or file:///{rest})" if proto == "file" else f"{proto}://{rest}"
    raise UrlError(f"{url!r} is a local path to Python and fsspec ({os.path.abspath(url)}), and nothing is there: "
                   f"a {proto} URL has two slashes after '{proto}:'. Did you mean {meant}?")


def refuse_chained_url(url: str) -> None:
    """:class:`UrlError` for an fsspec chained URL (``simplecache::s3://...``), naming
    the plain URL to open instead."""
    if "::" in url:
        raise UrlError(
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
        refuse_mistyped_url(url)
        return LocalStore(url)
    return FsspecStore(url, storage_options_for(url, storage_options))


def in_this_process(store: Store) -> bool:
    """Whether ``store`` lives in this process's memory (a :class:`MemoryStore`, fsspec's
    ``memory://``): another process that opens the same URL sees other objects, so work on
    it cannot move to a worker or writer process."""
    return isinstance(store, MemoryStore) or getattr(store, "protocol", None) == "memory"
