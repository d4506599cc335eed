"""`index_tokens()`: existing token files made a datapipe token dataset where they lie.

Megatron-LM ``.bin``/``.idx`` pairs (named by their prefix, either file, or a folder of them)
and nanoGPT-style flat ``.bin`` files of raw ids are read once: every ``.idx`` is checked by
:func:`~datapipe.format.tokens.read_idx` against its ``.bin``'s size, a flat file is cut into
documents at its EOS tokens (:func:`~datapipe.format.tokens.flat_index`), and the block
checksums of every ``.bin`` are computed. The dataset folder (the folder the files share, or
``index_to``) then receives, for each file, its ``<name>.xxh`` (and for a flat file the index
datapipe made of it, ``<name>.flat.idx``: never ``<name>.idx``, which would make the user's
file look like a Megatron pair it is not), and the token manifest last. Parts are named
relative to the folder when their ``.bin`` lies in it, else by absolute path or URL.

Nothing of the user's is modified or deleted. A dataset folder holding a manifest that is
not an index of ours, or a file at one of the names this index writes that no index of ours
wrote, is refused before anything is read. The names are journaled (``_pack/token-index.json``)
before the first is written, so a rerun after a kill knows them as its own.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..checksum import checksum
from ..errors import (
    DatapipeError,
    DestinationExistsError,
    FormatError,
    ObjectChangedError,
    ObjectNotFoundError,
    OptionError,
    PackOptionError,
    StorageError,
)
from ..format.tokens import (
    BLOCK_BYTES,
    MANIFEST,
    TokenPart,
    block_sums,
    flat_index,
    idx_bytes,
    make_token_manifest,
    parse_token_manifest,
    read_idx,
    token_dtype,
    xxh_bytes,
)
from ..options import check_path
from ..progress import progress_bar
from ..storage import Store, expand_braces, glob_urls, has_glob, is_local_url, open_store, split_url
from .arguments import check_block_bytes, check_fits, check_id_options
from .publish_glue import WORK, WriterLock
from .sources import absolute_url

__all__ = ["index_tokens", "TokenIndexResult", "is_token_source", "ORIGIN", "NAMES"]

ORIGIN = "token-index"
#: the names an index writes, journaled before the first is written
NAMES = f"{WORK}/token-index.json"
_READ_BYTES = 64 << 20


@dataclass(frozen=True)
class _Input:
    bin_url: str
    idx_url: str | None  # None: a flat token file
    folder: str
    stem: str


@dataclass
class TokenIndexResult:
    """What :func:`index_tokens` indexed: ``parts`` files (``flat`` of them flat token files)
    of ``documents`` and ``tokens``, ``read_bytes`` read, at ``dest``."""

    dest: str
    parts: int
    documents: int
    tokens: int
    read_bytes: int
    seconds: float
    flat: int = 0
    dtype: str = ""

    def summary(self) -> str:
        rate = f", {self.read_bytes / 1e6 / self.seconds:,.1f} MB/s" if self.seconds and self.read_bytes else ""
        kinds = f" ({self.flat} flat)" if self.flat else ""
        return (f"indexed {self.parts} token files{kinds}: {self.documents:,} documents, {self.tokens:,} tokens "
                f"({self.dtype}) at {self.dest}\n  {self.read_bytes / 1e6:,.1f} MB read in {self.seconds:.2f} s{rate}")


# --- what the arguments name ---------------------------------------------------------------


def _exists(url: str, storage_options: dict[str, Any] | None) -> bool:
    try:
        folder, key = split_url(url)
        return open_store(folder, None if is_local_url(folder) else storage_options).exists(key)
    except DatapipeError:
        return False


def _pair(prefix: str, storage_options: dict[str, Any] | None, named: str) -> _Input:
    """The input whose ``.bin`` is ``prefix.bin``: a Megatron pair when ``prefix.idx`` is
    beside it, else a flat file."""
    bin_url, idx_url = prefix + ".bin", prefix + ".idx"
    if not _exists(bin_url, storage_options):
        nor = f" (nor {idx_url})" if not named.endswith(".bin") else ""
        raise ObjectNotFoundError(f"{named}: no {bin_url}{nor}")
    folder, name = split_url(bin_url)
    return _Input(bin_url, idx_url if _exists(idx_url, storage_options) else None, folder, name[:-4])


def _inputs(items: Any, storage_options: dict[str, Any] | None) -> list[_Input]:
    items = [items] if isinstance(items, str | os.PathLike) else items
    if not isinstance(items, list | tuple) or not items:
        raise PackOptionError(f"paths_or_prefixes={items!r}: expected a Megatron prefix, a .bin or .idx path, a "
                              "folder or a glob, or a non-empty list of them")
    out: list[_Input] = []
    seen: set[str] = set()
    for item in items:
        text = check_path("paths_or_prefixes", item, error=PackOptionError)
        for name in expand_braces(text):
            name = absolute_url(name)
            low = name.lower()
            if has_glob(name):
                urls = glob_urls(name, storage_options)
            elif not low.endswith((".bin", ".idx")) and (os.path.isdir(name) if is_local_url(name)
                                                         else not _exists(name + ".bin", storage_options)):
                store = open_store(name, storage_options)  # a folder: the .bin files directly in it
                urls = [store.url(k) for k in store.list() if "/" not in k and k.endswith(".bin")]
            else:
                urls = [name]
            if not urls:
                raise ObjectNotFoundError(f"{text!r} names no token file (.bin, .idx or a Megatron prefix)")
            for url in urls:
                low = url.lower()
                prefix = url[:-4] if low.endswith((".bin", ".idx")) else url
                if low.endswith(".idx") and not _exists(prefix + ".bin", storage_options):
                    raise ObjectNotFoundError(f"{url}: a Megatron index without its data file {prefix}.bin")
                inp = _pair(prefix, storage_options, url)
                if low.endswith(".idx") and inp.idx_url is None:  # pragma: no cover - it was just found
                    raise ObjectNotFoundError(f"{url} vanished")
                if inp.bin_url not in seen:
                    seen.add(inp.bin_url)
                    out.append(inp)
    return out


def is_token_source(urls: str | list[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``urls`` name token files for :func:`index_tokens` rather than tar shards:
    every one a ``.bin`` or ``.idx`` (or a pattern of them), a Megatron prefix (``p.bin`` and
    ``p.idx`` exist), or a local folder holding ``.bin`` files and no ``.tar``."""
    items = [urls] if isinstance(urls, str) else list(urls)
    if not items:
        return False
    for u in items:
        u = os.fspath(u)
        low = u.lower().rstrip("/")
        if low.endswith((".bin", ".idx")):
            continue
        if is_local_url(u) and os.path.isdir(u):
            names = os.listdir(u)
            if any(n.endswith(".bin") for n in names) and not any(n.endswith(".tar") for n in names):
                continue
            return False
        if has_glob(u) or "{" in u or low.endswith(".tar"):
            return False
        if not (_exists(u + ".bin", storage_options) and _exists(u + ".idx", storage_options)):
            return False
    return True


# --- reading --------------------------------------------------------------------------


def _store_of(url: str, storage_options: dict[str, Any] | None) -> tuple[Store, str]:
    folder, key = split_url(url)
    return open_store(folder, None if is_local_url(folder) else storage_options), key


def _whole(url: str, storage_options: dict[str, Any] | None) -> Any:
    """The bytes of ``url``: a read-only map of a local file (an ``.idx`` may be GBs)."""
    store, key = _store_of(url, storage_options)
    path = store.local_path(key)
    if path is None:
        return store.get(key)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ObjectNotFoundError(f"no file at {path}") from None
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e.strerror or e}") from None


def _read_chunks(store: Store, key: str, size: int, version: str | None, chunk: int, url: str) -> Any:
    """The bytes of the object, ``chunk`` bytes at a time (as of the version listed)."""
    path = store.local_path(key)
    if path is None:
        for a in range(0, size, chunk):
            yield store.get_range_at(key, a, min(a + chunk, size), version)
        return
    buf = bytearray(min(chunk, max(size, 1)))
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                got += n
                yield memoryview(buf)[:n]
    except OSError as e:
        raise StorageError(f"cannot read {url}: {e.strerror or e}") from None
    if got != size or store.stat(key) != (size, version):
        raise ObjectChangedError(f"{url} changed while it was read (listed with {size} bytes); run the same "
                                 "command again")


def _bin_sums(inp: _Input, dtype: np.dtype[Any], block: int, top: int | None, starts: npt.NDArray[np.int64],
              storage_options: dict[str, Any] | None, bar: Any) -> tuple[npt.NDArray[np.uint64], int]:
    """(the block checksums of ``inp``'s ``.bin``, its size), checking every id is at most
    ``top`` (and not negative) when ``top`` is given."""
    store, key = _store_of(inp.bin_url, storage_options)
    size, version = store.stat(key)
    per = max(1, _READ_BYTES // block) * block
    while per % 8:
        per += block  # whole tokens in every read
    sums: list[npt.NDArray[np.uint64]] = []
    at = 0
    for data in _read_chunks(store, key, size, version, per, inp.bin_url):
        sums.append(block_sums(data, block))
        if top is not None and len(data) >= dtype.itemsize:
            ids = np.frombuffer(data, dtype=dtype, count=len(data) // dtype.itemsize)
            if ids.size and (int(ids.max()) > top or int(ids.min()) < 0):
                j = int(np.flatnonzero((ids > top) | (ids < 0))[0])
                k = at // dtype.itemsize + j
                doc = int(np.searchsorted(starts, k, side="right")) - 1
                raise FormatError(f"{inp.bin_url}: token {k} (document {doc}) is id {int(ids[j])}, outside the "
                                  f"vocabulary [0, {top}] (pass the right vocab_size= / --vocab-size)")
        at += len(data)
        bar.update(len(data))
    return np.concatenate([*sums, np.empty(0, np.uint64)]).astype(np.uint64), size


# --- the index ------------------------------------------------------------------------


def _names(inputs: list[_Input]) -> list[str]:
    stems = [i.stem for i in inputs]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{k:05d}-{s}" for k, s in enumerate(stems)]


def _ours(store: Store) -> tuple[set[str], bool]:
    """(the names earlier indexes of ours wrote here, whether a manifest of ours is here);
    a manifest that is not an index of ours is refused."""
    names: set[str] = set()
    has_manifest = store.exists(MANIFEST)
    if has_manifest:
        where = store.url(MANIFEST)
        try:
            m = parse_token_manifest(store.get(MANIFEST), where)
        except DatapipeError:
            m = None
        if m is None or m.doc.get("origin") != ORIGIN:
            what = "a datapipe token dataset written by pack_tokens" if m is not None else \
                "a manifest.json that is not an index of token files"
            raise DestinationExistsError(f"{where} exists: {store.root} holds {what}; index into another folder "
                                         "(index_to= / --index-to DIR)")
        for p in m.parts:
            names.add(p.xxh)
            if p.idx.endswith(".flat.idx") and "/" not in p.idx:
                names.add(p.idx)
    if store.exists(NAMES):
        try:
            doc = json.loads(store.get(NAMES))
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("names"), list):
            names.update(n for n in doc["names"] if isinstance(n, str) and "/" not in n)
    return names, has_manifest


def index_tokens(
    paths_or_prefixes: Any,
    *,
    index_to: str | os.PathLike[str] | None = None,
    dtype: Any = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    block_bytes: int = BLOCK_BYTES,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> TokenIndexResult:
    """Index existing token files in place (docs/TOKEN_FORMAT.md): Megatron-LM pairs named by
    their prefix (``data/train`` for ``train.bin`` + ``train.idx``), their ``.bin`` or ``.idx``,
    a folder of them, or a glob; nanoGPT-style flat ``.bin`` files (no ``.idx`` beside) of raw
    ``dtype`` ids (default uint16), cut into documents after each ``eos_id`` (the whole file
    one document without it). Every ``.idx`` is validated against its ``.bin``; ids are
    checked against ``vocab_size`` when given. Checksums and the manifest go into the folder
    the files share, or ``index_to``. The files are read, never changed."""
    t0 = time.perf_counter()
    vocab_size, eos_id = check_id_options(storage_options, vocab_size, eos_id)
    check_block_bytes(block_bytes)
    try:
        flat_dtype = token_dtype(np.uint16 if dtype is None else dtype)
    except OptionError as e:
        raise PackOptionError(str(e)) from None
    inputs = _inputs(paths_or_prefixes, storage_options)
    if index_to is None:
        folders = sorted({i.folder for i in inputs})
        if len(folders) != 1:
            raise PackOptionError(f"the token files lie in {len(folders)} folders ({', '.join(folders[:3])}, ...): "
                                  "pass index_to= / --index-to DIR to say where the index goes")
        dest = folders[0]
    else:
        dest = absolute_url(check_path("index_to", index_to, error=PackOptionError))
    names = _names(inputs)
    written = {n + ".xxh" for n in names} | {n + ".flat.idx" for n, i in zip(names, inputs) if i.idx_url is None}
    inside = {split_url(u)[1] for i in inputs if i.folder == dest for u in (i.bin_url, i.idx_url) if u}
    clash = sorted(written & inside)
    if clash:
        raise DestinationExistsError(f"{dest}/{clash[0]} is one of the files being indexed and a name this index "
                                     "would write: index into another folder (index_to= / --index-to DIR)")
    base = open_store(dest, storage_options)
    if not base.supports_writes:
        raise StorageError(f"cannot write the index at {dest}: pass index_to= / --index-to DIR")
    with WriterLock(base) as lock:
        store = lock.store
        ours, had_manifest = _ours(store)
        theirs = sorted(n for n in written if n not in ours and store.exists(n))
        if theirs:
            raise DestinationExistsError(
                f"{store.url(theirs[0])} exists and no index of ours wrote it: indexing here would replace it; "
                "index into another folder (index_to= / --index-to DIR), or move it away")
        store.put(NAMES, json.dumps({"names": sorted(ours | written)}).encode())
        if had_manifest:
            store.delete(MANIFEST)  # the old index stops existing before its files are replaced
        parts, result = _index_all(inputs, names, dest, store, flat_dtype, dtype, eos_id, vocab_size, block_bytes,
                                   storage_options, progress)
        lock.check()
        store.put(MANIFEST, make_token_manifest(parts, dtype=token_dtype(result.dtype), vocab_size=vocab_size,
                                                eos_id=eos_id, block_bytes=block_bytes, extra={"origin": ORIGIN}))
        for stale in sorted(ours - written):
            store.delete(stale)  # an earlier index's files that this one no longer lists
        store.delete(NAMES)
    result.seconds = time.perf_counter() - t0
    return result


def _index_all(inputs: list[_Input], names: list[str], dest: str, store: Store, flat_dtype: np.dtype[Any],
               dtype: Any, eos_id: int | None, vocab_size: int | None, block: int,
               storage_options: dict[str, Any] | None, progress: bool) -> tuple[list[TokenPart], TokenIndexResult]:
    parts: list[TokenPart] = []
    result = TokenIndexResult(dest, len(inputs), 0, 0, 0, 0.0)
    part_dtype: np.dtype[Any] | None = None
    first = ""
    total = 0
    for inp in inputs:
        s, k = _store_of(inp.bin_url, storage_options)
        total += s.size(k)
    bar = progress_bar(total, progress, unit="B", unit_scale=True, desc="index tokens", smoothing=0.1)
    try:
        for inp, name in zip(inputs, names):
            where_bin = inp.bin_url
            bin_store, bin_key = _store_of(inp.bin_url, storage_options)
            bin_size = bin_store.size(bin_key)
            if inp.idx_url is not None:
                idx_data = _whole(inp.idx_url, storage_options)
                index = read_idx(idx_data, bin_size=bin_size, where=inp.idx_url)
                if dtype is not None and index.dtype != flat_dtype:
                    raise FormatError(f"{inp.idx_url}: its tokens are {index.dtype}, not dtype={flat_dtype} as given "
                                      "(dtype= applies to flat files; a Megatron .idx says its own)")
            else:
                if bin_store.local_path(bin_key) is None:
                    raise PackOptionError(f"{inp.bin_url}: a flat token file is indexed from a local path (its "
                                          "documents are found by scanning it in place); copy it to a local disk")
                if bin_size % flat_dtype.itemsize:
                    raise FormatError(f"{where_bin}: {bin_size} bytes is not a whole number of {flat_dtype} tokens "
                                      "(pass the dtype= / --dtype it was written with)")
                path = bin_store.local_path(bin_key) or ""
                tokens: Any = np.memmap(path, dtype=flat_dtype, mode="r") if bin_size else np.empty(0, flat_dtype)
                try:
                    index = flat_index(tokens, eos_id=eos_id, dtype=flat_dtype)
                except OptionError as e:
                    raise PackOptionError(f"{where_bin}: {e}") from None
                idx_data = idx_bytes(index.lengths, index.doc_index, flat_dtype)
                del tokens
                result.flat += 1
            if part_dtype is None:
                part_dtype, first = index.dtype, where_bin
                check_fits(part_dtype, eos_id, vocab_size, dtype_is=f"the files' dtype {part_dtype}")
            elif index.dtype != part_dtype:
                raise FormatError(f"{where_bin} holds {index.dtype} tokens, {first} {part_dtype}: the files of one "
                                  "dataset share one dtype; index them separately")
            top = None if vocab_size is None else vocab_size - 1
            if top is not None and top > int(np.iinfo(index.dtype).max):
                top = None  # every id of the dtype is in the vocabulary
            sums, size = _bin_sums(inp, index.dtype, block, top, index.document_starts(), storage_options, bar)
            if size != bin_size:
                raise ObjectChangedError(f"{where_bin} changed while it was indexed; run the same command again")
            xxh = xxh_bytes(sums)
            store.put(name + ".xxh", xxh)
            relative = inp.folder == dest
            prefix = inp.stem if relative else inp.bin_url[:-4]
            if inp.idx_url is None:
                idx_name = name + ".flat.idx"
                store.put(idx_name, idx_data)
            else:
                idx_name = inp.stem + ".idx" if relative else inp.idx_url
            parts.append(TokenPart(prefix=prefix, idx=idx_name, xxh=name + ".xxh", bin_bytes=size,
                                   idx_bytes=len(idx_data), documents=index.num_documents,
                                   sequences=index.num_sequences, tokens=index.num_tokens,
                                   idx_checksum=checksum(idx_data), xxh_checksum=checksum(xxh)))
            result.read_bytes += size
            del index
            if isinstance(idx_data, mmap.mmap):
                try:
                    idx_data.close()
                except BufferError:
                    pass  # a view of it is still alive: the map goes with it
    finally:
        bar.close()
    result.documents = sum(p.documents for p in parts)
    result.tokens = sum(p.tokens for p in parts)
    result.dtype = str((part_dtype or flat_dtype).newbyteorder("="))
    return parts, result
