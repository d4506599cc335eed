"""A decoder whose package is missing (decode="pil" without Pillow, decode="torch" without
torch) is a configuration error: a MissingDependencyError naming the package and the extra
that installs it, raised once where the decoder is made, and never skipped by
on_error="skip". The missing package is real: the checks run in a Python process (or a
DataLoader worker) where importing it fails, as it does where it is not installed."""

from __future__ import annotations

import importlib.abc
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from datapipe import ShardWriter
from datapipe.errors import DecodeError, MissingDependencyError, OptionError
from datapipe.loader import StreamingDataset

N = 30

#: makes the named top-level modules unimportable in this process, as if not installed
BLOCKER = textwrap.dedent('''
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    def block(*names):
        for m in [m for m in sys.modules if m.partition(".")[0] in names]:
            del sys.modules[m]
        sys.meta_path.insert(0, NotInstalled(names))
''')


class _NotInstalled(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _no_pillow_here(worker_id):
    """A DataLoader worker where Pillow is not installed (the main process has it)."""
    for m in [m for m in sys.modules if m.partition(".")[0] == "PIL"]:
        del sys.modules[m]
    sys.meta_path.insert(0, _NotInstalled({"PIL"}))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "ds"
    with ShardWriter(str(path), max_samples=8) as w:
        for i in range(N):
            buf = io.BytesIO()
            Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(buf, "PNG")
            w.write({"__key__": f"k{i:03d}", "png": buf.getvalue(), "cls": str(i)})
    return str(path)


def _run(code: str, *args: str) -> dict:
    """Run ``code`` (after the blocker) in a fresh Python; it prints one JSON line."""
    script = BLOCKER + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CONSTRUCT = '''
    import json, sys
    block(*sys.argv[3].split(","))
    from datapipe import StreamingDataset, open_dataset
    from datapipe.decode import make_decoder
    from datapipe.errors import MissingDependencyError, OptionError
    url, out = sys.argv[1], {}
    for spec in json.loads(sys.argv[2]):
        seen = out[json.dumps(spec)] = {}
        for name, make in [("StreamingDataset", lambda: StreamingDataset(url, decode=spec, on_error="skip")),
                           ("not-a-dataset", lambda: StreamingDataset(url + "-missing", decode=spec)),
                           ("open_dataset", lambda: open_dataset(url, decode=spec)),
                           ("make_decoder", lambda: make_decoder(spec))]:
            try:
                make()
                seen[name] = None
            except Exception as e:
                seen[name] = [type(e).__name__, str(e), isinstance(e, OptionError), isinstance(e, ImportError)]
    print(json.dumps(out))
'''

IMAGE_SPECS = ["pil", "pilrgba", "rgb8", "l8", "torch", "torchvision", ["pil", "auto"], ["torch", "json", "cls"]]


def test_without_pillow_an_image_decoder_is_refused_when_made(url):
    # before: the dataset was made, then every image sample was a DecodeError advising
    # decode=None; with on_error="skip" all 30 were skipped with one warning
    out = _run(CONSTRUCT, url, json.dumps(IMAGE_SPECS), "PIL")
    assert len(out) == len(IMAGE_SPECS)
    for spec, seen in out.items():
        for where, got in seen.items():
            assert got is not None, f"{where} took decode={spec} without Pillow"
            kind, message, is_option, is_import = got
            assert kind == "MissingDependencyError" and is_option and is_import, (spec, where, got)
            assert "Pillow" in message and "pip install 'datapipe[images]'" in message, message
            assert "decode=None" not in message  # the advice is to install it, not to read bytes


def test_without_torch_a_tensor_decoder_names_torch_and_the_others_work(url):
    out = _run(CONSTRUCT, url, json.dumps(["torch", "torchvision", "torchrgb8", ["pil", "cls"]]), "torch")
    for spec in ("torch", "torchvision", "torchrgb8"):
        for where, got in out[json.dumps(spec)].items():
            assert got is not None and got[0] == "MissingDependencyError", (spec, where, got)
            assert "needs torch" in got[1] and "pip install 'datapipe[torch]'" in got[1], got[1]
    others = out[json.dumps(["pil", "cls"])]
    assert others["StreamingDataset"] is None and others["open_dataset"] is None and others["make_decoder"] is None
    assert others["not-a-dataset"][0] == "ObjectNotFoundError"


SKIP_LATER = '''
    import json, sys, warnings
    from datapipe import StreamingDataset
    ds = StreamingDataset(sys.argv[1], decode="pil", on_error="skip", seed=1)  # Pillow imports here
    block("PIL")  # and is gone by the time samples decode (a worker's environment, say)
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for s in ds:
                got.append(s["__key__"])
            error = None
        except Exception as e:
            error = [type(e).__name__, str(e)]
    print(json.dumps({"samples": len(got), "error": error, "skipped": len(ds.skipped),
                      "warnings": [str(w.message) for w in caught]}))
'''


def test_a_package_gone_while_reading_is_raised_not_skipped(url):
    out = _run(SKIP_LATER, url)
    assert out["samples"] == 0 and out["skipped"] == 0, out
    assert out["error"][0] == "MissingDependencyError" and "datapipe[images]" in out["error"][1], out
    assert not [w for w in out["warnings"] if "skipped" in w], out


def test_a_worker_without_pillow_stops_the_loader_once(url):
    ds = StreamingDataset(url, decode="pil", on_error="skip", seed=1, batch_size=4)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn",
                        worker_init_fn=_no_pillow_here, collate_fn=list)
    with pytest.raises(MissingDependencyError, match=r"Pillow.*pip install 'datapipe\[images\]'"):
        next(iter(loader))


def _needs_a_module(sample):
    import datapipe_no_such_module  # noqa: F401  # not installed anywhere

    return sample


def test_a_decode_function_missing_a_module_is_not_skipped(url):
    ds = StreamingDataset(url, decode=_needs_a_module, on_error="skip")
    with pytest.raises(MissingDependencyError, match="datapipe_no_such_module") as e:
        list(ds)
    assert not isinstance(e.value, DecodeError) and ds.skipped == []


def test_with_pillow_decoders_are_made_and_bad_specs_are_option_errors(url):
    assert len([s for s in StreamingDataset(url, decode="pil") if isinstance(s["png"], Image.Image)]) == N
    with pytest.raises(OptionError, match="decode='jpeg2000'"):
        StreamingDataset(url, decode="jpeg2000")
    with pytest.raises(OptionError, match=r"decode\['png'\]"):
        StreamingDataset(url, decode={"png": "not a function"})
