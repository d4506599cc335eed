"""The arguments pack_tokens and index_tokens share are checked one way for both: the same
PackOptionError, naming the argument, its value and what is allowed, before any input is read."""

from __future__ import annotations

import re

import numpy as np
import pytest

from datapipe.errors import OptionError, PackOptionError
from datapipe.tokens import index_tokens, pack_tokens

BAD = [
    ({"vocab_size": 0}, "vocab_size"),
    ({"vocab_size": 1.5}, "vocab_size"),
    ({"vocab_size": (1 << 40) + 1}, "vocab_size"),
    ({"eos_id": -1}, "eos_id"),
    ({"eos_id": True}, "eos_id"),
    ({"block_bytes": 4095}, r"block_bytes=4095: expected an int in \[4096, 2\*\*30\]"),
    ({"block_bytes": True}, r"block_bytes=True: expected an int in \[4096, 2\*\*30\]"),
    ({"block_bytes": (1 << 30) + 1}, r"block_bytes=1073741825: expected an int in \[4096, 2\*\*30\]"),
    ({"storage_options": [("anon", True)]}, "storage_options"),
]


def _message(call, **kwargs) -> str:
    with pytest.raises(PackOptionError) as e:
        call(**kwargs)
    assert isinstance(e.value, OptionError) and isinstance(e.value, ValueError)
    return str(e.value)


@pytest.mark.parametrize("bad,match", BAD, ids=[next(iter(b)) + "=" + repr(next(iter(b.values()))) for b, _ in BAD])
def test_a_bad_shared_argument_is_the_same_error_in_both(tmp_path, bad, match):
    missing = str(tmp_path / "nothing-here.jsonl")  # never read: the arguments are checked first
    packed = _message(pack_tokens, source=missing, dest=tmp_path / "out", **{"eos_id": 0, **bad})
    indexed = _message(index_tokens, paths_or_prefixes=str(tmp_path / "nothing-here"), **bad)
    assert re.search(match, packed), packed
    assert packed == indexed
    assert not (tmp_path / "out").exists()


def test_vocabulary_and_eos_must_fit_the_dtype(tmp_path):
    src = str(tmp_path / "nothing-here.jsonl")
    with pytest.raises(PackOptionError, match=re.escape(
            "vocab_size=300 does not fit dtype=uint8 (largest id 255); pass a wider dtype or none "
            "(Megatron's rule picks one from the vocabulary size)")):
        pack_tokens(src, tmp_path / "out", dtype="uint8", vocab_size=300, eos_id=0)
    with pytest.raises(PackOptionError, match=re.escape(
            "eos_id=300 lies outside the vocabulary (vocab_size=None, dtype=uint8)")):
        pack_tokens(src, tmp_path / "out", dtype="uint8", eos_id=300)


def test_index_tokens_names_the_files_dtype(tmp_path):
    flat = tmp_path / "flat.bin"
    np.arange(10, dtype=np.uint8).tofile(flat)
    with pytest.raises(PackOptionError, match=re.escape(
            "vocab_size=300 does not fit the files' dtype uint8 (largest id 255)")):
        index_tokens(str(flat), dtype="uint8", vocab_size=300, index_to=str(tmp_path / "ix"))
    with pytest.raises(PackOptionError, match=re.escape(
            "eos_id=256 lies outside the vocabulary (vocab_size=None, dtype=uint8)")):
        index_tokens(str(flat), dtype="uint8", eos_id=256, index_to=str(tmp_path / "ix"))
