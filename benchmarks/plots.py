"""PNG plots of a `benchmarks.report` run (matplotlib, no display needed)."""

from __future__ import annotations

import os
from typing import Any

OURS = "#d62728"
FLOOR = "#7f7f7f"
PEER = "#1f77b4"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _color(name: str) -> str:
    n = name.lower()
    return OURS if "datapipe" in n else FLOOR if "floor" in n else PEER


def pack_png(r: dict[str, Any], path: str) -> None:
    plt = _plt()
    rows = [x for x in r["rows"] if x.get("seconds")]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    labels = [x["label"] for x in rows]
    ax.barh(labels, [x["samples_per_s"] for x in rows], color=[_color(x["label"]) for x in rows])
    for i, x in enumerate(rows):
        ax.text(x["samples_per_s"], i, f"  {x['ratio_to_floor']:.2f}x floor", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (higher is better)")
    modes = ", ".join(r["cache_modes"])
    ax.set_title(f"Packing {r['config']['samples']:,} samples of small files ({modes} page cache)")
    ax.margins(x=0.25)
    _save(plt, fig, path)


def read_png(r: dict[str, Any], path: str) -> None:
    plt = _plt()
    import numpy as np

    names = [n for n, e in r["systems"].items() if "error" not in e]
    warm = [r["systems"][n]["warm"]["samples_per_s"] for n in names]
    cold = [r["systems"][n]["cold"]["samples_per_s"] for n in names]
    y = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(names) + 1.5))
    ax.barh(y - 0.2, warm, 0.4, label="warm (next epoch)", color=[_color(n) for n in names])
    ax.barh(y + 0.2, cold, 0.4, label="cold (page cache dropped)", color=[_color(n) for n in names], alpha=0.45)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("samples/s, log scale (higher is better); dark = warm, light = cold")
    ax.set_title(f"Shuffled read, one process, {r['samples']:,} samples")
    _save(plt, fig, path)


def cache_png(r: dict[str, Any], path: str) -> None:
    plt = _plt()
    fracs = sorted(r["policies"], key=float)
    x = [float(f) * 100 for f in fracs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    pol = r["policies"]
    series = {
        "Belady optimum": ([pol[f]["belady_optimum"]["hit_rate"] for f in fracs], None),
        "datapipe clairvoyant": ([pol[f]["datapipe_clairvoyant"]["hit_rate"] for f in fracs],
                                 [pol[f]["datapipe_clairvoyant"]["steady_cold_bytes_per_epoch"] for f in fracs]),
        "datapipe LRU": ([pol[f]["datapipe_lru"]["hit_rate"] for f in fracs],
                         [pol[f]["datapipe_lru"]["steady_cold_bytes_per_epoch"] for f in fracs]),
    }
    for peer, label in (("mosaicml_streaming", "MosaicML cache_limit"), ("litdata", "LitData max_cache_size")):
        rows = r.get("peers", {}).get(peer, {})
        pts = [(float(f) * 100, rows[f]) for f in fracs if f in rows and "error" not in rows[f]]
        if pts:
            series[label] = ([p["hit_rate"] for _, p in pts], [p["steady_cold_bytes_per_epoch"] for _, p in pts],
                             [q for q, _ in pts])
    clipped = False
    for name, val in series.items():
        xs = val[2] if len(val) > 2 else x
        style = dict(marker="o", color=OURS if "datapipe" in name else FLOOR if "Belady" in name else None,
                     linestyle="--" if "LRU" in name else "-")
        if "Belady" in name:  # drawn wide underneath: the clairvoyant line lies on it when it matches
            style.update(linewidth=6, alpha=0.35, marker=None)
        rates = [max(0.0, h) for h in val[0]]
        clipped |= rates != list(val[0])
        a1.plot(xs, rates, label=name, **style)
        if val[1] is not None:
            a2.plot(xs, [b / 1e6 for b in val[1]], label=name, **style)
    total = r["dataset_bytes"] / 1e6
    a2.plot(x, [(1 - f / 100) * total + 0.05 * total for f in x], color=FLOOR, linestyle=":",
            label="target: (1 - size) x data + 5%")
    a1.set(xlabel="cache size, % of the dataset", ylabel="hit rate", title="Hit rate (steady epochs)")
    if clipped:
        a1.annotate("a peer downloaded more objects than were read: its\n"
                    "negative 'hit rate' is drawn at 0 (see the table)",
                    (0.02, 0.85), xycoords="axes fraction", fontsize=7)
    a2.set(xlabel="cache size, % of the dataset", ylabel="MB from cold per epoch",
           title="Bytes from cold (lower is better)")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    _save(plt, fig, path)


def checkpoint_png(r: dict[str, Any], path: str) -> None:
    plt = _plt()
    runs = sorted((e for e in r.values() if "error" not in e), key=lambda e: e["floors"]["bytes"])
    if not runs:
        return
    gb = [e["floors"]["bytes"] / 1e9 for e in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))

    def line(ax: Any, key: str, field: str, label: str, **kw: Any) -> None:
        ys = [e.get(key, {}).get(field) for e in runs]
        if any(y is not None for y in ys):
            ax.plot(gb, ys, marker="o", label=label, **kw)

    line(a1, "datapipe", "steady_stall_s", "datapipe (steady)", color=OURS)
    line(a1, "datapipe", "first_stall_s", "datapipe (first save)", color=OURS, linestyle="--")
    line(a1, "torch_save", "steady_stall_s", "torch.save + fsync")
    line(a1, "dcp_async_save", "steady_stall_s", "DCP async_save (steady)")
    line(a1, "floors", "memcpy_s", "floor: memcpy", color=FLOOR, linestyle=":")
    line(a1, "floors", "clone_fresh_s", "floor: fresh clone", color=FLOOR, linestyle="-.")
    line(a2, "datapipe", "steady_total_s", "datapipe", color=OURS)
    line(a2, "torch_save", "steady_total_s", "torch.save + fsync")
    line(a2, "dcp_async_save", "steady_total_s", "DCP async_save")
    line(a2, "floors", "disk_s", "floor: fsync'd sequential write", color=FLOOR, linestyle=":")
    a1.set(xlabel="state size, GB", ylabel="seconds the training loop is blocked", title="Checkpoint stall")
    a2.set(xlabel="state size, GB", ylabel="seconds until durable", title="Checkpoint total")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    _save(plt, fig, path)


#: the loader panels: (title, where the figure is: mode and key, or the cell's mode figures)
_LOADER_PANELS = (
    ("(a) one process, first epoch of a new dataset", "first_epoch"),
    ("(c) one process, steady state", "steady"),
    ("(b) DataLoader, 2 new workers each epoch: slowest epoch", "nonpersistent_slowest"),
    ("(c) DataLoader, 2 persistent workers: steady state", "persistent_steady"),
)


def loader_png(r: dict[str, Any], path: str) -> None:
    """Samples/s per cell of the loader sweep: one bar per system variant, one panel per
    mode (a first epoch, b non-persistent workers, c steady states; log scale: the rates
    span decades)."""
    plt = _plt()
    import numpy as np

    cells = r.get("cells", {})
    if not cells:
        raise ValueError("no sweep cells in this run")
    names = sorted({n for c in cells.values() for n in c.get("modes", {}).get("systems", {})},
                   key=lambda n: (n != "datapipe", n))
    fig, axes = plt.subplots(2, 2, figsize=(13, 0.9 * len(cells) * len(names) / 2 + 4), sharey=True)
    y = np.arange(len(cells))
    h = 0.8 / max(len(names), 1)
    for ax, (title, key) in zip(axes.flat, _LOADER_PANELS, strict=True):
        for i, n in enumerate(names):
            vals = [c.get("modes", {}).get("systems", {}).get(n, {}).get(key) or 0 for c in cells.values()]
            base = n.split("@")[0]
            color = {"litdata": PEER, "mosaicml": "#2ca02c", "webdataset": "#9467bd"}.get(base, _color(n))
            ax.barh(y + i * h, vals, h, label=n, color=color, alpha=1.0 if "@" not in n else 0.45)
        ax.set_xscale("log")
        ax.set_xlabel("samples/s (higher is better)")
        ax.set_title(title, fontsize=9)
    for ax in axes[:, 0]:
        ax.set_yticks(y + 0.4 - h / 2, list(cells))
    axes[0, 0].invert_yaxis()
    axes[0, 1].legend(fontsize=7, loc="lower right")
    _save(plt, fig, path)


def write_all(report: dict[str, Any], out: str) -> list[str]:
    """Write every plot whose part ran; returns the file names."""
    made = []
    for part, fn in (("pack", pack_png), ("read", read_png), ("loader", loader_png), ("cache", cache_png),
                     ("checkpoint", checkpoint_png)):
        r = report.get(part)
        if not r or "error" in r:
            continue
        name = f"{part}.png"
        try:
            fn(r, os.path.join(out, name))
            made.append(name)
        except (KeyError, TypeError, ValueError) as e:  # a changed result shape must not lose the others
            print(f"plot {name} skipped: {type(e).__name__}: {e}")
    return made
