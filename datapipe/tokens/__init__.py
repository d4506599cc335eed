"""Token datasets for language-model pretraining, in Megatron-LM's indexed layout with
datapipe's checksums and manifest (docs/TOKEN_FORMAT.md).

Holds: ``pack`` (:func:`pack_tokens`: plan, worker pool or Ray tasks, journal, commit),
``write`` (the worker side: one piece of the input tokenized and written into parts),
``sources`` (listing the input, cutting it into pieces, reading documents, loading a
tokenizer), ``index`` (:func:`index_tokens`: existing Megatron ``.bin``/``.idx`` pairs and
flat token files indexed in place), ``arguments`` (the checks of the arguments those two
share), ``publish_glue`` (the one module that uses pack's journal, lock and commit).

The token loaders: ``dataset`` (:class:`TokenDataset`: fixed-length or document-packed
sequences), ``mix`` (:class:`TokenMix`: sources mixed by weight with exact per-batch
counts, weights that change mid-run), both over ``stream`` (what they share: topology,
one pass at a time, whose resume state it is) and ``read`` (a token dataset opened and
checked, one logical chunk fetched and verified block by block, batches cut with numpy).
They reuse the loader's stages (:mod:`datapipe.loader`: ``EpochPlanner``, ``pass_chunks``,
``Prefetcher``/``PassFetch``, ``Progress``, the ``StreamingDataLoader`` and its ring) and the
pure plans (:mod:`datapipe.plan`: ``ConcatLayout``, ``DocumentLayout``, ``MixturePlan``).

May import :mod:`datapipe.format`, :mod:`datapipe.storage`, :mod:`datapipe.pack` (journal,
lock, commit: through ``publish_glue`` only), :mod:`datapipe.tarindex` (brace patterns),
:mod:`datapipe.loader` and :mod:`datapipe.plan` (the loaders), :mod:`datapipe.options`,
:mod:`datapipe.progress` and :mod:`datapipe.errors`; ``tokenizers`` and torch lazily; and
:mod:`datapipe.ray` only inside ``pack_tokens(engine="ray")``, which hands its pieces to
``datapipe.ray.write_token_pieces`` (``PieceTask``, ``pack_piece`` and ``init_worker`` are on
this face for it: the Ray task runs the process worker's own function). Names
are imported on first use (``datapipe._lazy``), so a worker process that imports
``datapipe.tokens.write`` does not import pack's modules, nor the loaders torch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .dataset import TokenDataset
    from .index import TokenIndexResult, index_tokens, is_token_source
    from .mix import TokenMix
    from .pack import DEFAULT_PART_BYTES, TokenPackResult, pack_tokens
    from .read import IGNORE_INDEX
    from .write import PieceTask, init_worker, pack_piece

_WHERE = {
    "pack_tokens": "pack",
    "TokenPackResult": "pack",
    "DEFAULT_PART_BYTES": "pack",
    "index_tokens": "index",
    "TokenIndexResult": "index",
    "is_token_source": "index",
    "TokenDataset": "dataset",
    "TokenMix": "mix",
    "IGNORE_INDEX": "read",
    "PieceTask": "write",
    "pack_piece": "write",
    "init_worker": "write",
}

__all__ = ["pack_tokens", "TokenPackResult", "index_tokens", "TokenIndexResult", "is_token_source",
           "DEFAULT_PART_BYTES", "TokenDataset", "TokenMix", "IGNORE_INDEX", "PieceTask", "pack_piece",
           "init_worker"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE)
