"""The ``_pack/`` folder in a destination: the fingerprint of the plan (input and options)
and one record per finished shard (its index rows), so a rerun of the same pack skips
what is done and a pack of other input is refused."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import DestinationExistsError
from ..format import MANIFEST
from ..storage import Store
from .commit import LEASE, LOCK, PLAN, WORK, retract_dataset

__all__ = ["WORK", "Journal", "fingerprint"]

# keys under _pack/ that are not shard records
_NOT_RECORDS = (PLAN, LOCK, LEASE)


_RECORD_KEYS = frozenset({"record"})  # what every record holds (see packer.pack_shard, packer._pack_table)


def _json_object(store: Store, key: str) -> dict[str, Any] | None:
    """The JSON object stored at ``key``, or None if it is not one."""
    try:
        doc = json.loads(store.get(key))
    except ValueError:  # not JSON, or not UTF-8
        return None
    return doc if isinstance(doc, dict) else None


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


class Journal:
    """The ``_pack/`` folder: the plan's fingerprint and one record per finished shard.

    ``committed`` is true when this very plan already wrote its manifest and was killed
    before it removed the journal: the rerun has only the cleanup left to do."""

    def __init__(self, store: Store, fingerprint: str, overwrite: bool) -> None:
        self.store = store
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
                self.committed = store.exists(MANIFEST)
            else:
                if not overwrite:
                    if store.exists(MANIFEST):
                        raise DestinationExistsError(
                            f"{store.url(MANIFEST)} exists: {store.root} already holds a dataset of other "
                            "input or options (pass overwrite=True / --overwrite to replace it)"
                        )
                    raise DestinationExistsError(
                        f"{store.root} holds an unfinished pack of other input or options "
                        "(pass --overwrite to discard it and start again)"
                    )
                self.clear()
        elif [k for k in store.list(WORK + "/") if k not in _NOT_RECORDS] and not overwrite:
            raise DestinationExistsError(f"{store.url(WORK)} exists without a plan (pass --overwrite)")
        if not self.committed:
            store.put(PLAN, json.dumps({"fingerprint": fingerprint}).encode())

    def clear(self) -> None:
        retract_dataset(self.store)

    def done(self) -> dict[str, dict[str, Any]]:
        """The records of finished shards. A record that does not parse (damaged on disk)
        is not a finished shard: its shard is packed again."""
        out = {}
        for key in self.store.list(WORK + "/"):
            if key.endswith(".json") and key not in _NOT_RECORDS:
                rec = _json_object(self.store, key)
                if rec is not None and _RECORD_KEYS <= rec.keys():
                    out[key[len(WORK) + 1 : -5]] = rec
        return out

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.store.put(f"{WORK}/{name}.json", json.dumps(result).encode())

    def remove(self) -> None:
        """Delete the journal, its plan last: a rerun after a kill in between still finds
        the plan and finishes. The writer's lock goes when the writer releases it."""
        for key in self.store.list(WORK + "/"):
            if key not in _NOT_RECORDS:
                self.store.delete(key)
        self.store.delete(PLAN)
