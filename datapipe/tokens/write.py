"""The worker side of :func:`~datapipe.tokens.pack_tokens`: one piece of the input read,
tokenized (``encode_batch``), checked, followed document by document by the EOS token, and
written into parts of at most ``part_bytes`` bytes of tokens by
:class:`~datapipe.format.tokens.TokenPartWriter`, each published when finished. Runs in a
worker process (or in-process), so it imports only what that needs: the format, the
storage, the sources; never pack's journal or lock, which the main process holds."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import DatapipeError, InputFileError, OptionError, PackError, StorageError
from ..format.tokens import TokenPart, TokenPartWriter, token_dtype
from ..storage import Store, fsync_dir, temporary_name
from .publish_glue import die_with_parent
from .sources import Batch, Piece, import_tokenizers, read_piece

__all__ = ["PieceTask", "pack_piece", "PartSeries", "part_name", "with_eos", "encode_texts", "check_ids",
           "init_worker", "publish_part"]


def part_name(piece: int, k: int) -> str:
    """The name (prefix) of the ``k``-th part of piece ``piece``."""
    return f"part-{piece:05d}-{k:03d}"


_progress: Any = None  # shared counters (tokens, documents, input bytes), set in each worker
_tokenizers: dict[str, Any] = {}  # a worker's tokenizer, by its JSON


def init_worker(counters: Any, parent: int | None, threads: int | None) -> None:
    """A worker process's start (or, with ``parent`` None, the in-process run's): the shared
    progress ``counters``, an end with the pack ``parent``, the tokenizer's ``threads``."""
    global _progress
    _progress = counters
    if parent is not None:
        die_with_parent(parent)
    if threads is not None:  # the tokenizer's own threads share the cores with the other workers
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


def _bump(tokens: int, documents: int, nbytes: int) -> None:
    if _progress is not None:
        with _progress.get_lock():
            _progress[0] += tokens
            _progress[1] += documents
            _progress[2] += nbytes


def _tokenizer(text: str) -> Any:
    tok = _tokenizers.get(text)
    if tok is None:
        _tokenizers.clear()
        tok = _tokenizers[text] = import_tokenizers().Tokenizer.from_str(text)
    return tok


@dataclass(frozen=True)
class PieceTask:
    piece: Piece
    mode: str  # "text" or "tokens"
    column: str
    tokenizer: str | None
    eos_id: int
    vocab_size: int | None
    dtype: str
    part_bytes: int
    block_bytes: int
    store: Store
    token: str
    storage_options: dict[str, Any] | None


def encode_texts(tok: Any, batch: Batch) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    texts = batch.texts or []
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # the same ids; no offsets kept
    try:
        encodings = encode(texts)
    except Exception as e:  # the tokenizers library raises plain TypeErrors (a lone surrogate, say)
        for j, t in enumerate(texts):
            try:
                encode([t])
            except Exception as one:
                raise InputFileError(f"{batch.where(j)}: the tokenizer refuses this text ({type(one).__name__}: "
                                     f"{str(one)[:200]})") from None
        raise PackError(f"{batch.where(0)}: the tokenizer failed on a batch of {len(texts)} documents "
                        f"({type(e).__name__}: {str(e)[:200]})") from None
    # each document's ids made a list and read into the array one after the other (making
    # all the batch's lists first took twice the time here)
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    values = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=int(lengths.sum()))
    return values, lengths


def check_ids(batch: Batch, values: npt.NDArray[Any], lengths: npt.NDArray[np.int64], top: int) -> None:
    """Refuse an id outside ``[0, top]``, naming its file and row."""
    if not values.size:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi <= top:
        return
    k = int(np.flatnonzero((values < 0) | (values > top))[0])
    j = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
    raise InputFileError(f"{batch.where(j)}: token id {int(values[k])} lies outside the vocabulary [0, {top}] "
                         "(pass the right vocab_size= / --vocab-size, or the tokenizer that made these ids)")


def with_eos(values: npt.NDArray[Any], lengths: npt.NDArray[np.int64], eos: int,
             dtype: np.dtype[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """Each document's ids followed by ``eos``, back to back in ``dtype``, and the new lengths."""
    out = np.empty(values.size + lengths.size, dtype=dtype)
    ends = np.cumsum(lengths + 1) - 1  # where each document's EOS goes
    keep = np.ones(out.size, dtype=bool)
    keep[ends] = False
    out[keep] = values
    out[ends] = eos
    return out, lengths + 1


class PartSeries:
    """The parts of one piece, written one after the other, each at most ``part_bytes`` bytes
    of tokens (more only when one document alone is larger)."""

    def __init__(self, task: PieceTask) -> None:
        self.task = task
        self.dtype = token_dtype(task.dtype)
        self.itemsize = self.dtype.itemsize
        self.parts: list[TokenPart] = []
        self.writer: TokenPartWriter | None = None
        self.name = ""
        self.root = task.store.local_path("")
        self.scratch: str | None = None

    def _open(self) -> TokenPartWriter:
        t = self.task
        self.name = part_name(t.piece.index, len(self.parts))
        if self.root is not None:  # beside the published files, under a name the lock's cleanup knows
            path = os.path.join(self.root, temporary_name(t.token, self.name))
        else:  # written here, uploaded when finished
            if self.scratch is None:
                self.scratch = tempfile.mkdtemp(prefix="datapipe-pack-tokens-")
            path = os.path.join(self.scratch, self.name)
        self.writer = TokenPartWriter(path, vocab_size=t.vocab_size, dtype=self.dtype, block_bytes=t.block_bytes,
                                      name=self.name)
        return self.writer

    def add(self, tokens: npt.NDArray[Any], lengths: npt.NDArray[np.int64]) -> None:
        cum = np.cumsum(lengths) * self.itemsize
        done = 0  # documents of this batch written
        while done < lengths.size:
            w = self.writer or self._open()
            before = int(cum[done - 1]) if done else 0
            room = self.task.part_bytes - w.tokens * self.itemsize
            fit = int(np.searchsorted(cum[done:] - before, room, side="right"))
            if fit == 0 and w.documents == 0:
                fit = 1  # a document larger than a part: a part of its own
            if fit:
                a, b = before // self.itemsize, int(cum[done + fit - 1]) // self.itemsize
                w.add_documents(tokens[a:b], lengths[done:done + fit])
                done += fit
            if done < lengths.size:
                self.close()

    def close(self) -> None:
        w, self.writer = self.writer, None
        if w is None:
            return
        part = w.close()
        publish_part(w, self.task.store, self.name)
        self.parts.append(part)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        if self.scratch is not None:
            try:
                os.rmdir(self.scratch)
            except OSError:
                pass


def pack_piece_alone(task: PieceTask) -> dict[str, Any]:
    """:func:`pack_piece` in a process that holds one CPU and runs no pool (a Ray task's)."""
    init_worker(None, None, 1)  # the tokenizer's threads: the one CPU this process holds
    return pack_piece(task)


def pack_piece(task: PieceTask) -> dict[str, Any]:
    """Write the parts of one piece; returns its journal record. Runs in a worker process
    (or in-process with ``workers=1``)."""
    piece = task.piece
    dtype = token_dtype(task.dtype)
    top = task.vocab_size - 1 if task.vocab_size is not None else int(np.iinfo(dtype).max)
    tok = _tokenizer(task.tokenizer) if task.tokenizer is not None else None
    parts = PartSeries(task)
    documents = tokens = 0
    try:
        for batch in read_piece(piece, task.column, task.mode, task.storage_options):
            if batch.values is None:
                values, lengths = encode_texts(tok, batch)
            else:
                values, lengths = batch.values, batch.lengths
            check_ids(batch, values, lengths, top)
            out, out_lengths = with_eos(values, lengths, task.eos_id, dtype)
            parts.add(out, out_lengths)
            documents += int(lengths.size)
            tokens += int(out.size)
            _bump(int(out.size), int(lengths.size), 0)
        parts.close()
    except OSError as e:
        parts.abort()
        if isinstance(e, DatapipeError):
            raise
        raise StorageError(f"cannot write part {parts.name} of {task.store.root}: {e.strerror or e} (free space "
                           "or fix that, then run the same command again: finished parts are kept)") from None
    except OptionError as e:  # TokenPartWriter's refusals: our own checks come first
        parts.abort()
        raise PackError(f"{piece.file.url}: {e}") from None
    except BaseException:
        parts.abort()
        raise
    parts.abort()  # the scratch folder, if any
    _bump(0, 0, piece.input_bytes)
    return {"record": {"piece": piece.index, "input": piece.file.url}, "parts": [asdict(p) for p in parts.parts],
            "documents": documents, "tokens": tokens}


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
        fsync_dir(root)
        return
    try:
        for tmp, ext in ext_of.items():
            with open(tmp, "rb") as src, store.open_writer(name + ext) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
    finally:
        writer.abort()  # the local copies: the writer's own files, and nothing else
