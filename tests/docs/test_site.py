"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing
anchor or a reference that does not resolve fails), its API pages have an entry for every
public name of every face, its troubleshooting page a section for every error class, and a
headless Chromium opens the home page, a guide and an API page, rendered, with no console
message and no failed request.

Needs the ``docs`` extra (part of ``tests``): the build tests skip, naming the install command,
where mkdocs is missing; the browser test skips where no Chromium is installed
(``apt-get install -y chromium``).
"""

from __future__ import annotations

import ast
import functools
import http.server
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
INSTALL_DOCS = "python -m pip install -e '.[docs]' -c constraints.txt"
#: each public face, the file whose __all__ it presents, and its API page in the built site
FACES = {
    "datapipe": ("datapipe/__init__.py", "reference/datapipe/index.html"),
    "datapipe.cache": ("datapipe/cache/__init__.py", "reference/cache/index.html"),
    "datapipe.checkpoint": ("datapipe/checkpoint/__init__.py", "reference/checkpoint/index.html"),
    "datapipe.tokens": ("datapipe/tokens/__init__.py", "reference/tokens/index.html"),
    "datapipe.telemetry": ("datapipe/telemetry.py", "reference/telemetry/index.html"),
    "datapipe.health": ("datapipe/health/__init__.py", "reference/health/index.html"),
    "datapipe.ray": ("datapipe/ray/__init__.py", "reference/ray/index.html"),
    "datapipe.errors": ("datapipe/errors.py", "reference/errors/index.html"),
}
#: what the browser opens: the home page, a guide, an API page; and text each must show
PAGES = {"index": ("", "Quickstart"), "guide": ("guides/streaming/", "Resume exactly"),
         "api": ("reference/datapipe/", "StreamingDataLoader")}
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER_TIMEOUT_S = 120


def _hooks() -> Any:
    spec = importlib.util.spec_from_file_location("datapipe_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public_names(path: Path) -> list[str]:
    """The names of a module's ``__all__`` (a literal list), read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [n for n in value if not (n.startswith("__") and n.endswith("__"))]
    raise AssertionError(f"{path} has no literal __all__")


# --- the troubleshooting page: no mkdocs needed -------------------------------------------


def test_troubleshooting_has_a_section_for_every_error() -> None:
    hooks = _hooks()
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert hooks.troubleshooting_problems(text) == []
    tree = hooks.error_tree()
    import datapipe.errors as errors

    for name in errors.__all__:
        assert f"[`{name}`](#{name.lower()})" in tree
    # and every DatapipeError the module defines is in its __all__ (so it gets its section)
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.DatapipeError)}
    assert defined == set(errors.__all__)


def test_troubleshooting_check_names_what_is_missing() -> None:
    hooks = _hooks()
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    without = text.replace("### `ThrottledError`", "### Throttled")
    problems = hooks.troubleshooting_problems(without + "\n### `NoSuchError`\n\n### `PlanError`\n")
    assert any("datapipe.errors.ThrottledError has no section" in p for p in problems), problems
    assert any("'### `NoSuchError`' names no class" in p for p in problems), problems
    assert any("'### `PlanError`' appears 2 times" in p for p in problems), problems
    assert any("the mark" in p for p in hooks.troubleshooting_problems(text.replace(hooks.TREE_MARK, "")))


# --- the built site ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: {INSTALL_DOCS}")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-8000:]}\n{r.stderr[-8000:]}"
    return out


def test_site_builds_strict_with_every_page(site: Path) -> None:
    for page in ["index.html", "troubleshooting/index.html", "migration/index.html", "FORMAT/index.html",
                 "CHECKPOINT_FORMAT/index.html", "TOKEN_FORMAT/index.html", "ARCHITECTURE/index.html",
                 "benchmarks/REPORT/index.html", "benchmarks/loader-rerun/REPORT/index.html",
                 *[f"guides/{p.stem}/index.html" for p in (ROOT / "docs" / "guides").glob("*.md")],
                 *[page for _, page in FACES.values()]]:
        assert (site / page).is_file(), f"{page} is not in the built site"
    # the report's plots are served beside it, so its relative image links work
    for image in ["pack.png", "read.png", "cache.png", "checkpoint.png", "loader-rerun/loader.png"]:
        assert (site / "benchmarks" / image).is_file(), image
    troubleshooting = (site / "troubleshooting" / "index.html").read_text()
    assert "errors: tree" not in troubleshooting and 'href="#throttlederror"' in troubleshooting


@pytest.mark.parametrize("face", sorted(FACES))
def test_every_public_name_has_a_reference_entry(site: Path, face: str) -> None:
    source, page = FACES[face]
    html = (site / page).read_text()
    missing = [n for n in public_names(ROOT / source) if f'id="{face}.{n}"' not in html]
    assert not missing, f"{page}: no entry for {', '.join(f'{face}.{n}' for n in missing)}"
    assert ":class:" not in html and ":func:" not in html, f"{page}: a Sphinx role was left unrendered"


# --- a headless browser --------------------------------------------------------------------


class _Server:
    """The built site on 127.0.0.1 (a port from the kernel), recording each request's status."""

    def __init__(self, root: Path) -> None:
        self.statuses: list[tuple[str, int]] = []
        owner = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_request(self, code: Any = "-", size: Any = "-") -> None:
                owner.statuses.append((self.path, int(code) if str(code).isdigit() else 0))

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                     functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(site: Path) -> Iterator[_Server]:
    s = _Server(site)
    yield s
    s.close()


def _browser() -> str | None:
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run with a fresh profile; its whole process group is ended."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"chromium ran past {BROWSER_TIMEOUT_S} s: {' '.join(cmd)}\n{err[-4000:]}") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # helpers it left behind
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _console(stderr: str) -> list[str]:
    """The console messages Chromium logged (``INFO:CONSOLE(...)] "text", source: url``): a
    page of this site logs none, so every one counts."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.parametrize("name", sorted(PAGES))
def test_pages_render_in_headless_chromium(server: _Server, tmp_path: Path, name: str) -> None:
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium here: apt-get install -y chromium")
    from PIL import Image

    path, text = PAGES[name]
    url = server.url + path
    shot = tmp_path / f"{name}.png"
    r = _chromium(browser, tmp_path / "profile-shot", "--window-size=1280,1600", "--hide-scrollbars",
                  f"--screenshot={shot}", url)
    assert r.returncode == 0 and shot.is_file(), f"no screenshot of {url}:\n{r.stderr[-4000:]}"
    dom = _chromium(browser, tmp_path / "profile-dom", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-4000:]
    print(f"{name}: {url} -> {shot}")

    assert not _console(r.stderr + dom.stderr), f"console messages on {url}: {_console(r.stderr + dom.stderr)}"
    failed = [(p, s) for p, s in server.statuses if s >= 400]
    assert not failed, f"requests that failed while {url} loaded: {failed}"
    assert text in dom.stdout, f"{url}: the rendered page does not show {text!r}"
    # the theme's bundle marks the document when it runs (its focus-visible polyfill)
    assert "js-focus-visible" in dom.stdout, f"{url}: the theme's scripts did not run"
    with Image.open(shot) as image:
        assert image.size == (1280, 1600)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 50, f"{shot}: a blank page ({len(colours)} colours)"
    keep = os.environ.get("DATAPIPE_DOCS_SCREENSHOTS")
    if keep:  # where to keep the screenshots to look at them (they are in tmp_path otherwise)
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, os.path.join(keep, shot.name))
