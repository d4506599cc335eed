"""benchmarks/bench_pack_tokens runs end to end at a tiny size and reports every row (the
figures themselves are the benchmark's, not a test's)."""

from __future__ import annotations

from benchmarks.bench_pack_tokens import format_table, run


def test_bench_pack_tokens_rows(tmp_path):
    rows = run(tokens=300_000, text_tokens=20_000, rounds=1, workers=2, work=str(tmp_path))
    assert [(r["case"], r["system"]) for r in rows] == [
        ("pre-tokenized parquet", "floor"), ("pre-tokenized parquet", "datapipe"),
        ("text + tokenizer", "encode_batch"), ("text + tokenizer", "encode_batch_fast"),
        ("text + tokenizer", "datapipe")]
    assert all(r["tokens"] > 0 and r["seconds"] > 0 for r in rows)
    assert rows[0]["tokens"] == rows[1]["tokens"]  # the floor writes what datapipe writes
    assert "datapipe" in format_table(rows)
