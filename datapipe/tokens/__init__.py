"""Token datasets for language-model pretraining, in Megatron-LM's indexed layout with
datapipe's checksums and manifest (docs/TOKEN_FORMAT.md).

Holds: ``pack`` (:func:`pack_tokens`: Parquet/JSONL text or token ids -> parts, in worker
processes, resumable), ``sources`` (listing the input, cutting it into pieces, reading and
tokenizing documents), ``index`` (:func:`index_tokens`: existing Megatron ``.bin``/``.idx``
pairs and flat token files indexed in place), ``publish_glue`` (the one module that uses
pack's journal, lock and commit). May import :mod:`datapipe.format`, :mod:`datapipe.storage`,
:mod:`datapipe.pack` (journal, lock, commit: through ``publish_glue`` only),
:mod:`datapipe.tarindex` (brace patterns), :mod:`datapipe.options`, :mod:`datapipe.progress`
and :mod:`datapipe.errors`; ``tokenizers`` lazily.
"""

from .index import TokenIndexResult, index_tokens, is_token_source
from .pack import DEFAULT_PART_BYTES, TokenPackResult, pack_tokens

__all__ = ["pack_tokens", "TokenPackResult", "index_tokens", "TokenIndexResult", "is_token_source",
           "DEFAULT_PART_BYTES"]
