"""Every ```python and ```bash block of the README, the docs site's home page and the guides
runs, in order, as a user would paste it: one fresh temporary folder per document (files a
block writes are there for the next block; variables are not: each block is a script of its
own), with this checkout first on PYTHONPATH and the interpreter's folder first on PATH, so
``datapipe ...`` in a bash block is this checkout's command.

A block that only shows syntax (a bucket that is not there, a cluster) is marked by an HTML
comment on the line before it: ``<!-- not-run: why -->``. A block that needs something this
machine may lack says so: ``<!-- requires: NAME -->`` where NAME is a module
(``ray``), a name a module must export (``datapipe.TokenDataset``) or an absolute path
(``/usr/share/icons/Adwaita/48x48``); it runs where NAME is there and is counted as not
run where it is not. Each document's test prints its counts, and a document may not mark
more of its blocks than it runs.

The Ray guide starts Ray clusters, so its test is marked ``ray`` (``python -m pytest -m ray
-n 0``), as the other Ray tests are.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
#: the documents whose code blocks run: the README, the site's home page, every guide
DOCUMENTS = ["README.md", "docs/index.md",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md"))]
#: documents whose blocks start Ray: run with the Ray tests
RAY_DOCUMENTS = {"docs/guides/ray.md"}
LANGUAGES = {"python", "bash"}
#: seconds one block may take (a block that trains or packs stays well under a minute)
BLOCK_TIMEOUT_S = 240

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```|~~~)(?P<info>[^\n`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<kind>not-run|requires)\s*:\s*(?P<value>.*?)\s*-->\s*$")


@dataclass
class Block:
    document: str
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None = None  # why it is not run (marked syntax)
    requires: str | None = None


def code_blocks(document: str, text: str) -> list[Block]:
    """The fenced blocks of ``text`` in ``LANGUAGES``, with the directive of the line before
    each. A directive not followed by such a block is an error (it would mark nothing)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            d = _DIRECTIVE.match(lines[i])
            if d:
                nxt = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                if not nxt or nxt.group("info").strip().split(" ")[0] not in LANGUAGES:
                    raise AssertionError(f"{document}:{i + 1}: {lines[i].strip()} is not right before a ```python "
                                         "or ```bash block")
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        language = m.group("info").strip().split(" ")[0] if m.group("info").strip() else ""
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip() == fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i >= len(lines):
            raise AssertionError(f"{document}:{start + 1}: a code block that is never closed")
        i += 1
        if language not in LANGUAGES:
            continue
        block = Block(document, start + 1, language, "\n".join(body) + "\n")
        d = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
        if d:
            if not d.group("value"):
                raise AssertionError(f"{document}:{start}: {d.group('kind')}: says nothing (give the reason or name)")
            if d.group("kind") == "not-run":
                block.not_run = d.group("value")
            else:
                block.requires = d.group("value")
        blocks.append(block)
    return blocks


def missing(requirement: str) -> str | None:
    """Why ``requirement`` is not met here, or None."""
    if requirement.startswith("/"):
        return None if os.path.exists(requirement) else f"{requirement} does not exist on this machine"
    parts = requirement.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[cut:])} here (not yet importable)"
            obj = getattr(obj, attr)
        return None
    return f"{requirement} does not import here"


def environment(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["DATAPIPE_CACHE_DIR"] = str(workdir / ".datapipe-cache")  # indexes of tar shards, not in ~/.cache
    env["MPLBACKEND"] = "Agg"
    env.pop("RAY_ADDRESS", None)
    return env


def run_block(block: Block, workdir: Path, n: int) -> None:
    script = workdir / f".block-{n:02d}.{'py' if block.language == 'python' else 'sh'}"
    script.write_text(block.code)
    cmd = [sys.executable, str(script)] if block.language == "python" else ["bash", "-euo", "pipefail", str(script)]
    try:
        r = subprocess.run(cmd, cwd=workdir, env=environment(workdir), capture_output=True, text=True,
                           timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{block.document}:{block.line}: the {block.language} block ran past "
                             f"{BLOCK_TIMEOUT_S} s\n{block.code}\n--- output ---\n{e.stdout}\n{e.stderr}") from None
    if r.returncode != 0:
        raise AssertionError(f"{block.document}:{block.line}: the {block.language} block exited {r.returncode}\n"
                             f"{block.code}\n--- stdout ---\n{r.stdout[-6000:]}\n--- stderr ---\n{r.stderr[-6000:]}")


def _params() -> list[object]:
    out = []
    for doc in DOCUMENTS:
        # a guide's blocks together may take minutes on a loaded 2-core machine
        marks = [pytest.mark.timeout(900), *([pytest.mark.ray] if doc in RAY_DOCUMENTS else [])]
        out.append(pytest.param(doc, id=doc, marks=marks))
    return out


@pytest.mark.parametrize("document", _params())
def test_code_blocks_run(document: str, tmp_path: Path) -> None:
    path = ROOT / document
    if not path.exists():
        pytest.skip(f"{document} is not in this checkout")
    blocks = code_blocks(document, path.read_text())
    ran, not_run = 0, []
    for n, block in enumerate(blocks):
        why = block.not_run or (missing(block.requires) if block.requires else None)
        if why:
            not_run.append(f"{document}:{block.line}: {why}")
            continue
        run_block(block, tmp_path, n)
        ran += 1
    print(f"{document}: {ran} blocks ran, {len(not_run)} not run")
    for line in not_run:
        print("  not run:", line)
    marked = sum(1 for b in blocks if b.not_run)
    assert marked <= ran, f"{document}: {marked} blocks marked not-run against {ran} that run: show runnable code"


def test_directives_are_read() -> None:
    text = "\n".join([
        "<!-- not-run: a bucket -->", "```bash", "datapipe pack x s3://b/y", "```",
        "", "```python", "print(1)", "```", "```text", "out", "```",
        "<!-- requires: datapipe.NoSuchName -->", "```python", "import datapipe", "```",
        "- item:", "", "    ```bash", "    echo indented", "    ```",
    ])
    blocks = code_blocks("t.md", text)
    assert [(b.language, b.not_run, b.requires) for b in blocks] == [
        ("bash", "a bucket", None), ("python", None, None), ("python", None, "datapipe.NoSuchName"),
        ("bash", None, None)]
    assert blocks[3].code == "echo indented\n"
    assert missing("datapipe.NoSuchName") is not None and missing("datapipe.pack") is None
    assert missing("/nonexistent/path") is not None and missing("os.path") is None
    with pytest.raises(AssertionError, match="not right before"):
        code_blocks("t.md", "<!-- not-run: x -->\n\ntext\n")
