"""`FsspecStore`: any fsspec protocol (s3://, gs://, memory://, http://, ...) as a Store.

Filesystem objects are created lazily and per process (they hold event loops and
connection pools that break across fork), never taken from fsspec's instance cache.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from ..errors import ObjectNotFoundError, StorageError, TruncatedReadError
from .stores import Store, _check_range

__all__ = ["FsspecStore"]

# object stores whose upload publishes only when it completes (discarded on failure)
_STREAMING_WRITE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "az", "abfss"}
# conditional PUT (If-None-Match: * / If-Match: <ETag>) through s3fs
_CONDITIONAL_WRITE_PROTOCOLS = {"s3", "s3a"}


def _precondition_failed(e: BaseException) -> bool:
    if isinstance(e, FileExistsError):  # s3fs: If-None-Match failed
        return True
    resp = getattr(e.__cause__, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict")


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
        self.supports_conditional_writes = self.protocol in _CONDITIONAL_WRITE_PROTOCOLS

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

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        if not self.supports_conditional_writes:
            return super().get_tagged(key)
        path = self._path(key)
        try:
            self.fs.invalidate_cache(path)  # the tag must be the object's, not a listing's
            with self.fs.open(path, "rb") as f:  # s3fs pins every read to this ETag
                return f.read(), str(f.details["ETag"])
        except Exception as e:
            raise self._translate(key, e) from e

    def put_if(self, key: str, data: bytes, match: str | None) -> str | None:
        if not self.supports_conditional_writes:
            return super().put_if(key, data, match)
        path = self._path(key)
        try:
            if match is None:
                out = self.fs.pipe_file(path, bytes(data), mode="create")
            else:
                out = self.fs.pipe_file(path, bytes(data), IfMatch=match)
        except Exception as e:
            if match is not None and isinstance(e, FileNotFoundError):
                return None  # If-Match on an object that is gone
            if _precondition_failed(e):
                return None
            raise self._translate(key, e) from e
        return str(out["ETag"])

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

