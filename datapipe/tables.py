"""Parquet tables read in place: a dataset of Parquet files (one file, a folder, Hive
partitions) streamed by row group, without packing.

    ds = StreamingDataset("s3://bucket/table/")          # or a .parquet file
    for sample in ds: sample["__key__"], sample["caption"], sample["image.bytes"], ...

Each row group is one "shard" of the plan (its row count is all the plan needs), so the
global shuffle, the exact partition over ranks x workers and resume hold as for packed
shards. A row is a sample: its ``__key__`` column if it has one (and it is not null; a
binary key is decoded as UTF-8), else ``<file>/<row>``; columns are fields (see
:func:`datapipe.format.rows.flatten_bytes_structs`: a struct of bytes such as a Hugging Face
``Image`` column becomes ``image.bytes`` and ``image.path``); the partition keys of Hive
folders are columns too.

What is trusted: Parquet files carry no checksum of ours. Each file's size and version
(mtime or etag) are recorded when the table is opened and the plan is made from its row
groups; a row group's rows are delivered only if its file has that size and version
before and after they are read (else :class:`~datapipe.errors.ObjectChangedError`), and pyarrow's parse errors are
:class:`~datapipe.errors.FormatError` naming file and row group. So is a value Python cannot hold
(a timestamp past ``datetime``'s years, a string that is not UTF-8), naming its row and column
too: a field's is that row's error (``on_error="skip"`` skips the row), a ``__key__``'s the
row group's (every row of it raises, or is skipped).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .checksum import checksum
from .dataset import ShardInfo
from .errors import DatapipeError, FormatError, ObjectChangedError, ObjectNotFoundError, PlanError
from .format import flatten_bytes_structs, key_text, python_values
from .storage import is_local_url, open_store, refuse_chained_url, storage_options_for

__all__ = ["ParquetTable", "is_parquet_source"]

def is_parquet_source(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a Parquet table to read in place: a ``.parquet`` file, or a folder
    without a datapipe manifest (nor a pack's or an index's work folder) whose files are
    Parquet files (Hive partitions included)."""
    url = os.fspath(url)
    if url.rstrip("/").endswith(".parquet"):
        return True
    if is_local_url(url):
        path = url[len("file://"):] if url.startswith("file://") else url
        if not os.path.isdir(path) or os.path.exists(os.path.join(path, "manifest.json")):
            return False
        from .publish import RECORDS, WORK

        # the work folders pack and index write beside their index files: a folder holding
        # one is a datapipe destination whose manifest is still to come, not a table
        if any(os.path.isdir(os.path.join(path, ours)) for ours in (WORK, RECORDS)):
            return False
        from .packing import is_parquet_tree

        return is_parquet_tree(path)
    store = open_store(url, storage_options)
    try:
        if store.exists("manifest.json"):
            return False
        names = [n for n in store.list("") if not os.path.basename(n).startswith((".", "_"))]
    except DatapipeError:
        return False
    return bool(names) and all(n.endswith(".parquet") for n in names)


class ParquetTable:
    """The row groups of a Parquet table as the shards of a plan (the part of
    :class:`~datapipe.dataset.DatasetIndex` that the loader uses)."""

    compression = "none"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import pyarrow as pa

        from .packing import parquet_dataset, row_group_bytes

        self.url = os.fspath(url).rstrip("/")
        refuse_chained_url(self.url)
        self.storage_options = storage_options
        local = is_local_url(self.url)
        path = self.url[len("file://"):] if self.url.startswith("file://") else self.url
        fs = None
        if not local:
            import fsspec

            protocol, _, rest = self.url.partition("://")
            fs = fsspec.filesystem(protocol, **storage_options_for(self.url, storage_options))
            path = rest
        try:
            self._dataset = parquet_dataset(path, fs)
            fragments = sorted(self._dataset.get_fragments(), key=lambda f: f.path)
        except (OSError, pa.ArrowException) as e:  # pyarrow's errors on a missing or damaged table
            raise FormatError(f"{self.url}: not a readable Parquet table: {e}") from e
        if not fragments:
            raise PlanError(f"{self.url}: no Parquet file in this table; nothing to stream")
        is_file = path.rstrip("/").endswith(".parquet")
        self._is_file = is_file
        root = os.path.dirname(path.rstrip("/")) if is_file else path.rstrip("/")
        self.store = open_store(root if local else f"{self.url.partition('://')[0]}://{root}", storage_options)
        self._row_groups: list[tuple[Any, int, str]] = []  # (fragment, row group, file name)
        self._files: dict[str, tuple[int, str | None]] = {}
        self._file_first: dict[str, int] = {}  # the first sample of each file
        shards: list[ShardInfo] = []
        counts: list[int] = []
        first = 0
        for frag in fragments:
            rel = os.path.relpath(frag.path, root) if local else frag.path[len(root):].lstrip("/")
            size, version = self._stat(rel)
            self._files[rel] = (size, version)
            self._file_first[rel] = first
            try:
                meta = frag.metadata
                columns = frag.physical_schema  # from the footer just read
            except (OSError, ValueError) as e:
                raise FormatError(f"{self._file_url(rel)}: not a readable Parquet file: {e}") from e
            flatten_bytes_structs(columns.empty_table(), self._file_url(rel))  # two columns giving one field
            for i in range(meta.num_row_groups):
                rg = meta.row_group(i)
                rows = int(rg.num_rows)
                name = f"{rel}#rowgroup={i}"
                shards.append(ShardInfo(name=name, url=f"{self.url}/{name}", bytes=max(row_group_bytes(meta, i), 1),
                                        samples=rows, checksum=checksum(f"{rel}\0{size}\0{version}\0{i}".encode()),
                                        first_sample=first, tar_bytes=0))
                self._row_groups.append((frag, i, rel))
                counts.append(rows)
                first += rows
        self.shards = shards
        self.sample_counts: NDArray[np.int64] = np.asarray(counts, dtype=np.int64)
        self.num_samples = int(self.sample_counts.sum())
        self.schema = self._dataset.schema
        flatten_bytes_structs(self.schema.empty_table(), self.url)  # the same across files and Hive keys
        self.manifest = {"kind": "parquet", "files": sorted([k, v[0], v[1]] for k, v in self._files.items()),
                         "schema": self.schema.to_string()}
        self._lock = threading.Lock()

    def _file_url(self, rel: str) -> str:
        """The URL of the table's file ``rel`` (the table's own when it is one file), for errors."""
        return self.url if self._is_file else f"{self.url}/{rel}"

    def _stat(self, rel: str) -> tuple[int, str | None]:
        try:
            return self.store.stat(rel)
        except ObjectNotFoundError:
            raise
        except DatapipeError as e:
            raise FormatError(f"{self._file_url(rel)}: cannot stat this Parquet file: {e}") from e

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def read_row_group(self, i: int, max_bytes: int = 512 << 20) -> tuple[Any, list[str]]:
        """(the rows of row group ``i`` as a pyarrow table with the table's schema, their keys),
        once its file is checked to be the one the plan was made from. ``max_bytes``: what
        the row group may decode to (the reader's ``prefetch_bytes``; StreamingDataset's
        default here), else a :class:`~datapipe.errors.FormatError` before it is decoded."""
        import pyarrow as pa

        from .packing import read_fragment

        frag, rg, rel = self._row_groups[i]
        if self._stat(rel) != self._files[rel]:
            raise ObjectChangedError(f"{self._file_url(rel)} changed since the table was opened (its size or version "
                                     "differs): open the dataset again for a plan of the new rows")
        try:
            table = read_fragment(frag, self.schema, rg, max_bytes, self._file_url(rel),
                                  "a row group may take within the dataset's prefetch_bytes (pass a larger "
                                  "prefetch_bytes to StreamingDataset to read it)", FormatError)
        except (OSError, pa.ArrowException) as e:
            raise FormatError(f"{self._file_url(rel)} row group {rg}: cannot be read: {e}") from e
        if self._stat(rel) != self._files[rel]:  # replaced after the check above, or while read
            raise ObjectChangedError(f"{self._file_url(rel)} changed while row group {rg} was read (its size or "
                                     "version differs): open the dataset again for a plan of the new rows")
        info = self.shards[i]
        if table.num_rows != info.samples:
            raise FormatError(f"{self._file_url(rel)} row group {rg}: {table.num_rows} rows, the file's footer says "
                              f"{info.samples}")
        table = flatten_bytes_structs(table, f"{self._file_url(rel)} row group {rg}")
        start = info.first_sample - self._file_first[rel]
        keys = [f"{rel}/{start + j:09d}" for j in range(info.samples)]
        if "__key__" in table.column_names:  # its values, where not null
            where = f"{self._file_url(rel)} row group {rg}"
            values = python_values(table.column("__key__"), "__key__", where)
            keys = [k if v is None else key_text(v, where, j) for j, (k, v) in enumerate(zip(keys, values))]
            table = table.drop_columns(["__key__"])
        return table, keys

