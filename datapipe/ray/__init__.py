"""datapipe on Ray Data (optional extra ``ray``): the packer as Ray write tasks, the
verified reader as Ray read tasks.

Holds: ``sink`` (:class:`DatapipeDatasink`: each write task rolls its own shards with
names fixed by its task index, journals each name before its first byte, verifies each
shard it published and returns the index rows; the driver merges them and commits the
manifest last, as ``pack`` does), ``source`` (:func:`read`, :class:`DatapipeDatasource`:
one read task per shard range, each shard checked against its index before a row leaves
it; packed datasets and indexes of existing tars), ``engine`` (:func:`pack`: ``datapipe
pack --engine ray``: folders listed in parallel, samples planned into shards by the local
packer's rules, written through the Datasink), ``tokens`` (:func:`write_token_pieces`:
``pack_tokens(..., engine="ray")``, each piece of the input a Ray task running the process
worker's own function; ``pack_tokens`` stays the driver). May import (their faces only)
:mod:`datapipe.packing`, :mod:`datapipe.publish`, :mod:`datapipe.dataset`,
:mod:`datapipe.tokens`, :mod:`datapipe.tarindex`, :mod:`datapipe.format`, :mod:`datapipe.storage`,
:mod:`datapipe.errors`, :mod:`datapipe.checksum`, and Ray; nothing below imports this
package, so datapipe works without Ray.
"""

try:
    import ray
    import ray.data  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess without Ray
    raise ImportError(
        f"datapipe.ray needs Ray Data, which is not installed ({e}): pip install 'datapipe[ray]'"
    ) from e

from .engine import pack
from .sink import DatapipeDatasink, write
from .source import DatapipeDatasource, read
from .tokens import write_token_pieces

__all__ = ["DatapipeDatasink", "DatapipeDatasource", "pack", "read", "write", "write_token_pieces"]
