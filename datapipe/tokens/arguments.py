"""The arguments :func:`~datapipe.tokens.pack_tokens` and :func:`~datapipe.tokens.index_tokens`
share, checked one way for both: each a :class:`~datapipe.errors.PackOptionError` naming the
argument, its value and what is allowed."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PackOptionError
from ..options import check_int, check_mapping

__all__ = ["check_id_options", "check_block_bytes", "check_fits"]


def check_id_options(storage_options: Any, vocab_size: Any, eos_id: Any) -> tuple[int | None, int | None]:
    """``storage_options`` (a mapping or None), then ``vocab_size`` and ``eos_id`` (ints in
    [1, 2**40] and [0, 2**40], or None): the two ids as plain ints."""
    if storage_options is not None:
        check_mapping("storage_options", storage_options, error=PackOptionError)
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, min=1, max=1 << 40, error=PackOptionError)
    if eos_id is not None:
        eos_id = check_int("eos_id", eos_id, min=0, max=1 << 40, error=PackOptionError)
    return vocab_size, eos_id


def check_block_bytes(block_bytes: Any) -> int:
    """The bytes of ``.bin`` one block checksum covers: an int in [4096, 2**30]."""
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or not 4096 <= block_bytes <= 1 << 30:
        raise PackOptionError(f"block_bytes={block_bytes!r}: expected an int in [4096, 2**30]")
    return block_bytes


def check_fits(dtype: np.dtype[Any], eos_id: int | None, vocab_size: int | None, *, dtype_is: str,
               hint: str = "") -> None:
    """Every id of ``vocab_size``, and ``eos_id``, fits ``dtype`` (``dtype_is``: how the
    message names it; ``hint``: what to do, after the message)."""
    top = int(np.iinfo(dtype).max)
    if vocab_size is not None and vocab_size - 1 > top:
        raise PackOptionError(f"vocab_size={vocab_size} does not fit {dtype_is} (largest id {top}){hint}")
    if eos_id is not None and eos_id > (top if vocab_size is None else vocab_size - 1):
        raise PackOptionError(f"eos_id={eos_id} lies outside the vocabulary (vocab_size={vocab_size}, dtype={dtype})")
