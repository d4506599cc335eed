"""Fresh shard buffers ask for transparent huge pages only where the kernel hands them out
without stalling the fault: with THP ``defrag`` at ``always``, ``madvise`` or
``defer+madvise``, an advised fault compacts memory directly, which on a busy machine cost
two to three times the plain pages and the copy together in every buffer of a first epoch."""

import ctypes
import os

import pytest

from datapipe.loader.source import BufferPool, huge_pages_without_stalls

_DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"


@pytest.mark.parametrize(("setting", "asks"), [
    ("always defer defer+madvise [madvise] never", False),
    ("[always] defer defer+madvise madvise never", False),
    ("always defer [defer+madvise] madvise never", False),
    ("always [defer] defer+madvise madvise never", True),
    ("always defer defer+madvise madvise [never]", True),
    ("", False),
    (None, False),
])
def test_huge_pages_are_asked_for_only_where_a_fault_does_not_compact(setting, asks):
    assert huge_pages_without_stalls(setting) is asks


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process holding ``address``."""
    inside, flags = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
    assert flags is not None
    return flags


@pytest.mark.skipif(not os.path.exists(_DEFRAG) or not os.path.exists("/proc/self/smaps"),
                    reason="Linux with transparent huge pages")
def test_a_fresh_shard_buffer_follows_the_machines_setting():
    """Old code: every buffer of 2 MB or more advised MADV_HUGEPAGE ('hg'), whatever the setting."""
    with open(_DEFRAG) as f:
        expect = huge_pages_without_stalls(f.read())
    pool = BufferPool(64 << 20)
    mm = pool.take(8 << 20)
    mm[0] = 1
    c = ctypes.c_char.from_buffer(mm)
    try:
        flags = _vm_flags(ctypes.addressof(c))
    finally:
        del c
    assert ("hg" in flags) is expect, flags
    pool.give(mm)
