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

from ..errors import ObjectNotFoundError, StorageError, TruncatedReadError

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
            f.close()
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


class FsspecStore(Store):
    """Any fsspec protocol (s3://, gs://, memory://, http://, ...).

    ``storage_options`` go to the filesystem's constructor, e.g. for a local S3 endpoint
    ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:PORT"}, "key": ..., "secret": ...}``.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root)
        self.protocol = root.split("://", 1)[0]
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"], state["_pid"], state["_lock"] = None, -1, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            with self._lock:
                if self._fs is None or self._pid != os.getpid():
                    try:
                        import fsspec
                    except ImportError as e:  # pragma: no cover - fsspec is a dependency
                        raise StorageError("fsspec is required: pip install fsspec") from e
                    try:
                        cls = fsspec.get_filesystem_class(self.protocol)
                    except (ImportError, ValueError) as e:
                        extra = " (pip install 'datapipe[s3]')" if self.protocol in ("s3", "s3a") else ""
                        raise StorageError(
                            f"cannot open {self.root}: no fsspec backend for "
                            f"{self.protocol!r}{extra}: {e}"
                        ) from e
                    opts = dict(self.storage_options)
                    opts.setdefault("skip_instance_cache", True)
                    self._fs = cls(**opts)
                    self._pid = os.getpid()
        return self._fs

    def _path(self, key: str) -> str:
        return self.url(key)

    def _translate(self, key: str, e: Exception) -> Exception:
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(f"no object at {self.url(key)}")
        return StorageError(f"{type(e).__name__} on {self.url(key)}: {e}")

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except Exception as e:
            raise self._translate(key, e) from e

    def get_range(self, key: str, start: int, end: int) -> bytes:
        _check_range(self.url(key), start, end)
        if end == start:
            return b""
        try:
            data = self.fs.cat_file(self._path(key), start=start, end=end)
        except Exception as e:
            raise self._translate(key, e) from e
        if len(data) != end - start:
            raise TruncatedReadError(
                f"range [{start}, {end}) of {self.url(key)} returned {len(data)} bytes"
            )
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        try:
            self.fs.pipe_file(self._path(key), bytes(data))
        except Exception as e:
            raise self._translate(key, e) from e

    @contextmanager
    def open_writer(self, key: str) -> Iterator[BinaryIO]:
        # Object stores publish an object when its upload completes; on failure the
        # multipart upload is discarded so nothing partial appears. Other filesystems
        # (memory:// publishes a file the moment it is opened) write to memory and
        # publish with one put.
        f = None
        if self.protocol in _STREAMING_WRITE_PROTOCOLS:
            try:
                f = self.fs.open(self._path(key), "wb")
            except Exception as e:
                raise self._translate(key, e) from e
        if f is None or not hasattr(f, "discard"):
            if f is not None:
                f.close()
            buf = io.BytesIO()
            yield buf
            self.put(key, buf.getbuffer())
            return
        try:
            yield f
        except BaseException:
            f.discard()
            f.closed = True  # else fsspec's __del__ would flush (publish) the partial upload
            raise
        try:
            f.close()
        except Exception as e:
            raise self._translate(key, e) from e

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.isfile(self._path(key)))
        except Exception as e:
            raise self._translate(key, e) from e

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self._path(key)))
        except Exception as e:
            raise self._translate(key, e) from e

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._translate(key, e) from e

    def list(self, prefix: str = "") -> list[str]:
        # Backends spell paths differently (memory:// keeps a leading "/"); compare bare.
        root = self.root.split("://", 1)[1].strip("/")
        try:
            self.fs.invalidate_cache()
            found = self.fs.find(self._path(""), withdirs=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._translate("", e) from e
        out = []
        for p in found:
            p = p.split("://", 1)[-1].lstrip("/")
            rel = p[len(root) :].lstrip("/") if p.startswith(root) else p
            if rel.startswith(prefix):
                out.append(rel)
        return sorted(out)


_STREAMING_WRITE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "az", "abfss"}


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store rooted at ``url``: a local directory for plain paths and ``file://``,
    fsspec for every other protocol."""
    if is_local_url(url):
        return LocalStore(url)
    return FsspecStore(url, storage_options)
