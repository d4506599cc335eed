"""What every datapipe manifest (a dataset's, a token dataset's) shares around its own
fields: JSON naming its ``format`` and ``version``, and a ``manifest_checksum`` over the
canonical JSON of every other field (:func:`datapipe.checksum.canonical_json`), so no field
can change unnoticed. :func:`seal_manifest` writes one, :func:`open_manifest` and
:func:`check_manifest_checksum` read one back; each manifest's own fields are its module's."""

from __future__ import annotations

import json
from typing import Any

from ..checksum import canonical_json, checksum
from ..errors import CorruptIndexError, FormatError

__all__ = ["CHECKSUM_FIELD", "seal_manifest", "open_manifest", "check_manifest_checksum"]

#: the field holding a manifest's checksum of its other fields
CHECKSUM_FIELD = "manifest_checksum"


def seal_manifest(doc: dict[str, Any], *, allow_nan: bool = False) -> bytes:
    """``doc`` with its ``manifest_checksum`` set, as the bytes of a manifest file (indented,
    keys sorted, a newline at the end)."""
    doc[CHECKSUM_FIELD] = checksum(canonical_json(doc, omit=CHECKSUM_FIELD, allow_nan=allow_nan))
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=allow_nan).encode() + b"\n"


def open_manifest(data: bytes, where: str, *, name: str, version: int | tuple[int, ...],
                  what: str) -> dict[str, Any]:
    """The JSON object of the manifest ``data`` (at ``where``), once it names format
    ``name`` and ``version`` (or one of the versions given: the ones a reader reads;
    ``what``: how messages name its kind, "dataset", "token"); else
    :class:`CorruptIndexError` (not JSON) or :class:`FormatError`."""
    versions = (version,) if isinstance(version, int) else version
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptIndexError(f"{where}: manifest is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != name:
        raise FormatError(f"{where}: not a datapipe {what} manifest (format != {name!r})")
    if doc.get("version") not in versions:
        raise FormatError(f"{where}: {what} format version {doc.get('version')!r}; this datapipe reads "
                          f"version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))} "
                          "(upgrade datapipe)")
    return doc


def check_manifest_checksum(doc: dict[str, Any], where: str, remedy: str, *, allow_nan: bool = False) -> None:
    """:class:`CorruptIndexError` naming ``where`` and saying ``remedy`` unless the manifest's
    ``manifest_checksum`` is the checksum of its other fields."""
    stored = doc.get(CHECKSUM_FIELD)
    try:
        ok = isinstance(stored, str) \
            and checksum(canonical_json(doc, omit=CHECKSUM_FIELD, allow_nan=allow_nan)) == stored
    except ValueError:  # 1e999 parses to inf, which canonical JSON refuses
        ok = False
    if not ok:
        raise CorruptIndexError(f"{where}: manifest checksum mismatch (the manifest was damaged or edited); {remedy}")
