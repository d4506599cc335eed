"""The benchmarks load datapipe compiled, as the peers' installed wheels are loaded."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datapipe

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_benchmarks_writes_datapipes_bytecode_where_the_environment_forbids_it(tmp_path: Path) -> None:
    # a copy of the package without bytecode, found before the checkout's
    package = Path(datapipe.__file__).parent
    shutil.copytree(package, tmp_path / "datapipe", ignore=shutil.ignore_patterns("__pycache__"))
    sources = sorted((tmp_path / "datapipe").rglob("*.py"))
    assert sources and not list((tmp_path / "datapipe").rglob("*.pyc"))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    code = "import datapipe, benchmarks; print(datapipe.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "datapipe" / "__init__.py")
    missing = [str(p) for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    assert not missing, missing[:5]
