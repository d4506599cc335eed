"""Byte stores addressed by URL: memory (hot), local directory (warm), fsspec (cold).

A store is rooted at a URL and holds objects under relative keys ("shard-00000.tar").
The interface is small (zarr v3's `Store` shape): whole-object and ranged reads, atomic
put, a streaming writer that publishes only on success, exists, size, delete, list.
Each blocking method has an async twin (``aget`` ...) that runs it off the event loop,
so the loader's asyncio prefetcher and plain synchronous code share one implementation.

fsspec filesystem objects are created lazily and per process (they hold event loops and
connection pools that break across fork), never taken from fsspec's instance cache.
"""

from __future__ import annotations

import asyncio
import io
import os
import posixpath
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from ..errors import ObjectChangedError, ObjectNotFoundError, StorageError, TruncatedReadError

__all__ = [
    "Store",
    "MemoryStore",
    "LocalStore",
    "FsspecStore",
    "open_store",
    "split_url",
    "join_url",
    "is_local_url",
]


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
                raise ObjectChangedError(_changed_message(self.url(key), version, now))
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

    # -- async twins -------------------------------------------------------------------
    async def aget(self, key: str) -> bytes:
        return await asyncio.to_thread(self.get, key)

    async def aget_range(self, key: str, start: int, end: int) -> bytes:
        return await asyncio.to_thread(self.get_range, key, start, end)

    async def aput(self, key: str, data: bytes | memoryview) -> None:
        await asyncio.to_thread(self.put, key, data)

    async def aexists(self, key: str) -> bool:
        return await asyncio.to_thread(self.exists, key)

    async def asize(self, key: str) -> int:
        return await asyncio.to_thread(self.size, key)

    async def adelete(self, key: str) -> None:
        await asyncio.to_thread(self.delete, key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


def _changed_message(url: str, was: str | None, now: str | None) -> str:
    return (f"{url} changed while being read (version {was} became {now}); the bytes read "
            "so far are dropped")


def _check_range(url: str, start: int, end: int, size: int | None = None) -> None:
    if start < 0 or end < start:
        raise StorageError(f"invalid byte range [{start}, {end}) for {url}")
    if size is not None and end > size:
        raise TruncatedReadError(
            f"range [{start}, {end}) runs past the end of {url} ({size} bytes)"
        )


class MemoryStore(Store):
    """Objects in a dict of this process. Used as the hot tier and in tests."""

    def __init__(self, root: str = "mem://") -> None:
        super().__init__(root)
        self._objects: dict[str, bytes] = {}
        self._generation: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        try:
            return self._objects[key]
        except KeyError:
            raise ObjectNotFoundError(f"no object at {self.url(key)}") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.get(key)
        _check_range(self.url(key), start, end, len(data))
        return data[start:end]

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self._objects[key] = bytes(data)
            self._generation[key] = self._generation.get(key, 0) + 1

    def stat(self, key: str) -> tuple[int, str | None]:
        with self._lock:
            data, gen = self._objects.get(key), self._generation.get(key)
        if data is None:
            raise ObjectNotFoundError(f"no object at {self.url(key)}")
        return len(data), str(gen)

    @contextmanager
    def open_writer(self, key: str) -> Iterator[BinaryIO]:
        buf = io.BytesIO()
        yield buf
        self.put(key, buf.getvalue())

    def exists(self, key: str) -> bool:
        return key in self._objects

    def size(self, key: str) -> int:
        return len(self.get(key))

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k in list(self._objects) if k.startswith(prefix))


TMP_MARK = ".tmp-"


def _file_version(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class LocalStore(Store):
    """A directory on a local filesystem. Writes go to a temporary name beside the target
    (``.tmp-<uuid>-<name>``), are fsync'd when ``durable``, and are published by rename."""

    def __init__(self, root: str, *, durable: bool = True) -> None:
        if root.startswith("file://"):
            root = root[len("file://") :]
        super().__init__(os.path.abspath(root))
        self.durable = durable

    def path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def url(self, key: str) -> str:
        return self.path(key)

    def _open_read(self, key: str) -> BinaryIO:
        try:
            return open(self.path(key), "rb", buffering=0)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"no file at {self.path(key)}") from None
        except IsADirectoryError:
            raise ObjectNotFoundError(f"{self.path(key)} is a directory, not an object") from None

    def get(self, key: str) -> bytes:
        with self._open_read(key) as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._open_read(key) as f:
            _check_range(self.path(key), start, end)
            data = os.pread(f.fileno(), end - start, start)
        if len(data) != end - start:
            raise TruncatedReadError(
                f"range [{start}, {end}) runs past the end of {self.path(key)} "
                f"({start + len(data)} bytes)"
            )
        return data

    def stat(self, key: str) -> tuple[int, str | None]:
        try:
            st = os.stat(self.path(key))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"no file at {self.path(key)}") from None
        return st.st_size, _file_version(st)

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        # The file as opened is checked before and after the read: a rename over it or a
        # write into it in between shows in its inode, size or times.
        with self._open_read(key) as f:
            _check_range(self.path(key), start, end)
            before = _file_version(os.fstat(f.fileno()))
            if version is not None and before != version:
                raise ObjectChangedError(_changed_message(self.path(key), version, before))
            data = os.pread(f.fileno(), end - start, start)
            after = _file_version(os.fstat(f.fileno()))
        if after != before:
            raise ObjectChangedError(_changed_message(self.path(key), before, after))
        if len(data) != end - start:
            raise TruncatedReadError(
                f"range [{start}, {end}) runs past the end of {self.path(key)} "
                f"({start + len(data)} bytes)"
            )
        return data

    def readinto(self, key: str, buf: memoryview, start: int = 0) -> int:
        with self._open_read(key) as f:
            f.seek(start)
            total = 0
            while total < len(buf):
                n = f.readinto(buf[total:])
                if not n:
                    break
                total += n
            return total

    def _tmp_path(self, key: str) -> str:
        final = self.path(key)
        d, name = os.path.split(final)
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f"{TMP_MARK}{uuid.uuid4().hex[:12]}-{name}")

    def _publish(self, tmp: str, key: str) -> None:
        os.replace(tmp, self.path(key))
        if self.durable:
            fd = os.open(os.path.dirname(self.path(key)), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self.open_writer(key) as f:
            f.write(data)

    @contextmanager
    def open_writer(self, key: str) -> Iterator[BinaryIO]:
        tmp = self._tmp_path(key)
        f = open(tmp, "wb")
        try:
            yield f
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
            f.close()
            self._publish(tmp, key)
        except BaseException:
            try:
                f.close()  # may fail again (ENOSPC flushing the buffer): the unlink must still run
            except OSError:
                pass
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path(key))

    def size(self, key: str) -> int:
        try:
            return os.stat(self.path(key)).st_size
        except FileNotFoundError:
            raise ObjectNotFoundError(f"no file at {self.path(key)}") from None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return
        # drop directories the delete left empty, up to (not including) the root
        d = os.path.dirname(self.path(key))
        while d != self.root and d.startswith(self.root):
            try:
                os.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)

    def list(self, prefix: str = "") -> list[str]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for name in files:
                if name.startswith(TMP_MARK):
                    continue
                key = name if rel == "." else posixpath.join(*rel.split(os.sep), name)
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


from .remote import FsspecStore  # noqa: E402  (after Store: remote.py subclasses it)


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store rooted at ``url``: a local directory for plain paths and ``file://``,
    fsspec for every other protocol."""
    if is_local_url(url):
        return LocalStore(url)
    return FsspecStore(url, storage_options)
