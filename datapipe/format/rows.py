"""Table rows as the fields of a sample (one mechanism for pack and the loader)."""

from __future__ import annotations

from typing import Any

from ..errors import DatapipeError, FormatError

__all__ = ["flatten_bytes_structs", "row_fields", "python_rows", "python_values", "key_text"]


def _holds_bytes(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
                or pa.types.is_binary_view(t))


def flatten_bytes_structs(table: Any, where: str = "table", error: type[DatapipeError] = FormatError) -> Any:
    """The pyarrow table (or record batch) ``table`` with each struct column that has a
    binary child (a Hugging Face ``Image`` or ``Audio`` column: ``{"bytes": ..., "path":
    ...}``) replaced by one column per child, ``column.child``, so its bytes stay bytes.
    Decided by the schema, so every row has the same field names, whichever of its values
    are null. Two columns that would give one field name (a struct ``image`` beside a
    column ``image.bytes``, or a name twice) are ``error`` naming ``where`` and both: a row
    holds one value per field, so one of them would be dropped."""
    import pyarrow as pa

    if isinstance(table, pa.RecordBatch):
        return flatten_bytes_structs(pa.Table.from_batches([table]), where, error)
    given: dict[str, str] = {}  # field name -> the column that gives it
    flatten: list[int] = []  # the struct columns to flatten
    for i, f in enumerate(table.schema):
        names, column = [f.name], f"column {f.name!r}"
        if pa.types.is_struct(f.type) and any(_holds_bytes(f.type.field(k).type) for k in range(f.type.num_fields)):
            flatten.append(i)
            names = [f"{f.name}.{f.type.field(k).name}" for k in range(f.type.num_fields)]
            column = f"struct column {f.name!r} (one field per child)"
        for name in names:
            if name in given:
                raise error(f"{where}: {given[name]} and {column} both give the field {name!r}, and a sample holds "
                            "one value per field, so one would be dropped: rename one of the columns")
            given[name] = column
    for i in reversed(flatten):
        f = table.schema.field(i)
        children = pa.Table.from_arrays([table.column(i)], names=[f.name]).flatten()
        table = table.remove_column(i)
        for k in range(children.num_columns):
            table = table.add_column(i + k, children.schema.field(k), children.column(k))
    return table


def row_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns as fields, None values left out (a row of a table that went
    through :func:`flatten_bytes_structs`)."""
    return {name: value for name, value in row.items() if value is not None}


def _conversion_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow's ``to_pylist`` raises on a value Python cannot hold: a timestamp or
    date past ``datetime``'s years 1-9999 (OverflowError), a string that is not UTF-8
    (UnicodeDecodeError: a damaged data page), a time zone Python does not know (KeyError)."""
    import pyarrow as pa

    return (OverflowError, ValueError, KeyError, pa.ArrowException)


def _converts(values: Any) -> bool:
    try:
        values.to_pylist()
    except _conversion_errors():
        return False
    return True


def _why(e: BaseException) -> str:
    if isinstance(e, UnicodeDecodeError):
        return ("a string that is not UTF-8 (a damaged data page, or bytes written as a string column): "
                "rewrite the file, or store the column as binary")
    if isinstance(e, OverflowError):
        return ("a date, time or duration beyond what Python's datetime holds (years 1 to 9999): "
                "cast the column to int64 or string in the table")
    return "a value Python cannot hold: rewrite the column with a type it can"


def python_values(column: Any, name: str, where: str, error: type[DatapipeError] = FormatError,
                  first: int = 0) -> list[Any]:
    """``column.to_pylist()`` (a pyarrow array or chunked array, column ``name`` of the
    rows ``where`` names, the first of them row ``first``); a value Python cannot hold is
    ``error`` naming its row and column (found by halving: each half converted in C)."""
    try:
        return list(column.to_pylist())
    except _conversion_errors() as e:
        lo, hi = 0, len(column)  # a value that does not convert lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _converts(column.slice(lo, mid - lo)):
                lo = mid
            else:
                hi = mid
        raise error(f"{where}: row {first + lo}, column {name!r}: {_why(e)} ({type(e).__name__}: "
                    f"{str(e)[:200]})") from e


def python_rows(table: Any, where: str, error: type[DatapipeError] = FormatError,
                first: int = 0) -> list[dict[str, Any]]:
    """``table.to_pylist()`` (a pyarrow table or record batch, the rows ``where`` names,
    the first of them row ``first``); a value Python cannot hold is ``error`` naming its
    row and column, never pyarrow's or Python's own exception."""
    try:
        return list(table.to_pylist())
    except _conversion_errors() as e:
        for name in table.column_names:  # the column that fails raises, naming its row
            python_values(table.column(name), name, where, error, first)
        raise error(f"{where}: rows {first} to {first + table.num_rows - 1}: {_why(e)} ({type(e).__name__}: "
                    f"{str(e)[:200]})") from e


def key_text(value: Any, where: str, row: int | None, error: type[DatapipeError] = FormatError) -> str:
    """A ``__key__`` value as the sample's key: a binary key decoded as UTF-8 (never the
    ``"b'...'"`` of ``str(bytes)``; one that is not UTF-8 is ``error`` naming its row),
    other values as ``str`` gives them."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            at = "" if row is None else f"row {row}, "
            raise error(f"{where}: {at}column '__key__': the key {bytes(value)[:100]!r} is not UTF-8 "
                        f"({e.reason} at byte {e.start}); a key must be text: rewrite the column as UTF-8 "
                        "strings") from None
    return str(value)
