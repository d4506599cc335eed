"""pack_tokens benchmark (issue 30, item 1): ``datapipe.pack_tokens`` against its floors, with
the same number of processes N everywhere (``--workers``, default the CPU count).

- pre-tokenized Parquet (a list-of-integers column): against the floor of reading the input
  once and writing the output once (N processes, each reading its share of the row groups
  with pyarrow and writing the same tokens, EOS appended, in the output dtype, fsynced).
  Target: datapipe <= 1.2x the floor's time.
- text through a tokenizer: against the tokenizer's own batch encode rate (N processes, each
  running ``encode_batch`` over its share of the texts, held in memory: the rate of the
  tokenizer alone). Target: datapipe >= 90% of that rate (tokens/s, end to end).

Documents are synthetic with log-normal lengths (mean about 1k tokens), a 50,257-id
vocabulary (uint16 output); the text corpus is words, its byte-level BPE tokenizer trained
here on it (nothing downloaded). The page cache is warm (an untimed read of the input
first). Every system, datapipe included, starts its N processes inside the timed region.
Systems take turns round by round; the best time of each is kept. datapipe's ``part_bytes``
is set so that the input makes at least 4 pieces per process (a piece is at most 64 MiB of
input: a corpus of many GBs has thousands at the default), so that all N processes work.

    python -m benchmarks.bench_pack_tokens            # 40 M pre-tokenized, 4 M text tokens
    python -m benchmarks.bench_pack_tokens --quick    # 8 M and 1 M

``run(quick=...)`` returns the rows (JSON-able dicts) for benchmarks/report.py."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

__all__ = ["run", "format_table", "main", "PARQUET_TARGET", "TEXT_TARGET"]

PARQUET_TARGET = 1.2  # datapipe's time / the floor's, at most
TEXT_TARGET = 0.9  # datapipe's tokens/s / the tokenizer's, at least
VOCAB = 50257
EOS = 50256
_WORDS = ("the of and to in is was that for on as with by he at from his an were are which this be or "
          "data model token train loss step epoch rank gradient shard cache pipeline parallel batch").split()


def _lengths(rng: np.random.Generator, tokens: int, mean: float = 1000.0) -> np.ndarray:
    sigma = 1.0
    mu = np.log(mean) - sigma * sigma / 2
    out, total = [], 0
    while total < tokens:
        n = np.maximum(1, rng.lognormal(mu, sigma, size=4096).astype(np.int64))
        out.append(n)
        total += int(n.sum())
    lengths = np.concatenate(out)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


def make_parquet(path: str, tokens: int, seed: int = 0, row_group_rows: int = 2048) -> int:
    """Pre-tokenized documents (``input_ids``, int32 ids below VOCAB - 1) of about
    ``tokens`` tokens; returns the document count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = _lengths(rng, tokens)
    with pq.ParquetWriter(path, pa.schema([("input_ids", pa.list_(pa.int32()))])) as w:
        for a in range(0, lengths.size, row_group_rows):
            ln = lengths[a:a + row_group_rows]
            values = rng.integers(0, VOCAB - 1, size=int(ln.sum()), dtype=np.int32)
            offsets = np.concatenate(([0], np.cumsum(ln))).astype(np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            w.write_table(pa.table({"input_ids": arr}), row_group_size=row_group_rows)
    return int(lengths.size)


def make_texts(path: str, words: int, seed: int = 1) -> list[str]:
    """A JSONL file of texts (log-normal lengths, mean about 700 words); returns them."""
    import json

    rng = np.random.default_rng(seed)
    texts = []
    for n in _lengths(rng, words, mean=700.0):
        texts.append(" ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), size=int(n))))
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return texts


def train_tokenizer(texts: list[str], path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts[:2000], trainer=trainer)
    tok.save(path)


def _part_bytes(input_bytes: int, workers: int) -> int:
    """A part size that cuts the input into at least 4 pieces per process."""
    return max(1 << 16, min(256 << 20, input_bytes // (4 * workers)))


def _warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


# --- the floors (run in worker processes) -------------------------------------------------


def _floor_part(args: tuple[str, list[int], str]) -> int:
    """Read row groups ``groups`` of the Parquet file once, write their tokens (EOS after each
    document, uint16) to ``out`` once, fsynced."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path, groups, out = args
    pf = pq.ParquetFile(path, pre_buffer=False)
    n = 0
    with open(out, "wb") as f:
        for g in groups:
            col = pf.read_row_group(g, columns=["input_ids"], use_threads=False).column(0)
            for chunk in col.chunks:
                lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
                values = chunk.flatten().to_numpy(zero_copy_only=False)
                buf = np.empty(values.size + lengths.size, dtype="<u2")
                ends = np.cumsum(lengths + 1) - 1
                keep = np.ones(buf.size, dtype=bool)
                keep[ends] = False
                buf[keep] = values
                buf[ends] = EOS
                f.write(buf.data)
                n += buf.size
        f.flush()
        os.fsync(f.fileno())
    return n


def _encode_share(args: tuple[str, list[str], str, int]) -> tuple[int, float]:
    """(tokens, seconds) of ``method`` over ``texts`` in batches of 1024, in this process."""
    from tokenizers import Tokenizer

    tok_path, texts, method, threads = args
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    tok = Tokenizer.from_file(tok_path)
    encode = getattr(tok, method)
    t0 = time.perf_counter()
    n = 0
    for a in range(0, len(texts), 1024):
        n += sum(len(e.ids) for e in encode(texts[a:a + 1024]))
    return n, time.perf_counter() - t0


def _pool(n: int) -> Any:
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    return ctx.Pool(n)


def floor_parquet(path: str, out_dir: str, workers: int) -> float:
    import pyarrow.parquet as pq

    groups = list(range(pq.ParquetFile(path).metadata.num_row_groups))
    shares = [(path, groups[k::workers], os.path.join(out_dir, f"floor-{k}.bin")) for k in range(workers)]
    t0 = time.perf_counter()
    if workers == 1:
        _floor_part(shares[0])
    else:
        with _pool(workers) as pool:
            pool.map(_floor_part, shares)
    return time.perf_counter() - t0


def tokenizer_rate(tok_path: str, texts: list[str], workers: int, method: str) -> tuple[int, float]:
    """(tokens, seconds): the slowest process's encode time over its share, processes started
    beforehand (the tokenizer's rate alone)."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    shares = [(tok_path, texts[k::workers], method, threads) for k in range(workers)]
    if workers == 1:
        results = [_encode_share((tok_path, texts, method, os.cpu_count() or 1))]
    else:
        with _pool(workers) as pool:
            results = pool.map(_encode_share, shares)
    return sum(r[0] for r in results), max(r[1] for r in results)


# --- the benchmark ------------------------------------------------------------------------


def run(quick: bool = False, workers: int | None = None, tokens: int | None = None,
        text_tokens: int | None = None, rounds: int | None = None, work: str | None = None) -> list[dict[str, Any]]:
    """Every figure as rows: one per (case, system), with the ratio to the case's floor."""
    import datapipe

    workers = workers or os.cpu_count() or 1
    tokens = tokens or (8_000_000 if quick else 40_000_000)
    text_tokens = text_tokens or (1_000_000 if quick else 4_000_000)
    rounds = rounds or (2 if quick else 3)
    own = work is None
    work = work or tempfile.mkdtemp(prefix="bench-pack-tokens-")
    rows: list[dict[str, Any]] = []
    try:
        pq_path = os.path.join(work, "ids.parquet")
        docs = make_parquet(pq_path, tokens)
        best: dict[str, float] = {}
        for r in range(rounds):
            for system in ("floor", "datapipe"):
                _warm(pq_path)
                out = os.path.join(work, f"out-{system}-{r}")
                os.makedirs(out, exist_ok=True)
                if system == "floor":
                    sec = floor_parquet(pq_path, out, workers)
                else:
                    t0 = time.perf_counter()
                    datapipe.pack_tokens(pq_path, os.path.join(out, "ds"), eos_id=EOS, vocab_size=VOCAB,
                                         workers=workers, part_bytes=_part_bytes(os.path.getsize(pq_path), workers))
                    sec = time.perf_counter() - t0
                shutil.rmtree(out)
                best[system] = min(best.get(system, float("inf")), sec)
        n_out = tokens + docs
        for system in ("floor", "datapipe"):
            rows.append({"case": "pre-tokenized parquet", "system": system, "workers": workers,
                         "tokens": n_out, "seconds": round(best[system], 3),
                         "tokens_per_s": round(n_out / best[system]),
                         "ratio": round(best[system] / best["floor"], 3),
                         "target": f"<= {PARQUET_TARGET}x the floor's time" if system == "datapipe" else "floor"})

        text_path = os.path.join(work, "texts.jsonl")
        texts = make_texts(text_path, text_tokens)
        tok_path = os.path.join(work, "tokenizer.json")
        train_tokenizer(texts, tok_path)
        rates: dict[str, tuple[int, float]] = {}
        for r in range(rounds):
            for system in ("encode_batch", "encode_batch_fast", "datapipe"):
                if system == "datapipe":
                    _warm(text_path)
                    out = os.path.join(work, f"text-{r}")
                    t0 = time.perf_counter()
                    res = datapipe.pack_tokens(text_path, out, tokenizer=tok_path, workers=workers,
                                               part_bytes=_part_bytes(os.path.getsize(text_path), workers))
                    got = (res.tokens - res.documents, time.perf_counter() - t0)  # the tokenizer's tokens
                    shutil.rmtree(out)
                else:
                    got = tokenizer_rate(tok_path, texts, workers, system)
                if system not in rates or got[1] < rates[system][1]:
                    rates[system] = got
        base = max(rates["encode_batch"][0] / rates["encode_batch"][1],
                   rates["encode_batch_fast"][0] / rates["encode_batch_fast"][1])
        for system in ("encode_batch", "encode_batch_fast", "datapipe"):
            n, sec = rates[system]
            rows.append({"case": "text + tokenizer", "system": system, "workers": workers, "tokens": n,
                         "seconds": round(sec, 3), "tokens_per_s": round(n / sec),
                         "ratio": round(n / sec / base, 3),
                         "target": f">= {TEXT_TARGET:.0%} of the tokenizer's rate" if system == "datapipe"
                         else "tokenizer alone"})
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<24}{'system':<20}{'N':>3}{'tokens':>13}{'s':>9}{'tokens/s':>14}{'ratio':>8}  target"]
    for r in rows:
        lines.append(f"{r['case']:<24}{r['system']:<20}{r['workers']:>3}{r['tokens']:>13,}{r['seconds']:>9.3f}"
                     f"{r['tokens_per_s']:>14,}{r['ratio']:>8.3f}  {r['target']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="pre-tokenized tokens")
    ap.add_argument("--text-tokens", type=int, default=None, help="words of text (about as many tokens)")
    ap.add_argument("--rounds", type=int, default=None)
    a = ap.parse_args(argv)
    rows = run(quick=a.quick, workers=a.workers, tokens=a.tokens, text_tokens=a.text_tokens, rounds=a.rounds)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
