"""Check a checkpoint_resume work folder: over the steps that the checkpoints carried on, every
sample appears exactly once per epoch.

    python examples/checkpoint_resume/verify.py WORKDIR

The log holds every attempt's steps in order. An attempt that resumed from the checkpoint of
step S replaces every step after S of the attempts before it (those steps were lost with the
crash and trained again), so the timeline keeps, for each step, the last attempt that ran it.
Exit status 0 when every epoch of the timeline holds every sample of the dataset once.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import datapipe


def timeline(log_path: str) -> dict[int, dict]:
    """step -> the logged step that the run carried on with."""
    steps: dict[int, dict] = {}
    with open(log_path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill: its step was lost
                continue
            if "resumed_from" in row:  # a new attempt: steps after its checkpoint are trained again
                steps = {s: r for s, r in steps.items() if s <= row["resumed_from"]}
            else:
                steps[row["step"]] = row
    return steps


def check(workdir: str) -> dict:
    keys = datapipe.open_index(os.path.join(workdir, "data")).keys()
    steps = timeline(os.path.join(workdir, "log.jsonl"))
    attempts = Counter(r["attempt"] for r in steps.values())
    per_epoch: dict[int, Counter] = {}
    for row in steps.values():
        per_epoch.setdefault(row["epoch"], Counter()).update(row["keys"])
    once = bool(per_epoch) and all(c == Counter(keys) for c in per_epoch.values())
    return {"steps": len(steps), "attempts": len(attempts), "epochs": sorted(per_epoch), "every_sample_once": once}


def main(argv: list[str] | None = None) -> int:
    workdir = (argv if argv is not None else sys.argv[1:])[0]
    result = check(workdir)
    print(f"{result['steps']} steps from {result['attempts']} attempts, epochs {result['epochs']}: "
          f"every sample exactly once per epoch: {result['every_sample_once']}")
    return 0 if result["every_sample_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
