"""The cache package's layout, read from its source: no module imports another's private
name, no import circle among its modules (imports inside functions count: they hide a
circle, they do not break it), and other packages are reached only through their faces."""

import ast
import pathlib
import warnings

import pytest

import datapipe.cache

PACKAGE = pathlib.Path(datapipe.cache.__file__).parent
MODULES = {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}


def _imports(path):
    """(module the import names, relative level, names imported, line) of every import."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, 0, [], node.lineno


def test_no_module_imports_a_private_name():
    bad = [f"{name}.py:{line}: {n}" for name, path in MODULES.items()
           for _m, _lv, names, line in _imports(path) for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def _graph():
    """module -> the modules of this package it imports."""
    graph = {}
    for name, path in MODULES.items():
        deps = set()
        for module, level, names, _line in _imports(path):
            if level == 1:
                deps |= {module} if module else set(names)
            elif module.startswith("datapipe.cache."):
                deps.add(module.split(".")[2])
        graph[name] = deps & set(MODULES) - {name}
    return graph


def test_no_import_circle():
    graph = _graph()
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import circle: " + " -> ".join([*path, m])
        state[m] = "open"
        for d in sorted(graph[m]):
            visit(d, [*path, m])
        state[m] = "done"

    for m in sorted(graph):
        if m != "__init__":  # the face imports its modules (lazily); none imports the face
            visit(m, [])
    assert not any("__init__" in deps for m, deps in graph.items() if m != "__init__")


def test_other_packages_are_reached_through_their_faces():
    bad = [f"{name}.py:{line}: {'.' * level}{module}" for name, path in MODULES.items()
           for module, level, _names, line in _imports(path)
           if (level >= 2 and "." in module) or (level == 0 and module.startswith("datapipe.")
                                                 and not module.startswith("datapipe.cache"))]
    assert not bad, bad


def test_the_old_name_of_cache_tier_still_works_and_says_it_is_old():
    with pytest.warns(DeprecationWarning, match="CacheTier"):
        old = datapipe.cache.Tier
    assert old is datapipe.cache.CacheTier
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name is no warning
        from datapipe.cache import CacheTier
    assert CacheTier("/x", 1) == old("/x", 1)
