"""Table rows as the fields of a sample (one mechanism for pack and the loader)."""

from __future__ import annotations

from typing import Any

__all__ = ["flatten_bytes_structs", "row_fields"]


def _holds_bytes(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
                or pa.types.is_binary_view(t))


def flatten_bytes_structs(table: Any) -> Any:
    """The pyarrow table (or record batch) ``table`` with each struct column that has a
    binary child (a Hugging Face ``Image`` or ``Audio`` column: ``{"bytes": ..., "path":
    ...}``) replaced by one column per child, ``column.child``, so its bytes stay bytes.
    Decided by the schema, so every row has the same field names, whichever of its values
    are null."""
    import pyarrow as pa

    if isinstance(table, pa.RecordBatch):
        return flatten_bytes_structs(pa.Table.from_batches([table]))
    for i in reversed(range(table.num_columns)):
        f = table.schema.field(i)
        if pa.types.is_struct(f.type) and any(_holds_bytes(f.type.field(k).type) for k in range(f.type.num_fields)):
            children = pa.Table.from_arrays([table.column(i)], names=[f.name]).flatten()
            table = table.remove_column(i)
            for k in range(children.num_columns):
                table = table.add_column(i + k, children.schema.field(k), children.column(k))
    return table


def row_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns as fields, None values left out (a row of a table that went
    through :func:`flatten_bytes_structs`)."""
    return {name: value for name, value in row.items() if value is not None}
