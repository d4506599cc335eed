"""Build code of the documentation site (mkdocs.yml `hooks:`), and the checks the tests share.

- The benchmark report lives with its figures in benchmarks/results/ (where
  ``python -m benchmarks.report`` writes them); the site serves that folder as
  ``benchmarks/`` without a copy, so the report's relative links and plots keep working.
- The troubleshooting page holds one section per error class of datapipe/errors.py; the tree
  of the classes is generated from the module, and a class without a section (or a section
  of no class) fails the build, as it fails tests/test_docs_site.py.
- Docstrings are written with Sphinx roles (``:class:`~datapipe.Dataset```); the API pages
  show such a name as code, without the role.

Imports nothing of mkdocs at module level, so the tests use it without mkdocs installed.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the repository folder served under ``benchmarks/`` and the kinds of file taken from it
BENCHMARK_RESULTS = os.path.join(ROOT, "benchmarks", "results")
BENCHMARK_FILES = (".md", ".png", ".json", ".txt")
TROUBLESHOOTING = "troubleshooting.md"
#: where the generated tree of the error classes goes in the troubleshooting page
TREE_MARK = "<!-- errors: tree -->"
SECTION = re.compile(r"^### `(\w+)`\s*$", re.MULTILINE)


def error_classes() -> list[type[BaseException]]:
    """The classes datapipe.errors defines, in the order of its ``__all__``."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import datapipe.errors as errors

    return [getattr(errors, name) for name in errors.__all__]


def troubleshooting_problems(text: str) -> list[str]:
    """What the troubleshooting page (its markdown ``text``) lacks or has too many of: a
    section ``### `Name``` per class of datapipe.errors, none of any other name, none twice,
    and the tree's mark."""
    names = [c.__name__ for c in error_classes()]
    sections = SECTION.findall(text)
    problems = [f"datapipe.errors.{n} has no section '### `{n}`' in docs/{TROUBLESHOOTING}: say what it means "
                "and what to do" for n in names if n not in sections]
    problems += [f"docs/{TROUBLESHOOTING}: section '### `{s}`' names no class of datapipe.errors"
                 for s in sorted(set(sections) - set(names))]
    problems += [f"docs/{TROUBLESHOOTING}: section '### `{s}`' appears {sections.count(s)} times"
                 for s in sorted({s for s in sections if sections.count(s) > 1})]
    if TREE_MARK not in text:
        problems.append(f"docs/{TROUBLESHOOTING}: the mark {TREE_MARK} (where the tree of the errors goes) is missing")
    return problems


def _anchor(name: str) -> str:
    return name.lower()  # the toc extension's slug of a heading that is one name in backticks


def error_tree() -> str:
    """The error classes as a nested list (each under its first base among them, with its
    other bases named), each linking to its section."""
    classes = error_classes()
    known = set(classes)
    children: dict[Any, list[type[BaseException]]] = {}
    for c in classes:
        parents = [b for b in c.__bases__ if b in known]
        children.setdefault(parents[0] if parents else None, []).append(c)
    lines: list[str] = []

    def add(parent: Any, depth: int) -> None:
        for c in children.get(parent, []):
            others = [b.__name__ for b in c.__bases__ if b is not parent]
            also = f" (also {', '.join(f'`{o}`' for o in others)})" if others else ""
            summary = (inspect.getdoc(c) or "").split(". ")[0].split("\n\n")[0].replace("\n", " ").rstrip(".")
            lines.append(f"{'    ' * depth}- [`{c.__name__}`](#{_anchor(c.__name__)}){also}: {summary}.")
            add(c, depth + 1)

    add(None, 0)
    return "\n".join(lines)


# --- mkdocs hooks ------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for folder, dirs, names in os.walk(BENCHMARK_RESULTS):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "tmp")))
        for name in sorted(names):
            if name.endswith(BENCHMARK_FILES):
                path = os.path.join(folder, name)
                uri = "benchmarks/" + os.path.relpath(path, BENCHMARK_RESULTS).replace(os.sep, "/")
                files.append(File.generated(config, uri, abs_src_path=path))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != TROUBLESHOOTING:
        return markdown
    problems = troubleshooting_problems(markdown)
    if problems:
        from mkdocs.exceptions import PluginError

        raise PluginError("; ".join(problems))
    return markdown.replace(TREE_MARK, error_tree())


#: a Sphinx role as the API pages render it: ``:class:`~datapipe.X``` -> ``:class:<code>~datapipe.X</code>``
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]+)</code>")


def _role(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _ROLE.sub(_role, html)
