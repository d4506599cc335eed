"""What :func:`~datapipe.tokens.pack_tokens` reads: Parquet and JSONL files (a file, a folder,
a glob or brace pattern, or a list of them; local paths or any fsspec URL, read through
:mod:`datapipe.storage`), cut into **pieces** (runs of Parquet row groups, byte windows of a
JSONL file) that depend on the input and ``piece_bytes`` only, and read as batches of
documents: texts for a tokenizer, or token ids with their lengths.

A JSONL piece ``[start, stop)`` holds the lines that *start* in it, so pieces tile the file
without a scan for line ends. Every file is read at the size and version it had when it
was listed (else :class:`~datapipe.errors.ObjectChangedError`). Bad input is an
:class:`~datapipe.errors.InputFileError` naming the file and the row (a Parquet row number,
or a JSONL line number).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    DatapipeError,
    InputFileError,
    MissingDependencyError,
    ObjectChangedError,
    ObjectNotFoundError,
    PackOptionError,
    StorageError,
)
from ..options import check_path
from ..storage import Store, expand_braces, glob_urls, has_glob, is_local_url, open_store, split_url

__all__ = ["InputFile", "Piece", "Batch", "KINDS", "absolute_url", "list_inputs", "plan_pieces", "read_piece",
           "load_tokenizer", "import_tokenizers", "column_kind", "StoreFile", "EOS_TOKENS", "BATCH_DOCUMENTS",
           "BATCH_TOKENS", "MAX_LINE_BYTES"]

#: file name endings -> kind
KINDS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
#: the tokens a tokenizer names its end of document with, in the order they are looked for
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]")
#: documents per batch of text (one encode_batch call)
BATCH_DOCUMENTS = 1024
#: tokens per batch of token ids (at least one document)
BATCH_TOKENS = 1 << 22
#: a JSONL line longer than this is refused (a line is held in memory whole)
MAX_LINE_BYTES = 1 << 28
_INSTALL = "pip install 'datapipe[tokens]'"


@dataclass(frozen=True)
class InputFile:
    """One input file: ``url`` (an absolute path locally), its store's root ``folder`` and
    ``key``, its ``kind`` and the size and version it had when listed."""

    url: str
    folder: str
    key: str
    kind: str
    size: int
    version: str | None


@dataclass(frozen=True)
class Piece:
    """A unit of work: Parquet row groups ``row_groups`` (whose first row is row
    ``first_row`` of the file), or the JSONL lines starting in bytes ``[start, stop)``."""

    index: int
    file: InputFile
    row_groups: tuple[int, ...] = ()
    first_row: int = 0
    start: int = 0
    stop: int = 0
    input_bytes: int = 0

    @property
    def name(self) -> str:
        return f"piece-{self.index:05d}"


@dataclass
class Batch:
    """Documents read from a piece: ``texts``, or token ``values`` back to back with their
    ``lengths``. ``rows`` names each document's row in errors: Parquet row numbers of the
    file, or JSONL byte offsets of the lines (turned into line numbers only for a message)."""

    texts: list[str] | None
    values: npt.NDArray[np.int64] | None
    lengths: npt.NDArray[np.int64]
    rows: list[int]
    file: InputFile
    store: Store

    def where(self, j: int) -> str:
        """The file and row of document ``j``, for a message."""
        if self.file.kind == "parquet":
            return f"{self.file.url} row {self.rows[j]}"
        return f"{self.file.url} line {_line_number(self.store, self.file, self.rows[j])}"


# --- listing ----------------------------------------------------------------------------


def _kind(url: str) -> str | None:
    low = url.lower()
    return next((k for ext, k in KINDS.items() if low.endswith(ext)), None)


def _hidden(rel: str) -> bool:
    return any(p.startswith((".", "_")) for p in rel.split("/"))


def absolute_url(url: str) -> str:
    """A local path made absolute (``file://`` dropped); a URL without its trailing slash."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    return os.path.abspath(url) if is_local_url(url) else url.rstrip("/")


def _is_folder(url: str, storage_options: dict[str, Any] | None) -> bool:
    if is_local_url(url):
        return os.path.isdir(url)
    return _kind(url) is None


def _listed(url: str, storage_options: dict[str, Any] | None, exclude: str | None) -> list[str]:
    """The input files in the folder ``url`` and its subfolders, sorted (names starting with
    ``.`` or ``_`` passed over, and the folder ``exclude``: the destination)."""
    store = open_store(url, storage_options)
    try:
        keys = store.list()
    except ObjectNotFoundError:
        keys = []
    out = []
    for k in keys:
        full = store.url(k)
        if _hidden(k) or _kind(k) is None:
            continue
        if exclude is not None and (full == exclude or full.startswith(exclude.rstrip("/") + "/")):
            continue
        out.append(full)
    return out


def list_inputs(source: Any, storage_options: dict[str, Any] | None = None,
                exclude: str | None = None) -> list[InputFile]:
    """Every input file ``source`` names, in order: a file, a folder (its Parquet and JSONL
    files, subfolders included, sorted), a glob or brace pattern (sorted), or a list of
    them; each with its size and version. ``exclude``: a folder never listed (the
    destination). Nothing found, a file named twice or of another kind is an error."""
    items = [source] if isinstance(source, str | os.PathLike) else source
    if not isinstance(items, list | tuple) or not items:
        raise PackOptionError(f"source={source!r}: expected a path or URL (a file, a folder or a glob), or a "
                              "non-empty list of them")

    urls: list[str] = []
    for item in items:
        text = check_path("source", item, error=PackOptionError)
        found: list[str] = []
        for name in expand_braces(text):
            if has_glob(name):
                found.extend(glob_urls(name, storage_options))
            elif _is_folder(name, storage_options):
                found.extend(_listed(name, storage_options, exclude))
            elif is_local_url(name) and not os.path.lexists(absolute_url(name)):
                raise ObjectNotFoundError(f"source {text!r}: nothing at {absolute_url(name)}")
            else:
                found.append(name)
        if not found:
            raise ObjectNotFoundError(f"source {text!r} names no Parquet or JSONL file (expected .parquet, "
                                      ".jsonl, .ndjson or .json files)")
        urls.extend(absolute_url(u) for u in found)
    seen: set[str] = set()
    out: list[InputFile] = []
    for url in urls:
        if url in seen:
            raise PackOptionError(f"source: {url} is named twice")
        seen.add(url)
        kind = _kind(url)
        if kind is None:
            raise PackOptionError(f"source: {url} is neither Parquet (.parquet) nor JSONL (.jsonl, .ndjson, .json)")
        folder, key = split_url(url)
        store = open_store(folder, storage_options)
        try:
            size, version = store.stat(key)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(f"input {url} does not exist") from None
        out.append(InputFile(url, folder, key, kind, size, version))
    return out


# --- tokenizers -------------------------------------------------------------------------


def import_tokenizers() -> Any:
    """The ``tokenizers`` module, or :class:`MissingDependencyError` naming the extra."""
    try:
        import tokenizers
    except ImportError as e:
        raise MissingDependencyError(f"a tokenizer needs Hugging Face tokenizers, which does not import here "
                                     f"({e}): {_INSTALL}") from None
    return tokenizers


def load_tokenizer(tokenizer: Any, storage_options: dict[str, Any] | None = None) -> tuple[str, int, int | None]:
    """(its JSON, its vocabulary size with added tokens, its end-of-document id or None) of
    ``tokenizer``: a ``tokenizers.Tokenizer``, a ``transformers`` fast tokenizer (its
    backend), or the path or URL of a ``tokenizer.json`` (or of a folder holding one)."""
    eos: int | None = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # transformers' PreTrainedTokenizerFast
        eos_id = getattr(tokenizer, "eos_token_id", None)
        eos = eos_id if isinstance(eos_id, int) else None
        tokenizer = backend
    if isinstance(tokenizer, str | os.PathLike):
        tk = import_tokenizers()
        path = check_path("tokenizer", tokenizer, error=PackOptionError)
        if (is_local_url(path) and os.path.isdir(path)) or (not is_local_url(path) and not path.endswith(".json")):
            path = path.rstrip("/") + "/tokenizer.json"
        folder, key = split_url(absolute_url(path))
        try:
            text = open_store(folder, storage_options).get(key).decode("utf-8")
            tokenizer = tk.Tokenizer.from_str(text)
        except (DatapipeError, UnicodeDecodeError) as e:
            raise PackOptionError(f"tokenizer={path!r}: cannot read it ({e})") from None
        except Exception as e:  # the tokenizers library raises plain Exceptions on a bad file
            raise PackOptionError(f"tokenizer={path!r}: not a tokenizers JSON file ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None
    to_str = getattr(tokenizer, "to_str", None)
    if not callable(to_str) or not callable(getattr(tokenizer, "encode_batch", None)):
        raise PackOptionError(f"tokenizer={type(tokenizer).__name__}: expected a tokenizers.Tokenizer, a "
                              "transformers fast tokenizer, or the path of a tokenizer.json")
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if eos is None:
        for name in EOS_TOKENS:
            found = tokenizer.token_to_id(name)
            if found is not None:
                eos = int(found)
                break
    return str(to_str()), vocab, eos


# --- planning ---------------------------------------------------------------------------


class StoreFile(io.RawIOBase):
    """A file of a :class:`Store` as a seekable binary file, every read pinned to the
    version it was listed with (so a file rewritten meanwhile is an ObjectChangedError)."""

    def __init__(self, store: Store, f: InputFile) -> None:
        self.store, self.f, self.pos = store, f, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.f.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def size(self) -> int:
        return self.f.size

    def readinto(self, b: Any) -> int:
        end = min(self.pos + len(b), self.f.size)
        if end <= self.pos:
            return 0
        data = self.store.get_range_at(self.f.key, self.pos, end, self.f.version)
        memoryview(b).cast("B")[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _store(f: InputFile, storage_options: dict[str, Any] | None) -> Store:
    return open_store(f.folder, None if is_local_url(f.folder) else storage_options)


def _check_unchanged(store: Store, f: InputFile) -> None:
    try:
        now = store.stat(f.key)
    except ObjectNotFoundError:
        raise ObjectChangedError(f"{f.url} was removed while it was packed; run the same command again") from None
    if now != (f.size, f.version):
        raise ObjectChangedError(f"{f.url} changed since it was listed (size or version differs): run the "
                                 "same command again for a pack of the new contents")


def _parquet(store: Store, f: InputFile) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = store.local_path(f.key)
    try:
        return pq.ParquetFile(path if path is not None else StoreFile(store, f), pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, DatapipeError):
            raise
        raise InputFileError(f"{f.url}: not a readable Parquet file: {e}") from None


def column_kind(arrow_type: Any) -> str | None:
    """``"text"`` for a string column, ``"tokens"`` for a list of integers, else None."""
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "text"
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
            and pa.types.is_integer(t.value_type):
        return "tokens"
    return None


def plan_pieces(files: list[InputFile], column: str, mode: str, piece_bytes: int,
                storage_options: dict[str, Any] | None = None) -> list[Piece]:
    """The pieces of ``files``, in order: a Parquet file's consecutive row groups until their
    ``column`` holds ``piece_bytes`` (uncompressed; at least one row group each), a JSONL
    file's windows of ``piece_bytes``. A Parquet ``column`` that is missing or of the wrong
    type (``mode`` "text": strings; "tokens": lists of integers) is refused here, before
    anything is written."""
    pieces: list[Piece] = []
    for f in files:
        if f.kind == "jsonl":
            for a in range(0, f.size, piece_bytes):
                b = min(a + piece_bytes, f.size)
                pieces.append(Piece(len(pieces), f, start=a, stop=b, input_bytes=b - a))
            continue
        store = _store(f, storage_options)
        pf = _parquet(store, f)
        schema = pf.schema_arrow
        if column not in schema.names:
            raise InputFileError(f"{f.url}: no column {column!r} (it has {', '.join(schema.names[:10])}); "
                                 + ("pass text_column= / --text-column" if mode == "text"
                                    else "pass tokens_column= / --tokens-column, or a tokenizer for a text column"))
        kind = column_kind(schema.field(column).type)
        if kind != mode:
            want = "strings (text)" if mode == "text" else "lists of integers (token ids)"
            hint = "" if kind is None else (" (it holds text: pass a tokenizer)" if kind == "text"
                                            else " (it holds token ids: pass no tokenizer)")
            raise InputFileError(f"{f.url}: column {column!r} is {schema.field(column).type}, expected {want}{hint}")
        meta = pf.metadata
        leaves = [j for j in range(meta.num_columns)
                  if meta.schema.column(j).path.split(".")[0] == column]
        group: list[int] = []
        first = row = size = 0
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            if not group:
                first = row
            group.append(g)
            size += sum(int(rg.column(j).total_uncompressed_size) for j in leaves)
            row += int(rg.num_rows)
            if size >= piece_bytes:
                pieces.append(Piece(len(pieces), f, tuple(group), first, input_bytes=size))
                group, size = [], 0
        if group:
            pieces.append(Piece(len(pieces), f, tuple(group), first, input_bytes=size))
    return pieces


# --- reading ----------------------------------------------------------------------------


def _line_number(store: Store, f: InputFile, offset: int) -> int:
    """The 1-based line number of the line starting at byte ``offset`` of ``f`` (a scan of
    the bytes before it: only for an error message)."""
    try:
        raw = StoreFile(store, f)
        count, pos = 0, 0
        while pos < offset:
            chunk = raw.read(min(1 << 24, offset - pos))
            if not chunk:
                break
            count += chunk.count(b"\n")
            pos += len(chunk)
        return count + 1
    except DatapipeError:
        return -1


def _token_array(value: Any) -> npt.NDArray[np.int64] | None:
    """``value`` as a 1-d int64 array if it is a list of integers (no bools), else None."""
    if not isinstance(value, list):
        return None
    if not value:
        return np.empty(0, np.int64)
    if any(type(v) is not int for v in value):
        return None
    try:
        return np.array(value, dtype=np.int64)
    except OverflowError:
        return None


def _jsonl_batches(raw: Any, store: Store, piece: Piece, column: str, mode: str) -> Iterator[Batch]:
    f = piece.file
    buf = io.BufferedReader(raw, 4 << 20)
    pos = piece.start
    if pos > 0:  # the rest of the line that started before the piece belongs to the piece before
        buf.seek(pos - 1)
        pos -= 1
        while True:
            rest = buf.readline(1 << 24)
            pos += len(rest)
            if not rest or rest.endswith(b"\n"):
                break
    texts: list[str] = []
    arrays: list[npt.NDArray[np.int64]] = []
    rows: list[int] = []

    def flush() -> Batch:
        lengths = np.array([a.size for a in arrays] if mode == "tokens" else [0] * len(texts), dtype=np.int64)
        values = np.concatenate([*arrays, np.empty(0, np.int64)]) if mode == "tokens" else None
        return Batch(list(texts) if mode == "text" else None, values, lengths, list(rows), f, store)

    while pos < piece.stop:
        line = buf.readline(MAX_LINE_BYTES)
        if not line:
            break
        at = pos
        pos += len(line)
        if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise InputFileError(f"{f.url} line {_line_number(store, f, at)}: longer than {MAX_LINE_BYTES:,} bytes; "
                                 "split the document")
        if not line.strip():
            continue

        def here(at: int = at) -> str:
            return f"{f.url} line {_line_number(store, f, at)}"

        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise InputFileError(f"{here()}: not JSON: {str(e)[:200]}") from None
        if not isinstance(row, dict):
            raise InputFileError(f"{here()}: a line must be a JSON object")
        if column not in row:
            hint = ("pass text_column= / --text-column" if mode == "text"
                    else "pass tokens_column= / --tokens-column, or a tokenizer for a text field")
            raise InputFileError(f"{here()}: no field {column!r} (it has {', '.join(list(row)[:10])}): {hint}")
        value = row[column]
        if mode == "text":
            if not isinstance(value, str):
                raise InputFileError(f"{here()}: field {column!r} is {type(value).__name__}, not text")
            texts.append(value)
        else:
            arr = _token_array(value)
            if arr is None:
                raise InputFileError(f"{here()}: field {column!r} is not a list of integer token ids")
            arrays.append(arr)
        rows.append(at)
        if len(rows) >= BATCH_DOCUMENTS:
            yield flush()
            texts, arrays, rows = [], [], []
    if rows:
        yield flush()


def _python_texts(part: Any, f: InputFile, first: int, column: str) -> list[str]:
    """A string array's values as Python strings; one that is not UTF-8 is named by row."""
    try:
        texts: list[str] = part.to_pylist()
    except UnicodeDecodeError:
        for j in range(len(part)):
            try:
                part[j].as_py()
            except UnicodeDecodeError as e:
                raise InputFileError(f"{f.url} row {first + j}: column {column!r} is not UTF-8 text ({e})") from None
        raise
    return texts


def _parquet_batches(store: Store, piece: Piece, column: str, mode: str) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.compute as pc

    f = piece.file
    pf = _parquet(store, f)
    row = piece.first_row
    for g in piece.row_groups:
        try:
            col = pf.read_row_group(g, columns=[column], use_threads=False).column(0)
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, DatapipeError):
                raise
            raise InputFileError(f"{f.url} row group {g}: cannot be read: {e}") from None
        for chunk in col.chunks:
            if chunk.null_count:
                j = int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
                raise InputFileError(f"{f.url} row {row + j}: column {column!r} is null (no document)")
            if mode == "text":
                if pa.types.is_dictionary(chunk.type):
                    chunk = chunk.dictionary_decode()
                for a in range(0, len(chunk), BATCH_DOCUMENTS):
                    part = chunk.slice(a, BATCH_DOCUMENTS)
                    yield Batch(_python_texts(part, f, row + a, column), None, np.zeros(len(part), np.int64),
                                list(range(row + a, row + a + len(part))), f, store)
                row += len(chunk)
                continue
            lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
            ends = np.cumsum(lengths)
            a = 0
            while a < len(chunk):  # batches of about BATCH_TOKENS tokens (at least one row)
                before = int(ends[a - 1]) if a else 0
                b = max(a + 1, int(np.searchsorted(ends, before + BATCH_TOKENS, side="right")))
                part = chunk.slice(a, b - a)
                flat = part.flatten()
                if flat.null_count:
                    k = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
                    j = a + int(np.searchsorted(ends[a:b] - before, k, side="right"))
                    raise InputFileError(f"{f.url} row {row + j}: column {column!r} holds a null token id")
                yield Batch(None, flat.to_numpy(zero_copy_only=False), lengths[a:b],
                            list(range(row + a, row + b)), f, store)
                a = b
            row += len(chunk)


def read_piece(piece: Piece, column: str, mode: str, storage_options: dict[str, Any] | None = None
               ) -> Iterator[Batch]:
    """The documents of ``piece`` as batches, in order. The file must still have the size
    and version it was listed with, before and after (and, remotely, every read is pinned to
    that version)."""
    f = piece.file
    store = _store(f, storage_options)
    _check_unchanged(store, f)
    if f.kind == "parquet":
        yield from _parquet_batches(store, piece, column, mode)
    else:
        path = store.local_path(f.key)
        try:
            raw: Any = open(path, "rb", buffering=0) if path is not None else StoreFile(store, f)
        except OSError as e:
            raise StorageError(f"cannot read {f.url}: {e.strerror or e}") from None
        with raw:
            yield from _jsonl_batches(raw, store, piece, column, mode)
    _check_unchanged(store, f)
