"""Token datasets for language-model pretraining, in Megatron-LM's indexed layout with
datapipe's checksums and manifest (docs/TOKEN_FORMAT.md).

Holds: ``pack`` (:func:`pack_tokens`: plan, worker pool, journal, commit), ``write`` (the
worker side: one piece of the input tokenized and written into parts), ``sources`` (listing
the input, cutting it into pieces, reading documents, loading a tokenizer), ``index``
(:func:`index_tokens`: existing Megatron ``.bin``/``.idx`` pairs and flat token files indexed
in place), ``publish_glue`` (the one module that uses pack's journal, lock and commit). May
import :mod:`datapipe.format`, :mod:`datapipe.storage`, :mod:`datapipe.pack` (journal,
lock, commit: through ``publish_glue`` only), :mod:`datapipe.tarindex` (brace patterns),
:mod:`datapipe.options`, :mod:`datapipe.progress` and :mod:`datapipe.errors`; ``tokenizers``
lazily. Names are imported on first use (``datapipe._lazy``), so a worker process that
imports ``datapipe.tokens.write`` does not import pack's modules.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .index import TokenIndexResult, index_tokens, is_token_source
    from .pack import DEFAULT_PART_BYTES, TokenPackResult, pack_tokens

_WHERE = {
    "pack_tokens": "pack",
    "TokenPackResult": "pack",
    "DEFAULT_PART_BYTES": "pack",
    "index_tokens": "index",
    "TokenIndexResult": "index",
    "is_token_source": "index",
}

__all__ = ["pack_tokens", "TokenPackResult", "index_tokens", "TokenIndexResult", "is_token_source",
           "DEFAULT_PART_BYTES"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE)
