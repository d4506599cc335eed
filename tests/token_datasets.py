"""Token datasets written in-process for the loader tests (fast enough for hypothesis):
documents given as arrays of ids, written part by part through the format's own writer
(``TokenPartWriter``: ``.bin``, ``.idx``, ``.xxh``) with a token manifest last, exactly the
layout ``pack_tokens`` writes. ``pack_tokens`` itself (with the locally trained tokenizer)
is used by the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from datapipe.format.tokens import MANIFEST, TokenPartWriter, make_token_manifest

VOCAB = 50_000
EOS = VOCAB - 1


def random_documents(rng: np.random.Generator, n: int, mean: float = 40.0, vocab: int = VOCAB,
                     eos: int | None = EOS) -> list[np.ndarray]:
    """``n`` documents of log-normal lengths (each ending with ``eos`` when given)."""
    lengths = np.maximum(1, rng.lognormal(np.log(mean), 0.9, size=n).astype(np.int64))
    docs = []
    for k in lengths.tolist():
        d = rng.integers(0, vocab - 1, size=k, dtype=np.int64)
        if eos is not None:
            d[-1] = eos
        docs.append(d)
    return docs


def write_tokens(root: str | Path, parts: list[list[np.ndarray]], *, vocab_size: int = VOCAB, eos_id: int | None = EOS,
                 block_bytes: int = 4096, dtype: str | None = None) -> np.ndarray:
    """A token dataset at ``root`` whose part i holds the documents ``parts[i]``; returns the
    concatenated token stream (what every reader must see)."""
    root = str(root)
    os.makedirs(root, exist_ok=True)
    entries = []
    for i, docs in enumerate(parts):
        w = TokenPartWriter(os.path.join(root, f"part-{i:05d}-000"), vocab_size=vocab_size, dtype=dtype,
                            block_bytes=block_bytes, fsync=False)
        if docs:
            w.add_documents(np.concatenate(docs), [d.size for d in docs])
        entries.append(w.close())
        for tmp, final in w.renames:
            os.replace(tmp, final)
        dt = w.dtype
    manifest = make_token_manifest(entries, dtype=dt, vocab_size=vocab_size, eos_id=eos_id, block_bytes=block_bytes)
    with open(os.path.join(root, MANIFEST), "wb") as f:
        f.write(manifest)
    flat = [d for docs in parts for d in docs]
    return np.concatenate(flat).astype(np.int64) if flat else np.zeros(0, np.int64)
