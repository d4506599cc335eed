"""Package attributes imported on first use (PEP 562): a process that needs one part of
datapipe (``datapipe pack``, the checkpoint writer process) does not pay for importing
the others, and torch stays optional. Type checkers see the names through the package's
``if TYPE_CHECKING:`` imports."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any], where: dict[str, str],
                 submodules: frozenset[str] = frozenset()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose name ``n`` lives in its submodule
    ``where[n]``; a name once imported is kept in ``namespace`` (the package's globals), so
    later lookups do not come here. The names in ``submodules`` are submodules that an
    eager import of the package used to bind (``import datapipe; datapipe.cache.Tier``):
    each is imported on first use, which binds it."""

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return import_module(f".{name}", package)
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where, *submodules})

    return __getattr__, __dir__
