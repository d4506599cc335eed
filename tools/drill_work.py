"""What both drills (tools/recovery_drill.py, tools/elastic_drill.py) need of the machine:
a free loopback port, and a work folder that is theirs to delete in."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def claim_work_dir(work: str, marker_name: str, drill: str) -> None:
    """Make ``work`` the drill's: a new or empty folder gets the marker; a folder with
    other content and no marker is refused (the drill deletes only what it wrote)."""
    os.makedirs(work, exist_ok=True)
    marker = os.path.join(work, marker_name)
    if os.path.exists(marker):
        return
    if os.listdir(work):
        raise SystemExit(f"--dir {work} is not empty and was not made by the {drill} drill (no {marker_name} "
                         "file in it): the drill deletes its work folders there; pass a new or empty folder")
    with open(marker, "w") as f:
        f.write(f"made by tools/{drill}_drill.py; its subfolders are deleted by the next drill run here\n")
