"""`pack_tokens()`: Parquet/JSONL documents (text and a tokenizer, or token ids) into a token
dataset in Megatron's layout, in parallel and resumable. Layout: docs/TOKEN_FORMAT.md.

The input is cut into pieces (:func:`~datapipe.tokens.sources.plan_pieces`: they depend on the
input and ``part_bytes`` only); each piece is read, tokenized (``encode_batch``, documents in
batches) and written by one worker process into parts of at most ``part_bytes`` bytes of
tokens, named ``part-<piece>-<k>``, so the parts, their names and their bytes are the same
whatever the number of workers (or with ``engine="ray"``, where each piece is a Ray task
running the same function: :mod:`datapipe.ray`'s ``write_token_pieces``). Every document is
its token ids followed by the end-of-document token; an empty document is the EOS token
alone. A finished piece is recorded in the destination's ``_pack/`` journal: a rerun of the
same command (after a kill -9, say) skips recorded pieces and writes the others again,
under the same names; a run of other input or options is refused unless ``overwrite``. The
manifest is written last, so a dataset is either complete or absent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checksum import checksum
from ..errors import (
    DatapipeError,
    EmptyInputError,
    MissingDependencyError,
    OptionError,
    PackError,
    PackOptionError,
    StorageError,
)
from ..format.tokens import (
    BLOCK_BYTES,
    MANIFEST,
    TokenPart,
    block_count,
    make_token_manifest,
    optimal_dtype,
    parse_token_manifest,
    token_dtype,
)
from ..options import check_bool, check_bytes, check_int, check_path
from ..progress import polled_progress, progress_bar
from ..storage import Store, in_this_process, is_local_url, open_store
from .arguments import check_block_bytes, check_fits, check_id_options
from .publish_glue import Journal, WriterLock, check_destination, fingerprint, remove_stale_parts
from .sources import EOS_TOKENS, Piece, list_inputs, load_tokenizer, plan_pieces
from .write import PieceTask, init_worker, pack_piece, pack_piece_alone, part_name

__all__ = ["pack_tokens", "TokenPackResult", "DEFAULT_PART_BYTES", "MAX_PIECE_BYTES", "part_name"]

#: the default bound of a part's ``.bin`` (a cache holds whole parts)
DEFAULT_PART_BYTES = 256 << 20
#: input bytes per piece at most (fewer when ``part_bytes`` is smaller): enough pieces for
#: every worker to have work, whatever ``part_bytes``
MAX_PIECE_BYTES = 64 << 20
_MIN_PART_BYTES = 1 << 12
ORIGIN = "pack-tokens"
#: who writes the pieces: worker processes here, or Ray tasks (the same bytes either way)
ENGINES = ("local", "ray")


@dataclass
class TokenPackResult:
    """What :func:`pack_tokens` wrote: ``documents`` and ``tokens`` in ``parts`` parts at
    ``dest`` (``resumed_parts`` of them by an earlier run), in ``seconds``."""

    dest: str
    documents: int
    tokens: int
    parts: int
    seconds: float
    input_bytes: int = 0
    resumed_parts: int = 0
    dtype: str = ""
    vocab_size: int | None = None
    eos_id: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = [f"packed {self.documents:,} documents, {self.tokens:,} tokens ({self.dtype}) into {self.parts} "
                 f"parts at {self.dest}",
                 f"  {self.input_bytes / 1e6:,.1f} MB in, {self.seconds:.2f} s ({self.tokens_per_s:,.0f} tokens/s); "
                 f"vocab_size {self.vocab_size}, eos_id {self.eos_id}"]
        if self.resumed_parts:
            lines.append(f"  {self.resumed_parts} parts were already written by an earlier run")
        return "\n".join(lines)


# --- the pack ---------------------------------------------------------------------------


def _part_of(d: Any) -> TokenPart | None:
    try:
        part = TokenPart(**d)
    except TypeError:
        return None
    ok = all(isinstance(getattr(part, k), str) for k in ("prefix", "idx", "xxh", "idx_checksum", "xxh_checksum")) \
        and all(type(getattr(part, k)) is int for k in ("bin_bytes", "idx_bytes", "documents", "sequences", "tokens"))
    return part if ok else None


def _finished(store: Store, piece: Piece, rec: dict[str, Any], block_bytes: int) -> list[TokenPart] | None:
    """The parts a journal record of ``piece`` names, if the record has our shape and every
    part's files are there at the sizes recorded; else None (the piece is written again)."""
    raw, head = rec.get("parts"), rec.get("record")
    if not isinstance(raw, list) or not isinstance(head, dict) or head.get("piece") != piece.index:
        return None
    parts = [_part_of(d) for d in raw]
    if any(p is None for p in parts):
        return None
    out = [p for p in parts if p is not None]
    try:
        for i, p in enumerate(out):
            if p.prefix != part_name(piece.index, i) or store.size(p.bin) != p.bin_bytes \
                    or store.size(p.idx) != p.idx_bytes \
                    or store.size(p.xxh) != 8 * block_count(p.bin_bytes, block_bytes):
                return None
    except DatapipeError:
        return None
    return out


def _progress_bar(enabled: bool) -> Any:
    return progress_bar(None, enabled, unit="tok", unit_scale=True, desc="pack-tokens", smoothing=0.1)  # type: ignore[arg-type]


def _polled(counters: Any, enabled: bool, input_bytes: int) -> AbstractContextManager[None]:
    """A progress bar of tokens (tokens/s), with documents and the share of the input done."""
    return polled_progress(
        _progress_bar(enabled), counters,
        lambda _bar: f"{counters[1]:,} docs, {100 * counters[2] / max(1, input_bytes):.0f}% of input",
        enabled, name="datapipe-pack-tokens-progress")


def _options(tokenizer: Any, text_column: Any, tokens_column: Any, eos_id: Any, vocab_size: Any, dtype: Any,
             workers: Any, part_bytes: Any, block_bytes: Any, storage_options: Any
             ) -> tuple[str | None, int | None, int, np.dtype[Any], str, str]:
    """Checked options: (tokenizer JSON, vocabulary size, EOS id, dtype, mode, column)."""
    for name, value in (("text_column", text_column), ("tokens_column", tokens_column)):
        if not isinstance(value, str) or not value:
            raise PackOptionError(f"{name}={value!r}: expected a column name (a non-empty str)")
    if workers is not None:
        check_int("workers", workers, min=1, max=4096, error=PackOptionError)
    check_bytes("part_bytes", part_bytes, min=_MIN_PART_BYTES, error=PackOptionError)
    check_block_bytes(block_bytes)
    vocab_size, eos_id = check_id_options(storage_options, vocab_size, eos_id)
    tok_json = None
    if tokenizer is not None:
        tok_json, tok_vocab, tok_eos = load_tokenizer(tokenizer, storage_options)
        vocab_size = tok_vocab if vocab_size is None else vocab_size
        eos_id = tok_eos if eos_id is None else eos_id
    if eos_id is None:
        raise PackOptionError("eos_id=None: every document ends with an end-of-document token, and "
                              + ("the tokenizer has none of " + ", ".join(EOS_TOKENS) if tokenizer is not None
                                 else "token ids come without a tokenizer to name it")
                              + ": pass eos_id= / --eos-id N")
    try:
        dt = optimal_dtype(vocab_size) if dtype is None else token_dtype(dtype)
    except OptionError as e:
        raise PackOptionError(str(e)) from None
    check_fits(dt, eos_id, vocab_size, dtype_is=f"dtype={dt}",
               hint="; pass a wider dtype or none (Megatron's rule picks one from the vocabulary size)")
    mode = "text" if tokenizer is not None else "tokens"
    return tok_json, vocab_size, eos_id, dt, mode, text_column if mode == "text" else tokens_column


def _dest_url(dest: str) -> str:
    if dest.startswith("file://"):
        dest = dest[len("file://"):]
    return os.path.abspath(dest) if is_local_url(dest) else dest.rstrip("/")


def pack_tokens(
    source: Any,
    dest: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    text_column: str = "text",
    tokens_column: str = "input_ids",
    eos_id: int | None = None,
    vocab_size: int | None = None,
    dtype: Any = None,
    workers: int | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    block_bytes: int = BLOCK_BYTES,
    overwrite: bool = False,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    engine: str = "local",
    address: str | None = None,
) -> TokenPackResult:
    """Write the documents of ``source`` as a token dataset at ``dest`` (a local path or any
    fsspec URL): Megatron-LM's ``.bin``/``.idx`` parts, datapipe's block checksums (``.xxh``)
    and the token manifest, written last (docs/TOKEN_FORMAT.md).

    ``source``: Parquet or JSONL files (a file, a folder, a glob or brace pattern, or a list).
    With ``tokenizer`` (a ``tokenizers.Tokenizer``, a ``transformers`` fast tokenizer, or
    a ``tokenizer.json`` path) each row's ``text_column`` is tokenized (``encode_batch``, as
    ``tokenizer.encode(text).ids``); without, ``tokens_column`` holds the token ids. Every
    document is followed by ``eos_id`` (default: the tokenizer's ``<|endoftext|>``, ``</s>``,
    ...); an empty document becomes the EOS token alone. Ids are checked against
    ``vocab_size`` (default: the tokenizer's). ``dtype``: default Megatron's rule (uint16
    below 65,500 ids, else int32).

    ``workers`` processes (default: the CPU count) each write whole pieces of the input;
    the output is the same whatever their number. Worker processes are started by
    forkserver (spawn where there is none): a script that calls this needs an
    ``if __name__ == "__main__":`` guard. A rerun of the same call after a crash or kill
    finishes the job; other input or options at a ``dest`` that holds a dataset or an
    unfinished pack are refused unless ``overwrite``. One writer per destination.

    ``engine="ray"`` (``pip install 'datapipe[ray]'``): each piece is written by a Ray task
    instead (:func:`datapipe.ray.write_token_pieces`, on the cluster at ``address``, as
    ``pack --engine ray``), into the same bytes; this call stays the driver (lock, journal,
    commit), so a pack either engine began, the other may finish. ``dest`` and the input
    must be reachable from every node; ``workers`` is the local engine's."""
    t0 = time.perf_counter()
    dest = _dest_url(check_path("dest", dest, error=PackOptionError))
    check_bool("overwrite", overwrite, error=PackOptionError)
    check_bool("progress", progress, error=PackOptionError)
    on_ray = _engine(engine, address, workers)
    tok_json, vocab, eos, dt, mode, column = _options(tokenizer, text_column, tokens_column, eos_id, vocab_size,
                                                       dtype, workers, part_bytes, block_bytes, storage_options)
    inputs = list_inputs(source, storage_options, exclude=dest)
    piece_bytes = min(part_bytes, MAX_PIECE_BYTES)
    pieces = plan_pieces(inputs, column, mode, piece_bytes, storage_options)
    fp = fingerprint({
        "format": ORIGIN, "mode": mode, "column": column, "eos_id": eos, "vocab_size": vocab, "dtype": str(dt),
        "part_bytes": part_bytes, "block_bytes": block_bytes, "piece_bytes": piece_bytes,
        "tokenizer": None if tok_json is None else checksum(tok_json.encode()),
        "inputs": [[f.url, f.size, f.version] for f in inputs],
    })
    result = TokenPackResult(dest, 0, 0, 0, 0.0, input_bytes=sum(f.size for f in inputs),
                             dtype=str(dt.newbyteorder("=")), vocab_size=vocab, eos_id=eos)
    base = open_store(dest, storage_options)
    if on_ray is not None and in_this_process(base):
        raise PackOptionError(f"dest={dest!r}: Ray tasks run in other processes, where this process's memory store "
                              "does not exist; with engine='ray' write to a path or URL every node can reach")
    with WriterLock(base) as lock:
        store = lock.store
        check_destination(store, overwrite)
        work = Journal(store, fp, overwrite)
        if work.committed:  # killed after the manifest, before the journal's removal
            m = parse_token_manifest(store.get(MANIFEST), store.url(MANIFEST))
            work.remove()
            result.parts = result.resumed_parts = len(m.parts)
            result.documents, result.tokens = m.documents, m.tokens
            result.seconds = time.perf_counter() - t0
            return result
        done: dict[int, list[TokenPart]] = {}
        records = work.done()
        for p in pieces:
            rec = records.get(p.name)
            found = None if rec is None else _finished(store, p, rec, block_bytes)
            if found is not None:
                done[p.index] = found
        result.resumed_parts = sum(len(v) for v in done.values())
        todo = [p for p in pieces if p.index not in done]
        tasks = [PieceTask(p, mode, column, tok_json, eos, vocab, str(dt), part_bytes, block_bytes, store, lock.token,
                       storage_options) for p in todo]
        if on_ray is not None:
            _run_on_ray(on_ray, tasks, work, done, progress, address)
        else:
            _run(tasks, work, done, workers, progress, sum(p.input_bytes for p in todo), in_this_process(lock.base))
        parts = [part for p in pieces for part in done[p.index]]
        if not parts:
            raise EmptyInputError(f"{', '.join(f.url for f in inputs[:3])}: no document to pack")
        lock.check()
        store.put(MANIFEST, make_token_manifest(parts, dtype=dt, vocab_size=vocab, eos_id=eos,
                                                block_bytes=block_bytes, extra={"origin": ORIGIN}))
        if overwrite:
            remove_stale_parts(store, {f for p in parts for f in (p.bin, p.idx, p.xxh)})
        work.remove()
    result.parts = len(parts)
    result.documents = sum(p.documents for p in parts)
    result.tokens = sum(p.tokens for p in parts)
    result.seconds = time.perf_counter() - t0
    return result


def _engine(engine: Any, address: Any, workers: Any) -> Any:
    """None for the local engine; for "ray", :func:`datapipe.ray.write_token_pieces`
    (imported here only: datapipe.ray imports this package, never the reverse at import)."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise PackOptionError(f"engine={engine!r}: expected one of {', '.join(map(repr, ENGINES))}")
    if engine == "local":
        if address is not None:
            raise PackOptionError(f"address={address!r}: applies to engine='ray' only")
        return None
    if address is not None and (not isinstance(address, str) or not address):
        raise PackOptionError(f"address={address!r}: expected a Ray cluster address (a non-empty str, e.g. 'auto')")
    if workers is not None:
        raise PackOptionError(f"workers={workers!r}: an option of engine='local' (worker processes here); with "
                              "engine='ray' Ray spreads the pieces over its cluster")
    try:
        from ..ray import write_token_pieces
    except ImportError as e:
        raise MissingDependencyError(f"engine='ray': {e}") from None
    return write_token_pieces


def _run_on_ray(write_pieces: Any, tasks: list[PieceTask], work: Journal, done: dict[int, list[TokenPart]],
                progress: bool, address: str | None) -> None:
    """Write ``tasks``' pieces as Ray tasks, journaling each here as it finishes."""
    counters = [0, 0, 0]  # tokens, documents, input bytes: the progress bar's, counted as pieces finish
    input_bytes = {t.piece.index: t.piece.input_bytes for t in tasks}

    def finished(res: dict[str, Any]) -> None:
        _record(work, res, done)
        counters[0] += res["tokens"]
        counters[1] += res["documents"]
        counters[2] += input_bytes[res["record"]["piece"]]

    with _polled(counters, progress, sum(input_bytes.values())):
        write_pieces(tasks, finished, run=pack_piece_alone, address=address, progress=progress)


def _record(work: Journal, res: dict[str, Any], done: dict[int, list[TokenPart]]) -> None:
    try:
        work.record(f"piece-{res['record']['piece']:05d}", res)
    except OSError as e:
        if isinstance(e, DatapipeError):
            raise
        raise StorageError(f"cannot write the journal {work.store.url('_pack')}: {e.strerror or e}") from None
    done[res["record"]["piece"]] = [TokenPart(**d) for d in res["parts"]]


def _context() -> Any:
    # never fork: a tokenizer's threads (and any of the caller's) do not survive it
    return mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


def _run(tasks: list[PieceTask], work: Journal, done: dict[int, list[TokenPart]], workers: int | None,
         progress: bool, input_bytes: int, here: bool) -> None:
    """Write ``tasks``' pieces (in worker processes when more than one), journaling each
    as it finishes; the first failure cancels what has not started and is raised."""
    cpus = os.cpu_count() or 1
    nworkers = 1 if here else max(1, min(workers or cpus, len(tasks) or 1))
    ctx = _context()
    counters = ctx.Array("q", 3)
    if nworkers == 1:
        init_worker(counters, None, None)
        try:
            with _polled(counters, progress, input_bytes):
                for t in tasks:
                    _record(work, pack_piece(t), done)
        finally:
            init_worker(None, None, None)
        return
    pool = ProcessPoolExecutor(nworkers, mp_context=ctx, initializer=init_worker,
                               initargs=(counters, os.getpid(), max(1, cpus // nworkers)))
    futures: dict[Future[dict[str, Any]], PieceTask] = {}
    try:
        futures = {pool.submit(pack_piece, t): t for t in tasks}
        with _polled(counters, progress, input_bytes):
            pending = set(futures)
            try:
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        _record(work, fut.result(), done)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
    except BrokenProcessPool:
        raise PackError(f"a pack-tokens worker process died (killed by a signal, e.g. by the out-of-memory killer) "
                        f"while writing {work.store.root}; {len(done)} pieces are recorded: run the same command "
                        "again to resume (with fewer workers if memory is short)") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


