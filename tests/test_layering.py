"""The house's rules, checked on the code's own imports (AST, nothing imported):

- no module imports another module's ``_private`` name (``from .x import _y``; a name
  shared between modules gets a public name in the module that owns it);
- no import circle between modules, counting imports inside functions too (a circle
  hidden by a function-local import is still a circle); ``if TYPE_CHECKING:`` imports
  are for type checkers only and are left out;
- another package is reached through its face (its ``__init__``), never an inner module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "datapipe"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if _is_package(path) else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    if hasattr(n, "lineno"):
                        lines.add(n.lineno)
    return lines


def _bound_names(path: Path) -> set[str]:
    """The names a package's ``__init__`` binds itself (imports, definitions, assignments):
    ``from .pkg import commit`` then takes the face's ``commit``, not the submodule."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _imports(mods: dict[str, Path]):
    """(importer, imported module, names, line) for every import in datapipe/."""
    bound = {m: _bound_names(p) for m, p in mods.items() if _is_package(p)}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path, node)
                if not target.startswith("datapipe"):
                    continue
                names = [a.name for a in node.names]
                # `from . import x` / `from .pkg import mod`: a submodule, when one exists and
                # the package's face does not bind that name itself
                subs = [n for n in names if f"{target}.{n}" in mods and n not in bound.get(target, set())]
                for n in subs:
                    yield mod, f"{target}.{n}", [], node.lineno
                yield mod, target, [n for n in names if n not in subs], node.lineno
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("datapipe"):
                        yield mod, a.name, [], node.lineno


def test_no_module_imports_a_private_name_of_another():
    mods = _modules()
    bad = [f"{mod}:{line} imports {n} from {target}"
           for mod, target, names, line in _imports(mods)
           for n in names if n.startswith("_") and not n.startswith("__") and target != mod]
    assert not bad, "\n".join(bad)


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in mods}
    for mod, target, _names, _line in _imports(mods):
        if target in mods and target != mod:
            # a package's __init__ importing its own submodules is its face, not a dependency
            # of those submodules; a submodule importing its own package's face is the circle
            g[mod].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    mods = _modules()
    g = _graph(mods)
    # a package's face importing its own inner modules lazily is how faces work; the edge
    # from an inner module back up to its own package's __init__ is what would make a circle
    for m, path in mods.items():
        if _is_package(path):
            g[m] = {t for t in g[m] if not t.startswith(m + ".")}
    cycles = _cycles(g)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


#: modules a package's face declares to be faces of their own (their names would clash with
#: the package's: the token format's ``MANIFEST`` is not the dataset index's)
SUBFACES = {"datapipe.format.tokens"}


def test_other_packages_are_reached_through_their_faces():
    mods = _modules()
    packages = {m for m, p in mods.items() if _is_package(p) and m != "datapipe"}
    bad = []
    for mod, target, _names, line in _imports(mods):
        for pkg in packages:
            inside_target = target.startswith(pkg + ".")
            inside_importer = mod == pkg or mod.startswith(pkg + ".")
            if inside_target and not inside_importer and target not in SUBFACES:
                bad.append(f"{mod}:{line} imports {target}, inside {pkg}")
    assert not bad, "\n".join(sorted(set(bad)))
