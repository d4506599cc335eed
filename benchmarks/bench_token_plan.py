"""Start-up time and memory of token sequence plans per rank, beside Megatron's O(samples) indices.

    python benchmarks/bench_token_plan.py [--tokens 1e10] [--docs 1e7] [--seq-len 2048] [--world 1024]

Synthetic log-normal document lengths (sigma 1, mean ``tokens / docs``) stored as int32 the
way an ``.idx`` holds them, in a scratch ``.npy`` that each process maps (as a reader maps
its ``.idx``). Chunks as ``TokenDataset``'s defaults make them (``chunk_tokens`` 2^20;
document packing: blocks of 64 sequences' tokens). Each step runs in a fresh process and
prints its time and its peak RSS growth (Linux VmHWM, reset once the lengths are mapped,
so they are not counted):

- concat, per rank: ``ConcatLayout`` and the rank's ``EpochPlan`` (O(chunks)).
- documents, once per (dataset, seq_len): ``DocumentLayout`` counts every document
  (O(documents)) and its ``DocumentTable`` is stored (what ``TokenDataset`` writes beside
  the manifest, ``plans/``).
- documents, per rank (every later process, restarts included): the stored table read
  and checked, ``DocumentLayout(..., table=)`` and the rank's ``EpochPlan`` (O(chunks): no
  length is read until a chunk is repacked).

Then each figure computed for 10^12 tokens in 10^9 documents by the formula printed beside
it (O(chunks) figures scale with tokens, O(documents) ones with documents), and the sizes of
the indices Megatron's GPTDataset builds for the same data (``_build_document_index``:
int32 per document and epoch; ``build_sample_idx``: 2 x int32 per sample plus one, int64
once a document index or length passes int32; ``_build_shuffle_index``: uint32 per sample,
int64 from 2^32 - 1 samples on).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIG_TOKENS, BIG_DOCS = 10**12, 10**9
#: TokenDataset's default tokens per logical chunk (one fetch)
CHUNK_TOKENS = 1 << 20

_CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from datapipe.plan import ConcatLayout, DocumentLayout, DocumentTable

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0

step, L, world, chunk_tokens, docs = {step!r}, {L}, {world}, {chunk_tokens}, {docs}
table_path = {table!r}
block = 64 * L
if step == "count":  # in memory, so that the plan's own growth is what is measured
    lengths = np.load({lengths!r})
elif step == "rank":  # what a rank has: a map of the .idx, of which nothing is read
    lengths = np.broadcast_to(np.int32(0), (docs,))
else:
    total = int(np.load({lengths!r}, mmap_mode="r").sum(dtype=np.int64)) * {tile}
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM back to the current RSS
t = time.perf_counter()
if step == "concat":
    lay = ConcatLayout([total], L, chunk_sequences=max(1, chunk_tokens // L))
    lay.epoch_plan(seed=0, world=world)
    kept = 2 * lay.counts.nbytes + lay.part_starts.nbytes
elif step == "count":
    lay = DocumentLayout([lengths], L, block_tokens=block, chunk_blocks=max(1, chunk_tokens // block))
    data = lay.table.to_bytes("bench")
    with open(table_path, "wb") as f:
        f.write(data)
    kept = len(data)
else:
    with open(table_path, "rb") as f:
        table = DocumentTable.from_bytes(f.read(), table_path, identity="bench")
    lay = DocumentLayout([lengths], L, block_tokens=block, chunk_blocks=max(1, chunk_tokens // block), table=table)
    lay.epoch_plan(seed=0, world=world)
    kept = 2 * lay.counts.nbytes + lay.chunk_doc_start.nbytes + lay.chunk_token_start.nbytes
dt = time.perf_counter() - t
print(json.dumps({{"tokens": lay.num_tokens, "seconds": dt, "peak_growth": status("VmHWM:") - before,
                  "kept": kept, "sequences": lay.num_sequences, "chunks": lay.num_chunks}}))
"""


def run(step: str, lengths: str, table: str, seq_len: int, world: int, docs: int, tile: int = 1) -> dict[str, Any]:
    code = _CHILD.format(root=str(ROOT), step=step, L=seq_len, world=world, chunk_tokens=CHUNK_TOKENS,
                         lengths=lengths, table=table, docs=docs, tile=tile)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def tile_table(src: str, dest: str, times: int) -> None:
    """The table at ``src`` repeated ``times`` over (documents and tokens shifted): a table
    of the size a ``times`` larger dataset has, for the per-rank step at that size."""
    import numpy as np

    from datapipe.plan import DocumentTable

    t = DocumentTable.from_bytes(Path(src).read_bytes(), src)
    docs, tokens = int(t.part_docs.sum()), int(t.part_tokens.sum())
    shift = np.arange(times, dtype=np.int64)[:, None]
    doc_start = np.append((t.chunk_doc_start[:-1] + shift * docs).ravel(), docs * times)
    tok_start = np.append((t.chunk_token_start[:-1] + shift * tokens).ravel(), tokens * times)
    big = DocumentTable(t.seq_len, t.block_tokens, t.chunk_blocks, np.array([docs * times]),
                        np.array([tokens * times]), doc_start, tok_start, np.tile(t.counts, times))
    Path(dest).write_bytes(big.to_bytes("bench"))


def write_lengths(path: str, tokens: int, docs: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    sigma = 1.0
    mu = np.log(tokens / docs) - sigma**2 / 2
    lengths = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(docs,))
    for a in range(0, docs, 1 << 20):
        n = min(1 << 20, docs - a)
        lengths[a:a + n] = np.clip(rng.lognormal(mu, sigma, size=n), 1, 2**31 - 1).astype(np.int32)
    lengths.flush()
    del lengths


def megatron_bytes(tokens: int, docs: int, seq_len: int, max_doc: int) -> dict[str, int]:
    """Bytes of GPTDataset's indices for one epoch (add_extra_token_to_sequence=True)."""
    samples = (tokens - 1) // seq_len
    doc_index = 4 * docs
    wide = max(docs, max_doc) > 2**31 - 1
    sample_index = (samples + 1) * 2 * (8 if wide else 4)
    shuffle_index = samples * (8 if samples >= 2**32 - 2 else 4)
    return {"document_index": doc_index, "sample_index": sample_index, "shuffle_index": shuffle_index,
            "total": doc_index + sample_index + shuffle_index}


def mb(n: float) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def show(name: str, small: dict[str, Any], big: dict[str, Any]) -> None:
    """A per-rank step measured here and on a plan of 1e12 tokens' chunks, and the formula
    t = a + b x chunks (memory likewise) the two give: every part of the step is O(chunks)
    but for a fixed cost ``a`` (plain scaling of the small figure would scale ``a`` too)."""
    n1, n2 = small["chunks"], big["chunks"]
    b = (big["seconds"] - small["seconds"]) / (n2 - n1)
    a = small["seconds"] - b * n1
    bm = (big["peak_growth"] - small["peak_growth"]) / (n2 - n1)
    am = small["peak_growth"] - bm * n1
    n12 = n1 * BIG_TOKENS / small["tokens"]
    print(f"  {name}")
    print(f"    measured at {small['tokens']:.3g} tokens ({n1:,} chunks): {small['seconds']:.3f} s, "
          f"peak RSS growth {mb(small['peak_growth'])}")
    print(f"    measured at {big['tokens']:.3g} tokens ({n2:,} chunks): {big['seconds']:.3f} s, "
          f"peak RSS growth {mb(big['peak_growth'])}")
    print(f"    formula: {a * 1e3:.1f} ms + {b * 1e6:.3f} us x chunks, {mb(am)} + {bm:.0f} B x chunks; at 1e12 "
          f"tokens ({n12:,.0f} chunks): {a + b * n12:.2f} s, {mb(am + bm * n12)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e10)
    ap.add_argument("--docs", type=float, default=1e7)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--world", type=int, default=1024, help="data-parallel ranks the plan is partitioned over")
    args = ap.parse_args()
    tokens, docs, L, world = int(args.tokens), int(args.docs), args.seq_len, args.world
    print(f"plans over {tokens:.3g} tokens in {docs:.3g} documents (log-normal, sigma 1), seq_len {L}, "
          f"{world} data-parallel ranks, chunks of {CHUNK_TOKENS:,} tokens")
    times = max(1, round(BIG_TOKENS / tokens))
    with tempfile.TemporaryDirectory(prefix="bench_token_plan-") as tmp:
        lengths, table, big = (str(Path(tmp) / n) for n in ("lengths.npy", "documents.table", "big.table"))
        write_lengths(lengths, tokens, docs)
        concat = run("concat", lengths, table, L, world, docs)
        concat_big = run("concat", lengths, table, L, world, docs, times)
        count = run("count", lengths, table, L, world, docs)
        rank = run("rank", lengths, table, L, world, docs)
        tile_table(table, big, times)
        rank_big = run("rank", lengths, big, L, world, docs * times)
    by_tokens = BIG_TOKENS / concat["tokens"]  # chunks grow with tokens
    by_docs = BIG_DOCS / docs
    meg = megatron_bytes(concat["tokens"], docs, L, 0)
    meg_big = megatron_bytes(BIG_TOKENS, BIG_DOCS, L, 0)
    print(f"\nMegatron GPTDataset's indices: {mb(meg['total'])} here (document {mb(meg['document_index'])}, "
          f"sample {mb(meg['sample_index'])}, shuffle {mb(meg['shuffle_index'])}); at 1e12 tokens "
          f"{mb(meg_big['total'])} = 4 B x 1e9 documents + (2 x 4 + 4) B x {(BIG_TOKENS - 1) // L:,} samples, "
          "built on a compute node before step 0")

    print(f"\nconcat: {concat['sequences']:,} sequences in {concat['chunks']:,} chunks; plan keeps "
          f"{mb(concat['kept'])}")
    show("per rank: layout + EpochPlan (O(chunks))", concat, concat_big)

    pad = 1 - rank["tokens"] / (rank["sequences"] * L)
    print(f"\ndocuments: {rank['sequences']:,} sequences in {rank['chunks']:,} chunks (padding "
          f"{pad:.1%} of their tokens); the stored table: {mb(count['kept'])} "
          f"= 8 B x (3 x chunks + 2 x parts + 2); at 1e12 tokens {mb(count['kept'] * by_tokens)}")
    print(f"  once per (dataset, seq_len): count every document, store the table (O(documents) time, "
          f"O(chunks) memory): {count['seconds']:.3f} s, peak RSS growth {mb(count['peak_growth'])}")
    print(f"    at 1e12 tokens / 1e9 documents = measured x 1e9 / documents = x {by_docs:,.0f}: "
          f"{count['seconds'] * by_docs:.1f} s; memory: the slices' working set + the table: "
          f"~{mb(count['peak_growth'] + count['kept'] * (by_tokens - 1))}")
    show(f"per rank (every later process): read + check the table, layout + EpochPlan (O(chunks)); at "
         f"1e12 on the table tiled x {times}", rank, rank_big)
    print("\ntarget per rank at 1e12 tokens / 1e9 documents: <= 2 s and <= 200 MB (the formulas' figures above)")

if __name__ == "__main__":
    main()
