"""Bytes by URL, in tiers. The only package that imports fsspec."""

from .stores import FsspecStore, LocalStore, MemoryStore, Store, join_url, open_store, split_url

__all__ = ["Store", "MemoryStore", "LocalStore", "FsspecStore", "open_store", "split_url", "join_url"]
