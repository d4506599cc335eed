"""Start-up time and memory of token sequence plans per rank, beside Megatron's O(samples) indices.

    python benchmarks/bench_token_plan.py [--tokens 1e10] [--docs 1e7] [--seq-len 2048] [--world 1024] [--parts 8]

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
- documents, what a rank really does at start-up: ``TokenDataset(url, L,
  packing="documents", rank=0, world_size=world)`` over a token dataset on disk (``--parts``
  parts; manifest, ``.xxh`` files, ``.bin`` sizes, the stored table; no ``.idx`` is read)
  and the rank's ``EpochPlan``; it prints the bytes the process read (``/proc/self/io``
  rchar) beside time and memory. The first process (``TokenDataset`` with no table yet:
  every ``.idx`` read whole, counted, the table stored) is measured too. The ``.bin``
  files are sparse files of zeros (their ``.xxh`` the real checksums of those zeros) and
  the ``.idx`` files real (the lengths above). At 10^12 tokens the dataset is the same
  parts repeated (``.bin`` and ``.idx`` sparse, each ``.idx`` with its real header: start-up
  reads neither) with the stored table tiled to match: the start-up measured at that size.

Then each figure computed for 10^12 tokens in 10^9 documents by the formula printed beside
it (O(chunks) figures scale with tokens, O(documents) ones with documents), and the sizes of
the indices Megatron's GPTDataset builds for the same data (``_build_document_index``:
int32 per document and epoch; ``build_sample_idx``: 2 x int32 per sample plus one, int64
once a document index or length passes int32; ``_build_shuffle_index``: uint32 per sample,
int64 from 2^32 - 1 samples on).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from datapipe.plan import CHUNK_TOKENS  # TokenDataset's default tokens per logical chunk (one fetch)

ROOT = Path(__file__).resolve().parents[1]
BIG_TOKENS, BIG_DOCS = 10**12, 10**9

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

def rchar():
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0

step, L, world, chunk_tokens, docs = {step!r}, {L}, {world}, {chunk_tokens}, {docs}
table_path = {table!r}
block = 64 * L
if step in ("first", "open"):  # a token dataset on disk (table_path: its folder)
    from datapipe import TokenDataset
elif step == "count":  # in memory, so that the plan's own growth is what is measured
    lengths = np.load({lengths!r})
elif step == "rank":  # what a rank has: a map of the .idx, of which nothing is read
    lengths = np.broadcast_to(np.int32(0), (docs,))
else:
    total = int(np.load({lengths!r}, mmap_mode="r").sum(dtype=np.int64)) * {tile}
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM back to the current RSS
read0 = rchar()
t = time.perf_counter()
if step in ("first", "open"):
    ds = TokenDataset(table_path, L, packing="documents", rank=0, world_size=world, chunk_tokens=chunk_tokens)
    lay = ds.layout
    lay.epoch_plan(seed=0, world=world)
    kept = sum(a.nbytes for a in (lay.counts, lay.chunk_doc_start, lay.chunk_token_start, lay.table.chunk_sums))
elif step == "concat":
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
                  "kept": kept, "sequences": lay.num_sequences, "chunks": lay.num_chunks,
                  "read": rchar() - read0}}))
"""


def run(step: str, lengths: str, table: str, seq_len: int, world: int, docs: int, tile: int = 1) -> dict[str, Any]:
    code = _CHILD.format(root=str(ROOT), step=step, L=seq_len, world=world, chunk_tokens=CHUNK_TOKENS,
                         lengths=lengths, table=table, docs=docs, tile=tile)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def tile_table(src: str, dest: str, times: int, identity: str = "bench", keep_parts: bool = False) -> None:
    """The table at ``src`` repeated ``times`` over (documents and tokens shifted): a table
    of the size a ``times`` larger dataset has, for the per-rank step at that size (one
    part, or with ``keep_parts`` the parts repeated)."""
    import numpy as np

    from datapipe.plan import DocumentTable

    t = DocumentTable.from_bytes(Path(src).read_bytes(), src)
    docs, tokens = int(t.part_docs.sum()), int(t.part_tokens.sum())
    shift = np.arange(times, dtype=np.int64)[:, None]
    doc_start = np.append((t.chunk_doc_start[:-1] + shift * docs).ravel(), docs * times)
    tok_start = np.append((t.chunk_token_start[:-1] + shift * tokens).ravel(), tokens * times)
    if keep_parts:
        parts = (np.tile(t.part_docs, times), np.tile(t.part_tokens, times), np.tile(t.part_ranged, times))
    else:
        parts = (np.array([docs * times]), np.array([tokens * times]), np.array([1]))
    big = DocumentTable(t.seq_len, t.block_tokens, t.chunk_blocks, *parts, doc_start, tok_start,
                        np.tile(t.counts, times), np.tile(t.chunk_sums, times))
    Path(dest).write_bytes(big.to_bytes(identity))


def write_dataset(root: str, lengths_path: str, parts: int) -> None:
    """A token dataset at ``root`` of the lengths at ``lengths_path`` in ``parts`` parts: real
    ``.idx`` files, sparse ``.bin`` files of zeros with the real ``.xxh`` of those zeros, the
    manifest last."""
    import numpy as np

    from datapipe.format.tokens import MANIFEST, make_token_manifest, write_idx

    lengths = np.load(lengths_path, mmap_mode="r")
    os.makedirs(root)
    entries = []
    for i, (a, b) in enumerate(_bounds(lengths.size, parts)):
        name = f"part-{i:05d}"
        sizes = np.asarray(lengths[a:b])
        tokens = int(sizes.sum(dtype=np.int64))
        with open(os.path.join(root, name + ".idx"), "wb") as f:
            idx_n, idx_sum = write_idx(f, sizes, np.arange(sizes.size + 1), np.uint16)
        entries.append(_zero_bin(root, name, tokens, idx_n, idx_sum, sizes.size))
    with open(os.path.join(root, MANIFEST), "wb") as f:
        f.write(make_token_manifest(entries, dtype=np.uint16, vocab_size=50257, eos_id=50256))


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    cut = [n * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(cut))


def _zero_bin(root: str, name: str, tokens: int, idx_n: int, idx_sum: str, docs: int) -> Any:
    """Part ``name``'s sparse ``.bin`` of ``tokens`` zeros (uint16) and its ``.xxh``; its entry."""
    import numpy as np

    from datapipe.checksum import checksum
    from datapipe.format.tokens import BLOCK_BYTES, TokenPart, block_count, block_sums, xxh_bytes

    nbytes = 2 * tokens
    with open(os.path.join(root, name + ".bin"), "wb") as f:
        f.truncate(nbytes)
    n = block_count(nbytes, BLOCK_BYTES)
    sums = np.full(n, block_sums(bytes(BLOCK_BYTES))[0], dtype=np.uint64)
    if nbytes % BLOCK_BYTES:
        sums[-1] = block_sums(bytes(nbytes % BLOCK_BYTES))[0]
    data = xxh_bytes(sums)
    with open(os.path.join(root, name + ".xxh"), "wb") as f:
        f.write(data)
    return TokenPart(prefix=name, idx=name + ".idx", xxh=name + ".xxh", bin_bytes=nbytes, idx_bytes=idx_n,
                     documents=docs, sequences=docs, tokens=tokens, idx_checksum=idx_sum, xxh_checksum=checksum(data))


def tile_dataset(src: str, dest: str, times: int) -> None:
    """The dataset at ``src`` with its parts repeated ``times`` over, as sparse files (each
    ``.idx`` with its real header, the rest zeros, and the checksum of that), and its stored
    table tiled to match (:func:`tile_table`): what a rank opens at ``times`` the size."""
    import numpy as np

    from datapipe.checksum import Hasher
    from datapipe.format.tokens import HEADER_BYTES, MANIFEST, make_token_manifest, parse_token_manifest

    m = parse_token_manifest(Path(src, MANIFEST).read_bytes(), src)
    os.makedirs(dest)
    idx = []  # (header, checksum of the sparse .idx) of each part
    for p in m.parts:
        header = Path(src, p.idx).read_bytes()[:HEADER_BYTES]
        h, left = Hasher(), p.idx_bytes - HEADER_BYTES
        h.update(header)
        zeros = bytes(8 << 20)
        while left:
            k = min(left, len(zeros))
            h.update(memoryview(zeros)[:k])
            left -= k
        idx.append((header, h.hexdigest()))
    entries = []
    for r in range(times):
        for i, p in enumerate(m.parts):
            name = f"part-{r:05d}-{i:03d}"
            header, idx_sum = idx[i]
            with open(os.path.join(dest, name + ".idx"), "wb") as f:
                f.write(header)
                f.truncate(p.idx_bytes)
            entries.append(_zero_bin(dest, name, p.tokens, p.idx_bytes, idx_sum, p.documents))
    data = make_token_manifest(entries, dtype=np.uint16, vocab_size=50257, eos_id=50256)
    Path(dest, MANIFEST).write_bytes(data)
    identity = str(parse_token_manifest(data, dest).doc["manifest_checksum"])
    tables = sorted(Path(src, "plans").iterdir())
    os.makedirs(os.path.join(dest, "plans"))
    for t in tables:
        tile_table(str(t), os.path.join(dest, "plans", t.name), times, identity, keep_parts=True)


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
    ap.add_argument("--parts", type=int, default=8, help="parts of the token dataset the start-up step opens")
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
        small_ds, big_ds = str(Path(tmp) / "dataset"), str(Path(tmp) / "dataset-big")
        write_dataset(small_ds, lengths, args.parts)
        first = run("first", lengths, small_ds, L, world, docs)
        opened = run("open", lengths, small_ds, L, world, docs)
        tile_dataset(small_ds, big_ds, times)
        opened_big = run("open", lengths, big_ds, L, world, docs * times)
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
          f"= 8 B x (4 x chunks + 3 x parts + 2) and its header; at 1e12 tokens {mb(count['kept'] * by_tokens)}")
    print(f"  once per (dataset, seq_len): count every document, store the table (O(documents) time, "
          f"O(chunks) memory): {count['seconds']:.3f} s, peak RSS growth {mb(count['peak_growth'])}")
    print(f"    at 1e12 tokens / 1e9 documents = measured x 1e9 / documents = x {by_docs:,.0f}: "
          f"{count['seconds'] * by_docs:.1f} s; memory: the slices' working set + the table: "
          f"~{mb(count['peak_growth'] + count['kept'] * (by_tokens - 1))}")
    show(f"per rank (every later process): read + check the table, layout + EpochPlan (O(chunks)); at "
         f"1e12 on the table tiled x {times}", rank, rank_big)
    nparts = args.parts
    print(f"\ndocuments, what a rank does at start-up: TokenDataset(packing='documents') over a dataset of "
          f"{nparts} parts, the table stored (reads the manifest, each .xxh, each .bin's size, the table; no .idx)")
    print(f"  the first process (no table yet: every .idx read whole, counted, the table stored): "
          f"{first['seconds']:.3f} s, peak RSS growth {mb(first['peak_growth'])}, read {mb(first['read'])}")
    show(f"per rank: open + layout + EpochPlan; at 1e12 on the parts repeated x {times} ({nparts * times:,} parts: "
         "the formula's per-chunk cost includes the parts', which grow with it here)", opened, opened_big)
    for name, r, parts in (("here", opened, nparts), ("at 1e12", opened_big, nparts * times)):
        xxh = 8 * sum(-(-2 * t // (1 << 20)) for t in [r["tokens"] // parts] * parts)
        table_bytes = 8 * (4 * r["chunks"] + 3 * parts + 2)
        print(f"    read {name}: {mb(r['read'])} = manifest + .xxh (8 B a 1 MiB block: ~{mb(xxh)}) + table "
              f"(8 B x (4 x chunks + 3 x parts + 2) = {mb(table_bytes)}); kept: the table's chunk arrays "
              f"{mb(r['kept'])}")
    per_chunk = 4 * docs / max(1, opened["chunks"])
    print(f"  at fetch: a chunk's document lengths, one range of its .idx sizes (4 B a document: ~{per_chunk:,.0f} B "
          f"a chunk here) and each part's 34-byte .idx header once per process, checked against the table's "
          f"checksum of the chunk's lengths; then the chunk's .bin blocks")
    print("\ntarget per rank at 1e12 tokens / 1e9 documents: <= 2 s and <= 200 MB (the formulas' figures above)")

if __name__ == "__main__":
    main()
