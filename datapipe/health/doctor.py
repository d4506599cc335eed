"""Tier health checks: each tier written, fsync'd, read back and timed; free space against
its budget; an object store's GET latency and error rate. ``datapipe doctor`` prints them.
A folder's check is ``datapipe.cache.check_folder``, the one check of a folder tier: a
``TieredCache`` runs it, with a 16 KiB probe, on each directory tier as a process opens its
tiers, and a ``CheckpointWriter`` on each local tier as it starts (a tier that fails is out
of the path from the start, with a warning naming it and the fix).

    checks = check_tiers([TierSpec("warm", "/mnt/nvme/cache", budget_bytes=100 << 30),
                          TierSpec("cold", "s3://bucket/dataset")])
    print(format_checks(checks)); failed = [c for c in checks if c.failed]

A folder tier (``check_folder``): a probe file ``.datapipe-doctor-<token>`` is created (``O_EXCL``: never an
existing file), written, fsync'd, dropped from the page cache where the kernel allows, read
back and compared, and removed (only if it is still the file this check created: delete
only what we wrote). A missing folder, a read-only one, a full disk, a read that differs
from what was written fail the tier with the reason; free space plus the tier's own files
short of its budget is a warning. An object store tier (any URL ``open_store`` opens): GETs
of one object, timed, errors counted (one attempt each, no retries: the error rate is the
store's); the object is the dataset's ``manifest.json``, else one this check puts there
and deletes (a checkpoint tier, ``write=True``, always gets one: its writes are checked too).

Each tier is checked on a thread of its own with a deadline (``timeout_s``): a hung mount
fails its tier ("no answer") instead of hanging the check; such a thread removes its probe
when the filesystem answers at last.
"""

from __future__ import annotations

import inspect
import math
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..cache import PROBE_PREFIX, Deadline, check_folder
from ..errors import DatapipeError, OptionError
from ..options import check_bool, check_bytes, check_float, check_int, check_mapping, check_path, show
from ..storage import (
    FsspecStore,
    RetryPolicy,
    is_local_url,
    is_throttle,
    open_store,
    single_layer_options,
    storage_options_for,
)

__all__ = ["TierSpec", "TierCheck", "check_tiers", "tiers_from_config", "format_checks", "worst", "PROBE_PREFIX"]

_ERROR_RATE_FAILS = 0.2
_STATUS_ORDER = {"ok": 0, "warn": 1, "failed": 2}


@dataclass(frozen=True)
class TierSpec:
    """A tier to check: ``name`` (as the table shows it), ``url`` (a local folder or a
    URL), ``budget_bytes`` (the bytes it is allowed to hold), ``kind`` (``"dir"``: a
    folder, written and read; ``"store"``: an object store, read by GETs; ``"auto"``: a
    folder for local paths), ``write`` (store tiers: put a probe object and GET it; None:
    only when there is no ``manifest.json`` to GET), ``storage_options`` (fsspec)."""

    name: str
    url: str
    budget_bytes: int | None = None
    kind: str = "auto"
    write: bool | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise OptionError(f"TierSpec(name={show(self.name)}): expected a non-empty str")
        check_path(f"TierSpec({self.name!r}).url", self.url)
        if self.budget_bytes is not None:
            check_bytes(f"TierSpec({self.name!r}).budget_bytes", self.budget_bytes)
        if self.kind not in ("auto", "dir", "store"):
            raise OptionError(f"TierSpec({self.name!r}).kind={show(self.kind)}: expected 'auto', 'dir' or 'store'")
        if self.write is not None:
            check_bool(f"TierSpec({self.name!r}).write", self.write)
        if self.storage_options is not None:
            check_mapping(f"TierSpec({self.name!r}).storage_options", self.storage_options)
        if self.kind == "auto":
            object.__setattr__(self, "kind", "dir" if is_local_url(self.url) else "store")


@dataclass(frozen=True)
class TierCheck:
    """The check of one tier. ``status``: ``ok``, ``warn`` or ``failed``; ``problem``:
    why (empty when ok). Rates in MB/s (10^6 bytes), times in ms; None where not measured."""

    name: str
    url: str
    kind: str
    status: str
    problem: str = ""
    write_mb_s: float | None = None
    read_mb_s: float | None = None
    fsync_ms: float | None = None
    free_bytes: int | None = None
    budget_bytes: int | None = None
    used_bytes: int | None = None
    gets: int = 0
    get_errors: int = 0
    get_throttled: int = 0
    get_p50_ms: float | None = None
    get_p95_ms: float | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_tiers(tiers: Iterable[TierSpec | str | tuple[str, str] | Mapping[str, Any]] | Mapping[str, Any], *,
                probe_bytes: int = 4 << 20, probes: int = 5, timeout_s: float = 30.0,
                min_mb_s: float | None = None, storage_options: dict[str, Any] | None = None) -> list[TierCheck]:
    """Check each tier (see the module docstring) and return one :class:`TierCheck` each,
    in order. ``tiers``: :class:`TierSpec` s, paths or URLs (named ``tier0``, ...),
    ``(name, url)`` pairs, or config dicts of a ``TieredCache`` or ``CheckpointWriter``
    (:func:`tiers_from_config`). ``probe_bytes``: the size of each probe; ``probes``: GETs
    per object store; ``timeout_s``: the most one tier may take; ``min_mb_s``: a folder
    that writes or reads slower fails; ``storage_options``: for URLs whose spec has none.
    Never raises for a failing tier: it is reported failed."""
    probe_bytes = check_bytes("probe_bytes", probe_bytes, min=1, max=1 << 30)
    probes = check_int("probes", probes, min=1, max=10_000)
    timeout_s = check_float("timeout_s", timeout_s, min=0, min_open=True, max=1e6)
    if min_mb_s is not None:
        min_mb_s = check_float("min_mb_s", min_mb_s, min=0)
    if storage_options is not None:
        storage_options = check_mapping("storage_options", storage_options)
    specs = _specs(tiers)
    return [_with_deadline(spec, probe_bytes, probes, timeout_s, min_mb_s, storage_options) for spec in specs]


def _specs(tiers: Iterable[Any] | Mapping[str, Any]) -> list[TierSpec]:
    if isinstance(tiers, Mapping):
        return tiers_from_config(tiers)
    if isinstance(tiers, (str, os.PathLike)):
        tiers = [tiers]
    try:
        items = list(tiers)
    except TypeError:
        raise OptionError(f"tiers={show(tiers)}: expected a list of TierSpec, paths/URLs, (name, url) pairs or "
                          "config dicts") from None
    specs: list[TierSpec] = []
    for i, t in enumerate(items):
        if isinstance(t, TierSpec):
            specs.append(t)
        elif isinstance(t, (str, os.PathLike)):
            specs.append(TierSpec(f"tier{i}", check_path(f"tiers[{i}]", t)))
        elif isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str):
            specs.append(TierSpec(t[0], check_path(f"tiers[{i}][1]", t[1])))
        elif isinstance(t, Mapping):
            specs.extend(tiers_from_config(t))
        else:
            raise OptionError(f"tiers[{i}]={show(t)}: expected a TierSpec, a path or URL, a (name, url) pair or "
                              "a config dict")
    return specs


_CACHE_TIER_KEYS = {"warm_dir", "warm_bytes", "local_tiers", "shared_dir", "shared_bytes", "cold", "storage_options"}
_CHECKPOINT_TIER_KEYS = {"url", "tiers", "storage_options"}


def _parameters(kind: str) -> set[str]:
    """The keyword arguments of ``TieredCache`` or ``CheckpointWriter`` (imported here:
    a config of the other kind should not pay for it)."""
    if kind == "TieredCache":
        from ..cache import TieredCache as cls
    else:
        from ..checkpoint import CheckpointWriter as cls  # type: ignore[assignment]
    return {p for p in inspect.signature(cls.__init__).parameters if p != "self"}


def tiers_from_config(config: Mapping[str, Any]) -> list[TierSpec]:
    """The tiers of a ``TieredCache`` config (its keyword arguments: ``warm_dir`` /
    ``warm_bytes``, ``local_tiers``, ``shared_dir`` / ``shared_bytes``, plus ``cold``: the
    cold store's URL) or of a ``CheckpointWriter`` config (``url``, ``tiers``: Tier
    objects or dicts with ``url`` and ``node_local``). Other arguments of those classes are
    ignored; a key neither has is an :class:`OptionError`."""
    config = check_mapping("config", config)
    opts = config.get("storage_options")
    if opts is not None:
        opts = check_mapping("config['storage_options']", opts)
    if set(config) & {"url", "tiers"}:
        allowed = _parameters("CheckpointWriter") | _CHECKPOINT_TIER_KEYS
        kind = "CheckpointWriter"
    else:
        allowed = _parameters("TieredCache") | _CACHE_TIER_KEYS
        kind = "TieredCache"
    unknown = sorted(set(config) - allowed)
    if unknown:
        keys = _CACHE_TIER_KEYS if kind == "TieredCache" else _CHECKPOINT_TIER_KEYS
        raise OptionError(f"config[{unknown[0]!r}]: not an argument of {kind} nor a tier key "
                          f"({', '.join(sorted(keys))})")
    if kind == "CheckpointWriter":
        return _checkpoint_tiers(config, opts)
    specs = []
    for name, path_key, bytes_key in (("warm", "warm_dir", "warm_bytes"), ("shared", "shared_dir", "shared_bytes")):
        if config.get(path_key) is not None:
            budget = config.get(bytes_key)
            if budget is not None:
                budget = check_bytes(f"config[{bytes_key!r}]", budget)
            specs.append(TierSpec(name, check_path(f"config[{path_key!r}]", config[path_key]), budget_bytes=budget,
                                  kind="dir"))
    local = config.get("local_tiers") or ()
    if isinstance(local, (str, bytes)) or not isinstance(local, Sequence):
        raise OptionError(f"config['local_tiers']={show(local)}: expected a list of Tier(path, bytes) or "
                          "{'path': ..., 'bytes': ...}")
    for i, t in enumerate(local):
        path, budget = _path_and_bytes(t, f"config['local_tiers'][{i}]")
        specs.insert(len([s for s in specs if s.name != "shared"]),
                     TierSpec(f"node-local{i + 2}", path, budget_bytes=budget, kind="dir"))
    if config.get("cold") is not None:
        specs.append(TierSpec("cold", check_path("config['cold']", config["cold"]), storage_options=opts))
    return specs


def _path_and_bytes(t: Any, where: str) -> tuple[str, int | None]:
    if isinstance(t, Mapping):
        path, budget = t.get("path"), t.get("bytes")
    elif isinstance(t, (tuple, list)) and len(t) == 2:
        path, budget = t
    elif hasattr(t, "path") and hasattr(t, "bytes"):  # cache.Tier
        path, budget = t.path, t.bytes
    else:
        raise OptionError(f"{where}={show(t)}: expected Tier(path, bytes) or {{'path': ..., 'bytes': ...}}")
    return check_path(f"{where}.path", path), None if budget is None else check_bytes(f"{where}.bytes", budget)


def _checkpoint_tiers(config: Mapping[str, Any], opts: dict[str, Any] | None) -> list[TierSpec]:
    specs = []
    if config.get("url") is not None:
        url = check_path("config['url']", config["url"])
        specs.append(TierSpec("checkpoint", url, write=None if is_local_url(url) else True, storage_options=opts))
    tiers = config.get("tiers") or ()
    if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence):
        raise OptionError(f"config['tiers']={show(tiers)}: expected a list of checkpoint Tier or {{'url': ...}}")
    for i, t in enumerate(tiers):
        get = t.get if isinstance(t, Mapping) else lambda name, t=t: getattr(t, name, None)
        url = check_path(f"config['tiers'][{i}].url", get("url"))
        local, tier_opts = get("node_local"), get("storage_options")
        name = f"checkpoint{i}" + ("-node-local" if local else "")
        specs.append(TierSpec(name, url, write=None if is_local_url(url) else True, storage_options=tier_opts or opts))
    return specs


def _with_deadline(spec: TierSpec, probe_bytes: int, probes: int, timeout_s: float, min_mb_s: float | None,
                   storage_options: dict[str, Any] | None) -> TierCheck:
    t0 = time.perf_counter()

    def run() -> TierCheck:
        try:
            if spec.kind == "dir":
                return _check_dir(spec, probe_bytes, min_mb_s)
            return _check_store(spec, probe_bytes, probes, storage_options, timeout_s)
        except Exception as e:  # an unforeseen failure is the tier's, named, never the caller's crash
            return TierCheck(spec.name, spec.url, spec.kind, "failed", f"check failed: {type(e).__name__}: {e}")

    deadline = Deadline(timeout_s, name=f"datapipe-doctor-{spec.name}")
    try:
        check = deadline.call(run, what=f"checking {spec.url}")
    except OSError:  # the deadline's own: run() returns every failure as the tier's
        return TierCheck(spec.name, spec.url, spec.kind, "failed",
                         f"no answer within {timeout_s:g} s: the filesystem or store hangs (a dead mount, a "
                         "stuck network); its probe is removed when it answers", budget_bytes=spec.budget_bytes,
                         seconds=time.perf_counter() - t0)
    finally:
        deadline.close()
    return _replace(check, seconds=time.perf_counter() - t0)


def _replace(check: TierCheck, **changes: Any) -> TierCheck:
    return TierCheck(**{**asdict(check), **changes})


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _check_dir(spec: TierSpec, probe_bytes: int, min_mb_s: float | None) -> TierCheck:
    c = check_folder(spec.url, probe_bytes=probe_bytes, budget_bytes=spec.budget_bytes, min_mb_s=min_mb_s)
    return TierCheck(spec.name, c.path, "dir", c.status, c.problem, write_mb_s=c.write_mb_s, read_mb_s=c.read_mb_s,
                     fsync_ms=c.fsync_ms, free_bytes=c.free_bytes, budget_bytes=c.budget_bytes,
                     used_bytes=c.used_bytes)


def _check_store(spec: TierSpec, probe_bytes: int, probes: int, storage_options: dict[str, Any] | None,
                 timeout_s: float) -> TierCheck:
    def fail(problem: str, **kw: Any) -> TierCheck:
        return TierCheck(spec.name, spec.url, "store", "failed", problem, budget_bytes=spec.budget_bytes, **kw)

    opts = spec.storage_options if spec.storage_options is not None else storage_options
    try:
        # one attempt per GET, as the cache's cold reads make them: the error rate is the store's own
        opts = single_layer_options(spec.url.split("://", 1)[0], storage_options_for(spec.url, opts),
                                    RetryPolicy(attempt_timeout_s=timeout_s))
        store = open_store(spec.url, opts)
        if isinstance(store, FsspecStore):
            store.backend_retries = 1
    except DatapipeError as e:
        return fail(f"cannot open {spec.url}: {e}")
    key, written, write_mb_s = None, False, None
    if spec.write is not True:
        try:
            if store.exists("manifest.json"):
                key = "manifest.json"
        except (DatapipeError, OSError) as e:
            return fail(f"cannot reach {spec.url}: {e}")
    if key is None:
        if spec.write is False:
            return fail(f"nothing to GET: no manifest.json at {spec.url}, and write=False forbids a probe object")
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex[:16]}"
        data = os.urandom(probe_bytes)
        t0 = time.perf_counter()
        try:
            store.put(key, data)
        except (DatapipeError, OSError) as e:
            return fail(f"cannot write a probe object to {spec.url}: {e}")
        write_mb_s = probe_bytes / max(time.perf_counter() - t0, 1e-9) / 1e6
        written = True
    try:
        try:
            size = store.size(key)
        except (DatapipeError, OSError) as e:
            return fail(f"cannot stat {store.url(key)}: {e}", write_mb_s=write_mb_s)
        n = min(size, probe_bytes)
        times, errors, throttled, last = [], 0, 0, ""
        for _ in range(probes):
            t0 = time.perf_counter()
            try:
                got = store.get_range(key, 0, n)
            except (DatapipeError, OSError) as e:
                errors += 1
                throttled += is_throttle(e)
                last = str(e)
                continue
            times.append(time.perf_counter() - t0)
            if written and got != data[:n]:
                return fail(f"corrupt: the probe object read back from {store.url(key)} differs from what was "
                            "written", write_mb_s=write_mb_s)
    finally:
        if written:
            try:
                store.delete(key)
            except (DatapipeError, OSError):
                pass
    times.sort()
    p50 = times[len(times) // 2] * 1e3 if times else None
    p95 = times[min(math.ceil(0.95 * len(times)) - 1, len(times) - 1)] * 1e3 if times else None
    read_mb_s = n * len(times) / max(sum(times), 1e-9) / 1e6 if times else None
    status, problem = "ok", ""
    if errors:
        rate = errors / probes
        status = "failed" if rate > _ERROR_RATE_FAILS else "warn"
        slow_down = f", {throttled} of them throttled (503 SlowDown / 429)" if throttled else ""
        problem = f"{errors} of {probes} GETs failed ({rate:.0%}{slow_down}); the last: {last[:300]}"
    return TierCheck(spec.name, spec.url, "store", status, problem, write_mb_s=write_mb_s, read_mb_s=read_mb_s,
                     budget_bytes=spec.budget_bytes, gets=probes, get_errors=errors, get_throttled=throttled,
                     get_p50_ms=p50, get_p95_ms=p95)


def format_checks(checks: Sequence[TierCheck]) -> str:
    """The checks as a table: tier, path, write MB/s, read MB/s, fsync ms, free/budget,
    GET p50/p95 ms, status, problem."""
    def num(x: float | None, fmt: str = ".3g") -> str:
        return "-" if x is None else format(x, fmt)

    head = ("tier", "path", "write MB/s", "read MB/s", "fsync ms", "free/budget", "GET ms p50/p95", "status",
            "problem")
    rows = []
    for c in checks:
        free = "-" if c.free_bytes is None else _size(c.free_bytes)
        budget = "-" if c.budget_bytes is None else _size(c.budget_bytes)
        gets = "-" if c.kind != "store" else f"{num(c.get_p50_ms)}/{num(c.get_p95_ms)}"
        rows.append((c.name, c.url, num(c.write_mb_s), num(c.read_mb_s), num(c.fsync_ms), f"{free}/{budget}", gets,
                     c.status.upper(), c.problem or "-"))
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in (head, *rows)]
    return "\n".join(line.rstrip() for line in lines)


def worst(checks: Sequence[TierCheck]) -> str:
    """The worst status among ``checks`` (``ok`` when there are none)."""
    return max((c.status for c in checks), key=_STATUS_ORDER.__getitem__, default="ok")
