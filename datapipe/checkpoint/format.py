"""The on-storage layout of a checkpoint (docs/CHECKPOINT_FORMAT.md): object keys and the
two JSON documents, the per-rank *part* and the commit *manifest*, plus the *parts index*
(every part document of a multi-rank step in one object, for readers of all parts).

Both documents carry a checksum of their own canonical JSON, so a flipped byte in
metadata is caught like one in tensor data. Nothing here imports torch: the format is
JSON plus raw bytes, and a reader never runs code from storage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checksum import Hasher, canonical_json, checksum
from ..errors import CorruptCheckpointError

__all__ = [
    "FORMAT",
    "VERSION",
    "LATEST_KEY",
    "step_dir",
    "manifest_key",
    "part_key",
    "parts_index_key",
    "PARTS_INDEX_MAX_BYTES",
    "encode_parts_index",
    "chunk_key",
    "parse_step_dir",
    "parse_attempt",
    "is_data_key",
    "encode_doc",
    "decode_doc",
    "MAX_MANIFEST_BYTES",
    "MAX_PART_BYTES",
    "MAX_LATEST_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_CHUNK_BYTES",
    "MAX_WORLD_SIZE",
    "MAX_NDIM",
    "BLOCK_BYTES",
    "block_checksums",
]

FORMAT = "datapipe.checkpoint"
VERSION = 1
LATEST_KEY = "latest"
MANIFEST_NAME = "manifest.json"
PARTS_INDEX_NAME = "parts-index.json"
#: a step whose part documents add up to more gets no parts index: rank 0 would hold them
#: twice while writing it, and each reader would fetch that much in one request anyway
PARTS_INDEX_MAX_BYTES = 1 << 30

_STEP_RE = re.compile(r"^step-(\d{12})$")
# <attempt id>-<n>: the id as run_id.agree_writer_ids draws it (a given run_id, maybe with a nonce),
# n the writer's save count of the step
_ATTEMPT_RE = re.compile(r"^([A-Za-z0-9_]{1,64})-(\d{1,9})$")

# Bounds a reader enforces before it parses or allocates anything named by a document.
# A writer never produces more (writer.py refuses such states at save()).
MAX_MANIFEST_BYTES = 64 << 20  # ~270k ranks (~245 bytes per part entry)
MAX_PART_BYTES = 256 << 20
MAX_LATEST_BYTES = 64 << 10
MAX_JSON_DEPTH = 400  # a state nested 100 containers deep encodes to ~302 levels
MAX_CHUNK_BYTES = 1 << 32
MAX_WORLD_SIZE = 1 << 20  # ranks a manifest may name
MAX_NDIM = 64  # dimensions of a leaf or a global tensor
# Checksum granularity inside an uncompressed chunk (a chunk record's "blocks"): a reader of
# a byte range (a shard of a global tensor, reshard.py) reads and checks the blocks that
# overlap it instead of the whole chunk, so checking costs what the read costs.
BLOCK_BYTES = 1 << 20


def step_dir(step: int) -> str:
    return f"step-{step:012d}"


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def part_key(step: int, attempt: str, rank: int) -> str:
    return f"{step_dir(step)}/{attempt}/part-{rank:05d}.json"


def parts_index_key(step: int, attempt: str) -> str:
    return f"{step_dir(step)}/{attempt}/{PARTS_INDEX_NAME}"


def encode_parts_index(step: int, attempt: str, docs: list[bytes]) -> tuple[bytes, list[int]]:
    """The parts index of one attempt: ``docs`` (each rank's part document, its exact
    bytes, in rank order) inside one JSON object, and the offset of each document in it.

    The documents are copied byte for byte, so a reader slices rank ``r``'s out at
    ``[offset, offset + len)`` and checks it against the checksum the manifest already
    records for that part file; the object stays valid JSON for tools (each part is a JSON
    object, joined as the items of ``"parts"``). It carries no checksum of its own: the
    manifest records its size and checksum."""
    head = json.dumps({"format": FORMAT, "kind": "parts_index", "version": VERSION, "step": step,
                       "attempt": attempt, "world_size": len(docs)}, sort_keys=True)
    out = [head[:-1].encode() + b', "parts": [\n']
    pos = len(out[0])
    offsets = []
    for i, doc in enumerate(docs):
        if i:
            out.append(b",\n")
            pos += 2
        offsets.append(pos)
        out.append(doc)
        pos += len(doc)
    out.append(b"\n]}\n")
    return b"".join(out), offsets


def chunk_key(step: int, attempt: str, rank: int, index: int) -> str:
    return f"{step_dir(step)}/{attempt}/rank-{rank:05d}/chunk-{index:06d}.bin"


def block_checksums(data: memoryview, block: int = BLOCK_BYTES, whole: Hasher | None = None,
                    sink: Callable[[memoryview], Any] | None = None) -> dict[str, Any]:
    """An uncompressed chunk record's ``blocks``: ``{"bytes": block, "checksums": [...]}``,
    one per ``block`` bytes (the last may be shorter), so that a range read checks only the
    blocks it touches (reshard.py). Hashed a block at a time: xxhash holds the GIL while it
    hashes, and the writer's background threads must not hold it for long. ``whole`` is
    fed every block too, so the chunk's own checksum comes from the same pass, and so is
    ``sink`` (a file's ``write``), after the hashes: the block is read from memory once,
    the writer copies it from the CPU's cache (a separate write read all of it again)."""
    sums = []
    for i in range(0, len(data), block):
        part = data[i : i + block]
        if whole is not None:
            whole.update(part)
        sums.append(checksum(part))
        if sink is not None:
            sink(part)
    return {"bytes": block, "checksums": sums}


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-000000000100`` directory name, or None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


_DATA_KEY_RE = re.compile(
    r"^step-\d{12}/[A-Za-z0-9_]{1,64}-\d{1,9}/(part-\d{5}\.json|parts-index\.json|rank-\d{5}/chunk-\d{6}\.bin)$"
)


def is_data_key(key: str) -> bool:
    """Whether ``key`` is a part, parts index or chunk name this format writes inside an
    attempt (retention deletes only such keys and manifests, never a file someone else
    put in the folder)."""
    return bool(_DATA_KEY_RE.match(key))


def parse_attempt(name: Any) -> tuple[str, int] | None:
    """``(run_id, n)`` of an attempt directory name, or None if it is not one."""
    m = _ATTEMPT_RE.match(name) if isinstance(name, str) else None
    return (m.group(1), int(m.group(2))) if m else None


_JSON_STRING = re.compile(rb'"[^"]*"')  # once no escaped quote is left in the text
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_SLICE = 1 << 20  # brackets counted at a time: the count's memory stays a few MiB


def json_depth(text: bytes) -> int:
    """Nesting depth of UTF-8 JSON text that parsed: its strings dropped, the brackets left are
    the containers' (a hostile document is deep; a large one has many strings, which a
    walk of the parsed document would visit one by one). Backslashes occur only in strings'
    escapes, which pair up left to right: dropping escaped backslashes, then escaped quotes
    (each a pass in C, where a regex stepping over escapes went at ~25 MB/s) leaves strings
    that end at their next quote. The brackets are counted with numpy, a slice at a time
    (a Python loop over them cost a reader more than parsing the document)."""
    unescaped = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = np.frombuffer(_JSON_STRING.sub(b"", unescaped).translate(None, _NOT_BRACKETS), np.uint8)
    deepest = level = 0
    for i in range(0, len(brackets), _DEPTH_SLICE):
        part = brackets[i : i + _DEPTH_SLICE]
        # "[" and "{" open (+1), "]" and "}" close (-1)
        steps = np.where((part == ord("[")) | (part == ord("{")), np.int8(1), np.int8(-1))
        depths = np.cumsum(steps, dtype=np.int64) + level
        deepest = max(deepest, int(depths.max()))
        level = int(depths[-1])
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def encode_doc(doc: dict[str, Any], kind: str) -> bytes:
    """JSON bytes of ``doc`` with ``format``/``kind``/``version`` and a self-checksum, on one
    line: json's C encoder writes that, an indented document goes through its pure-Python
    encoder (5 ms of a save per part document of 192 leaves)."""
    body = dict(doc, format=FORMAT, kind=kind, version=VERSION)
    body.pop("checksum", None)
    body["checksum"] = checksum(canonical_json(body))
    return json.dumps(body, sort_keys=True, allow_nan=False).encode()


def decode_doc(data: bytes, kind: str, where: str) -> dict[str, Any]:
    """Parse and verify a document written by :func:`encode_doc`; raise
    :class:`CorruptCheckpointError` naming ``where`` on any defect."""
    try:
        # NaN/Infinity are not JSON and the writer never emits them (allow_nan=False);
        # RecursionError: a document nested deeper than the parser's stack.
        # UTF-8 only (the writer emits ASCII): json.loads of bytes also reads UTF-16/32,
        # where a character's bytes can be a quote or a bracket, and json_depth's count
        # of the text would no longer be the document's depth
        doc = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if doc.get("format") != FORMAT or doc.get("kind") != kind:
        raise CorruptCheckpointError(
            f"{where}: not a {FORMAT} {kind} (format={doc.get('format')!r}, kind={doc.get('kind')!r})"
        )
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {doc.get('version')!r}; this datapipe reads version {VERSION}"
        )
    expected = doc.pop("checksum", None)
    try:
        got = checksum(canonical_json(doc))
    except ValueError as e:  # 1e999 parses to inf, which canonical JSON refuses
        raise CorruptCheckpointError(f"{where}: not canonical JSON ({e})") from None
    if expected != got:
        raise CorruptCheckpointError(
            f"{where}: metadata checksum mismatch (recorded {expected}, computed {got})"
        )
    return doc
