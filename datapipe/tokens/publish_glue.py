"""How the token writers make a dataset visible, through :mod:`datapipe.publish`: one
writer per destination (``WriterLock``, and ``die_with_parent``: a worker process ends with
the writer that started it), the ``_pack/`` journal of finished work with its
fingerprint rule (``Journal``), and the destination check and retraction
(``check_destination``). Every import of :mod:`datapipe.publish` by :mod:`datapipe.tokens`
is here.

What is added for token datasets: the names a token writer publishes (``part-PPPPP-KKK.bin``
/ ``.idx`` / ``.xxh``, see :data:`PART_FILE`), refused in a destination that holds them
without a journal of ours, and removed by ``overwrite`` as pack's own names are. (How a
worker publishes one part is :func:`datapipe.tokens.write.publish_part`: it needs none of
pack's modules.)
"""

from __future__ import annotations

import re

from ..errors import DestinationExistsError
from ..format.tokens import MANIFEST
from ..publish import LEASE, LOCK, PLAN, WORK, Journal, WriterLock, die_with_parent, fingerprint
from ..publish import check_destination as check_pack_destination
from ..storage import Store

__all__ = ["Journal", "WriterLock", "die_with_parent", "fingerprint", "WORK", "PLAN", "PART_FILE",
           "check_destination", "remove_stale_parts"]

#: the files of a part pack_tokens writes: part-<piece>-<k>.bin/.idx/.xxh
PART_FILE = re.compile(r"^part-\d{5,}-\d{3,}\.(bin|idx|xxh)$")


def _has_journal(keys: list[str]) -> bool:
    return any(k.startswith(WORK + "/") and k not in (LOCK, LEASE) for k in keys)


def check_destination(store: Store, overwrite: bool) -> None:
    """pack's rule for a destination (``publish.check_destination``: a dataset there is
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

