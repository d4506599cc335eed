"""`LocalStore`: a directory on a local filesystem as a Store."""

from __future__ import annotations

import io
import os
import posixpath
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import ObjectChangedError, ObjectNotFoundError, StorageError, TruncatedReadError
from .store import Store, changed_message, check_range

__all__ = ["LocalStore", "open_regular", "temporary_name"]


#: temporaries are named ``.tmp-<writer>-<name>``; listings hide them
_TMP_MARK = ".tmp-"


def temporary_name(token: str, name: str) -> str:
    """The temporary name of the file ``name`` written by the writer ``token`` (letters and
    digits): what :meth:`LocalStore.for_writer` writes before the rename that publishes it,
    and what :meth:`Store.remove_temporaries` deletes for that writer. A writer that writes
    its files itself (not through ``open_writer``) names them so, in the same folder."""
    return f"{_TMP_MARK}{token}-{name}"


def _file_version(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


@contextmanager
def _reading(path: str) -> Iterator[None]:
    """OS errors reading ``path`` as the store's errors: missing (no file, a directory, a
    path through a file) as :class:`ObjectNotFoundError`, any other (a failing disk, no
    permission, a symlink loop) as :class:`StorageError`, each naming the path."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError) as e:
        if isinstance(e, StorageError):
            raise
        raise ObjectNotFoundError(f"no file at {path}") from None
    except IsADirectoryError:
        raise ObjectNotFoundError(f"{path} is a directory, not an object") from None
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"cannot read {path}: {e.strerror or e} (errno {e.errno})") from e


def _regular(path: str, st: os.stat_result) -> os.stat_result:
    if stat.S_ISDIR(st.st_mode):
        raise ObjectNotFoundError(f"{path} is a directory, not an object")
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"{path} is not a regular file (a FIFO, socket or device where an object "
                           "should be): refused unread; remove it")
    return st


def open_regular(path: str) -> tuple[io.FileIO, os.stat_result]:
    """``path`` open for reading, and its status, if it is a regular file. O_NONBLOCK:
    opening a FIFO put where a file was would otherwise block forever. Anything else there
    (a directory, a FIFO, a device) raises :class:`ObjectNotFoundError` or
    :class:`StorageError` naming it; OS errors are the caller's to name."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    f = open(fd, "rb", buffering=0, closefd=True)
    try:
        return f, _regular(path, os.fstat(fd))
    except BaseException:
        f.close()
        raise


def fsync_dir(path: str) -> None:
    """fsync the folder ``path``: a rename into it (or a file made in it) survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """A directory on a local filesystem. Writes go to a temporary name beside the target
    (``.tmp-<writer>-<name>``: ``writer_token``, or a fresh random one per write), are
    fsync'd when ``durable``, and are published by rename (and the folder fsync'd, unless
    ``folder_sync`` is False: :meth:`deferring_folder_sync`)."""

    def __init__(self, root: str, *, durable: bool = True, writer_token: str | None = None,
                 folder_sync: bool = True) -> None:
        if root.startswith("file://"):
            root = root[len("file://") :]
        super().__init__(os.path.abspath(root))
        if writer_token is not None and not (writer_token.isascii() and writer_token.isalnum()):
            raise StorageError(f"writer_token must be letters and digits, got {writer_token!r}")
        self.durable = durable
        self.writer_token = writer_token
        self.folder_sync = folder_sync

    def path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def url(self, key: str) -> str:
        return self.path(key)

    # -- capabilities ----------------------------------------------------------------------
    def local_path(self, key: str) -> str:
        return self.path(key)

    def sync_parents(self, key: str) -> None:
        if not self.durable:
            return
        parts = key.split("/")[:-1]
        for i in range(len(parts) - 1, -1, -1):
            fsync_dir(os.path.join(self.root, *parts[:i]))

    def sync_folder(self, key: str, *, parents: bool = True) -> None:
        if not self.durable:
            return
        fsync_dir(os.path.dirname(self.path(key)))
        if parents:
            self.sync_parents(key)

    def deferring_folder_sync(self) -> LocalStore:
        return LocalStore(self.root, durable=self.durable, writer_token=self.writer_token, folder_sync=False)

    def for_writer(self, token: str) -> LocalStore:
        return LocalStore(self.root, durable=self.durable, writer_token=token, folder_sync=self.folder_sync)

    def remove_temporaries(self, folder: str = "", *, tokens: Iterable[str] | None = None,
                           suffix: str = "") -> int:
        marks = (_TMP_MARK,) if tokens is None else tuple(f"{_TMP_MARK}{t}-" for t in tokens)
        if not marks:
            return 0
        path = self.path(folder) if folder else self.root
        try:
            names = os.listdir(path)
        except OSError:
            return 0
        n = 0
        for name in names:
            if name.startswith(marks) and name.endswith(suffix):
                try:
                    os.unlink(os.path.join(path, name))
                    n += 1
                except OSError:
                    pass  # gone already, or not ours to remove after all
        return n

    def _status(self, key: str) -> os.stat_result:
        """The status of the regular file at ``key``; anything else there (nothing, a
        directory, a FIFO, a device) is refused by name, as is a failing disk."""
        path = self.path(key)
        with _reading(path):
            st = os.stat(path)
        return _regular(path, st)

    @contextmanager
    def _open_read(self, key: str) -> Iterator[io.FileIO]:
        """The regular file at ``key`` (:func:`open_regular`), open for reading; every OS
        error while it is open becomes a :class:`StorageError` naming it."""
        path = self.path(key)
        with _reading(path):
            f, _st = open_regular(path)
            with f:
                yield f

    def get(self, key: str) -> bytes:
        with self._open_read(key) as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._open_read(key) as f:
            check_range(self.path(key), start, end)
            data = os.pread(f.fileno(), end - start, start)
        if len(data) != end - start:
            raise TruncatedReadError(
                f"range [{start}, {end}) runs past the end of {self.path(key)} "
                f"({start + len(data)} bytes)"
            )
        return data

    def stat(self, key: str) -> tuple[int, str | None]:
        st = self._status(key)
        return st.st_size, _file_version(st)

    def get_range_at(self, key: str, start: int, end: int, version: str | None) -> bytes:
        # The file as opened is checked before and after the read: a rename over it or a
        # write into it in between shows in its inode, size or times.
        with self._open_read(key) as f:
            check_range(self.path(key), start, end)
            before = _file_version(os.fstat(f.fileno()))
            if version is not None and before != version:
                raise ObjectChangedError(changed_message(self.path(key), version, before))
            data = os.pread(f.fileno(), end - start, start)
            after = _file_version(os.fstat(f.fileno()))
        if after != before:
            raise ObjectChangedError(changed_message(self.path(key), before, after))
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
        token = self.writer_token or uuid.uuid4().hex[:12]
        return os.path.join(d, temporary_name(token, name))

    def _publish(self, tmp: str, key: str) -> None:
        os.replace(tmp, self.path(key))
        if self.durable and self.folder_sync:
            fsync_dir(os.path.dirname(self.path(key)))

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
        return self._status(key).st_size

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
                if name.startswith(_TMP_MARK):
                    continue
                key = name if rel == "." else posixpath.join(*rel.split(os.sep), name)
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)
