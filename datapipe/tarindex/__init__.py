"""Existing tar shards (WebDataset's ShardWriter/TarWriter, GNU tar, Ray write_webdataset)
read in place: `index_shards` writes the datapipe index beside them or elsewhere, and
`resolve_source` indexes shard URLs given to a reader on first use (cached).

Sits beside ``dataset.py`` and ``pack/``: imports dataset, format, storage, pack (commit,
lock, part), errors."""

from .build import IndexResult, index_shards
from .resolve import index_location, open_dataset, resolve_source
from .urls import expand_braces, expand_urls, is_tar_source

__all__ = ["IndexResult", "expand_braces", "expand_urls", "index_location", "index_shards", "is_tar_source",
           "open_dataset", "resolve_source"]
