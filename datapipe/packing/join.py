"""Join the parts that `pack --part I/N` wrote on N machines into one dataset."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from ..dataset import open_index
from ..errors import DestinationExistsError, FormatError, PackError
from ..format import MANIFEST, SampleRecords, ShardRecord
from ..publish import WriterLock, commit, part_dir, write_index_files
from ..storage import open_store

__all__ = ["join_parts"]

_PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})/" + re.escape(MANIFEST) + "$")


def join_parts(dest: str, *, storage_options: dict[str, Any] | None = None, overwrite: bool = False) -> int:
    """Write one index at ``dest`` over every ``part-*-of-N`` dataset under it; the shards
    stay where they are. Refuses while a part is missing, or while another pack or join
    writes ``dest``. Returns the sample count."""
    with WriterLock(open_store(dest, storage_options)) as lock:
        return _join(lock, dest, storage_options, overwrite)


def _join(lock: WriterLock, dest: str, storage_options: dict[str, Any] | None, overwrite: bool) -> int:
    store = lock.store
    found: dict[int, set[int]] = {}
    for key in store.list("part-"):
        m = _PART_RE.match(key)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        raise PackError(f"no finished part under {dest} (expected part-00000-of-0000N/{MANIFEST})")
    if len(found) > 1:
        raise PackError(f"{dest} holds parts of different splits: of {sorted(found)}")
    (n, have), = found.items()
    missing = sorted(set(range(n)) - have)
    if missing:
        raise PackError(
            f"cannot join {dest}: parts {missing} of {n} are not finished "
            f"(e.g. run `datapipe pack SRC {dest} --part {missing[0]}/{n}`)"
        )
    if store.exists(MANIFEST):
        if not overwrite:
            raise DestinationExistsError(f"{store.url(MANIFEST)} exists: already joined (pass --overwrite)")
        store.delete(MANIFEST)  # only the top index: the parts stay
    indexes = [open_index(store.url(part_dir(i, n)), storage_options) for i in range(n)]
    compressions = {ix.compression for ix in indexes}
    if len(compressions) != 1:
        raise FormatError(f"parts under {dest} mix compressions {sorted(compressions)}")
    shards: list[ShardRecord] = []
    fields: set[str] = set()
    for i, ix in enumerate(indexes):
        fields.update(ix.manifest.get("fields", []))
        for s in ix.shards:
            shards.append(ShardRecord(f"{part_dir(i, n)}/{s.name}", s.bytes, s.samples, s.checksum, s.tar_bytes))

    def samples() -> Iterator[SampleRecords]:
        for ix in indexes:
            for j in range(ix.num_shards):
                yield ix.shard_samples(j).records()  # with the member layout the part's index records

    compression = compressions.pop()
    commit(lock, lambda store: write_index_files(store, shards, samples(), compression, fields, extra={"parts": n}))
    return sum(s.samples for s in shards)
