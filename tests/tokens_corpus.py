"""Shared by the token tests (packing, indexing, and the loader's later): a generated text
corpus, a small BPE tokenizer trained on it here (nothing downloaded), writers of JSONL and
Parquet inputs, and a reader of a token dataset that checks every file through
datapipe.format.tokens the way a loader must (manifest, each part's .idx and .xxh, every
.bin block) and returns the documents."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from datapipe.format.tokens import MANIFEST, check_part, parse_token_manifest, verify_blocks

EOS = "<|endoftext|>"
_WORDS = ("the", "a", "token", "data", "pipe", "shard", "model", "train", "loss", "step", "epoch", "rank",
          "grad", "über", "naïve", "日本語", "emoji🙂", "x", "yz", "0", "42", "\n", "  ", "tab\t", "end.")


def make_texts(n: int, seed: int = 0, empty_every: int = 17) -> list[str]:
    """``n`` documents of words with log-normal lengths (a few long ones), every
    ``empty_every``-th one empty."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            out.append("")
            continue
        k = max(1, int(rng.lognormal(3.0, 1.0)))
        out.append(" ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), size=k)))
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, with ``<|endoftext|>`` as a special
    token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_jsonl(path: Path | str, rows: list[dict[str, Any]]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


def write_parquet(path: Path | str, rows: list[dict[str, Any]], row_group_size: int = 64) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {k: [r[k] for r in rows] for k in rows[0]}
    table = pa.table({k: (pa.array(v, pa.list_(pa.int64())) if k == "input_ids" else pa.array(v))
                      for k, v in cols.items()})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def expected_documents(tok: Any, texts: list[str], eos: int) -> list[list[int]]:
    """What a token dataset of ``texts`` must hold: ``tok.encode(text).ids + [eos]`` each."""
    return [[*tok.encode(t).ids, eos] for t in texts]


def _location(root: str, name: str) -> str:
    return name if name.startswith("/") else os.path.join(root, name)


def read_token_dataset(root: Path | str) -> list[list[int]]:
    """Every document of the token dataset at ``root``, each file checked first (a damaged
    byte anywhere raises a DatapipeError)."""
    root = str(root)
    with open(os.path.join(root, MANIFEST), "rb") as f:
        m = parse_token_manifest(f.read(), os.path.join(root, MANIFEST))
    docs: list[list[int]] = []
    for i, part in enumerate(m.parts):
        with open(_location(root, part.idx), "rb") as f:
            idx = f.read()
        with open(os.path.join(root, part.xxh), "rb") as f:
            xxh = f.read()
        checked = check_part(m, i, idx, xxh, where=root)
        with open(_location(root, part.bin), "rb") as f:
            data = f.read()
        verify_blocks(data, 0, checked.sums, m.block_bytes, where=part.bin, whole=True)
        tokens = np.frombuffer(data, dtype=m.dtype)
        starts = checked.index.document_starts()
        docs.extend(tokens[starts[j]:starts[j + 1]].tolist() for j in range(checked.index.num_documents))
    return docs


def dataset_files(root: Path | str) -> dict[str, bytes]:
    """Every file of a dataset folder by relative name (for byte-for-byte comparisons)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out
