"""datapipe's benchmarks (``python -m benchmarks.<name>``; ``benchmarks.report`` runs them all).

Importing this package first writes datapipe's bytecode (``__pycache__``), as ``pip install``
does for the peers' wheels: with ``PYTHONDONTWRITEBYTECODE`` set (this machine sets it) an
editable checkout has none, and every fresh process of a measurement (a pack worker, a job's
interpreter, a forkserver or spawn child) would compile datapipe's sources again while the peers load
theirs compiled: a start-up cost that favours the peers. A no-op when the bytecode is current."""

from __future__ import annotations

import compileall
import importlib.util


def _compile_datapipe() -> None:
    spec = importlib.util.find_spec("datapipe")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        compileall.compile_dir(folder, quiet=2)


_compile_datapipe()
