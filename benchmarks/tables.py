"""Markdown tables of a `benchmarks.report` run: ratios to the floors and peers first."""

from __future__ import annotations

from typing import Any


def _f(x: Any, fmt: str = "{:,.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def pack_md(r: dict[str, Any]) -> str:
    c = r["config"]
    rows = []
    for row in r["rows"]:
        if row.get("seconds") is None:
            rows.append([row["label"], "failed: " + str(row.get("error"))[:80], "", "", "", "", "", ""])
            continue
        faster = {True: "yes", False: "no", None: ""}[row.get("faster_than_every_peer")]
        settings = ", ".join(f"{k}={v}" for k, v in (row.get("settings") or {}).items())
        rows.append([row["label"], _f(row["seconds"]), _f(row["samples_per_s"], "{:,.0f}"),
                     _f(row["mb_per_s"], "{:,.1f}"), _f(row["ratio_to_floor"]), faster,
                     str(row.get("processes") or 1), settings])
    v = r.get("verdict") or {}
    head = (f"{r['corpus']['files']:,} files ({c['samples']:,} samples x 3), {r['corpus']['bytes'] / 1e6:,.0f} MB; "
            f"shard limit {c['shard_mb']:g} MiB; best of {c['repeats']}; page cache: {', '.join(r['cache_modes'])}; "
            f"{c.get('workers') or 'default'} processes for every system and the floor (x floor divides by "
            f"'{r.get('floor_system', 'floor')}').")
    verdict = ""
    if v:
        verdict = (f"\n\ndatapipe.pack: **{v['ratio_to_floor']:.2f}x** the floor (target <= {v['target_ratio']}x); "
                   f"faster than every peer: **{'yes' if v['faster_than_every_peer'] else 'no'}**.")
    table = _table(["system", "seconds", "samples/s", "MB/s", "x floor", "faster than every peer", "processes",
                    "settings"], rows)
    return head + "\n\n" + table + verdict


def read_md(r: dict[str, Any]) -> str:
    rows = []
    for name, e in r["systems"].items():
        if "error" in e:
            rows.append([name, "failed: " + e["error"][:80]] + [""] * 6)
            continue
        q = e.get("quality", {})
        rows.append([name, _f(e["warm"]["samples_per_s"], "{:,.0f}"), _f(e["cold"]["samples_per_s"], "{:,.0f}"),
                     _f(e["cold"]["MB_per_s"], "{:,.0f}"), _f(e["cold"]["first_sample_s"], "{:.3f}"),
                     _f(e["warm"]["first_sample_s"], "{:.3f}"), _f(q.get("mean_shards_per_batch"), "{:.1f}"),
                     _f(q.get("position_correlation"), "{:.3f}")])
    fl = r.get("floor", {})
    if fl:
        rows.append(["floor: sequential read of the shards", "", "", _f(fl["cold"]["payload_MB_per_s"], "{:,.0f}"),
                     "", "", "", ""])
    c = r["config"]
    lines = [f"{r['samples']:,} samples, {r['payload_MB']:,.0f} MB of payload, one process, shuffled; datapipe window "
             f"{c['window']} shards; batch {c['batch_size']} for the quality figures.", "",
             _table(["system", "warm samples/s", "cold samples/s", "cold MB/s", "first sample cold (s)",
                     "first sample warm (s)", "shards per batch", "position correlation"], rows), ""]
    if "datapipe_warm_over_litdata" in r:
        lines.append(f"datapipe warm / LitData warm: **{r['datapipe_warm_over_litdata']:.2f}x** (target >= 2x); "
                     f"per CPU-second {r.get('datapipe_warm_over_litdata_per_cpu_s', 0):.2f}x.")
    if "datapipe_cold_over_floor_cold" in r:
        lines.append(f"datapipe cold / sequential-read floor: **{r['datapipe_cold_over_floor_cold']:.2f}** "
                     "(target >= 0.8).")
    p = r.get("plan")
    if p:
        lines.append(f"An epoch plan for {p['samples']:.0e} samples in {p['shards']:.0e} shards: "
                     f"{p['seconds']:.3f} s, {p['peak_MB']:.0f} MB peak (target <= 2 s, <= 100 MB).")
    return "\n".join(lines)


def _mb(x: Any) -> str:
    return _f(x, "{:,.0f}")


def _fmt_setting(setting: dict[str, Any]) -> str:
    parts = []
    for k, v in setting.items():
        if k in ("shard_bytes", "chunk_bytes", "size_limit", "maxsize", "prefetch_bytes") \
                and isinstance(v, (int, float)):
            v = f"{v / 2**20:g} MiB" if v >= 1 << 20 and v % (1 << 20) == 0 else f"{v:g}"
        parts.append(f"{k}={v}")
    return ", ".join(parts)


def _mode_cell(e: dict[str, Any], mode: str, key: str = "samples_per_s") -> str:
    x = e.get(mode)
    if x is None:
        return "—"
    if "unavailable" in x:
        return "n/a"
    if "error" in x:
        return "error"
    return _mb(x.get(key))


def _lit(c: dict[str, Any], mode: str) -> tuple[float | None, str]:
    got = [(x[mode]["samples_per_s"], name) for name in ("litdata", "litdata@default")
           if "samples_per_s" in (x := c["systems"].get(name, {})).get(mode, {})]
    return max(got) if got else (None, "")


def _ratio(ours: dict[str, Any] | None, lit: float | None) -> str:
    v = (ours or {}).get("samples_per_s")
    return "—" if v is None or not lit else f"{v / lit:.2f}x"


def _n(x: Any) -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x:,.0f}"


def _s(x: Any) -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x:.3f}"


def _x(x: Any) -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x:.2f}x"


#: the columns of a cell's table by mode: (heading, figure key, format)
_MODE_COLUMNS: list[tuple[str, str, Any]] = [
    ("(a) first epoch, new object", "first_epoch", _n), ("first sample s", "first_sample_s", _s),
    ("2nd epoch", "second_epoch", _n), ("(a) / 2nd", "first_over_second", _x),
    ("(c) 1 proc steady", "steady", _n),
    ("(b) non-persistent, each epoch", "nonpersistent_epochs", None),
    ("(b) first batch s", "first_batch_s", _s),
    ("new worker: first batch s after its start", "worker_first_batch_s", _s),
    ("(c) persistent steady", "persistent_steady", _n), ("(b) slowest / (c)", "nonpersistent_over_persistent", _x),
]


def loader_modes_md(name: str, cell: dict[str, Any]) -> str:
    """One cell's samples/s by mode, every system, and datapipe / LitData in each mode:
    (a) the first epoch of a new dataset object, (b) every epoch with non-persistent
    workers, (c) the steady state, in one process and with persistent workers. Columns no
    system has a figure for are left out."""
    m = cell.get("modes") or {}
    figs: dict[str, dict[str, Any]] = m.get("systems", {})
    if "shard_bytes" in cell:
        title = (f"{name}: {cell['samples']:,} samples x {cell['mean_bytes'] / 1024:g} KiB, "
                 f"{cell['shard_bytes'] / 2**20:g} MiB shards; samples/s by mode")
    else:
        title = f"{name}: {cell['samples']:,} samples x {cell['mean_bytes'] / 1024:g} KiB; samples/s by mode"
    rows: list[list[str]] = []
    for sys_name in sorted(figs, key=lambda n: (n != "datapipe", n)):
        f = figs[sys_name]
        row = [sys_name]
        for _, key, fmt in _MODE_COLUMNS:
            v = f.get(key)
            row.append(" / ".join(_n(x) for x in v) if fmt is None and v else "—" if fmt is None else fmt(v))
        rows.append(row)
        if "batched_first_epoch" in f:
            rows.append([f"{sys_name} batched", _n(f["batched_first_epoch"]), "—", "—", "—",
                         _n(f.get("batched_steady"))] + ["—"] * (len(_MODE_COLUMNS) - 5))
    ratios = m.get("datapipe_over_litdata", {})
    if ratios:
        where = {"first_epoch": 1, "steady": 5, "nonpersistent_epochs": 6, "persistent_steady": 9}
        row = ["datapipe / LitData"] + ["—"] * len(_MODE_COLUMNS)
        for key, col in where.items():
            r = ratios.get("nonpersistent_slowest" if key == "nonpersistent_epochs" else key)
            if r:
                row[col] = f"**{r['ratio']:.2f}x** ({r['litdata_variant']}" + \
                           (", slowest epochs)" if key == "nonpersistent_epochs" else ")")
        rows.append(row)
    keep = [0] + [i for i in range(1, len(_MODE_COLUMNS) + 1) if any(r[i] != "—" for r in rows)]
    head = ["system"] + [h for h, _, _ in _MODE_COLUMNS]
    return title + "\n\n" + _table([head[i] for i in keep], [[r[i] for i in keep] for r in rows])


def loader_startup_md(startup: dict[str, Any]) -> str:
    """The start-up part: a large dataset's first sample and first batches, and the small
    job at every system's defaults."""
    lines: list[str] = []
    ix = startup.get("index", {})
    if "shards" in ix:
        ds = ix.get("dataset", {})
        lines += [f"Start-up: a new dataset of {ix['shards']:,} shards and {ix['samples']:,} samples "
                  f"({ds.get('bytes', 0) / 1e9:,.1f} GB on local disk), each run in a fresh interpreter (torch and "
                  f"datapipe imported first, untimed) after an untimed warm-up run; {ix['repeats']} runs; seconds. "
                  f"Loader: StreamingDataLoader(batch_size={ix['batch_size']}, num_workers={ix['workers']}, "
                  "persistent_workers=False), two passes, each taken to every worker's first batch.", ""]
    if "error" in ix:
        lines += [f"start-up failed: {ix['error']}", ""]
    elif "first_sample_s" in ix:
        rows = []
        for label, key in (("floor: one read of the index (Parquet decoded by pyarrow) and of one shard", "floor_s"),
                           ("of which the index", "index_read_floor_s"),
                           ("StreamingDataset(url) to its first sample", "first_sample_s"),
                           ("of which StreamingDataset(url) itself", "open_s"),
                           ("a new dataset through the loader to its first batch", "first_batch_s"),
                           ("its second pass (new workers): iter() to the first batch", "second_pass_first_batch_s"),
                           ("a new worker's start after iter() (slowest worker)", "worker_start_s"),
                           ("a new worker's first batch after its start (slowest worker, both passes)",
                            "worker_first_batch_s")):
            s = ix.get(key, {})
            rows.append([label, _s(s.get("best")), _s(s.get("median")), _s(s.get("slowest"))])
        lines += [_table(["figure", "best", "median", "slowest"], rows), ""]
    small = startup.get("small_defaults", {})
    if "error" in small:
        lines += [f"small job at defaults failed: {small['error']}", ""]
    elif small.get("modes"):
        lines += [loader_modes_md("A small job, one process, at each system's defaults", small), ""]
        rows = [[name, _fmt_setting(e.get("format_settings", {})) or "its defaults", e.get("loader", ""),
                 _fmt_setting(e.get("one_process", {}).get("settings", {})), e.get("error", "")]
                for name, e in small["systems"].items()]
        lines += [f"@default: the system's defaults (format and dataset); without it: our settings (datapipe's "
                  f"default shard size, {small.get('datapipe_shard_bytes', 0) / 2**20:g} MiB, shuffled).", "",
                  _table(["system", "format", "dataset", "settings seen", "error"], rows), ""]
    return "\n".join(lines)


def loader_md(r: dict[str, Any]) -> str:
    """The issue-12 sweep (one process, batched, DataLoader; ratios to LitData), every
    system at both settings, each peer's settings, the JPEG map, and the target checks."""
    c = r["config"]
    lines = [f"Shuffled warm reads of raw bytes (page cache warmed first), {c['epochs']} epochs per measurement; "
             f"DataLoaders with num_workers={c['workers']}, batch_size={c['batch_size']}; each measurement in a fresh "
             "interpreter that imports torch and the system first (untimed) and builds a new dataset object; every "
             f"epoch's keys checked (each sample exactly once). The whole run took {r.get('seconds', 0):,.0f} s.",
             "",
             "Modes, the same for every system: **(a)** the first epoch of a new dataset object, from its "
             "construction on; **(b)** every epoch through a DataLoader with persistent_workers=False (PyTorch's "
             "default: each epoch starts new worker processes with new copies of the dataset); **(c)** the steady "
             "state: the best epoch after the first, in one process and with persistent_workers=True (datapipe's "
             "default). Each figure below says which mode it is.", ""]
    cells = r.get("cells", {})
    if cells:
        rows = []
        for cell in cells.values():
            dp = cell["systems"].get("datapipe", {})
            lit1, w1 = _lit(cell, "one_process")
            litd, wd = _lit(cell, "dataloader")
            mos = cell["systems"].get("mosaicml", {})
            wds = cell["systems"].get("webdataset", {})
            size = f"{cell['samples']:,} x {cell['mean_bytes'] / 1024:g} KiB, {cell['shard_bytes'] / 2**20:g} MiB"
            lit_d = _mb(litd) + (" (default)" if "default" in wd else "")
            fl = cell.get("read_floor", {})
            rows.append([size, _f(fl.get("samples_per_s"), "{:,.0f}"),
                         _mode_cell(dp, "one_process"), _mb(lit1) + (" (default)" if "default" in w1 else ""),
                         _ratio(dp.get("one_process"), lit1), _mode_cell(dp, "batched"),
                         _ratio(dp.get("batched"), lit1), _mode_cell(dp, "dataloader"),
                         _mode_cell(dp, "dataloader", "MB_per_s"), lit_d,
                         _ratio(dp.get("dataloader"), litd), _mode_cell(mos, "dataloader"),
                         _mode_cell(wds, "dataloader")])
        lines += ["(c) steady state, samples/s; LitData is the faster of its two settings (ours, or its default "
                  "where marked); x = datapipe / that LitData figure (batched: / LitData one process). Read floor: "
                  "every shard file of datapipe's format read once from the page cache into buffers touched "
                  "beforehand, one thread per core, nothing parsed or checked (best pass): the fastest rate at "
                  "which epochs that each read every shard once can follow one another. One epoch can beat it by "
                  "what was read ahead during the epoch before (at most prefetch_bytes), never epoch after epoch.",
                  "",
                  _table(["samples x size, shard", "read floor", "datapipe 1 proc", "LitData 1 proc", "x",
                          "datapipe batched", "x",
                          "datapipe DataLoader", "MB/s", "LitData DataLoader", "x", "MosaicML DataLoader",
                          "WebDataset DataLoader"], rows), ""]
        lines += ["What users run, per cell: (a) first epochs, (b) non-persistent workers (each epoch listed), (c) "
                  "steady states; datapipe / LitData per mode (LitData the faster of its two settings; in (b) the "
                  "slowest epochs). The first sample and first batch count from the dataset's construction; a new "
                  "worker's first batch from the worker's start (its worker_init_fn), the slowest worker of any "
                  "epoch.", ""]
        for cid, cell in cells.items():
            if cell.get("modes"):
                lines += [loader_modes_md(cid, cell), ""]
        rows = []
        for cid, cell in cells.items():
            for name, e in cell["systems"].items():
                if "error" in e:
                    rows.append([cid, name, _fmt_setting(e["format_settings"]), "failed: " + e["error"][:80]]
                                + [""] * 10)
                    continue
                if "same_format_as" in e:
                    rows.append([cid, name, _fmt_setting(e["format_settings"]),
                                 f"the files of {e['same_format_as']}: measured there"] + [""] * 10)
                    continue
                mem = e.get("dataloader", {}).get("memory")
                peak = "—" if not mem else (f"{mem['main_peak_rss_MB']:,.0f} / "
                                            f"{max(mem['worker_peak_rss_MB'], default=0):,.0f}")
                fmt = _fmt_setting(e["format_settings"])
                rows.append([cid, name, fmt]
                            + [_mode_cell(e, m, k) for m in ("one_process", "dataloader")
                               for k in ("samples_per_s", "median_samples_per_s", "MB_per_s", "samples_per_cpu_s")]
                            + [_mode_cell(e, "dataloader_nonpersistent", k)
                               for k in ("median_samples_per_s", "slowest_samples_per_s")]
                            + [peak])
        lines += ["Every system at our settings (the cell's shard size) and at its own default shard size, each "
                  "read the same ways: (c) steady state in one process and with persistent workers (best epoch after "
                  "the first, median, payload MB/s, samples per CPU-second), (b) non-persistent workers (median and "
                  "slowest epoch):", "",
                  _table(["cell", "system", "format", "(c) 1 proc samples/s", "median", "MB/s", "per CPU-s",
                          "(c) persistent DataLoader samples/s", "median", "MB/s", "per CPU-s",
                          "(b) non-persistent median", "slowest", "peak RSS MB main / worker"], rows),
                  ""]
        errors = [f"- {cid} {name} {m}: {e[m].get('error') or e[m].get('unavailable')}"
                  for cid, cell in cells.items() for name, e in cell["systems"].items()
                  for m in ("one_process", "batched", "dataloader", "dataloader_nonpersistent")
                  if isinstance(e.get(m), dict) and ("error" in e[m] or "unavailable" in e[m])]
        if errors:
            lines += ["Errors and unavailable modes:", ""] + [x[:300] for x in errors] + [""]
        settings = []
        first = next(iter(cells.values()))
        for name, e in first["systems"].items():
            loader = "; ".join(f"{m}: " + _fmt_setting(e[m].get("settings", {}))
                               for m in ("one_process", "batched", "dataloader", "dataloader_nonpersistent")
                               if isinstance(e.get(m), dict) and "settings" in e[m])
            settings.append([name, _fmt_setting(e["format_settings"]) + (" (the cell's shard size)"
                                                                         if "@" not in name else ""), loader])
        lines += ["Settings (format as written for the first cell; the loaders' as passed):", "",
                  _table(["system", "format", "loader"], settings), ""]
        lines += [f"- {name} defaults: {d['source']}" for name, d in r.get("peer_defaults", {}).items()]
        lines.append(f"- datapipe.pack's own default: {r.get('datapipe_default_shard_bytes', 0) / 2**20:g} MiB "
                     "shards (the sweep packs datapipe at each cell's shard size)")
        lines.append("")
    m = r.get("map")
    if m:
        rows = []
        for name, e in m["systems"].items():
            w = [e.get(f"workers_{k}", {}) for k in (1, 2)] + [e.get("threads_2", {})]
            rows.append([name] + [(x.get("error", "")[:60] or ("n/a" if "unavailable" in x else "")
                                   or _mb(x.get("samples_per_s"))) for x in w]
                        + [_f(e.get("two_over_one"), "{:.2f}x")])
        lines += [f"CPU-heavy map: {m['images']:,} JPEGs {m['side']}x{m['side']} (quality 90), {m['map']} to "
                  f"{m['out_side']}x{m['out_side']}; batch {m['batch_size']}; shards/chunks of "
                  f"{m['shard_bytes'] / 2**20:g} MiB for both.", "",
                  _table(["system", "1 worker images/s", "2 workers images/s",
                          "no workers, 2 map threads images/s", "2 workers / 1"], rows), ""]
    if r.get("startup"):
        lines += [loader_startup_md(r["startup"]), ""]
    targets = r.get("targets", [])
    for issue in sorted({t.get("issue", 12) for t in targets}):
        lines += [f"Targets of issue {issue} (this run):", ""]
        lines += [f"- **{t['status']}** {t['target']}: " + "; ".join(t["figures"])
                  for t in targets if t.get("issue", 12) == issue]
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def gpu_md(r: dict[str, Any]) -> str:
    """Batches into device memory by worker count, against plain pinned copies."""
    fl = r["floor"]
    rows = [[w, "failed: " + str(x.get("error"))[:60], "", "", ""] if "error" in x else
            [w, _f(x["GB_per_s"]), _mb(x["samples_per_s"]), _f(x.get("of_floor")), x.get("path", "")]
            for w, x in r["runs"].items()]
    c = r["config"]
    lines = [f"{r['samples']:,} samples x {c['mean_bytes'] / 1024:g} KiB ({r['payload_MB']:,.0f} MB) on "
             f"{r.get('device_name', r['device'])}, {r['cpus']} CPUs; "
             f"StreamingDataLoader(batch_size={c['batch_size']}, pin_memory=True), each batch's byte fields copied "
             f"to the device; best of {c['epochs']} epochs. Floor: plain pinned host-to-device copies of "
             f"{fl['piece_bytes'] / 2**20:g} MiB, {fl['GB_per_s']:.2f} GB/s.", "",
             _table(["workers", "GB/s into device memory", "samples/s", "of floor", "path"], rows)]
    t = r.get("target")
    if t:
        ratio = "—" if t["eight_over_one"] is None else f"{t['eight_over_one']:.2f}x"
        lines += ["", f"- **{t['status']}** 8 workers >= 3 GB/s and >= 3x one worker: "
                      f"{t['eight_workers_GB_per_s']:.2f} GB/s, {ratio} one worker"]
    return "\n".join(lines)


def _peer_cold_mb(peers: dict[str, Any], name: str, frac: str) -> str:
    p = peers.get(name, {}).get(frac)
    if not p:
        return "—"
    if "error" in p:
        return "refused"
    return _f(p["steady_cold_bytes_per_epoch"] / 1e6, "{:,.1f}")


def cache_md(r: dict[str, Any]) -> str:
    c = r["config"]
    rows = []
    for frac, row in r["policies"].items():
        cl, lru = row["datapipe_clairvoyant"], row["datapipe_lru"]
        peers = r.get("peers", {})
        rows.append([f"{float(frac):.0%}", _f(row["belady_optimum"]["hit_rate"], "{:.3f}"),
                     _f(cl["hit_rate"], "{:.3f}"), _f(cl["fraction_of_belady"], "{:.0%}"),
                     _f(lru["hit_rate"], "{:.3f}"), _f(cl["steady_cold_bytes_per_epoch"] / 1e6, "{:,.1f}"),
                     _f(cl["cold_bytes_target"] / 1e6, "{:,.1f}"),
                     _f(lru["steady_cold_bytes_per_epoch"] / 1e6, "{:,.1f}"),
                     _peer_cold_mb(peers, "mosaicml_streaming", frac), _peer_cold_mb(peers, "litdata", frac)])
    w = r.get("warm_hit_throughput", {})
    lines = [f"{c['objects']} objects x {c['object_bytes'] / 2**20:g} MiB on moto S3 (loopback), {c['epochs']} epochs, "
             "a fresh shuffle each; steady = mean over epochs after the first.", "",
             _table(["cache size", "Belady hit rate", "clairvoyant hit rate", "of Belady", "LRU hit rate",
                     "clairvoyant MB/epoch from cold", "target", "LRU", "MosaicML cache_limit",
                     "LitData max_cache_size"], rows)]
    if w:
        lines += ["", f"Warm hit vs a direct read of the same local file: **{w.get('warm_hit_vs_direct', 0):.2f}** "
                      f"(target >= 0.9); with checksum verification {w.get('verified_vs_direct', 0):.2f}."]
    return "\n".join(lines)


def checkpoint_md(r: dict[str, Any]) -> str:
    rows = []
    for _layers, e in r.items():
        if "error" in e:
            rows.append([_layers, "failed: " + e["error"][:80]] + [""] * 7)
            continue
        fl, dp = e["floors"], e["datapipe"]
        gb = fl["bytes"] / 1e9
        ts, dcp = e.get("torch_save", {}), e.get("dcp_async_save", {})
        rows.append([f"{gb:.2f}", "floors", f"memcpy {fl['memcpy_s']:.3f}", f"fresh clone {fl['clone_fresh_s']:.3f}",
                     f"disk {fl['disk_s']:.3f}", "", "", ""])
        rows.append([f"{gb:.2f}", "datapipe", _f(dp.get("first_stall_s"), "{:.3f}"),
                     _f(dp.get("steady_stall_s"), "{:.3f}"), _f(dp.get("steady_total_s"), "{:.3f}"),
                     _f(dp.get("steady_stall_vs_memcpy")),
                     _f(dp.get("first_stall_vs_clone")), _f(dp.get("steady_total_vs_disk"))])
        if dp.get("prepared_first_stall_s") is not None:
            rows.append([f"{gb:.2f}", "datapipe, prepared ahead", _f(dp["prepared_first_stall_s"], "{:.3f}"),
                         "", "", "", "", ""])
        for name, x in (("torch.save + fsync", ts), ("DCP async_save", dcp)):
            if x:
                rows.append([f"{gb:.2f}", name, _f(x.get("first_stall_s"), "{:.3f}"),
                             _f(x.get("steady_stall_s"), "{:.3f}"), _f(x.get("steady_total_s"), "{:.3f}"),
                             _f(x.get("steady_stall_s", 0) / fl["memcpy_s"]),
                             _f(x.get("first_stall_s", 0) / fl["clone_fresh_s"]),
                             _f(x.get("steady_total_s", 0) / fl["disk_s"])])
        t = e.get("training")
        if t and t.get("ratio") is not None:
            persist = t.get("persist_s") or []
            took = f"{min(persist, default=0):.1f}-{max(persist, default=0):.1f}"
            rows.append([f"{gb:.2f}", f"training step while a save persists / without: **{t['ratio']:.2f}x** "
                         f"(the save then took {took} s to be durable)", "", "", "", "", "", ""])
    return ("Model + Adam state of N x Linear(1024, 1024); seconds; "
            "'stall' is the time save() blocks the training loop.\n\n"
            + _table(["state GB", "system", "first stall", "steady stall", "steady total", "stall / memcpy",
                      "first stall / fresh clone", "total / disk"], rows)
            + "\n\nTargets: steady stall <= 1.5x memcpy; first stall <= 1.0x a fresh clone (<= 0.3 s prepared); "
              "total <= 1.2x disk; step time while persisting <= 1.1x.")


def report_markdown(report: dict[str, Any], images: list[str]) -> str:
    m = report["machine"]
    out = ["# datapipe benchmark report", "",
           f"`{report['command']}` — {report['started']}; {m['cpus']} CPUs ({m['cpu']}), {m['memory_GiB']} GiB, "
           f"Python {m['python']}; load average at start {m['loadavg_start'][0]:.1f}, at end "
           f"{m.get('loadavg_end', [float('nan')])[0]:.1f}. Seconds per part: {report['seconds']}.", ""]
    for part, fn in (("pack", pack_md), ("read", read_md), ("loader", loader_md), ("gpu", gpu_md),
                     ("cache", cache_md), ("checkpoint", checkpoint_md)):
        if part in report:
            r = report[part]
            out += [f"## {part}", "", f"{part} benchmark failed: {r['error']}" if "error" in r else fn(r), ""]
            out += [f"![{img}]({img})" for img in images if img.startswith(part)] + [""]
    return "\n".join(out)
