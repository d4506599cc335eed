"""A table row as the fields of a sample (one mechanism for pack and the loader)."""

from __future__ import annotations

from typing import Any

__all__ = ["row_fields"]


def row_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns as fields, None values left out. A struct column that holds bytes
    (a Hugging Face ``Image`` or ``Audio`` column: ``{"bytes": ..., "path": ...}``) becomes
    one field per child, ``column.child``, so its bytes stay bytes."""
    out: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, dict) and any(isinstance(v, (bytes, bytearray)) for v in value.values()):
            for child, v in value.items():
                if v is not None:
                    out[f"{name}.{child}"] = v
        elif value is not None:
            out[name] = value
    return out
