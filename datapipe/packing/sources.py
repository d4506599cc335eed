"""What `pack` reads: a directory tree of small files, a JSONL file, or a Parquet file or
directory. Each source lists samples in a deterministic order."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import DatapipeError, EmptyInputError, InputFileError, InvalidMemberNameError, OptionError, PackError
from ..format import (
    BLOCK,
    check_key,
    chunk_pages,
    flatten_bytes_structs,
    key_text,
    member_name,
    python_rows,
    row_fields,
    split_member_name,
)
from ..storage import SeekableFile

__all__ = ["FileSample", "DirectoryListing", "KEY_RULES", "file_key", "list_directory", "list_in_pieces", "iter_table",
           "read_fragment", "row_group_bytes", "pack_row_group_bytes", "count_table_rows", "check_table_columns",
           "source_kind", "PACK_ROW_GROUP_ENV", "is_parquet_tree", "parquet_dataset", "NO_EXTENSION", "DOT_FILE",
           "DOT_FOLDER", "LINKED_FOLDER"]

#: how a directory's files become samples: "first-dot" (WebDataset's rule, the default: key =
#: the path up to the first dot of the file name, field = the rest, so files sharing that
#: key are one sample) or "file" (one sample per file: see :func:`file_key`)
KEY_RULES = ("first-dot", "file")

# reasons a file is dropped (not packed), as the pack summary counts them
NO_EXTENSION = "files with no extension (no 'key.field' name)"
DOT_FILE = "dot-files (hidden)"
DOT_FOLDER = "dot-folders (hidden; not entered, their files not counted)"
LINKED_FOLDER = "links to folders (not followed)"


@dataclass
class FileSample:
    key: str
    files: list[tuple[str, str, int]]  # (field, absolute path, size when listed), sorted by field
    tar_bytes: int  # estimated size in the tar (headers + padded data)


@dataclass
class DirectoryListing:
    samples: list[FileSample]
    # (path, reason): files the key rule cannot place (no extension under "first-dot",
    # dot-files), dot-folders (not entered) and links to folders (not followed)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, reason), skip_errors only
    # (path, reason): links not followed and files that are not regular (FIFOs, sockets,
    # devices: opening one can block forever), passed over with or without skip_errors
    passed_over: list[tuple[str, str]] = field(default_factory=list)
    # folders (relative to the root, "/"-separated) not entered because the listing was
    # not recursive: each can be listed on its own (``within=``), since a sample's files
    # always share a folder
    folders: list[str] = field(default_factory=list)


def is_parquet_tree(src: str) -> bool:
    """Whether the folder ``src`` is a Parquet table: every file in it and its subfolders
    (Hive partitions, ``year=2024/``) is a ``.parquet`` file, leaving out names starting
    with ``.`` or ``_`` (``_SUCCESS``, ``_metadata``), and there is at least one."""
    found = False
    for _dirpath, dirnames, names in os.walk(src):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
        for n in names:
            if n.startswith((".", "_")):
                continue
            if not n.endswith(".parquet"):
                return False
            found = True
    return found


def parquet_dataset(path: str, filesystem: Any = None) -> Any:
    """The pyarrow dataset of the Parquet table at ``path`` (a file or a folder, Hive keys
    as columns) with the columns of all its files: pyarrow takes the schema from the first
    file alone and drops columns only later files have. Columns with two types raise
    ``pyarrow.ArrowException`` (the caller names the table)."""
    import pyarrow as pa
    import pyarrow.dataset as pads

    ds = pads.dataset(path, format="parquet", partitioning="hive", filesystem=filesystem,
                      exclude_invalid_files=False)
    fragments = list(ds.get_fragments())
    schema = pa.unify_schemas([ds.schema, *(f.physical_schema for f in fragments)])
    if schema.equals(ds.schema):
        return ds
    return pads.FileSystemDataset(fragments, schema, ds.format, filesystem=ds.filesystem)


#: the environment variable that sets what a row group of a table may decode to when pack
#: reads it (as :func:`read_fragment` measures it; 1 GiB unless set): pack holds one row
#: group at a time, beside the shard it fills
PACK_ROW_GROUP_ENV = "DATAPIPE_PACK_ROW_GROUP_BYTES"
_PACK_ROW_GROUP_BYTES = 1 << 30
#: what a row costs at least once read, beyond its values: the Python objects a reader
#: makes of it (its dict, its key), so a footer of many empty rows is no bomb either
ROW_BYTES = 256
_VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8, "BYTE_ARRAY": 4}
_DICTIONARY_ENCODINGS = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}


def pack_row_group_bytes() -> int:
    """What a row group may decode to when pack reads it: ``$DATAPIPE_PACK_ROW_GROUP_BYTES``,
    else 1 GiB."""
    text = os.environ.get(PACK_ROW_GROUP_ENV)
    if text is None:
        return _PACK_ROW_GROUP_BYTES
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise OptionError(f"{PACK_ROW_GROUP_ENV}={text[:40]!r}: the most bytes pack may decode of one row group "
                          f"of a table; expected a positive integer of bytes (unset: {_PACK_ROW_GROUP_BYTES})")
    return value


def row_group_bytes(meta: Any, g: int) -> int:
    """What row group ``g`` of a Parquet file (its footer ``meta``) decodes to at least, from
    the footer alone: each column chunk's uncompressed size, or its values at their decoded
    width where run-length encoding stores many in a few bytes, and :data:`ROW_BYTES` per
    row. A dictionary-encoded column of text or bytes may decode to more (each value a copy
    of its dictionary entry): :func:`read_fragment` counts that before decoding it."""
    rg = meta.row_group(g)
    columns = 0
    for c in range(rg.num_columns):
        chunk = rg.column(c)
        columns += max(int(chunk.total_uncompressed_size), int(chunk.num_values) * _value_bytes(meta, c))
    return max(int(rg.total_byte_size), columns) + int(rg.num_rows) * ROW_BYTES


def _decoded_bytes(values: Any) -> int:
    """The bytes of the pyarrow array ``values`` with its dictionaries decoded (each value of
    a dictionary-encoded column a copy of its entry), without decoding them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.ChunkedArray):
        return sum(_decoded_bytes(chunk) for chunk in values.chunks)
    t = values.type
    if pa.types.is_dictionary(t):
        entries = values.dictionary
        if not (pa.types.is_binary(entries.type) or pa.types.is_large_binary(entries.type)
                or pa.types.is_string(entries.type) or pa.types.is_large_string(entries.type)):
            return int(values.nbytes)  # read_fragment asks for text and bytes dictionaries only
        lengths = pc.take(pc.binary_length(entries), values.indices)
        return int(pc.sum(lengths).as_py() or 0) + 8 * len(values)  # the values, their offsets
    if pa.types.is_struct(t):
        return sum(_decoded_bytes(child) for child in values.flatten()) + len(values) // 8
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_map(t):
        return _decoded_bytes(values.flatten()) + 8 * len(values)
    return int(values.nbytes)


def _value_bytes(meta: Any, c: int) -> int:
    """The bytes one value of column ``c`` of the file (its footer ``meta``) takes decoded."""
    column = meta.schema.column(c)
    if column.physical_type == "FIXED_LEN_BYTE_ARRAY":
        return max(int(column.length or 0), 1)
    return _VALUE_BYTES.get(column.physical_type, 8)


class _PageCheckedFile(SeekableFile):
    """The Parquet file that pyarrow reads one row group of, through ``pyarrow.PythonFile``.
    Without pre-buffering pyarrow reads each column chunk in one read from its start; the
    page headers in it are read first (:func:`datapipe.format.parquet_pages.chunk_pages`),
    and a chunk that takes the row group past ``limit`` is refused (``refuse``) before
    pyarrow decodes a page of it: a footer can understate what its pages hold. Any other
    read is refused too: it would be one these checks do not see."""

    def __init__(self, source: Any, meta: Any, g: int, limit: int, dictionaries: set[str], where: str,
                 refuse: Callable[[int, str], None], error: type[DatapipeError]) -> None:
        super().__init__(int(source.size()))
        self._source = source
        self._limit, self._where = limit, where
        self._refuse, self._error = refuse, error
        rg = meta.row_group(g)
        self.decoded = int(rg.num_rows) * ROW_BYTES
        # start -> (path, bytes, values, value bytes, whether a dictionary would go unmeasured)
        self._chunks: dict[int, tuple[str, int, int, int, bool]] = {}
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            start = int(chunk.data_page_offset)
            if chunk.has_dictionary_page and 0 < int(chunk.dictionary_page_offset or 0) < start:
                start = int(chunk.dictionary_page_offset)  # where pyarrow starts the chunk's read
            unmeasured = chunk.physical_type == "BYTE_ARRAY" and chunk.path_in_schema not in dictionaries
            self._chunks[start] = (chunk.path_in_schema, int(chunk.total_compressed_size),
                                   int(chunk.num_values), _value_bytes(meta, c), unmeasured)

    def read(self, n: int | None = -1) -> bytes:
        start = self._pos
        n = self._size - start if n is None or n < 0 else n
        chunk = self._chunks.pop(start, None)
        if chunk is None:
            raise self._error(f"{self._where}: pyarrow asked for bytes {start}..{start + n}, which start no column "
                              "chunk of the row group its footer describes (a damaged or crafted file)")
        path, length, values, width, unmeasured = chunk
        data = bytes(self._source.read_at(n, start))  # NativeFile.read_at gives bytes
        self._pos = start + len(data)
        pages = chunk_pages(data[:length], values, width, f"{self._where} column {path!r}")
        if pages.dictionary and unmeasured:  # its text or bytes would be decoded unmeasured
            raise self._error(f"{self._where} column {path!r}: its pages hold a dictionary that its footer does not "
                              "list among its encodings (a damaged or crafted file)")
        self.decoded += pages.decoded
        if self.decoded > self._limit:
            self._refuse(self.decoded, f"by its page headers, column {path!r} read last")
        return data


def read_fragment(frag: Any, schema: Any, g: int, max_bytes: int, where: str, budget: str,
                  error: type[DatapipeError]) -> Any:
    """Row group ``g`` of the Parquet file of the dataset fragment ``frag`` as a pyarrow
    table with ``schema`` (the dataset's): its Hive partition keys as columns, columns the
    file lacks as nulls. Read by ``pyarrow.parquet`` with no pre-buffering and no threads:
    pyarrow's dataset scanner starts Arrow's thread pools, whose threads can abort the
    process at exit ("terminate called without an active exception", apache/arrow#34314),
    so no datapipe process starts them.

    Memory: a row group that decodes to more than ``max_bytes`` is ``error`` naming the
    file (``where``), the row group and ``budget`` (what sets the limit, how to raise it):
    found from the footer before a byte of it is read (:func:`row_group_bytes`: a few
    kilobytes of compressed pages can claim gigabytes), then from each column chunk's page
    headers before pyarrow decodes it (:class:`_PageCheckedFile`: a footer can lie), and
    its dictionary-encoded text and bytes columns are read as dictionaries and measured
    before they are decoded."""
    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    meta = frag.metadata
    at = f"{where} row group {g}"

    def refuse(size: int, how: str) -> None:
        raise error(f"{at}: decodes to {size} bytes ({how}), more than the {max_bytes} bytes {budget}; or "
                    "rewrite the table with smaller row groups (pyarrow.parquet.write_table(..., row_group_size=ROWS))")

    size = row_group_bytes(meta, g)
    if size > max_bytes:
        refuse(size, "by the file's footer")
    rg = meta.row_group(g)
    dictionaries = {rg.column(c).path_in_schema for c in range(rg.num_columns)
                    if rg.column(c).physical_type == "BYTE_ARRAY"
                    and _DICTIONARY_ENCODINGS.intersection(rg.column(c).encodings)}
    # a Hive key wins over a column of the same name in the file, as in pyarrow's scanner
    keys = pads.get_partition_keys(frag.partition_expression)
    with frag.filesystem.open_input_file(frag.path) as source:
        checked = _PageCheckedFile(source, meta, g, max_bytes, dictionaries, at, refuse, error)
        # buffer_size=0: each column chunk in one read, which the checked file sees whole
        with pq.ParquetFile(pa.PythonFile(checked, mode="r"), metadata=meta, pre_buffer=False, buffer_size=0,
                            read_dictionary=sorted(dictionaries) or None) as f:
            have = set(f.schema_arrow.names) - set(keys)
            table = f.read_row_group(g, columns=[n for n in schema.names if n in have], use_threads=False)
    if dictionaries:
        size = sum(_decoded_bytes(col) for col in table.columns) + table.num_rows * ROW_BYTES
        if size > max_bytes:
            refuse(size, "its dictionary-encoded columns decoded")
    columns = []
    for column in schema:
        if column.name in keys:
            columns.append(pa.array([keys[column.name]] * table.num_rows, column.type))
        elif column.name in have:
            col = table.column(column.name)
            columns.append(col if col.type == column.type else col.cast(column.type))
        else:
            columns.append(pa.nulls(table.num_rows, column.type))
    return pa.Table.from_arrays(columns, schema=schema)


def source_kind(src: str) -> str:
    if os.path.isdir(src):
        return "parquet" if is_parquet_tree(src) else "directory"
    if not os.path.exists(src):
        raise InputFileError(f"input {src} does not exist")
    if src.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if src.endswith(".parquet"):
        return "parquet"
    raise PackError(f"cannot pack {src}: expected a directory, a .jsonl file or a .parquet file/directory")


def _member_tar_bytes(name: str, size: int) -> int:
    long = len(name) > 100 or (not name.isascii() and len(name.encode("utf-8", "surrogateescape")) > 100)
    return BLOCK + (3 * BLOCK if long else 0) + size + (-size % BLOCK)  # a long name: PAX or a ustar prefix


#: a file's status looked up by name in its folder's descriptor (``os.stat(name, dir_fd=)``)
_STAT_AT = os.stat in os.supports_dir_fd and os.scandir in os.supports_fd and hasattr(os, "O_DIRECTORY")


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _escape(name: str) -> str:
    return name.replace("%", "%25").replace(".", "%2E")


def file_key(rel: str) -> tuple[str, str] | None:
    """``keys="file"``: ``(key, field)`` of the file at relative path ``rel`` (one sample per
    file), or None for a dot-file. The key is the path itself; the field is the last
    extension in lower case (as WebDataset's reader gives it), or ``bin`` where the name has
    none. WebDataset cuts a key at the first dot of
    a member's file name, so the dots of the key's file name are written ``%2E`` (and ``%``
    as ``%25``): ``RelNotes/2.0.0.txt`` -> ``("RelNotes/2%2E0%2E0%2Etxt", "txt")``,
    ``copyright`` -> ``("copyright", "bin")``. Distinct paths give distinct keys, the path
    comes back by undoing the two escapes, and every reader cuts the member ``key.field``
    back to the same key and field."""
    folder, slash, base = rel.rpartition("/")
    if base.startswith("."):
        return None
    stem, dot, ext = base.rpartition(".")
    return folder + slash + _escape(base), ext.lower() if dot and stem and ext else "bin"


def list_directory(root: str, skip_errors: bool = False, follow_links: bool = False,
                   exclude: str | None = None, keys: str = "first-dot", *, within: str = "",
                   recursive: bool = True, allow_empty: bool = False) -> DirectoryListing:
    """Group every regular file under ``root`` into samples by the key rule ``keys`` (see
    :data:`KEY_RULES`), sorted by key. What the rule cannot place (dot-files; names
    without an extension under "first-dot"), dot-folders and links to folders are listed
    in ``dropped``. A symbolic link is followed only to a file inside ``root`` (anywhere
    with ``follow_links``) and is read at its target; anything but a regular file is passed
    over, never opened. ``exclude``: a folder never entered (the pack's own destination,
    when it lies inside ``root``: its lock, journal and shards are not input).

    Listing in pieces (a Ray pack lists folders in parallel): ``within`` lists only the
    folder ``root/within`` (keys still relative to ``root``); without ``recursive`` the
    subfolders are not entered but returned in ``folders``. The files of one sample share
    a folder under both key rules, so the pieces' samples are disjoint and their union
    is the whole listing. ``allow_empty``: no samples is not an error (a piece may hold
    none)."""
    if keys not in KEY_RULES:
        raise PackError(f"keys={keys!r}: expected one of {', '.join(KEY_RULES)}")
    cut_name = file_key if keys == "file" else split_member_name
    root = os.path.abspath(root)
    real_root = os.path.realpath(root)
    skip_dir = os.path.realpath(exclude) if exclude is not None else None
    groups: dict[str, list[tuple[str, str, int]]] = {}
    out = DirectoryListing([])
    checked: set[str] = set()
    start = within.strip("/")
    stack = [(os.path.join(root, *start.split("/")) if start else root, start + "/" if start else "")]
    tar_bytes: dict[str, int] = {}
    first_dot = keys == "first-dot"
    while stack:
        dirpath, prefix = stack.pop()
        fd = None
        try:
            # entries by a descriptor of the folder: each file's status is then looked up
            # by name in it, not by its whole path again (a third of a listing's time)
            fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if _STAT_AT else None
            entries = sorted(os.scandir(dirpath if fd is None else fd), key=lambda e: e.name)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            raise InputFileError(f"cannot list {dirpath}: {e.strerror}") from None
        base = os.path.join(dirpath, "")
        try:
            for entry in entries:
                name = entry.name
                path = base + name
                if entry.is_dir(follow_symlinks=False):
                    if name.startswith("."):
                        out.dropped.append((path, DOT_FOLDER))
                    elif os.path.realpath(path) == skip_dir:
                        pass
                    elif recursive:
                        stack.append((path, prefix + name + "/"))
                    else:
                        out.folders.append(prefix + name)
                    continue
                if entry.is_dir():  # a link to a directory: not followed, as os.walk does
                    out.dropped.append((path, LINKED_FOLDER))
                    continue
                rel = prefix + name
                cut = cut_name(rel)
                if cut is None:
                    out.dropped.append((path, DOT_FILE if name.startswith(".") else NO_EXTENSION))
                    continue
                key, fld = cut
                try:
                    if key not in checked:
                        rel.encode("utf-8")
                        check_key(key)
                        checked.add(key)
                    member_name(key, fld)  # the field too (c..d: field ".d"), here, not in a worker
                except (UnicodeEncodeError, InvalidMemberNameError) as e:
                    reason = (f"file name cannot be stored in tar as UTF-8: {e}" if isinstance(e, UnicodeEncodeError)
                              else f"file name cannot be stored in tar: {e}")
                    if not skip_errors:
                        raise InvalidMemberNameError(f"{path!r}: {reason} (rename it, or pass --skip-errors)") from None
                    out.bad.append((path, reason))
                    continue
                read_at = path
                try:
                    if entry.is_symlink():
                        target = os.path.realpath(path)
                        if not follow_links and not _inside(target, real_root):
                            out.passed_over.append((path, f"symbolic link to {target}, outside {root} "
                                                          "(not followed; pass --follow-links to follow it)"))
                            continue
                        read_at = target  # read what was checked, whatever the link says later
                        st = os.stat(target)
                    else:
                        st = os.stat(path) if fd is None else os.stat(name, dir_fd=fd)
                except OSError as e:
                    if not skip_errors:
                        raise InputFileError(f"cannot stat {path}: {e.strerror} (pass --skip-errors to skip it)"
                                             ) from None
                    out.bad.append((path, e.strerror or str(e)))
                    continue
                if not stat.S_ISREG(st.st_mode):
                    kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
                    out.passed_over.append((path, f"{kind}, not a regular file (not read)"))
                    continue
                size = st.st_size
                groups.setdefault(key, []).append((fld, read_at, size))
                tar_bytes[key] = tar_bytes.get(key, 0) + _member_tar_bytes(rel if first_dot else f"{key}.{fld}", size)
        finally:
            if fd is not None:
                os.close(fd)
    for key in sorted(groups):
        out.samples.append(FileSample(key, sorted(groups[key]), tar_bytes[key]))
    if not out.samples and not allow_empty:
        raise _no_samples(root, keys)
    return out


def _no_samples(root: str, keys: str) -> EmptyInputError:
    hint = "files need a 'key.field' name, or pass --keys file" if keys == "first-dot" else "no regular file"
    return EmptyInputError(f"no sample found under {root} ({hint})")


#: :func:`list_in_pieces` lists at most this many levels itself, looking for folders to hand out
_MAX_LEVELS = 3


def list_in_pieces(root: str, skip_errors: bool = False, follow_links: bool = False, exclude: str | None = None,
                   keys: str = "first-dot", *, pieces: int,
                   list_folders: Callable[[list[str]], Iterator[DirectoryListing]]) -> DirectoryListing:
    """The listing :func:`list_directory` gives (the same samples, and the same files
    dropped, skipped and passed over, in the same order, and the same first error), with
    whole folders listed elsewhere: the top levels are listed here without descending,
    until there are ``pieces`` folders (or three levels are listed), and
    ``list_folders(folders)`` yields the listing of each folder's subtree
    (``list_directory(..., within=folder, allow_empty=True)``), in order, listed elsewhere
    (by a pack's threads, by Ray tasks). A sample's files share a folder, so no sample is
    split between listings."""
    # ``units`` in the order a serial listing reaches them: a folder's own entries, then
    # its subfolders' subtrees, the last subfolder first (list_directory's stack)
    units: list[DirectoryListing | DatapipeError | str] = [""]
    for _ in range(_MAX_LEVELS):
        if sum(isinstance(u, str) for u in units) >= pieces:
            break
        expanded: list[DirectoryListing | DatapipeError | str] = []
        for u in units:
            if not isinstance(u, str):
                expanded.append(u)
                continue
            try:
                top = list_directory(root, skip_errors, follow_links, exclude, keys, within=u, recursive=False,
                                     allow_empty=True)
            except DatapipeError as e:  # raised in its turn, as a serial listing would meet it
                expanded.append(e)
                continue
            expanded.append(top)
            expanded.extend(reversed(top.folders))
        if len(expanded) == len(units):
            break
        units = expanded
    folders = [u for u in units if isinstance(u, str)]
    listed = list_folders(folders) if folders else iter(())
    out = DirectoryListing([])
    for u in units:
        part = next(listed) if isinstance(u, str) else u  # a folder's error is raised here, in order
        if isinstance(part, DatapipeError):
            raise part
        out.samples.extend(part.samples)
        out.dropped.extend(part.dropped)
        out.bad.extend(part.bad)
        out.passed_over.extend(part.passed_over)
    out.samples.sort(key=lambda s: s.key)
    if not out.samples:
        raise _no_samples(os.path.abspath(root), keys)
    return out


def _json_leaf(t: Any) -> bool:
    """Whether values of the pyarrow type ``t`` are JSON as Python gives them (a nested
    column's values are stored as JSON): text, booleans, numbers, nulls, and containers of them."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _json_leaf(t.value_type)
    if t.num_fields:  # list, map, struct, union: their children
        return all(_json_leaf(t.field(k).type) for k in range(t.num_fields))
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
                or pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t)
                or pa.types.is_null(t))


def check_table_columns(schema: Any, src: str) -> None:
    """Refuse, before any row is packed, a column of the pyarrow ``schema`` (of the table
    ``src``) that no sample could keep: a name starting with ``__`` other than ``__key__``
    (fields so named are not stored: it would vanish from every sample), or a list, map or
    struct holding bytes, dates, times or decimals (a nested value is stored as JSON, which
    has none of them; a struct of bytes at the top is one field per child instead, see
    :func:`~datapipe.format.rows.flatten_bytes_structs`)."""
    for f in flatten_bytes_structs(schema.empty_table(), src, InputFileError).schema:
        if f.name.startswith("__") and f.name != "__key__":
            raise InputFileError(f"{src}: column {f.name!r}: names starting with '__' are reserved ('__key__' "
                                 "names the sample), so it would be dropped from every sample; rename the column")
        if f.type.num_fields and not _json_leaf(f.type):
            raise InputFileError(
                f"{src}: column {f.name!r} ({f.type}): a list, map or struct is stored as JSON, which holds no "
                "bytes, dates, times or decimals; make each such value a top-level column (a struct of bytes "
                "at the top becomes one field per child), or encode them (e.g. base64 text) before packing")


def count_table_rows(src: str, kind: str) -> int:
    """The rows of a JSONL or Parquet table (a Parquet table's columns checked first:
    :func:`check_table_columns`, and the row group limit, :func:`pack_row_group_bytes`)."""
    if kind == "jsonl":
        with open(src, "rb") as f:
            return sum(1 for line in f if line.strip())
    import pyarrow as pa

    rows = 0
    try:  # from the footers, not a scan (see read_fragment)
        ds = parquet_dataset(src)
        for f in ds.get_fragments():
            rows += int(f.metadata.num_rows)
            flatten_bytes_structs(f.physical_schema.empty_table(), f.path, InputFileError)  # names the file
    except (pa.ArrowException, OSError) as e:
        raise InputFileError(f"{src}: not a readable Parquet table: {e}") from e
    check_table_columns(ds.schema, src)
    pack_row_group_bytes()  # a bad limit refused before anything is written
    return rows


def _row_to_sample(row: dict[str, Any], index: int, where: str) -> dict[str, Any]:
    key = row.pop("__key__", None)
    key = f"{index:09d}" if key is None else key_text(key, where, index, InputFileError)
    reserved = [name for name in row if name.startswith("__")]
    if reserved:  # never stored as fields: refused, not dropped
        raise InputFileError(f"{where}: row {index} has field {reserved[0]!r}: names starting with '__' are "
                             "reserved ('__key__' names the sample), so it would be dropped; rename it")
    sample: dict[str, Any] = {"__key__": key, **row_fields(row)}
    if len(sample) == 1:
        raise PackError(f"{where}: row {index} (key {key!r}) has no non-null field")
    return sample


def iter_table(src: str, kind: str, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
    """Rows ``[start, stop)`` of a JSONL or Parquet table as sample dicts: a row is a sample,
    a column a field; ``__key__`` names the sample (binary decoded as UTF-8), else the row
    number (zero-padded). Errors name the file and row: a value Python cannot hold (a
    timestamp past ``datetime``'s years, a string that is not UTF-8) with its column. The
    columns were checked by :func:`count_table_rows` (:func:`check_table_columns`), which a
    pack calls first, before anything is written."""
    if kind == "jsonl":
        with open(src, "rb") as f:
            i = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if i >= start and (stop is None or i < stop):
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise InputFileError(f"{src}:{lineno}: not JSON: {e}") from None
                    if not isinstance(row, dict):
                        raise InputFileError(f"{src}:{lineno}: a line must be a JSON object")
                    yield _row_to_sample(row, i, f"{src}:{lineno}")
                i += 1
                if stop is not None and i >= stop:
                    return
        return
    import pyarrow as pa

    try:
        ds = parquet_dataset(src)  # Hive folders: their keys are columns
    except (pa.ArrowException, OSError) as e:
        raise InputFileError(f"{src}: not a readable Parquet table: {e}") from e
    i, limit = 0, pack_row_group_bytes()
    for frag in ds.get_fragments():
        try:
            meta = frag.metadata
        except (pa.ArrowException, OSError) as e:
            raise InputFileError(f"{frag.path}: not a readable Parquet file: {e}") from e
        for g in range(meta.num_row_groups):  # one row group in memory at a time
            n = meta.row_group(g).num_rows
            if i + n <= start:
                i += n
                continue
            try:
                table = read_fragment(frag, ds.schema, g, limit, frag.path,
                                      f"pack decodes of a table at a time (one row group; set {PACK_ROW_GROUP_ENV} "
                                      "to raise it)", InputFileError)
            except (pa.ArrowException, OSError) as e:
                raise InputFileError(f"{frag.path} row group {g}: cannot be read: {e}") from e
            where, first = f"{frag.path} row group {g}", 0  # first: the batch's first row in the row group
            table = flatten_bytes_structs(table, where, InputFileError)
            for batch in table.to_batches(max_chunksize=1024):  # Python objects for 1024 rows at a time
                a = min(max(start - i, 0), batch.num_rows)  # the rows [a, b) of the batch are in [start, stop)
                b = batch.num_rows if stop is None else min(batch.num_rows, stop - i)
                if a < b:  # only those become Python objects: another part's bad value is not this one's
                    for k, row in enumerate(python_rows(batch.slice(a, b - a), where, InputFileError, first + a)):
                        yield _row_to_sample(row, i + a + k, src)
                i += batch.num_rows
                first += batch.num_rows
                if stop is not None and i >= stop:
                    return
