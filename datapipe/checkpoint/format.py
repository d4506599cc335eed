"""The on-storage layout of a checkpoint (docs/CHECKPOINT_FORMAT.md): object keys and the
two JSON documents, the per-rank *part* and the commit *manifest*.

Both documents carry a checksum of their own canonical JSON, so a flipped byte in
metadata is caught like one in tensor data. Nothing here imports torch: the format is
JSON plus raw bytes, and a reader never runs code from storage.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..checksum import checksum
from ..errors import CorruptCheckpointError

__all__ = [
    "FORMAT",
    "VERSION",
    "LATEST_KEY",
    "step_dir",
    "manifest_key",
    "part_key",
    "chunk_key",
    "parse_step_dir",
    "encode_doc",
    "decode_doc",
]

FORMAT = "datapipe.checkpoint"
VERSION = 1
LATEST_KEY = "latest"
MANIFEST_NAME = "manifest.json"

_STEP_RE = re.compile(r"^step-(\d{12})$")


def step_dir(step: int) -> str:
    return f"step-{step:012d}"


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def part_key(step: int, attempt: str, rank: int) -> str:
    return f"{step_dir(step)}/{attempt}/part-{rank:05d}.json"


def chunk_key(step: int, attempt: str, rank: int, index: int) -> str:
    return f"{step_dir(step)}/{attempt}/rank-{rank:05d}/chunk-{index:06d}.bin"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-000000000100`` directory name, or None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode_doc(doc: dict[str, Any], kind: str) -> bytes:
    """JSON bytes of ``doc`` with ``format``/``kind``/``version`` and a self-checksum."""
    body = dict(doc, format=FORMAT, kind=kind, version=VERSION)
    body.pop("checksum", None)
    body["checksum"] = checksum(_canonical(body))
    return json.dumps(body, sort_keys=True, indent=1, allow_nan=False).encode()


def decode_doc(data: bytes, kind: str, where: str) -> dict[str, Any]:
    """Parse and verify a document written by :func:`encode_doc`; raise
    :class:`CorruptCheckpointError` naming ``where`` on any defect."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object")
    if doc.get("format") != FORMAT or doc.get("kind") != kind:
        raise CorruptCheckpointError(
            f"{where}: not a {FORMAT} {kind} (format={doc.get('format')!r}, kind={doc.get('kind')!r})"
        )
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {doc.get('version')!r}; this datapipe reads version {VERSION}"
        )
    expected = doc.pop("checksum", None)
    got = checksum(_canonical(doc))
    if expected != got:
        raise CorruptCheckpointError(
            f"{where}: metadata checksum mismatch (recorded {expected}, computed {got})"
        )
    return doc
