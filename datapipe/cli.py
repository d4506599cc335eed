"""The `datapipe` command: pack, pack-tokens, index, join, inspect, verify, cache, doctor, status."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from decimal import Decimal
from typing import Any

from ._version import __version__
from .errors import DatapipeError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_size(text: str) -> int:
    """``'128M' -> 134217728``; plain numbers are bytes. A size that is no whole number of
    bytes (``1.5``, ``0.3K``) is refused, not rounded."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64M, 1G)")
    value = Decimal(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " ")
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r} is {value} bytes "
                                         "(e.g. 65536, 64M, 1.5G)")
    return int(value)


def _storage_options(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--storage-options must be JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return value


def _add_pack_engine(p: argparse.ArgumentParser, ray: str) -> None:
    """A pack command's --engine (``ray``: what a Ray pack does), --address, -q and storage options."""
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local (default): worker processes on this machine. ray: " + ray)
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="with --engine ray: the Ray cluster to join (e.g. auto, or ray://host:10001); default: the "
                        "cluster named by RAY_ADDRESS, else a local one started for this pack")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_storage(p)


def _add_storage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-options", type=_storage_options, default=None, metavar="JSON",
                   help='fsspec options for remote URLs, e.g. \'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'')


def _cmd_pack(a: argparse.Namespace) -> int:
    if a.engine == "ray":
        return _pack_on_ray(a)
    if a.address is not None:
        from .errors import PackOptionError

        raise PackOptionError("--address applies to --engine ray")
    from .packing import pack

    r = pack(a.src, a.dest, shard_bytes=a.shard_bytes, shard_samples=a.shard_samples,
             compression=a.compression, level=a.level, workers=a.workers, part=a.part,
             overwrite=a.overwrite, skip_errors=a.skip_errors, storage_options=a.storage_options,
             progress=not a.quiet, follow_links=a.follow_links, keys=a.keys, tars_as_files=a.tars_as_files)
    print(r.summary())
    return 0


def _pack_on_ray(a: argparse.Namespace) -> int:
    """``pack --engine ray``: the same packing as Ray tasks (datapipe.ray.pack)."""
    from .errors import PackOptionError

    if a.part is not None or a.workers is not None:
        raise PackOptionError("--part and --workers apply to --engine local; Ray spreads the work over its cluster")
    try:
        from .ray import pack as ray_pack
    except ImportError as e:
        raise PackOptionError(str(e)) from None
    r = ray_pack(a.src, a.dest, shard_bytes=a.shard_bytes, shard_samples=a.shard_samples,
                 compression=a.compression, level=a.level, overwrite=a.overwrite, skip_errors=a.skip_errors,
                 storage_options=a.storage_options, progress=not a.quiet, follow_links=a.follow_links, keys=a.keys,
                 tars_as_files=a.tars_as_files, address=a.address)
    print(r.summary())
    return 0


def _cmd_join(a: argparse.Namespace) -> int:
    from .packing import join_parts

    n = join_parts(a.dest, storage_options=a.storage_options, overwrite=a.overwrite)
    print(f"joined {n:,} samples at {a.dest}")
    return 0


def _cmd_pack_tokens(a: argparse.Namespace) -> int:
    from .tokens import pack_tokens

    r = pack_tokens(a.src if len(a.src) > 1 else a.src[0], a.dest, tokenizer=a.tokenizer, text_column=a.text_column,
                    tokens_column=a.tokens_column, eos_id=a.eos_id, vocab_size=a.vocab_size, dtype=a.dtype,
                    workers=a.workers, part_bytes=a.part_bytes, overwrite=a.overwrite, progress=not a.quiet,
                    storage_options=a.storage_options, engine=a.engine, address=a.address)
    print(r.summary())
    return 0


def _index_tokens(a: argparse.Namespace) -> int:
    """``datapipe index`` of token files (Megatron .bin/.idx pairs, flat .bin files)."""
    from .errors import PackOptionError
    from .tokens import index_tokens

    if a.part is not None or a.workers is not None:
        raise PackOptionError("--part and --workers apply to tar shards; token files are indexed in one pass")
    r = index_tokens(a.urls, index_to=a.index_to, dtype=a.dtype, eos_id=a.eos_id, vocab_size=a.vocab_size,
                     storage_options=a.storage_options, progress=not a.quiet)
    print(json.dumps(vars(r), indent=1) if a.json else r.summary())
    return 0


def _cmd_index(a: argparse.Namespace) -> int:
    from .tokens import is_token_source

    if is_token_source(a.urls, a.storage_options):
        return _index_tokens(a)
    if a.dtype is not None or a.eos_id is not None or a.vocab_size is not None:
        from .errors import PackOptionError

        raise PackOptionError("--dtype, --eos-id and --vocab-size apply to token files (.bin/.idx, Megatron prefixes)")
    from .tarindex import index_shards

    r = index_shards(a.urls, a.index_to, storage_options=a.storage_options, workers=a.workers, part=a.part,
                     progress=not a.quiet)
    print(json.dumps(r.as_dict(), indent=1) if a.json else r.summary())
    return 0


def _dataset_url(url: str, storage_options: dict[str, Any] | None) -> str:
    """``url``, or for tar shards (a shard URL or pattern) the index made on first use."""
    from .tarindex import resolve_source

    return resolve_source(url, storage_options)


def _being_packed(url: str, storage_options: dict[str, Any] | None) -> str | None:
    """Who holds the writer lease of a pack writing ``url`` now ("writer 'ab12' (host 'h',
    pid 7), holding it since ..."), seen without taking it; None when no pack does."""
    from .publish import LEASE, LOCK
    from .storage import current_holder, describe_holder, open_store

    try:
        store = open_store(url, storage_options)
        holder = current_holder(store, LOCK if store.local_path(LOCK) is not None else LEASE)
    except (DatapipeError, OSError):
        return None
    return None if holder is None else describe_holder(holder.doc, local=holder.local)


def _open_index(url: str, storage_options: dict[str, Any] | None, command: str) -> Any:
    """The verified index at ``url``; a destination a pack writes now is named as such (its
    manifest is written last: it is not missing, it is not there yet)."""
    from .dataset import open_index
    from .errors import ObjectNotFoundError

    url = _dataset_url(url, storage_options)
    try:
        return open_index(url, storage_options)
    except ObjectNotFoundError:
        holder = _being_packed(url, storage_options)
        if holder is None:
            raise
        raise ObjectNotFoundError(f"no dataset at {url} yet: it is being packed now by {holder}; wait for that "
                                  f"pack to finish, then run `datapipe {command}` again") from None


def _cmd_inspect(a: argparse.Namespace) -> int:
    ix = _open_index(a.url, a.storage_options, f"inspect {a.url}")
    m = ix.manifest
    info = {
        "url": ix.url,
        "shards": ix.num_shards,
        "samples": ix.num_samples,
        "stored_bytes": m.get("stored_bytes"),
        "compression": ix.compression,
        "fields": m.get("fields"),
        "format_version": m.get("version"),
        "created_by": m.get("created_by"),
    }
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    for k, v in info.items():
        print(f"{k:>15}: {v}")
    counts = ix.sample_counts
    if len(counts):
        sizes = [s.bytes for s in ix.shards]
        print(f"{'per shard':>15}: {counts.min()}..{counts.max()} samples, "
              f"{min(sizes) / 1e6:.1f}..{max(sizes) / 1e6:.1f} MB")
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from .verify import verify_dataset

    r = verify_dataset(_dataset_url(a.url, a.storage_options), all_problems=a.all,
                       storage_options=a.storage_options, progress=not a.quiet)
    for p in r.problems:
        print(f"FAIL {p}", file=sys.stderr)
    if r.ok:
        print(f"OK {r.url}: {r.shards} shards, {r.samples:,} samples, {r.bytes / 1e6:,.1f} MB verified")
        return 0
    hint = "" if a.all else " (stopped at the first; --all reports every one)"
    print(f"{len(r.problems)} problem(s) in {r.url}{hint}", file=sys.stderr)
    return 1


def _cmd_cache(a: argparse.Namespace) -> int:
    from . import cache

    if a.cache_cmd == "stats":
        report = cache.cache_report(a.dirs)
        if a.table:
            print(cache.format_tiers(report))
        elif len(a.dirs) == 1:  # one directory: its own object, as before, with the tiers added
            print(json.dumps({**report["dirs"][0], "tiers": report["tiers"]}, indent=1))
        else:
            print(json.dumps(report, indent=1))
    else:
        for d in a.dirs:
            shared = cache.is_shared_dir(d)
            n = cache.clear_shared_dir(d) if shared else cache.clear_warm_dir(d)
            print(f"removed {n} cached objects from {d}")
    return 0


_TIER_NAME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)=(.+)$")


def _budget(text: str) -> tuple[str, int]:
    """``--budget warm=800G`` -> ``("warm", 858993459200)``."""
    m = _TIER_NAME_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"--budget must be NAME=SIZE (e.g. warm=800G), got {text!r}")
    return m.group(1), parse_size(m.group(2))


def _cmd_doctor(a: argparse.Namespace) -> int:
    """``datapipe doctor``: check each tier; exit 1 when one failed."""
    from .errors import OptionError
    from .health import TierSpec, check_tiers, format_checks, tiers_from_config

    specs: list[TierSpec] = []
    for i, text in enumerate(a.tiers):
        m = _TIER_NAME_RE.match(text)
        name, url = (m.group(1), m.group(2)) if m else (f"tier{i}", text)
        specs.append(TierSpec(name, url, storage_options=a.storage_options))
    if a.config:
        try:
            with open(a.config) as f:
                config = json.load(f)
        except ValueError as e:
            raise OptionError(f"--config {a.config}: not JSON ({e})") from None
        for c in config if isinstance(config, list) else [config]:
            if not isinstance(c, dict):
                raise OptionError(f"--config {a.config}: expected a JSON object (a TieredCache or CheckpointWriter "
                                  "config) or a list of them")
            specs.extend(tiers_from_config(c))
    if not specs:
        raise OptionError("datapipe doctor needs at least one tier: PATH, URL or NAME=PATH, or --config FILE")
    budgets = dict(a.budget)
    for name in budgets:
        if not any(s.name == name for s in specs):
            names = ", ".join(s.name for s in specs)
            raise OptionError(f"--budget {name}=...: no tier named {name!r} (tiers: {names})")
    specs = [TierSpec(s.name, s.url, budget_bytes=budgets.get(s.name, s.budget_bytes),
                      kind=s.kind, write=s.write, storage_options=s.storage_options) for s in specs]
    checks = check_tiers(specs, probe_bytes=a.probe_bytes, probes=a.probes, timeout_s=a.timeout, min_mb_s=a.min_mb_s,
                         storage_options=a.storage_options)
    if a.json:
        print(json.dumps([c.to_dict() for c in checks], indent=1))
    else:
        print(format_checks(checks))
    failed = [c.name for c in checks if c.failed]
    if failed and not a.json:
        print(f"{len(failed)} tier(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _add_doctor(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="check each storage tier: write, fsync, read back, free space, GET latency and errors",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check each tier a cache or checkpoint writer uses. A folder (a local path) gets a probe file "
                    "(.datapipe-doctor-<token>, removed after) written, fsync'd and read back, each timed, and its "
                    "free space held against its --budget. An object store (any fsspec URL) gets --probes GETs of "
                    "its manifest.json (or of a probe object put there and deleted), timed, errors counted.\n\n"
                    "Prints a table (tier, path, write MB/s, read MB/s, fsync ms, free/budget, GET ms, status, "
                    "problem). Exit code 0 when no tier failed (warnings included), 1 when one did, 2 on bad "
                    "arguments.\n\n"
                    "examples:\n"
                    "  datapipe doctor warm=/mnt/nvme/cache shared=/mnt/lustre/cache cold=s3://bucket/dataset \\\n"
                    "      --budget warm=800G --budget shared=20T\n"
                    "  datapipe doctor --config cache.json --json   # a TieredCache or CheckpointWriter config")
    p.add_argument("tiers", nargs="*", metavar="TIER",
                   help="a folder or URL to check, optionally named: NAME=PATH or NAME=URL (default names tier0, ...)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON file holding a TieredCache config (warm_dir, warm_bytes, local_tiers, shared_dir, "
                        "shared_bytes, cold) or a CheckpointWriter config (url, tiers), or a list of them")
    p.add_argument("--budget", action="append", default=[], type=_budget, metavar="NAME=SIZE",
                   help="the byte budget of tier NAME (e.g. warm=800G): free space is held against it")
    p.add_argument("--probe-bytes", type=parse_size, default="4M", metavar="SIZE",
                   help="size of each probe file or object (default 4M)")
    p.add_argument("--probes", type=int, default=5, metavar="N", help="GETs per object store (default 5)")
    p.add_argument("--min-mb-s", type=float, default=None, metavar="X",
                   help="fail a folder that writes or reads slower than X MB/s")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="the most seconds one tier may take before it fails as hung (default 30)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON instead of a table")
    _add_storage(p)
    p.set_defaults(func=_cmd_doctor)


def _rank_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)) \
                or (int(hi) - int(lo) if sep else 0) > 1 << 24:
            raise argparse.ArgumentTypeError(f"--ranks: {part!r} is not a rank or a range of ranks (e.g. 0-7,9)")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def _cmd_status(a: argparse.Namespace) -> int:
    """``datapipe status RUN_DIR``: the stragglers of a job; exit 1 when one is named."""
    from .errors import HealthError, ObjectNotFoundError
    from .health import FileBoard, detect
    from .storage import is_local_url

    if is_local_url(a.run_dir) and not os.path.isdir(a.run_dir):
        raise ObjectNotFoundError(f"no run directory at {a.run_dir}")
    board = FileBoard(a.run_dir, group=a.group, storage_options=a.storage_options)
    read = board.read(a.ranks)
    if not read.docs and not read.unreadable:
        raise HealthError(f"no window summary under {board.store.url(board.folder)}: is the job publishing there "
                          "(datapipe.health.Publisher with a FileBoard of this folder)?")
    report = detect(read.docs, k=a.k, ranks=a.ranks, stale_s=a.stale_s, min_share=a.min_share,
                    unreadable=read.unreadable)
    print(json.dumps(report.to_dict(), indent=1) if a.json else report.format())
    return 0 if report.ok else 1


def _add_status(sub: Any) -> None:
    p = sub.add_parser(
        "status", help="name a running job's stragglers, with their cause, from the summaries its ranks publish",
        description="Read the window summaries the ranks of a job publish to RUN_DIR/health/ (a FileBoard; "
                    "datapipe.health.Publisher), compare each rank with the median, and name the ranks whose step "
                    "time or data wait is K times the median, with the cause: 'data' (which tier reads slowly, the "
                    "cache hit ratio, throttling, decode time) or 'compute'. Ranks that stopped publishing are "
                    "reported stale, not as stragglers. Exit code 0 when nothing is named, 1 when a rank is named "
                    "(straggler, stale, idle, missing or unreadable), 2 when there is nothing to read.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (local path or URL) the ranks publish to")
    p.add_argument("--group", default=None, help="the board group the ranks publish under (a sub-group's name)")
    p.add_argument("--ranks", type=_rank_list, default=None, metavar="LIST",
                   help="compare only these ranks, e.g. 0-7,16 (a sub-group); a rank without a summary is missing")
    p.add_argument("-k", type=float, default=1.5, metavar="K",
                   help="how many times the median step time or data wait names a straggler (default 1.5)")
    p.add_argument("--min-share", type=float, default=0.05, metavar="X",
                   help="the least data wait beyond the median, as a share of the median step, that names a data "
                        "straggler (default 0.05)")
    p.add_argument("--stale-s", type=float, default=None, metavar="S",
                   help="a summary older than S seconds is stale (default: three windows, at least 30 s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_storage(p)
    p.set_defaults(func=_cmd_status)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="datapipe", description="Pack, cache, stream and checkpoint training data.")
    ap.add_argument("--version", action="version", version=f"datapipe {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="pack small files, JSONL or Parquet into tar shards with an index",
                       description="Pack SRC (a directory of small files grouped by key, a .jsonl file, or a "
                                   "Parquet file/directory) into WebDataset-compatible tar shards at DEST "
                                   "(a local path or any fsspec URL). Running the same command again after "
                                   "a crash finishes the job.")
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--shard-bytes", type=parse_size, default="128M",
                   help="shard size limit, of tar bytes (default 128M)")
    p.add_argument("--shard-samples", type=int, default=100_000, help="samples per shard limit (default 100000)")
    p.add_argument("--compression", choices=["none", "zstd"], default="none",
                   help="zstd: one frame per sample (.tar.zst)")
    p.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: twice the CPU count; packing waits on the disk)")
    p.add_argument("--part", default=None, metavar="I/N",
                   help="pack only part I (0-based) of N, into DEST/part-I-of-N; then `datapipe join DEST`")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at DEST")
    p.add_argument("--skip-errors", action="store_true", help="skip unreadable inputs and list them in the summary")
    p.add_argument("--keys", choices=["first-dot", "file"], default="first-dot",
                   help="how files become samples. first-dot (default, WebDataset's rule): key = the path up to "
                        "the first dot of the file name, so img1.jpg and img1.json are one sample, and names "
                        "without a dot are not packed. file: one sample per file, key = its path with the "
                        "dots of its name written %%2E, field = its last extension in lower case (bin where it "
                        "has none). The summary counts the files dropped and merged, with examples")
    p.add_argument("--follow-links", action="store_true",
                   help="follow symbolic links to files outside SRC too (by default they are skipped and listed)")
    p.add_argument("--tars-as-files", action="store_true",
                   help="pack a folder of tar files as files (by default refused: index existing shards with "
                        "`datapipe index`)")
    _add_pack_engine(p, "Ray tasks on a Ray cluster (pip install 'datapipe[ray]'): folders listed in parallel, "
                        "one write task per shard, SRC and DEST reachable from every node; not resumable (a "
                        "failed pack removes what it wrote: run it again)")
    p.set_defaults(func=_cmd_pack)

    p = sub.add_parser("pack-tokens", help="tokenize Parquet/JSONL documents into a token dataset (Megatron .bin/.idx)",
                       description="Write the documents of SRC (Parquet or JSONL files: files, folders, globs) as a "
                                   "token dataset at DEST (a local path or any fsspec URL): parts in Megatron-LM's "
                                   "indexed layout (part-PPPPP-KKK.bin/.idx, each readable by Megatron-LM and NeMo "
                                   "as a --data-path prefix), datapipe's block checksums (.xxh) and a manifest, "
                                   "written last. With --tokenizer, each row's text column is tokenized; without, "
                                   "the tokens column holds the ids. Every document ends with the EOS token. "
                                   "Running the same command again after a crash finishes the job.")
    p.add_argument("src", nargs="+", metavar="SRC", help="Parquet/JSONL files, folders or globs")
    p.add_argument("dest", metavar="DEST")
    p.add_argument("--tokenizer", default=None, metavar="JSON",
                   help="a Hugging Face tokenizers file (tokenizer.json, or a folder holding one); without it the "
                        "input holds token ids")
    p.add_argument("--text-column", default="text", help="the column of text, with --tokenizer (default text)")
    p.add_argument("--tokens-column", default="input_ids",
                   help="the column of token ids (lists of integers), without --tokenizer (default input_ids)")
    p.add_argument("--eos-id", type=int, default=None, metavar="N",
                   help="the end-of-document token appended to every document (default: the tokenizer's "
                        "<|endoftext|> or </s>; required without a tokenizer)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="ids must be below it; it picks the dtype (uint16 below 65500, else int32). Default: the "
                        "tokenizer's")
    p.add_argument("--dtype", default=None, choices=["uint8", "int8", "int16", "uint16", "int32", "int64"],
                   help="store ids as this type instead of the one the vocabulary size picks")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: the CPU count)")
    p.add_argument("--part-bytes", type=parse_size, default="256M",
                   help="bound of a part's .bin (default 256M; a part exceeds it only for a single larger document)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset (or an unfinished pack) at DEST")
    _add_pack_engine(p, "one Ray task per piece of the input on a Ray cluster (pip install 'datapipe[ray]'), "
                        "SRC and DEST reachable from every node; the same bytes, resumable either way")
    p.set_defaults(func=_cmd_pack_tokens)

    p = sub.add_parser("index", help="index existing tar shards (WebDataset, GNU tar, Ray) or token files "
                                     "(Megatron .bin/.idx, flat .bin) where they are",
                       description="Build the datapipe index (manifest, shard and sample tables with checksums) "
                                   "of existing uncompressed tar shards, which stay where they are: local paths or "
                                   "any fsspec URL, brace patterns (shard-{000000..000999}.tar) and globs. The index "
                                   "goes beside the shards, or to --index-to DEST (for a source you may not write). "
                                   "Each shard is read once; running the same command again skips shards already "
                                   "indexed. Whole-file compressed tars (.tar.gz, .tar.zst) are refused: no sample "
                                   "of them can be reached by offset; decompress them first. Token files (Megatron "
                                   "prefixes, .bin/.idx paths, flat .bin files of raw ids) get block checksums "
                                   "(.xxh) and a token manifest beside them, or under --index-to DIR.")
    p.add_argument("urls", nargs="+", metavar="URL",
                   help="shard URLs, paths, brace patterns or globs; or token files: Megatron prefixes (data/train "
                        "for train.bin + train.idx), .bin/.idx paths")
    p.add_argument("--index-to", default=None, metavar="DEST",
                   help="where the index goes (default: the folder the shards share)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: the CPU count)")
    p.add_argument("--part", default=None, metavar="I/N",
                   help="index only part I (0-based) of N of the shard list (records only); then run without "
                        "--part to commit")
    p.add_argument("--json", action="store_true", help="print the result (with timing) as JSON")
    p.add_argument("--dtype", default=None, choices=["uint8", "int8", "int16", "uint16", "int32", "int64"],
                   help="token files: the ids' type in flat .bin files (default uint16, nanoGPT's)")
    p.add_argument("--eos-id", type=int, default=None, metavar="N",
                   help="token files: a flat file's documents end after each N (else it is one document); recorded")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N", help="token files: every id must be below N")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_storage(p)
    p.set_defaults(func=_cmd_index)

    p = sub.add_parser("join", help="join the parts written by `pack --part I/N` into one dataset")
    p.add_argument("dest")
    p.add_argument("--overwrite", action="store_true")
    _add_storage(p)
    p.set_defaults(func=_cmd_join)

    p = sub.add_parser("inspect", help="show a dataset's shards, samples, bytes, fields and compression")
    p.add_argument("url", help="a dataset or index folder, or tar shards (a URL or pattern: indexed on first use)")
    p.add_argument("--json", action="store_true")
    _add_storage(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="re-read every shard and check checksums and structure")
    p.add_argument("url", help="a dataset or index folder, or tar shards (a URL or pattern: indexed on first use)")
    p.add_argument("--all", action="store_true", help="report every problem, not only the first")
    p.add_argument("-q", "--quiet", action="store_true")
    _add_storage(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("cache", help="inspect or clear cache directories (node-local warm_dir, shared_dir)")
    csub = p.add_subparsers(dest="cache_cmd", required=True)
    c = csub.add_parser("stats", help="each tier (memory, local, shared, cold): bytes, budget, hits, misses, "
                        "fills from which tier, cold GETs per object; JSON unless --table",
                        description="Give the node-local warm_dir(s) (their counters cover every process that "
                        "used them) and the shared_dir (its contents and every node's cold GETs through it).")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="a warm_dir or shared_dir of a TieredCache")
    c.add_argument("--table", action="store_true", help="print the tiers as a table instead of JSON")
    c = csub.add_parser("clear", help="remove every cached object nobody is reading (and dead downloads)")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="a warm_dir or shared_dir of a TieredCache")
    p.set_defaults(func=_cmd_cache)

    _add_doctor(sub)
    _add_status(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DatapipeError as e:
        print(f"datapipe {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path we were given: name it, no traceback
        where = f" {e.filename}:" if e.filename else ""
        print(f"datapipe {args.cmd}: error:{where} {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"datapipe {args.cmd}: interrupted; run the same command again to finish", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
