"""The public surface, pinned: a change here is a change users see."""

import importlib
import inspect
import subprocess
import sys

import pytest

import datapipe
import datapipe.errors

# name -> (the module that documents it, what it is)
PUBLIC = {
    "CheckpointInfo": ("datapipe.checkpoint", "class"),
    "CheckpointWriter": ("datapipe.checkpoint", "class"),
    "SaveHandle": ("datapipe.checkpoint", "class"),
    "list_checkpoints": ("datapipe.checkpoint", "function"),
    "load_checkpoint": ("datapipe.checkpoint", "function"),
    "LocalShard": ("datapipe.checkpoint", "class"),  # a box of a global tensor, by hand
    "Replicated": ("datapipe.checkpoint", "class"),  # arrays the same on every rank: stored once
    "Dataset": ("datapipe.dataset", "class"),
    "DatasetIndex": ("datapipe.dataset", "class"),
    "open_dataset": ("datapipe.tarindex", "function"),  # dataset URLs, index locations and tar shard URLs
    "IndexResult": ("datapipe.tarindex", "class"),
    "index_shards": ("datapipe.tarindex", "function"),
    "open_index": ("datapipe.dataset", "function"),
    "PackResult": ("datapipe.packing", "class"),
    "ShardWriter": ("datapipe.packing", "class"),
    "join_parts": ("datapipe.packing", "function"),
    "pack": ("datapipe.packing", "function"),
    "set_storage_options": ("datapipe.storage.options", "function"),
    "Stream": ("datapipe.loader", "class"),
    "StreamingDataLoader": ("datapipe.loader", "class"),
    "StreamingDataset": ("datapipe.loader", "class"),
    "TieredCache": ("datapipe.cache", "class"),
    "TokenDataset": ("datapipe.tokens", "class"),  # sequences of a token dataset (concat or packed documents)
    "TokenMix": ("datapipe.tokens", "class"),  # token datasets mixed by weight, exact per global batch
    "VerifyReport": ("datapipe.verify", "class"),
    "verify_dataset": ("datapipe.verify", "function"),
    "pack_tokens": ("datapipe.tokens", "function"),
    "index_tokens": ("datapipe.tokens", "function"),
}


def test_public_names():
    assert sorted(datapipe.__all__) == sorted(["__version__", *PUBLIC])
    assert isinstance(datapipe.__version__, str) and datapipe.__version__


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_is_its_documented_object(name):
    module_name, kind = PUBLIC[name]
    module = importlib.import_module(module_name)
    assert name in module.__all__, f"{module_name}.__all__ lacks {name}"
    obj = getattr(datapipe, name)
    assert obj is getattr(module, name), f"datapipe.{name} is not {module_name}.{name}"
    assert obj.__name__ == name
    assert (inspect.isclass(obj) if kind == "class" else inspect.isfunction(obj)), f"{name} is not a {kind}"


def test_every_error_is_a_datapipe_error():
    for name in datapipe.errors.__all__:
        assert issubclass(getattr(datapipe.errors, name), datapipe.errors.DatapipeError), name


def test_import_does_not_load_torch_or_fsspec_backends():
    # `datapipe pack` must start fast and work without torch: the loader loads on first use
    probe = "import sys, datapipe; print('torch' in sys.modules, 's3fs' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for cmd in ("pack", "join", "inspect", "verify", "cache"):
        assert cmd in out


def test_each_part_imports_only_what_it_needs():
    # The checkpoint writer process starts as `python -m datapipe.checkpoint.writer_process` once
    # per writer: it must not pay for the packer, the cache, the tar indexer or the loader
    # (importing all of them took 0.38 s of its 0.4 s start here).
    probe = ("import sys, datapipe.checkpoint.writer_process; "
             "print(sorted(m for m in ('datapipe.packing', 'datapipe.publish', 'datapipe.cache', 'datapipe.tarindex', "
             "'datapipe.loader', 'datapipe.verify', 'datapipe.dataset', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    # and a name is the same object however it is reached, before and after its module loads
    probe = ("import datapipe; a = datapipe.CheckpointWriter; import datapipe.checkpoint as c; "
             "print(a is c.CheckpointWriter, 'CheckpointWriter' in dir(datapipe), datapipe.pack is not None)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]


def test_subpackages_are_attributes_after_a_plain_import():
    # `import datapipe` used to import these parts: code (and the README's
    # `local_tiers=[datapipe.cache.Tier(...)]`) reaches them as attributes, so the lazy
    # imports must import them on first use instead of raising AttributeError
    probe = ("import datapipe, datapipe.checkpoint as c; "
             "print(datapipe.cache.Tier.__name__, datapipe.checkpoint.Tier.__name__, "
             "datapipe.storage.LocalStore.__name__, "
             "datapipe.verify.verify_dataset.__name__, datapipe.dataset.open_index.__name__, "
             "datapipe.tarindex.index_shards.__name__, c.writer.CheckpointWriter.__name__, c.staging.ALIGN, "
             "callable(datapipe.pack), hasattr(datapipe, 'no_such_part'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CacheTier", "Tier", "LocalStore", "verify_dataset", "open_index", "index_shards",
                                  "CheckpointWriter", "64", "True", "False"]
