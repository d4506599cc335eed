"""The journal folder (``_pack/``) in a destination: the fingerprint of the plan (input and
options), one record per finished part (so a rerun of the same plan skips what is done
and a plan of other input is refused), and the names a writer journals before the first
byte of each file it writes (so a failed write deletes exactly the files it wrote)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ..errors import DestinationExistsError
from ..storage import Store
from .commit import retract_dataset
from .layout import JOURNAL_FILES, PLAN, SHARD_FILES, WORK, DatasetFiles

__all__ = ["Journal", "fingerprint", "journal_name"]

_RECORD_KEYS = frozenset({"record"})  # what every record holds (see Journal.record)


def _json_object(store: Store, key: str) -> dict[str, Any] | None:
    """The JSON object stored at ``key``, or None if it is not one."""
    try:
        doc = json.loads(store.get(key))
    except ValueError:  # not JSON, or not UTF-8
        return None
    return doc if isinstance(doc, dict) else None


def fingerprint(obj: Any) -> str:
    """A short digest of a plan (JSON-able: the input, the options): two runs of one plan
    have the same fingerprint."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def journal_name(store: Store, name: str, token: str, **fields: Any) -> None:
    """Journal that the writer ``token`` is about to write ``name``: called before the
    file's first byte (from any process: a worker, a Ray task), so that
    :meth:`Journal.discard` can later delete it if no finished part claims it. ``fields``
    are kept beside the token (a task's index, say)."""
    store.put(f"{WORK}/{name}.json", json.dumps({"writer": token, **fields}).encode())


class Journal:
    """The journal folder: the plan's fingerprint and one record per finished part.

    ``committed`` is true when this very plan already wrote its manifest and was killed
    before it removed the journal: the rerun has only the cleanup left to do. ``files``:
    the names this kind of writer publishes (what ``overwrite`` retracts)."""

    def __init__(self, store: Store, fingerprint: str, overwrite: bool, files: DatasetFiles = SHARD_FILES) -> None:
        self.store = store
        self.files = files
        self.committed = False
        if store.exists(PLAN):
            plan = _json_object(store, PLAN)
            old = None if plan is None else plan.get("fingerprint")
            if plan is None and not overwrite:
                raise DestinationExistsError(
                    f"{store.url(PLAN)} is damaged (not the JSON a pack writes): {store.root} holds an "
                    "unfinished pack that cannot be resumed (pass --overwrite to discard it and start again)"
                )
            if old == fingerprint:
                self.committed = store.exists(files.manifest)
            else:
                if not overwrite:
                    if store.exists(files.manifest):
                        raise DestinationExistsError(
                            f"{store.url(files.manifest)} exists: {store.root} already holds a dataset of other "
                            "input or options (pass overwrite=True / --overwrite to replace it)"
                        )
                    raise DestinationExistsError(
                        f"{store.root} holds an unfinished pack of other input or options "
                        "(pass --overwrite to discard it and start again)"
                    )
                self.clear()
        elif [k for k in store.list(WORK + "/") if k not in JOURNAL_FILES] and not overwrite:
            raise DestinationExistsError(f"{store.url(WORK)} exists without a plan (pass --overwrite)")
        if not self.committed:
            store.put(PLAN, json.dumps({"fingerprint": fingerprint}).encode())

    def clear(self) -> None:
        retract_dataset(self.store, self.files)

    def done(self) -> dict[str, dict[str, Any]]:
        """The records of finished parts, by name. A record that does not parse (damaged on
        disk) is not a finished part: its part is written again."""
        out = {}
        for key in self.store.list(WORK + "/"):
            if key.endswith(".json") and key not in JOURNAL_FILES:
                rec = _json_object(self.store, key)
                if rec is not None and _RECORD_KEYS <= rec.keys():
                    out[key[len(WORK) + 1 : -5]] = rec
        return out

    def record(self, name: str, result: dict[str, Any]) -> None:
        """Record the finished part ``name``: ``result`` is a JSON-able dict holding a
        ``"record"`` entry (what :meth:`done` returns for it on a rerun)."""
        self.store.put(f"{WORK}/{name}.json", json.dumps(result).encode())

    def journaled(self, token: str, names: re.Pattern[str]) -> list[str]:
        """The names the writer ``token`` journaled (:func:`journal_name`), of those that
        match ``names`` (a writer deletes only names of its own kind)."""
        out = []
        for key in self.store.list(WORK + "/"):
            name = key[len(WORK) + 1 : -len(".json")]
            if not key.endswith(".json") or key in JOURNAL_FILES or not names.fullmatch(name):
                continue
            doc = _json_object(self.store, key)
            if doc is not None and doc.get("writer") == token:
                out.append(name)
        return out

    def discard(self, token: str, names: re.Pattern[str], keep: set[str]) -> None:
        """Delete the files the writer ``token`` journaled that are not in ``keep`` (written
        by an attempt that failed, or by a write that failed)."""
        for name in self.journaled(token, names):
            if name not in keep:
                self.store.delete(name)

    def remove(self) -> None:
        """Delete the journal, its plan last: a rerun after a kill in between still finds
        the plan and finishes. The writer's lock goes when the writer releases it."""
        for key in self.store.list(WORK + "/"):
            if key not in JOURNAL_FILES:
                self.store.delete(key)
        self.store.delete(PLAN)
