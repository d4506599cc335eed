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

from ..errors import ObjectChangedError, ObjectNotFoundError, StorageError, TruncatedReadError
from .store import Store, changed_message, check_range

__all__ = ["FsspecStore"]

# object stores whose upload publishes only when it completes (discarded on failure)
_STREAMING_WRITE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "az", "abfss"}
# S3: conditional PUT (If-None-Match: * / If-Match: <ETag>) and If-Match on range GETs
_S3_PROTOCOLS = {"s3", "s3a"}
# get_tagged reads again when the object is rewritten during its read, this many times
_TAGGED_READ_TRIES = 5
# what fsspec backends call the token that changes when an object is rewritten, best first
_VERSION_FIELDS = ("ETag", "etag", "generation", "VersionId", "version_id", "md5Hash",
                   "mtime", "LastModified", "last_modified", "updated", "created")


def _version_of(info: dict[str, Any]) -> str | None:
    for name in _VERSION_FIELDS:
        v = info.get(name)
        if v not in (None, ""):
            return f"{name}={v}"
    return None


def _precondition_failed(e: BaseException) -> bool:
    """True when ``e`` (or an error it was raised from) says a conditional request's
    precondition did not hold (HTTP 412; s3fs raises FileExistsError for If-None-Match)."""
    if isinstance(e, FileExistsError):
        return True
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict) and (resp.get("Error", {}).get("Code") in ("PreconditionFailed", "412",
                                                                             "ConditionalRequestConflict")
                                       or resp.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412):
            return True
        if "PreconditionFailed" in str(cur) or "(412)" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class FsspecStore(Store):
    """Any fsspec protocol (s3://, gs://, memory://, http://, ...).

    ``storage_options`` go to the filesystem's constructor, e.g. for a local S3 endpoint
    ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:PORT"}, "key": ..., "secret": ...}``.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root)
        self.protocol = root.split("://", 1)[0]
        self.storage_options = dict(storage_options or {})
        #: set on the filesystem after it is created (s3fs's own retry loop; the cache sets 1)
        self.backend_retries: int | None = None
        self._fs: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        self.supports_conditional_writes = self.protocol in _S3_PROTOCOLS

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
                    fs = cls(**opts)
                    if self.backend_retries is not None and hasattr(fs, "retries"):
                        fs.retries = self.backend_retries
                    self._fs = fs
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
            data: bytes = self.fs.cat_file(self._path(key))
        except Exception as e:
            raise self._translate(key, e) from e
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_range(self.url(key), start, end)
        if end == start:
            return b""
        try:
            data: bytes = self.fs.cat_file(self._path(key), start=start, end=end)
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
        last: Exception | None = None
        for _try in range(_TAGGED_READ_TRIES):
            try:
                self.fs.invalidate_cache(path)  # the tag must be the object's, not a listing's
                with self.fs.open(path, "rb") as f:  # s3fs pins every read to this ETag
                    return f.read(), str(f.details["ETag"])
            except Exception as e:
                if type(e).__name__ != "FileExpired":
                    raise self._translate(key, e) from e
                # rewritten between s3fs's HEAD (the ETag) and its GET: read the new version
                last = e
        raise ObjectChangedError(changed_message(self.url(key), "read", "another, "
                                                 f"{_TAGGED_READ_TRIES} times in a row")) from last

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

    def stat(self, key: str) -> tuple[int, str | None]:
        try:
            if self.protocol in _S3_PROTOCOLS:
                info = self.fs.info(self._path(key), refresh=True)  # never a listing's memo
            else:
                info = self.fs.info(self._path(key))
        except Exception as e:
            raise self._translate(key, e) from e
        if info.get("type", "file") != "file":
            raise ObjectNotFoundError(f"{self.url(key)} is a directory, not an object")
        return int(info["size"]), _version_of(info)

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        if self.protocol not in _S3_PROTOCOLS or not (version or "").startswith("ETag="):
            return super().get_range_at(key, start, end, version)
        check_range(self.url(key), start, end)
        if end == start:
            return b""
        etag = (version or "").split("=", 1)[1]
        fs = self.fs
        bucket, path, _vid = fs.split_path(self._path(key))

        async def ranged() -> tuple[str | None, bytes]:
            # If-Match makes S3 refuse a rewritten object; the ETag of the answer is checked
            # too, for servers that ignore the header.
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=path, IfMatch=etag,
                                     Range=f"bytes={start}-{end - 1}")
            try:
                return resp.get("ETag"), await resp["Body"].read()
            finally:
                resp["Body"].close()

        try:
            from fsspec.asyn import sync

            answer: tuple[str | None, bytes] = sync(fs.loop, ranged)
        except Exception as e:
            if _precondition_failed(e):
                raise ObjectChangedError(changed_message(self.url(key), version, "another")) from e
            raise self._translate(key, e) from e
        got, data = answer
        if got is not None and got != etag:
            raise ObjectChangedError(changed_message(self.url(key), version, f"ETag={got}"))
        if len(data) != end - start:
            raise TruncatedReadError(
                f"range [{start}, {end}) of {self.url(key)} returned {len(data)} bytes"
            )
        return data

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

