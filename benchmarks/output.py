"""What a benchmark's command line prints: its result as JSON, also written to ``--out``."""

from __future__ import annotations

import json
from typing import Any


def print_json(result: Any, out: str | None, indent: int = 1) -> None:
    """Print ``result`` as JSON (numpy numbers as floats) and write the same text to ``out``."""
    text = json.dumps(result, indent=indent, default=float)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
