"""``python -m benchmarks.report`` writes its figures and tables beside the hand-written
narrative (``REPORT.md``), never over it, and the narrative links the tables."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent.parent
NARRATIVE = "# datapipe benchmark report\n\nWhat each figure means, written by hand.\n"


def test_a_run_leaves_the_narrative_and_writes_the_tables_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    (out / "REPORT.md").write_text(NARRATIVE)
    # no part: the run still writes every output file it writes after a full run
    assert report.main(["--parts", ",", "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    assert (out / "REPORT.md").read_text() == NARRATIVE
    tables = (out / report.TABLES).read_text()
    assert tables.startswith("# datapipe benchmark") and "`python -m benchmarks.report --parts ," in tables
    figures = json.loads((out / report.RESULTS).read_text())
    assert figures["seconds"] == {} and "loadavg_end" in figures["machine"]


def test_the_narrative_links_the_generated_tables() -> None:
    text = (ROOT / "benchmarks" / "results" / "REPORT.md").read_text()
    assert f"]({report.TABLES})" in text
