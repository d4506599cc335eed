"""Packages meet at their faces: ``datapipe.pack`` is the function (the packer is the
package ``datapipe.packing``, no module-type swap), publishing is ``datapipe.publish``,
the lease errors live in ``datapipe.errors``, and the packages that publish (packing,
publish, tarindex, ray, the CLI) import other packages only through their ``__init__``
and never a ``_private`` name of another module."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import subprocess
import sys
import types

import pytest

import datapipe
import datapipe.errors

ROOT = pathlib.Path(datapipe.__file__).parent
PUBLISHING = ["packing", "publish", "tarindex", "ray", "cli.py"]


def _files(parts):
    for part in parts:
        path = ROOT / part
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def _imports(path):
    """(line, package imported from, its inner module or None, names) of each relative import."""
    here = path.relative_to(ROOT).parts
    package = here[0] if len(here) > 1 else None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:-1][: len(here) - node.level]  # the package the dots name
            target = [*base, *(node.module or "").split(".")] if node.module else list(base)
            target = [t for t in target if t]
            yield node.lineno, package, target, [a.name for a in node.names]


def test_datapipe_pack_is_the_function_and_no_module():
    assert isinstance(datapipe.pack, types.FunctionType) and datapipe.pack is datapipe.packing.pack
    assert type(datapipe) is types.ModuleType  # no module-type swap
    assert "pack" not in {m.name for m in pkgutil.iter_modules(datapipe.__path__)}  # the packer is `packing`
    out = subprocess.run([sys.executable, "-c", "import datapipe.packing, datapipe; print(callable(datapipe.pack), "
                          "datapipe.packing.file_key('a/b.c.jpg'))"], capture_output=True, text=True, check=True)
    assert out.stdout.split(None, 1) == ["True", "('a/b%2Ec%2Ejpg', 'jpg')\n"]


def test_the_lease_errors_are_in_errors_and_named_by_storage():
    from datapipe.storage import lease

    for name in ("LeaseBusyError", "LeaseLostError"):
        error = getattr(datapipe.errors, name)
        assert name in datapipe.errors.__all__ and issubclass(error, datapipe.errors.StorageError)
        assert getattr(lease, name) is error and error.__module__ == "datapipe.errors"


@pytest.mark.parametrize("path", list(_files(PUBLISHING)), ids=lambda p: str(p.relative_to(ROOT)))
def test_publishing_packages_import_other_packages_by_their_faces_only(path):
    for line, package, target, names in _imports(path):
        other = target and target[0] != package and (ROOT / target[0]).is_dir()
        assert not (other and len(target) > 1), f"{path}:{line} imports {'.'.join(target)}, inside {target[0]}"
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{path}:{line} imports the private {private} of {'.'.join(target)}"


@pytest.mark.parametrize("face", ["datapipe.storage", "datapipe.format", "datapipe.publish", "datapipe.packing",
                                  "datapipe.tarindex"])
def test_each_face_gives_every_name_it_states(face):
    module = importlib.import_module(face)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{face}.{name}"


def test_what_other_packages_take_from_storage_and_format_is_on_their_faces():
    # every name another package imports from inside storage/ or format/ is on that face
    # (or, an error, in datapipe.errors), so each package can import it from there
    for path in ROOT.rglob("*.py"):
        for line, package, target, names in _imports(path):
            if len(target) > 1 and target[0] in ("storage", "format") and target[0] != package \
                    and target[1] != "tokens":
                face = importlib.import_module(f"datapipe.{target[0]}")
                missing = [n for n in names if n not in face.__all__ and n not in datapipe.errors.__all__]
                assert not missing, f"{path}:{line}: datapipe.{target[0]} lacks {missing}"
