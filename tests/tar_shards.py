"""Tiny tar shards for tests that index or read shards in place."""

from __future__ import annotations

import tarfile
from pathlib import Path


def text_shard(path: Path, keys: list[str]) -> None:
    """A ustar shard at ``path`` holding ``<key>.txt`` = b"hello" for each key."""
    src = path.parent / "member.txt"
    src.write_bytes(b"hello")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for k in keys:
            t.add(src, arcname=f"{k}.txt")
    src.unlink()
