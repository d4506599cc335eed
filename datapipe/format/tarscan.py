"""An existing tar shard (written by ``webdataset.TarWriter``/``ShardWriter``, GNU ``tar
-cf``, Ray's ``write_webdataset``) read into index rows, in one pass of the strict tar
parser over its bytes. No I/O here.

A sample is the run of consecutive members that share a key (WebDataset's rule, see
:mod:`.tar`); its stored bytes run from its first member's first header (PAX and GNU
long-name headers included) to the end of its last member's padding. Members that name
no sample (directories, names without ``key.field``, dot-files) are passed over, as
WebDataset passes over them: they lie in gaps between samples, which a dataset of
existing tars may have (``origin: tar-index`` in its manifest). What the index promises
is what :func:`datapipe.format.sample.decode_sample` reads back from each range, so every
reader of the index sees what the strict parser accepted, or nothing.

Refused with :class:`CorruptShardError` naming the shard and byte offset: anything the
strict parser refuses (links, devices, bad checksums, truncation), a key that is not a
safe relative path (``./x``, ``/x``, ``..``), a key that appears again after other
members (WebDataset would yield two samples with one key), a field twice in one sample,
a tar without its end-of-archive blocks, and bytes other than zeros after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checksum import checksum
from ..errors import CorruptShardError, InvalidMemberNameError
from .index import SampleRecords
from .tar import END_OF_ARCHIVE, check_key, padding, split_member_name, walk_members

__all__ = ["ScannedShard", "scan_tar"]


@dataclass
class ScannedShard:
    """The index rows of one existing tar shard."""

    bytes: int
    checksum: str
    records: SampleRecords
    fields: set[str] = field(default_factory=set)
    #: members that name no sample (directories, names without ``key.field``)
    passed_over: int = 0


def scan_tar(buf: bytes | bytearray | memoryview, where: str) -> ScannedShard:
    """Index rows of the tar ``buf`` (a whole shard); ``where`` names it in errors."""
    mv = memoryview(buf).cast("B")
    n = len(mv)
    member_fields: list[str] = []
    member_bounds: list[int] = []
    records = SampleRecords([], [], [], [], member_fields, member_bounds)
    fields: set[str] = set()
    seen: set[str] = set()
    passed_over = 0
    key: str | None = None  # the sample being gathered
    start = end = 0  # its byte range
    sample_fields: set[str] = set()
    order: list[str] = []  # its fields in stored order
    bounds: list[int] = []  # and where their data lies, from its first byte

    def close() -> None:
        nonlocal key
        if key is not None:
            records.keys.append(key)
            records.offsets.append(start)
            records.lengths.append(end - start)
            records.checksums.append(checksum(mv[start:end]))
            member_fields.append("/".join(order))
            member_bounds.extend(bounds)
            seen.add(key)
            key = None

    for name, data_start, data_end, header_at in walk_members(mv, where, directories=True):
        member_end = data_end + padding(data_end - data_start)
        cut = split_member_name(name)
        if cut is None:  # a directory, or a name WebDataset passes over too
            close()
            passed_over += 1
            end = member_end
            continue
        k, fld = cut
        if k == key:
            if fld in sample_fields:
                raise CorruptShardError(f"{where}: sample {k!r} holds field {fld!r} twice (member at byte "
                                        f"{header_at}); WebDataset refuses such a sample too")
            sample_fields.add(fld)
            fields.add(fld)
            order.append(fld)
            bounds.extend((data_start - start, data_end - start))
            end = member_end
            continue
        close()
        try:
            check_key(k)
        except InvalidMemberNameError as e:
            raise CorruptShardError(
                f"{where}: member {name[:200]!r} at byte {header_at}: {e}. Re-create the tar with plain "
                "relative names (e.g. `tar -cf shard.tar -C folder 000.jpg 000.txt ...`, or GNU tar's "
                "--transform 's,^\\./,,'), then run `datapipe index` again"
            ) from None
        if k in seen:
            raise CorruptShardError(
                f"{where}: sample key {k!r} appears again at byte {header_at}, after other members: a "
                "sample's members must be consecutive (WebDataset would read two samples with one key; GNU tar writes "
                "a folder's files in directory order unless given --sort=name)"
            )
        key, start, end, sample_fields = k, header_at, member_end, {fld}
        order, bounds = [fld], [data_start - start, data_end - start]
        fields.add(fld)
    close()
    tail = mv[end:]
    if len(tail) < len(END_OF_ARCHIVE):
        raise CorruptShardError(
            f"{where}: no end-of-archive blocks after byte {end} ({n} bytes): the shard is truncated "
            "(copy it again from its source)"
        )
    if bytes(tail) != bytes(len(tail)):
        at = end + next(i for i, b in enumerate(bytes(tail)) if b)
        raise CorruptShardError(
            f"{where}: non-zero byte at {at}, after the end-of-archive blocks at byte {end}: other tar "
            "readers may read members there (a concatenated or damaged tar; re-create it)"
        )
    return ScannedShard(n, checksum(mv), records, fields, passed_over)
