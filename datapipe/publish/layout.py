"""What a writer keeps in its destination beside the dataset: the journal folder (``_pack/``)
and its fixed files, the folders of a dataset written in parts (``part-IIIII-of-NNNNN/``),
and the names each kind of writer publishes (:class:`DatasetFiles`), so that ``overwrite``
deletes those names and nothing else that happens to live under the destination."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..format import MANIFEST, SAMPLES_FILE, SHARDS_FILE

__all__ = ["WORK", "PLAN", "LOCK", "LEASE", "JOURNAL_FILES", "RECORDS", "DatasetFiles", "SHARD_FILES", "part_dir"]

#: the journal folder: the plan's fingerprint, a record per finished part, the names a
#: writer is about to write, and the writer's lock
WORK = "_pack"
PLAN = f"{WORK}/plan.json"
# The writer's own lock and lease: owned by `lock.WriterLock`, never deleted by a cleanup
# (deleting a held lock file would let a second writer lock a new one).
LOCK = f"{WORK}/writer.lock"
LEASE = f"{WORK}/lease.json"
#: keys under the journal folder that are neither records nor names a writer journaled
JOURNAL_FILES = (PLAN, LOCK, LEASE)
#: the folder of per-shard records ``datapipe index`` keeps in its destination (here, beside
#: the journal folder, so that a reader of tables can tell a destination still being written)
RECORDS = "_index"


def part_dir(i: int, n: int) -> str:
    """The folder of part ``i`` of ``n`` (``pack --part I/N``) in a destination."""
    return f"part-{i:05d}-of-{n:05d}"


@dataclass(frozen=True)
class DatasetFiles:
    """The names one kind of writer publishes in a destination: ``parts``, a regular
    expression of its part files (shards, token ``.bin``/``.idx`` files, ...); ``index``,
    the files it commits before the manifest; ``manifest``, the commit point, written last.
    A destination may hold them at its top or in the folders of a parted write; the
    journal folder is always the writer's."""

    parts: str
    index: tuple[str, ...] = ()
    manifest: str = MANIFEST
    _owned: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = "|".join([self.parts, *map(re.escape, (self.manifest, *self.index)), f"{re.escape(WORK)}/.*"])
        object.__setattr__(self, "_owned", re.compile(rf"(part-\d{{5}}-of-\d{{5}}/)?({names})"))

    def owns(self, key: str) -> bool:
        """Whether ``key`` is a name this kind of writer publishes (and so may delete): the
        whole key (a name with a newline after it is someone else's)."""
        return self._owned.fullmatch(key) is not None


#: what a sample dataset's writers publish (pack, ShardWriter, the Ray sink, join):
#: shard-NNNNNN.tar[.zst], and shard-TTTTTT-NNNNNN (shard N of Ray write task T)
SHARD_FILES = DatasetFiles(parts=r"shard-(\d{6,}-)?\d{6}\.tar(\.zst)?", index=(SHARDS_FILE, SAMPLES_FILE))
