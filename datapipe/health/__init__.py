"""health: what the data path's telemetry says about a job, above the loader and the cache.

- summary.py: window summaries as published (checked, bounded) and as numpy columns;
- detector.py: `detect`, stragglers named with their cause (data: which tier, the cache,
  throttling, decode; compute), stale, idle, missing and unreadable ranks;
- board.py: where ranks publish their summaries (`StoreBoard`: the job's torch.distributed
  store; `FileBoard`: a file per rank in a run directory) and `Publisher`, which publishes
  each window of a `datapipe.telemetry.Telemetry` from a thread of its own;
- doctor.py: `check_tiers` (and `datapipe doctor`): each tier written, fsync'd, read back
  and timed, free space against its budget (a folder through `datapipe.cache.check_folder`,
  the check a cache and a checkpoint writer run as they start), an object store's GET
  latency and errors;
- prometheus.py: `serve`, a Prometheus endpoint (extra `metrics`: prometheus_client).

The recorder itself is `datapipe.telemetry` (a leaf), so the loader and the cache record
without importing this package. No collective runs here: publishing is a `set` or a file
rename per window, reading never waits on a rank.

Imports: telemetry, storage, topology, options, errors, cache (`check_folder`; cache and
checkpoint inside a function to read the arguments a config dict may hold).
"""

from .board import BOARD_FOLDER, Board, BoardRead, FileBoard, Publisher, StoreBoard
from .detector import STRAGGLER_KINDS, Finding, Report, detect
from .doctor import PROBE_PREFIX, TierCheck, TierSpec, check_tiers, format_checks, tiers_from_config
from .prometheus import MetricsServer, serve
from .summary import SummaryTable, parse_summary

__all__ = [
    "detect",
    "Report",
    "Finding",
    "STRAGGLER_KINDS",
    "Board",
    "BoardRead",
    "FileBoard",
    "StoreBoard",
    "Publisher",
    "BOARD_FOLDER",
    "check_tiers",
    "TierSpec",
    "TierCheck",
    "tiers_from_config",
    "format_checks",
    "PROBE_PREFIX",
    "serve",
    "MetricsServer",
    "SummaryTable",
    "parse_summary",
]
