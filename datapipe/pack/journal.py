"""The ``_pack/`` folder in a destination: the fingerprint of the plan (input and options)
and one record per finished shard (its index rows), so a rerun of the same pack skips
what is done and a pack of other input is refused."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import DestinationExistsError
from ..storage import Store
from .commit import retract_dataset

__all__ = ["WORK", "Journal", "fingerprint"]

WORK = "_pack"


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


class Journal:
    """The ``_pack/`` folder: the plan's fingerprint and one record per finished shard."""

    def __init__(self, store: Store, fingerprint: str, overwrite: bool) -> None:
        self.store = store
        plan_key = f"{WORK}/plan.json"
        if store.exists(plan_key):
            old = json.loads(store.get(plan_key)).get("fingerprint")
            if old != fingerprint:
                if not overwrite:
                    raise DestinationExistsError(
                        f"{store.root} holds an unfinished pack of other input or options "
                        "(pass --overwrite to discard it and start again)"
                    )
                self.clear()
        elif store.list(WORK + "/") and not overwrite:
            raise DestinationExistsError(f"{store.url(WORK)} exists without a plan (pass --overwrite)")
        store.put(plan_key, json.dumps({"fingerprint": fingerprint}).encode())

    def clear(self) -> None:
        retract_dataset(self.store)

    def done(self) -> dict[str, dict[str, Any]]:
        out = {}
        for key in self.store.list(WORK + "/"):
            if key.endswith(".json") and not key.endswith("plan.json"):
                out[key[len(WORK) + 1 : -5]] = json.loads(self.store.get(key))
        return out

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.store.put(f"{WORK}/{name}.json", json.dumps(result).encode())

    def remove(self) -> None:
        for key in self.store.list(WORK + "/"):
            self.store.delete(key)
