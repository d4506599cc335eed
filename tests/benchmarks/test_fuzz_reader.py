"""Property-based fuzzing of every reader (issue 9, "What done looks like"): byte flips,
truncations, overwrites and field edits (some re-signed, as a hostile writer would) of
shards, samples.parquet, shards.parquet and manifest.json, on plain and zstd datasets.
Each read through open_dataset, verify and one StreamingDataset epoch either returns
exactly the original samples or raises a DatapipeError naming the file; never other
data, another exception or a hang. The harness is benchmarks/fuzz_reader.py, which runs
thousands of cases (`python -m benchmarks.fuzz_reader --cases 3000`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_reader import build_references, hypothesis_draw, random_case, run_case


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return str(root), build_references(str(root))


@given(data=st.data())
@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
def test_damaged_dataset_reads_back_intact_or_names_the_file(refs, data):
    root, references = refs
    run_case(random_case(hypothesis_draw(data)), references, root)
