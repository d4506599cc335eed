"""Token loader benchmark (issue 30, item 4): the same corpus through datapipe's TokenDataset,
LitData's TokensLoader, megatron-core's GPTDataset and a plain np.memmap with random
offsets (nanoGPT's ``get_batch``), beside a memcpy floor of the same bytes.

Corpus: synthetic documents with log-normal lengths (mean about 1,000 tokens), **int32 ids**
(a 100,352-id vocabulary: Megatron's rule stores it as int32), written once as a datapipe
token dataset of one part (Megatron's ``.bin``/``.idx`` with datapipe's ``.xxh`` and
manifest). megatron-core reads that part as is; LitData gets the same documents through its
own ``optimize(..., item_loader=TokensLoader())``; the memmap reads the same ``.bin``.

Each system runs in a fresh process (megatron-core in its own venv, ``/work/venv-mcore``,
so it cannot replace torch here) for every (seq_len, num_workers): start-up (constructor to
first batch; GPTDataset builds its document, sample and shuffle indices in its first run at a
seq_len, num_workers=0, and reads them from its cache after), the memory the plan or index
adds (RSS growth over construction, libraries imported before), tokens/s over ``--tokens``
tokens after the first min(tokens / 2, 4 M) (workers start, the first windows are read),
and the CPU seconds the process and its workers spend per 100 M of them (a figure that other
load on the machine moves far less than tokens/s), counting every sequence as the L + 1
tokens the model reads (LitData's blocks of
``block_size = L + 1``, GPTDataset's ``tokens`` and its last label, datapipe's and the
memmap's ``input_ids``), and the peak RSS of the main process and of a worker. datapipe
hands out int64 (``datapipe``) or, with ``dtype="int32"``, the stored int32
(``datapipe-int32``: the bytes LitData's TokensLoader hands out). Batches of ``--batch``
sequences, shuffled (each system's own shuffle); the page cache is warm (every file read
once before).

Floor: ``memcpy`` of the bytes the loader hands out (batches of B x (L + 1) int64, one
thread, buffers reused), in tokens/s; the same in two processes at once when ``--workers``
includes 2 (``memcpy floor x2``: their sum, the parallelism num_workers=2 has, and each one
against one alone: how much the cores slow each other down); and ``read`` (the corpus file
read once into a reused buffer, the int32 bytes: what any loader must at least move).
Targets (issue 30): through num_workers=2 at seq_len 2048, datapipe >= 3x LitData and >= 3x
GPTDataset, and >= 50% of the memcpy floor.

    python -m benchmarks.bench_tokens                 # 200 M-token corpus, 60 M tokens per run
    python -m benchmarks.bench_tokens --quick         # 24 M and 8 M

``run(quick=...)`` returns the rows (JSON-able dicts) for benchmarks/report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

__all__ = ["run", "format_table", "main", "make_corpus", "LITDATA_TARGET", "MEGATRON_TARGET", "FLOOR_TARGET"]

LITDATA_TARGET = 3.0
MEGATRON_TARGET = 3.0
FLOOR_TARGET = 0.5
VOCAB = 100_352
EOS = 100_351
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MCORE_PYTHON = os.environ.get("DATAPIPE_MCORE_PYTHON", "/work/venv-mcore/bin/python")
SYSTEMS = ("datapipe", "datapipe-int32", "litdata", "megatron", "memmap")


# --- the corpus -----------------------------------------------------------------------------


def _lengths(rng: np.random.Generator, tokens: int, mean: float = 1000.0) -> np.ndarray:
    sigma = 1.0
    mu = np.log(mean) - sigma * sigma / 2
    out, total = [], 0
    while total < tokens:
        n = np.maximum(2, rng.lognormal(mu, sigma, size=1 << 16).astype(np.int64))
        out.append(n)
        total += int(n.sum())
    lengths = np.concatenate(out)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


def make_corpus(folder: str, tokens: int, seed: int = 0) -> dict[str, Any]:
    """A datapipe token dataset of about ``tokens`` int32 tokens in one part (kept when it
    is already there); returns what it holds."""
    sys.path.insert(0, ROOT)
    from datapipe.format.tokens import MANIFEST, TokenPartWriter, make_token_manifest, parse_token_manifest

    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        rng = np.random.default_rng(seed)
        lengths = _lengths(rng, tokens)
        w = TokenPartWriter(os.path.join(folder, "part-00000-000"), vocab_size=VOCAB, fsync=False)
        for a in range(0, lengths.size, 1 << 14):
            ln = lengths[a:a + (1 << 14)]
            ids = rng.integers(0, EOS, size=int(ln.sum()), dtype=np.int32)
            ids[np.cumsum(ln) - 1] = EOS
            w.add_documents(ids, ln)
        entry = w.close()
        for tmp, final in w.renames:
            os.replace(tmp, final)
        with open(path, "wb") as f:
            f.write(make_token_manifest([entry], dtype=w.dtype, vocab_size=VOCAB, eos_id=EOS))
    with open(path, "rb") as f:
        m = parse_token_manifest(f.read(), path)
    return {"tokens": m.tokens, "documents": m.documents, "dtype": str(m.dtype), "bin": os.path.join(folder,
                                                                                                      m.parts[0].bin)}


def make_litdata(corpus: str, out: str, workers: int = 2) -> float:
    """LitData's chunks of the same documents (``optimize`` with ``TokensLoader``); seconds."""
    if os.path.exists(os.path.join(out, "index.json")):
        return 0.0
    t0 = time.perf_counter()
    code = _LITDATA_OPTIMIZE.format(root=ROOT, corpus=corpus, out=out, workers=workers)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


_LITDATA_OPTIMIZE = r"""
import os, sys
import numpy as np, torch
sys.path.insert(0, {root!r})
from litdata import optimize, TokensLoader
from datapipe.format.tokens import read_idx

corpus = {corpus!r}
idx = read_idx(open(os.path.join(corpus, "part-00000-000.idx"), "rb").read())
starts = idx.document_starts()

def documents(k):
    mm = np.memmap(os.path.join(corpus, "part-00000-000.bin"), dtype=np.int32, mode="r")
    for j in range(k * 4096, min((k + 1) * 4096, idx.num_documents)):
        yield torch.from_numpy(np.array(mm[starts[j]:starts[j + 1]]))

if __name__ == "__main__":
    optimize(fn=documents, inputs=list(range(-(-idx.num_documents // 4096))), output_dir={out!r},
             num_workers={workers}, chunk_bytes="64MB", item_loader=TokensLoader(), verbose=False,
             start_method="fork")
"""


# --- one run, in a process of its own --------------------------------------------------------

_CHILD = r"""
import gc, json, os, resource, sys, time
import numpy as np
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["root"])

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0

def tree_cpu():
    # CPU seconds of this process and each of its descendants (the DataLoader workers and
    # whatever they start) so far, by pid: unlike tokens/s, hardly moved by other load
    me, parent, cpu = os.getpid(), {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(f[1])
        cpu[int(d)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in cpu:
        p, seen = pid, 0
        while p not in (me, 0, 1) and seen < 64:  # up the parents to this process, or not
            p, seen = parent.get(p, 0), seen + 1
        if p == me:
            out[pid] = cpu[pid]
    return out

def cpu_since(before):
    # a process gone since (a helper that exited) takes its CPU time with it: left out
    return sum(t - before.get(pid, 0.0) for pid, t in tree_cpu().items())

L, B, W, want, system = spec["seq_len"], spec["batch"], spec["workers"], spec["tokens"], spec["system"]
import torch  # imported before the baseline: the plan's memory is what construction adds
if system.startswith("datapipe"):
    from datapipe import StreamingDataLoader, TokenDataset
elif system == "litdata":
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
elif system == "megatron":
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
before = rss()
t0 = time.perf_counter()
extra = {}
if system.startswith("datapipe"):
    ds = TokenDataset(spec["corpus"], L, seed=0, dtype="int32" if system.endswith("int32") else "int64")
    plan_bytes = rss() - before
    if W:
        it = StreamingDataLoader(ds, batch_size=B, num_workers=W)
    else:
        ds.batch_size, ds.batched = B, True
        it = ds
    count = lambda b: b["input_ids"].numel()
elif system == "litdata":
    ds = StreamingDataset(spec["litdata"], item_loader=TokensLoader(block_size=L + 1), shuffle=True, seed=0,
                          drop_last=True)
    plan_bytes = rss() - before
    it = StreamingDataLoader(ds, batch_size=B, num_workers=W, drop_last=True)
    count = lambda b: b.numel()
elif system == "megatron":
    class Tok:  # what GPTDataset asks of a tokenizer: the data is tokenized already
        vocab_size, eod, pad = spec["vocab"], spec["eos"], -1
        unique_identifiers = {"class": "BenchTokenizer", "vocab_size": spec["vocab"]}
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=L, blend=([spec["prefix"]], None), split="100,0,0",
                           tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, create_attention_mask=False, path_to_cache=spec["cache"])
    n = (spec["corpus_tokens"] - 1) // L
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n, None, None], lambda: True, cfg).build()
    extra["index_bytes"] = int(train.document_index.nbytes + train.sample_index.nbytes + train.shuffle_index.nbytes)
    plan_bytes = rss() - before
    it = torch.utils.data.DataLoader(train, batch_size=B, num_workers=W, drop_last=True)
    count = lambda b: b["tokens"].numel() + b["tokens"].shape[0]
else:  # nanoGPT's get_batch: random offsets into a memmap, torch.from_numpy of the stacked slices
    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            rng = np.random.default_rng(0 if info is None else info.id + 1)
            data = np.memmap(spec["bin"], dtype=np.int32, mode="r")
            while True:
                ix = rng.integers(0, data.size - L - 1, size=B)
                yield torch.from_numpy(np.stack([data[i:i + L + 1] for i in ix.tolist()]).astype(np.int64))
    plan_bytes = rss() - before
    it = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=W)
    count = lambda b: b.numel()
first = None
n = 0
t1 = None
for b in it:
    if first is None:
        first = time.perf_counter() - t0
    k = count(b)
    if t1 is None:
        if n >= spec["warmup"]:  # the first tokens warm up (workers start, first windows read), then the timed ones
            t1, n, cpu1 = time.perf_counter(), 0, tree_cpu()
        else:
            n += k
            continue
    n += k
    if n >= want:
        break
seconds = time.perf_counter() - t1
cpu = cpu_since(cpu1)
del it, b
gc.collect()
time.sleep(0.2)
main = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"startup_s": first, "plan_bytes": plan_bytes, "tokens": n, "seconds": seconds,
                  "tokens_per_s": n / seconds, "cpu_s_per_100m": cpu / n * 1e8,
                  "peak_rss_main": main, "peak_rss_worker": children if W else 0,
                  **extra}))
"""


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _child(spec: dict[str, Any], python: str) -> dict[str, Any]:
    r = subprocess.run([python, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True, env=_child_env(),
                       timeout=1800)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1][:300] if (r.stderr or r.stdout) else
                f"exit {r.returncode}"}
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def memcpy_floor(seq_len: int, batch: int, seconds: float = 1.0, source_bytes: int = 512 << 20) -> float:
    """Tokens/s of copying the bytes a loader hands out: batches of ``batch`` x (L + 1) int64,
    each from the next place of a source larger than the caches into one reused batch
    buffer (one thread)."""
    width = batch * (seq_len + 1)
    src = np.ones(max(width, source_bytes // 8), dtype=np.int64)
    dst = np.empty(width, dtype=np.int64)
    starts = list(range(0, src.size - width + 1, width))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for a in starts:
            np.copyto(dst, src[a:a + width])
        n += len(starts)
    return n * width / (time.perf_counter() - t0)


_PARALLEL_CHILD = """
import json, sys, time
from benchmarks.bench_tokens import memcpy_floor
L, B, at, seconds = json.loads(sys.argv[1])
while time.time() < at:
    time.sleep(0.001)
print(memcpy_floor(L, B, seconds=seconds, source_bytes=256 << 20))
"""


def memcpy_floor_parallel(seq_len: int, batch: int, processes: int = 2, seconds: float = 1.5) -> list[float]:
    """Tokens/s of each of ``processes`` processes running :func:`memcpy_floor` at the same
    time (the parallelism of ``num_workers=processes``): their sum is the floor for that many
    processes; each one's figure against the floor of one alone shows how much the machine's
    cores slow each other down (shared caches, memory bandwidth, a host's hyperthreads)."""
    env = _child_env()
    at = time.time() + 2.0  # every child has imported numpy and built its buffers by then
    spec = json.dumps([seq_len, batch, at, seconds])
    children = [subprocess.Popen([sys.executable, "-c", _PARALLEL_CHILD, spec], stdout=subprocess.PIPE, text=True,
                                 env=env) for _ in range(processes)]
    rates = []
    try:
        for c in children:
            out, _ = c.communicate(timeout=120)
            if c.returncode != 0:
                raise RuntimeError(f"a memcpy floor process exited {c.returncode}")
            rates.append(float(out.strip().splitlines()[-1]))
    finally:
        for c in children:  # none is left running when one failed
            if c.poll() is None:
                c.kill()
                c.wait()
    return rates


def read_floor(path: str) -> float:
    """Tokens/s of reading the corpus file once into a reused buffer (from the page cache)."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    t0, total = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total / 4 / (time.perf_counter() - t0)


def megatron_helpers(python: str = MCORE_PYTHON) -> str:
    """Whether megatron-core imports here and its C++ index helpers load (or build)."""
    if not os.path.exists(python):
        return f"not installed ({python} missing)"
    probe = ("import megatron.core, megatron.core.datasets.helpers_cpp as h; "
             "print(megatron.core.__version__, h.__file__)")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return "helpers do not load: " + (r.stderr.strip().splitlines() or ["?"])[-1][:200]
    version, where = r.stdout.split()
    build = subprocess.run(["g++", "--version"], capture_output=True, text=True)
    compiler = build.stdout.splitlines()[0] if build.returncode == 0 else "no g++"
    return f"megatron-core {version}: C++ helpers load ({os.path.basename(where)}); compiler here: {compiler}"


def run(quick: bool = False, tokens: int | None = None, corpus_tokens: int | None = None, batch: int = 8,
        seq_lens: tuple[int, ...] = (2048, 8192), workers: tuple[int, ...] = (0, 2), systems: tuple[str, ...] = SYSTEMS,
        work: str | None = None, log: Any = print) -> list[dict[str, Any]]:
    """Every figure as rows: one per (seq_len, workers, system), floors included."""
    tokens = tokens or (8_000_000 if quick else 60_000_000)
    corpus_tokens = corpus_tokens or (24_000_000 if quick else 200_000_000)
    warmup = min(tokens // 2, 4_000_000)
    work = work or os.path.join(tempfile.gettempdir(), "datapipe-bench-tokens")
    corpus_dir = os.path.join(work, f"corpus-{corpus_tokens}")
    info = make_corpus(corpus_dir, corpus_tokens)
    lit_dir = os.path.join(work, f"litdata-{corpus_tokens}")
    if "litdata" in systems:
        log(f"litdata optimize: {make_litdata(corpus_dir, lit_dir):.1f} s")
    read_floor(info["bin"])  # warm the page cache
    floor_read = read_floor(info["bin"])
    rows: list[dict[str, Any]] = []
    mega = megatron_helpers() if "megatron" in systems else "not run"
    for L in seq_lens:
        floor = memcpy_floor(L, batch)
        rows.append({"seq_len": L, "workers": 0, "system": "memcpy floor", "tokens_per_s": floor})
        if 2 in workers:  # the floor with the parallelism of the target's num_workers=2
            each = memcpy_floor_parallel(L, batch, processes=2)
            rows.append({"seq_len": L, "workers": 2, "system": "memcpy floor x2", "tokens_per_s": sum(each),
                         "each_tokens_per_s": each})
        rows.append({"seq_len": L, "workers": 0, "system": "read floor", "tokens_per_s": floor_read})
        for w in workers:
            for system in systems:
                spec = {"root": ROOT, "system": system, "seq_len": L, "batch": batch, "workers": w,
                        "tokens": tokens, "warmup": warmup, "corpus": corpus_dir, "litdata": lit_dir,
                        "bin": info["bin"], "prefix": info["bin"][:-4], "cache": os.path.join(work, f"mcore-cache-{L}"),
                        "corpus_tokens": info["tokens"], "vocab": VOCAB, "eos": EOS}
                python = MCORE_PYTHON if system == "megatron" else sys.executable
                if system == "megatron" and not os.path.exists(python):
                    got: dict[str, Any] = {"error": mega}
                else:
                    got = _child(spec, python)
                row = {"seq_len": L, "workers": w, "system": system, **got}
                rows.append(row)
                log(_line(row))
    for r in rows:
        r["corpus_tokens"] = info["tokens"]
        r["documents"] = info["documents"]
        r["dtype"] = info["dtype"]
        r["batch"] = batch
    rows.append({"system": "megatron helpers", "note": mega})
    return rows


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"L={r['seq_len']} workers={r['workers']} {r['system']}: {r['error']}"
    if "startup_s" not in r:
        return f"L={r['seq_len']} {r['system']}: {r['tokens_per_s'] / 1e6:.0f} M tokens/s"
    return (f"L={r['seq_len']} workers={r['workers']} {r['system']}: {r['tokens_per_s'] / 1e6:.1f} M tokens/s, "
            f"CPU {r.get('cpu_s_per_100m', float('nan')):.2f} s per 100 M tokens, start-up {r['startup_s']:.2f} s, "
            f"plan {r['plan_bytes'] / 2**20:.0f} MiB, "
            f"peak RSS {r['peak_rss_main'] / 2**20:.0f} MiB (+ worker {r['peak_rss_worker'] / 2**20:.0f} MiB)")


def format_table(rows: list[dict[str, Any]]) -> str:
    """The figures and the ratios the targets name."""
    lines = [f"{'L':>5} {'workers':>7} {'system':<15} {'M tokens/s':>11} {'CPU s/100M':>10} {'start-up s':>10} "
             f"{'plan MiB':>9} {'RSS MiB':>8} {'worker MiB':>10}"]
    by = {}
    for r in rows:
        if "seq_len" not in r:
            continue
        by[(r["seq_len"], r["workers"], r["system"])] = r
        if "error" in r:
            lines.append(f"{r['seq_len']:>5} {r['workers']:>7} {r['system']:<15} {'-':>11}  {r['error'][:70]}")
        elif "startup_s" in r:
            lines.append(f"{r['seq_len']:>5} {r['workers']:>7} {r['system']:<15} {r['tokens_per_s'] / 1e6:>11.1f} "
                         f"{r.get('cpu_s_per_100m', float('nan')):>10.2f} {r['startup_s']:>10.2f} "
                         f"{r['plan_bytes'] / 2**20:>9.0f} {r['peak_rss_main'] / 2**20:>8.0f} "
                         f"{r['peak_rss_worker'] / 2**20:>10.0f}")
        else:
            lines.append(f"{r['seq_len']:>5} {'':>7} {r['system']:<15} {r['tokens_per_s'] / 1e6:>11.1f}")
    lines.append("")
    for L in sorted({k[0] for k in by}):
        for ours in ("datapipe", "datapipe-int32"):
            dp = by.get((L, 2, ours))
            if dp is None or "error" in dp:
                continue
            for other, target in (("litdata", LITDATA_TARGET), ("megatron", MEGATRON_TARGET)):
                o = by.get((L, 2, other))
                if o is not None and "error" not in o:
                    ratio = dp["tokens_per_s"] / o["tokens_per_s"]
                    where = "" if L == 2048 else ", set at L=2048"
                    lines.append(f"L={L}, num_workers=2: {ours} / {other} = {ratio:.2f}x (target >= {target:g}x"
                                 f"{where}): {'met' if ratio >= target else 'NOT met'}")
            floor = by.get((L, 0, "memcpy floor"))
            if floor is not None:
                ratio = dp["tokens_per_s"] / floor["tokens_per_s"]
                lines.append(f"L={L}, num_workers=2: {ours} / memcpy floor = {ratio:.0%} (target >= "
                             f"{FLOOR_TARGET:.0%}): {'met' if ratio >= FLOOR_TARGET else 'NOT met'}")
            both = by.get((L, 2, "memcpy floor x2"))
            if both is not None:
                lines.append(f"L={L}, num_workers=2: {ours} / memcpy floor of 2 processes at once = "
                             f"{dp['tokens_per_s'] / both['tokens_per_s']:.0%}")
        both, alone = by.get((L, 2, "memcpy floor x2")), by.get((L, 0, "memcpy floor"))
        if both is not None and alone is not None:
            each = ", ".join(f"{e / alone['tokens_per_s']:.2f}" for e in both["each_tokens_per_s"])
            lines.append(f"L={L}: 2 memcpy processes at once copy {each} of one alone each "
                         "(how much this machine's cores slow each other)")
    for r in rows:
        if r.get("system") == "megatron helpers":
            lines.append(f"megatron-core: {r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=None, help="tokens timed per run")
    p.add_argument("--corpus-tokens", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--work", default=None, help="where the corpora are kept (reused across runs)")
    p.add_argument("--json", default=None, help="write the rows here too")
    a = p.parse_args(argv)
    rows = run(quick=a.quick, tokens=a.tokens, corpus_tokens=a.corpus_tokens, batch=a.batch,
               seq_lens=tuple(a.seq_len), workers=tuple(a.workers), systems=tuple(a.systems), work=a.work)
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
