"""How the token writers make a dataset visible, through the mechanisms ``pack`` owns: one
writer per destination (``pack.lock.WriterLock``), the ``_pack/`` journal of finished work
with its fingerprint rule (``pack.journal``), and the destination check and retraction
(``pack.commit``). Every import of ``pack.journal``, ``pack.lock`` and ``pack.commit`` by
:mod:`datapipe.tokens` is here, so moving them (to ``datapipe.publish``) changes only this
module.

What is added for token datasets: the names a token writer publishes (``part-PPPPP-KKK.bin``
/ ``.idx`` / ``.xxh``, see :data:`PART_FILE`), refused in a destination that holds them
without a journal of ours, and removed by ``overwrite`` as pack's own names are; and the
publication of a part written by :class:`~datapipe.format.tokens.TokenPartWriter` (a rename
into place on a local destination, an upload per file elsewhere).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import sys
import threading
import time

from ..errors import DestinationExistsError
from ..format.tokens import MANIFEST, TokenPartWriter
from ..pack.commit import LEASE, LOCK, PLAN, WORK, retract_dataset
from ..pack.commit import check_destination as check_pack_destination
from ..pack.journal import Journal, fingerprint
from ..pack.lock import WriterLock
from ..storage import Store

__all__ = ["Journal", "WriterLock", "fingerprint", "WORK", "PLAN", "PART_FILE", "check_destination",
           "remove_stale_parts", "temporary_name", "publish_part", "die_with_parent"]

#: the files of a part pack_tokens writes: part-<piece>-<k>.bin/.idx/.xxh
PART_FILE = re.compile(r"^part-\d{5,}-\d{3,}\.(bin|idx|xxh)$")


def temporary_name(token: str, name: str) -> str:
    """The temporary name of ``name`` that :meth:`Store.remove_temporaries` removes for the
    writer ``token`` (the convention of ``Store.for_writer``, docs/ARCHITECTURE.md: "temporaries
    named ``.tmp-<writer token>-<name>``"). :class:`TokenPartWriter` writes plain files, so a
    part's temporaries are given this name by hand."""
    return f".tmp-{token}-{name}"


def _has_journal(keys: list[str]) -> bool:
    return any(k.startswith(WORK + "/") and k not in (LOCK, LEASE) for k in keys)


def check_destination(store: Store, overwrite: bool) -> None:
    """pack's rule for a destination (``pack.commit.check_destination``: a dataset there is
    refused unless ``overwrite``, which retracts it, manifest first; a killed writer's
    journal is left to :class:`Journal`), and the same for the names of token parts: parts
    without a journal of ours are someone's, refused unless ``overwrite``, which deletes
    them once the manifest is gone."""
    keys = store.list()
    journal = _has_journal(keys)
    retracting = overwrite and MANIFEST in keys
    check_pack_destination(store, overwrite, resumable=True)
    if journal and not retracting:
        return  # the journal decides what is ours (a rerun resumes it; other input is refused)
    theirs = [k for k in keys if PART_FILE.match(k)]
    if theirs and not overwrite:
        shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise DestinationExistsError(
            f"{store.root} holds no token dataset but files at names pack_tokens writes ({shown}): a pack "
            "would replace them. Pack into another folder, or pass overwrite=True / --overwrite to delete "
            "them first")
    for k in theirs:
        store.delete(k)


def remove_stale_parts(store: Store, keep: set[str]) -> None:
    """With ``overwrite``, after the new manifest: delete part files of an earlier dataset
    (or of an earlier run's plan) that the new dataset does not list."""
    for k in store.list():
        if PART_FILE.match(k) and k not in keep:
            store.delete(k)


def retract(store: Store) -> None:
    """Delete what a pack wrote at ``store``, the manifest first."""
    retract_dataset(store)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_part(writer: TokenPartWriter, store: Store, name: str) -> None:
    """Publish a closed part ``name`` (``.bin``, then ``.xxh``, then ``.idx``): by renaming the
    writer's temporaries into place when ``store`` is a local folder (they lie in it), else
    by uploading each file through ``store.open_writer`` (an object store publishes an upload
    when it completes). The writer's temporaries are gone afterwards either way."""
    root = store.local_path("")
    ext_of = {tmp: final[final.rfind("."):] for tmp, final in writer.renames}
    if root is not None:
        for tmp, ext in ext_of.items():
            os.replace(tmp, os.path.join(root, name + ext))
        _fsync_dir(root)
        return
    try:
        for tmp, ext in ext_of.items():
            with open(tmp, "rb") as src, store.open_writer(name + ext) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
    finally:
        writer.abort()  # the local copies: the writer's own files, and nothing else


def die_with_parent(parent: int) -> None:
    """Make a worker process end when the pack that started it ends, kill -9 included. A
    forkserver's children keep the forkserver alive (each holds its "alive" pipe) and their
    task queue open (each holds both ends), so neither the kernel's parent-death signal nor
    an end of file comes: a thread watches the pack's pid and ends the worker when it is
    gone. ``pack.packer`` has the same safeguard (``_die_with``) under a private name; this
    is its forkserver/spawn half, until the publish package gives it a public one."""
    if sys.platform.startswith("linux") and os.getppid() == parent:  # spawned: the pack is the parent
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def gone() -> bool:
        try:
            os.kill(parent, 0)
        except (ProcessLookupError, PermissionError):  # gone, or its pid is another user's process now
            return True
        return False

    def watch() -> None:
        while not gone():
            time.sleep(0.2)
        os._exit(1)

    if gone():
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="datapipe-pack-tokens-watchdog").start()
