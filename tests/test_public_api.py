"""The public surface, pinned: a change here is a change users see."""

import subprocess
import sys

import datapipe
import datapipe.errors


def test_public_names():
    assert sorted(datapipe.__all__) == sorted([
        "__version__", "CheckpointInfo", "CheckpointWriter", "Dataset", "DatasetIndex", "PackResult", "SaveHandle",
        "ShardWriter", "Stream", "StreamingDataLoader", "StreamingDataset", "TieredCache", "VerifyReport",
        "join_parts", "list_checkpoints", "load_checkpoint", "open_dataset", "open_index", "pack", "verify_dataset",
    ])
    for name in datapipe.__all__:
        assert getattr(datapipe, name) is not None


def test_every_error_is_a_datapipe_error():
    for name in datapipe.errors.__all__:
        assert issubclass(getattr(datapipe.errors, name), datapipe.errors.DatapipeError), name


def test_import_does_not_load_torch_or_fsspec_backends():
    # `datapipe pack` must start fast and work without torch: the loader loads on first use
    out = subprocess.run([sys.executable, "-c", "import sys, datapipe; print('torch' in sys.modules, 's3fs' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("pack", "join", "inspect", "verify", "cache"):
        assert cmd in out
