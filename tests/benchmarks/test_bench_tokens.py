"""benchmarks/bench_tokens runs end to end at a tiny size and reports every row (the figures
themselves are the benchmark's, not a test's; LitData's optimize and megatron-core's venv are
left to the benchmark run)."""

from __future__ import annotations

from benchmarks.bench_tokens import format_table, run


def test_bench_tokens_rows(tmp_path):
    rows = run(tokens=40_000, corpus_tokens=400_000, seq_lens=(256,), workers=(0, 2), systems=("datapipe", "memmap"),
               work=str(tmp_path), log=lambda s: None)
    cells = [(r["system"], r.get("workers")) for r in rows]
    assert cells == [("memcpy floor", 0), ("memcpy floor x2", 2), ("read floor", 0), ("datapipe", 0), ("memmap", 0),
                     ("datapipe", 2), ("memmap", 2), ("megatron helpers", None)]
    both = rows[1]  # two processes copying at once: the parallelism of num_workers=2
    assert len(both["each_tokens_per_s"]) == 2 and both["tokens_per_s"] == sum(both["each_tokens_per_s"]) > 0
    for r in rows[3:7]:
        assert "error" not in r, r
        assert r["tokens"] >= 40_000 and r["tokens_per_s"] > 0 and r["startup_s"] > 0 and r["peak_rss_main"] > 0
        assert r["cpu_s_per_100m"] >= 0
    assert rows[0]["dtype"] == "int32" and rows[0]["corpus_tokens"] >= 400_000
    table = format_table(rows)
    assert "datapipe" in table and "memcpy floor" in table
    assert "memcpy floor of 2 processes at once" in table and "2 memcpy processes at once copy" in table

