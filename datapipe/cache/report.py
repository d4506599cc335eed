"""What ``datapipe cache stats DIR...`` shows: each directory's contents and, per tier
(memory, node-local, shared, cold), bytes, budget, hits, misses, fills and where they came
from, and cold GETs per object.

Counters come from the node-local directories (every process that used one writes its
counters there, node_stats.py); a shared directory adds what it holds and its ledger of
cold GETs, which counts every node's downloads through it."""

from __future__ import annotations

from typing import Any

from .future import describe as describe_futures
from .pacing import pacing_state
from .shared import is_shared_dir, shared_dir_stats
from .warm import warm_dir_stats

__all__ = ["cache_report", "format_tiers"]


def _dir_stats(root: str) -> dict[str, Any]:
    if is_shared_dir(root):
        return shared_dir_stats(root)
    out = warm_dir_stats(root)  # raises a named error for a folder that is no cache of ours
    out["tier"] = "local"
    out["pacing"] = pacing_state(out["dir"])
    try:
        out["futures"] = describe_futures(out["dir"])
    except OSError:
        out["futures"] = None  # a read-only directory: nothing published can be listed
    return out


def cache_report(dirs: list[str]) -> dict[str, Any]:
    """``{"dirs": [per directory], "tiers": [memory, local, shared, cold]}``."""
    stats = [_dir_stats(d) for d in dirs]
    local = [s for s in stats if s["tier"] == "local"]
    shared = [s for s in stats if s["tier"] == "shared"]
    c: dict[str, float] = {}
    for s in local:
        for k, v in s["counters"].items():
            c[k] = c.get(k, 0) + v

    def n(key: str) -> float:
        return c.get(key, 0)

    def sources(tier: str) -> dict[str, float]:
        """Where ``tier``'s fills came from: ``<tier>_from_<source>`` counters."""
        out = {"shared": n(f"{tier}_from_shared"), "cold": n(f"{tier}_from_cold")}
        out.update({k.split("_from_", 1)[1]: v for k, v in sorted(c.items()) if k.startswith(f"{tier}_from_local")})
        return out

    tiers: list[dict[str, Any]] = [
        {"tier": "memory", "hits": n("hot_hits"), "misses": n("hot_misses"), "bytes_served": n("hot_bytes"),
         "evictions": n("hot_evictions"), "not_admitted": n("hot_not_admitted"), "fills_from": sources("hot")},
        {"tier": "local", "dirs": [s["dir"] for s in local], "bytes": sum(s["bytes"] for s in local),
         "budget_bytes": sum(s["budget_bytes"] or 0 for s in local), "hits": n("warm_hits"),
         "misses": n("warm_misses"), "bytes_served": n("warm_bytes"), "fills": n("warm_fills"),
         "fills_from": sources("warm"),
         "evictions": n("warm_evictions"), "not_admitted": n("warm_not_admitted"), "corrupt": n("warm_corrupt")},
    ]
    # further node-local tiers (TieredCache(local_tiers=...)): their counters, by level
    levels = sorted({int(k[5:].split("_", 1)[0]) for k in c if k.startswith("local") and k[5:6].isdigit()})
    for lv in levels:
        t = f"local{lv}"
        tiers.append({"tier": t, "hits": n(f"{t}_hits"), "misses": n(f"{t}_misses"), "bytes_served": n(f"{t}_bytes"),
                      "fills": n(f"{t}_fills"), "fills_from": sources(t), "evictions": n(f"{t}_evictions"),
                      "not_admitted": n(f"{t}_not_admitted"), "corrupt": n(f"{t}_corrupt")})
    if shared or n("shared_hits") or n("shared_misses"):
        tiers.append({
            "tier": "shared", "dirs": [s["dir"] for s in shared], "bytes": sum(s["bytes"] for s in shared),
            "budget_bytes": sum(s["budget_bytes"] or 0 for s in shared), "hits": n("shared_hits"),
            "misses": n("shared_misses"), "bytes_served": n("shared_bytes"), "fills": n("shared_fills"),
            "fills_from": {"cold": n("shared_fills")}, "evictions": n("shared_evictions"),
            "not_admitted": n("shared_not_admitted"), "corrupt": n("shared_corrupt"), "waits": n("shared_waits"),
            "takeovers": n("shared_takeovers"), "read_around": n("shared_read_around")})
    ledger = [s["cold_gets"] for s in shared]
    gets, objects = sum(g["gets"] for g in ledger), sum(g["objects"] for g in ledger)
    tiers.append({
        "tier": "cold", "gets": n("cold_reads"), "bytes": n("cold_bytes"), "retries": n("cold_retries"),
        "throttled": n("cold_throttled"), "backoffs": n("cold_backoffs"),
        # through the shared tier, every node's GETs are in its ledger; else this node's
        "gets_per_object": (round(gets / objects, 4) if objects else None),
        "gets_per_object_max": max((g["per_object_max"] or 0 for g in ledger), default=None) if ledger else None,
        "pacing": {p: v for s in local for p, v in s["pacing"].items()}})
    return {"dirs": stats, "tiers": tiers}


def format_tiers(report: dict[str, Any]) -> str:
    """The tiers as a table for people."""
    rows = [("tier", "bytes", "budget", "hits", "misses", "fills", "from shared", "from cold", "other")]
    for t in report["tiers"]:
        frm = t.get("fills_from", {})
        if t["tier"] == "cold":
            other = f"GETs {t['gets']:g}, per object {t['gets_per_object']}, throttled {t['throttled']:g}"
        elif t["tier"] == "shared":
            other = f"waits {t['waits']:g}, takeovers {t['takeovers']:g}, read around {t['read_around']:g}"
        else:
            other = f"evictions {t['evictions']:g}" + "".join(
                f", from {k} {v:g}" for k, v in frm.items() if k not in ("shared", "cold"))
        rows.append((t["tier"], _num(t.get("bytes")), _num(t.get("budget_bytes")), _num(t.get("hits")),
                     _num(t.get("misses")), _num(t.get("fills")), _num(frm.get("shared")), _num(frm.get("cold")),
                     other))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def _num(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if isinstance(v, (int, float)) else str(v)
