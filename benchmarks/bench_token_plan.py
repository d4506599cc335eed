"""Build time and memory of token sequence plans, beside Megatron's O(samples) indices.

    python benchmarks/bench_token_plan.py [--tokens 1e10] [--docs 1e7] [--seq-len 2048]

Each layout is built in a fresh process from synthetic log-normal document lengths (mean
about ``tokens / docs``), stored as int32 the way an ``.idx`` holds them. Printed per
layout: build time, the process's peak RSS growth while building (Linux VmHWM, reset after
the lengths exist, so the lengths themselves are not counted) and the bytes the plan keeps;
then the same figures extrapolated by formula to 10^12 tokens in 10^9 documents, and the
sizes of the document, sample and shuffle indices Megatron's GPTDataset builds for the same
data (``_build_document_index``: int32 per document and epoch; ``build_sample_idx``: 2 x int32
per sample plus one, int64 once a document index or length passes int32;
``_build_shuffle_index``: uint32 per sample, int64 from 2^32 - 1 samples on).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from datapipe.plan.tokens import ConcatLayout, DocumentLayout

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0

kind, tokens, docs, L = {kind!r}, {tokens}, {docs}, {L}
rng = np.random.default_rng(0)
sigma = 1.0
mu = np.log(tokens / docs) - sigma ** 2 / 2
lengths = np.empty(docs, dtype=np.int32)
for a in range(0, docs, 1 << 20):
    n = min(1 << 20, docs - a)
    lengths[a:a + n] = np.clip(rng.lognormal(mu, sigma, size=n), 1, 2**31 - 1).astype(np.int32)
total = int(lengths.sum(dtype=np.int64))
before = rss()
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
t = time.perf_counter()
if kind == "concat":
    lay = ConcatLayout([total], L)
    kept = 2 * lay.counts.nbytes + lay.part_starts.nbytes  # counts and their running sum
else:
    lay = DocumentLayout([lengths], L)
    kept = 2 * lay.counts.nbytes + sum(a.nbytes for a in (lay.chunk_doc_start, lay.chunk_token_start,
                                                          lay.part_doc_starts, lay.part_token_starts))
dt = time.perf_counter() - t
print(json.dumps({{"kind": kind, "tokens": total, "docs": docs, "seconds": dt, "peak_growth": hwm() - before,
                  "kept": kept, "sequences": lay.num_sequences, "chunks": lay.num_chunks}}))
"""


def run(kind: str, tokens: int, docs: int, seq_len: int) -> dict:
    code = _CHILD.format(root=str(ROOT), kind=kind, tokens=tokens, docs=docs, L=seq_len)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e10)
    ap.add_argument("--docs", type=float, default=1e7)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    tokens, docs, L = int(args.tokens), int(args.docs), args.seq_len
    big_t, big_d = 10**12, 10**9
    print(f"plans over {tokens:.3g} tokens in {docs:.3g} documents (log-normal, sigma 1), seq_len {L}")
    for kind in ("concat", "documents"):
        r = run(kind, tokens, docs, L)
        scale_docs = big_d / docs
        # concat is O(chunks): time and memory scale with the chunk count; documents reads
        # every length once (time O(documents)) and keeps O(chunks)
        scale_chunks = big_t / r["tokens"]
        t_big = r["seconds"] * (scale_docs if kind == "documents" else scale_chunks)
        kept_big = r["kept"] * scale_chunks
        meg = megatron_bytes(r["tokens"], docs, L, 0)
        meg_big = megatron_bytes(big_t, big_d, L, 0)
        print(f"\n{kind}: {r['sequences']:,} sequences in {r['chunks']:,} chunks")
        print(f"  build {r['seconds']:.3f} s, peak RSS growth {mb(r['peak_growth'])}, plan keeps {mb(r['kept'])}")
        print(f"  Megatron's indices for the same data: {mb(meg['total'])} "
              f"(document {mb(meg['document_index'])}, sample {mb(meg['sample_index'])}, "
              f"shuffle {mb(meg['shuffle_index'])})")
        print(f"  extrapolated to 1e12 tokens / 1e9 documents: build ~{t_big:.1f} s"
              f"{' (one pass over 4 GB of lengths)' if kind == 'documents' else ''}, keeps ~{mb(kept_big)}; "
              f"Megatron: {mb(meg_big['total'])}")
    print(f"\nMegatron at 1e12 tokens: (T - 1) // L = {(big_t - 1) // L:,} samples, each in its sample and "
          "shuffle index, and every document in its document index, built on a compute node before step 0")


if __name__ == "__main__":
    main()
