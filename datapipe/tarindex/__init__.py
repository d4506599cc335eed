"""Existing tar shards (WebDataset's ShardWriter/TarWriter, GNU tar, Ray write_webdataset)
read in place: `index_shards` writes the datapipe index beside them or elsewhere, and
`resolve_source` indexes shard URLs given to a reader on first use (cached).

Holds: ``urls`` (URL expansion: braces, globs, folders; one stat per shard), ``build``
(``index_shards``: one read and one strict scan per shard, per-shard records under
``_index/``, published through :mod:`datapipe.publish`: the writer lock, the manifest
last), ``resolve`` (``resolve_source``/``open_dataset``: shard URLs given to a reader indexed
on first use, cached). Sits beside ``dataset.py`` and ``packing/``: imports dataset, decode,
format, publish, storage, progress, options, errors; other packages import the names below
from here."""

from .build import RECORDS, IndexResult, index_shards
from .resolve import index_location, open_dataset, resolve_source
from .urls import expand_braces, expand_urls, is_tar_source

__all__ = ["RECORDS", "IndexResult", "expand_braces", "expand_urls", "index_location", "index_shards", "is_tar_source",
           "open_dataset", "resolve_source"]
