"""The `Store` contract: objects under one root URL, and URL helpers.

A store is rooted at a URL and holds objects under relative keys ("shard-00000.tar").
The interface is small (zarr v3's `Store` shape): whole-object and ranged reads, atomic
put, a streaming writer that publishes only on success, exists, size, delete, list; reads
pinned to one version; conditional writes where the backend has them; and capabilities
that callers ask for instead of testing a store's class (a local path, durable folders,
temporaries named per writer). Backends: memory.py, local.py, remote.py (fsspec).
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from ..errors import ObjectChangedError, StorageError, TruncatedReadError

__all__ = ["Store", "SeekableFile", "split_url", "join_url", "is_local_url", "changed_message", "check_range"]


def is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def split_url(url: str) -> tuple[str, str]:
    """``'s3://b/p/x.tar' -> ('s3://b/p', 'x.tar')``: the parent URL and the last name."""
    url = url.rstrip("/")
    head, _, name = url.rpartition("/")
    if not name or name.endswith(":") or head.endswith(":/") or head.endswith(":"):
        raise StorageError(f"{url!r} names no object inside a container")
    return head, name


def join_url(root: str, key: str) -> str:
    return root.rstrip("/") + "/" + key.lstrip("/")


class Store(ABC):
    """Objects under one root URL. Keys are relative, '/'-separated paths."""

    #: capability flags, as in zarr v3
    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") if root not in ("/",) else root

    def url(self, key: str) -> str:
        return join_url(self.root, key)

    # -- blocking interface ------------------------------------------------------------
    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a range past the end of the object is an error."""

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write the whole object; readers see the old object or the new one, never half."""

    @abstractmethod
    def open_writer(self, key: str) -> Any:
        """A context manager yielding a binary file; published only if the block succeeds."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing object is not an error."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (a key prefix, not only a directory), sorted."""

    # -- reads pinned to one version of an object ----------------------------------------
    def stat(self, key: str) -> tuple[int, str | None]:
        """``(size, version)``: ``version`` changes whenever the object is rewritten (an
        ETag, a generation, the inode, size and times of a local file), None when this
        store cannot tell versions apart."""
        return self.size(key), None

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        """``get_range`` of the version ``stat`` returned; raises ObjectChangedError when the
        object is another version now, so that the parts of one download never mix two
        versions. This fallback checks the version after reading; stores that can ask for
        a version (S3's If-Match) or check the file they read override it."""
        data = self.get_range(key, start, end)
        if version is not None:
            now = self.stat(key)[1]
            if now != version:
                raise ObjectChangedError(changed_message(self.url(key), version, now))
        return data

    #: put_if/get_tagged are atomic on the backend (S3 conditional writes)
    supports_conditional_writes: bool = False

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a tag of that version (an ETag) for :meth:`put_if`."""
        raise StorageError(f"{self.url(key)}: {type(self).__name__} has no conditional writes")

    def put_if(self, key: str, data: bytes, match: str | None) -> str | None:
        """Write ``key`` only if it does not exist (``match=None``) or if its current
        version's tag is ``match``, atomically; the new version's tag, or None if the
        condition did not hold."""
        raise StorageError(f"{self.url(key)}: {type(self).__name__} has no conditional writes")

    def readinto(self, key: str, buf: memoryview, start: int = 0) -> int:
        """Fill ``buf`` from ``start``; returns the byte count. Stores that can avoid the
        intermediate bytes object override this."""
        data = self.get_range(key, start, start + len(buf))
        buf[: len(data)] = data
        return len(data)

    # -- capabilities beyond bytes ------------------------------------------------------
    def local_path(self, key: str) -> str | None:
        """The path of ``key`` on a local filesystem, or None when this store has none
        (then the object is reachable through this interface only)."""
        return None

    def sync_parents(self, key: str) -> None:
        """Make the folders above ``key`` durable (fsync each directory between the store
        root and ``key``'s parent), so freshly created folders survive a power loss. A
        no-op where publishing an object is durable by itself (object stores) or where
        the store does not promise durability."""
        return None

    def deferring_folder_sync(self) -> Store:
        """This store for a writer of several files in one folder: a put through it is as
        atomic, and its bytes as durable, as through this store, but the folder's entry for
        the new name becomes durable only at :meth:`sync_folder` (one directory fsync for the
        batch instead of one per file). Stores whose folders need no sync (object stores,
        memory) return themselves."""
        return self

    def sync_folder(self, key: str, *, parents: bool = True) -> None:
        """Make the folder holding ``key`` durable and, as :meth:`sync_parents`, every folder
        above it (``parents=False``: that folder only, for a writer whose parents another
        writer syncs later): what a writer through :meth:`deferring_folder_sync` calls once
        its files there are published. A no-op where :meth:`sync_parents` is."""
        return None

    def for_writer(self, token: str) -> Store:
        """This store as one writer sees it: the temporaries of its writes carry ``token``
        (letters and digits), so :meth:`remove_temporaries` can later delete exactly the
        files that writer left behind. Stores without temporaries return themselves."""
        return self

    def remove_temporaries(self, folder: str = "", *, tokens: Iterable[str] | None = None,
                           suffix: str = "") -> int:
        """Delete the temporary files that unfinished writes left directly in ``folder``
        (a key prefix naming a folder; "" is the root): those of the writers ``tokens``
        names (see :meth:`for_writer`), or of every writer when None; with ``suffix``, only
        temporaries of keys ending so. Returns how many were deleted. Stores whose writes
        leave no temporaries (uploads that publish on completion, memory) have none."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


class DelegatingStore(Store):
    """A wrapper over the store ``inner`` (same root): every operation passes through to it;
    a subclass overrides what it changes (pacing, injected faults)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.root)
        self.inner = inner

    def url(self, key: str) -> str:
        return self.inner.url(key)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        return self.inner.get_range_at(key, start, end, version)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def stat(self, key: str) -> tuple[int, str | None]:
        return self.inner.stat(key)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.inner.put(key, data)

    def open_writer(self, key: str) -> Any:
        return self.inner.open_writer(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)


class SeekableFile(io.RawIOBase):
    """A read-only file of ``size`` bytes that a reader (pyarrow) seeks in and reads from:
    the position kept here, the reads the subclass's (``readinto`` or ``read``, from
    :attr:`_pos`, moving it)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._pos, self._size = 0, size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos


def changed_message(url: str, was: str | None, now: str | None) -> str:
    return (f"{url} changed while being read (version {was} became {now}); the bytes read "
            "so far are dropped")


def check_range(url: str, start: int, end: int, size: int | None = None) -> None:
    if start < 0 or end < start:
        raise StorageError(f"invalid byte range [{start}, {end}) for {url}")
    if size is not None and end > size:
        raise TruncatedReadError(
            f"range [{start}, {end}) runs past the end of {url} ({size} bytes)"
        )
