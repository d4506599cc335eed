"""Storage options set once per URL prefix, for every store datapipe opens.

    datapipe.set_storage_options("s3://bucket/", {"client_kwargs": {"endpoint_url": "http://minio:9000"}})

Every ``open_store`` (datasets, the cache's cold reads, pack, checkpoints) merges the
options of the longest prefix that covers the URL (whole path segments: ``s3://b`` covers
``s3://b/x``, not ``s3://b-public/x``) under the options passed to it explicitly
(explicit keys win; a nested dict such as ``client_kwargs`` is merged one level deep).
The environment variable ``DATAPIPE_STORAGE_OPTIONS`` holds the same as JSON
(``{"s3://bucket/": {...}}``) for processes that datapipe does not start itself (every
rank of a job); options set in the process win over it. Stores carry their merged options
into the worker processes they are pickled into.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from ..errors import OptionError, StorageError

__all__ = ["set_storage_options", "storage_options_for"]

ENV = "DATAPIPE_STORAGE_OPTIONS"
_set: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def set_storage_options(prefix: str, options: dict[str, Any] | None) -> None:
    """Options for every URL under ``prefix`` (``"s3://"``, ``"s3://bucket/"``; cut at whole
    path segments: ``"s3://bucket"`` is not a prefix of ``"s3://bucket-public/"``); ``None``
    forgets the prefix."""
    if not isinstance(prefix, str) or "://" not in prefix:
        raise OptionError(f"a storage-options prefix is a URL prefix with a protocol, such as 's3://bucket/', "
                          f"got {prefix!r}")
    if options is not None and (not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options)):
        raise OptionError(f"the storage options for {prefix!r} are a dict of fsspec options by name (str), or None "
                          f"to forget the prefix; got {type(options).__name__}")
    with _lock:
        if options is None:
            _set.pop(prefix, None)
        else:
            _set[prefix] = dict(options)


def _from_environment() -> dict[str, dict[str, Any]]:
    text = os.environ.get(ENV)
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise StorageError(f"{ENV} is not JSON ({e}); it maps URL prefixes to storage options, e.g. "
                           '{"s3://bucket/": {"client_kwargs": {"endpoint_url": "http://host:9000"}}}') from None
    # what is wrong is named, never the value: it holds keys and secrets
    if not isinstance(doc, dict):
        raise StorageError(f"{ENV} must map URL prefixes to dicts of storage options, got a JSON "
                           f"{type(doc).__name__}")
    for prefix, options in doc.items():
        if "://" not in prefix:
            raise StorageError(f"{ENV}: the prefix {prefix[:100]!r} has no protocol; use a URL prefix such "
                               "as 's3://bucket/'")
        if not isinstance(options, dict):
            raise StorageError(f"{ENV}: the options of {prefix[:100]!r} must be a JSON object, got a "
                               f"{type(options).__name__}")
    return doc


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _covers(prefix: str, url: str) -> bool:
    """Whether ``prefix`` names ``url`` or a folder above it, cut at whole path segments:
    ``s3://b`` and ``s3://b/`` cover ``s3://b`` and ``s3://b/x``, not ``s3://b-public/x``;
    ``s3://`` covers every s3 URL."""
    if prefix.endswith("://"):
        return url.startswith(prefix)
    folder = prefix.rstrip("/")
    return url.rstrip("/") == folder or url.startswith(folder + "/")


def storage_options_for(url: str, explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options a store for ``url`` opens with: those of the longest matching prefix
    (set here, else from the environment) with ``explicit`` merged over them."""
    with _lock:
        table = {**_from_environment(), **_set}
    matches = [p for p in table if _covers(p, url)]
    base = table[max(matches, key=len)] if matches else {}
    return _merged(base, dict(explicit or {}))
