"""Checkpoint stall and total time: datapipe vs torch.save+fsync vs DCP async_save,
against the floors (memcpy into preallocated buffers, a fresh clone, the disk's fsync'd
sequential write of the same bytes), plus training step time while a save persists.

    python -m benchmarks.bench_checkpoint            # ~0.75 GiB model + Adam state
    python -m benchmarks.bench_checkpoint --quick    # small state, seconds
    python -m benchmarks.bench_checkpoint --tiers --busy-mb 64 --rss-mb 50 --rss-saves 30
        # local tier: save() to durable with a busy vs an idle trainer, step time with
        # saves vs without on a busy host, resident memory over many saves (issue 15)
    from benchmarks.bench_checkpoint import run; run({"layers": 8})   # -> dict of figures
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch

from datapipe.checkpoint import CheckpointWriter, Tier

DEFAULTS: dict[str, Any] = {
    "layers": 64, "width": 1024, "saves": 3, "dir": None, "batch": 8,
    "train_steps": 8, "train_rounds": 3, "dcp": True, "torch_save": True, "compression": None,
}
QUICK = {"layers": 8, "width": 512, "saves": 2, "train_steps": 4}


def _state(layers: int, width: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    _step(model, opt, 8, width)
    return model, opt


def _step(model, opt, batch: int, width: int) -> None:
    model(torch.randn(batch, width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _tensors(state: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return out


def _memcpy_s(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    """Floor of a steady-state stall: one copy into preallocated, touched buffers."""
    t0 = time.perf_counter()
    for d, s in zip(dst, src):
        d.copy_(s)
    return time.perf_counter() - t0


def _trim_heap() -> None:
    """Give freed heap memory back to the OS, so that the next allocation is really fresh
    (glibc would otherwise hand out pages that earlier temporaries already touched)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _clone_s(src: list[torch.Tensor]) -> float:
    """Floor of a first stall: a fresh clone, page faults included."""
    _trim_heap()
    t0 = time.perf_counter()
    clones = [t.clone() for t in src]
    dt = time.perf_counter() - t0
    del clones
    return dt


def _disk_s(view: memoryview, path: str) -> float:
    """Floor of the total: the same bytes written sequentially to one file and fsync'd."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(view)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def bench_datapipe(state: Any, work: str, saves: int, compression: str | None) -> dict[str, Any]:
    """Each steady save is measured next to its floors (memcpy just before, disk write
    just after), so that a ratio compares two things seen under the same machine load."""
    ts = _tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    dst = [t.clone() for t in ts]
    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.fill_(1)
    view = memoryview(flat.numpy())
    floor_path = os.path.join(work, "floor.bin")
    url = os.path.join(work, "datapipe")
    w = CheckpointWriter(url, keep_last=2, compression=compression)
    clone_s = _clone_s(ts)
    _trim_heap()
    h = w.save(0, state)
    first_stall = h.metrics["stall_s"]
    first_total = h.wait()["total_s"]
    pairs = []
    for i in range(1, saves + 1):
        mc = _memcpy_s(dst, ts)
        h = w.save(i, state)
        stall = h.metrics["stall_s"]
        m = h.wait()
        dk = _disk_s(view, floor_path)
        pairs.append({"memcpy_s": mc, "stall_s": stall, "total_s": m["total_s"], "disk_s": dk,
                      "stall_vs_memcpy": stall / mc, "total_vs_disk": m["total_s"] / dk,
                      "write_gbps": m["write_gbps"], "staging_gbps": m["staging_gbps"],
                      "waited_s": m["waited_s"]})
    w.close()
    shutil.rmtree(url, ignore_errors=True)
    del dst, flat, view
    # a new writer told the layout ahead (meta tensors), prepared off the training path
    layout = [torch.empty_like(t, device="meta") for t in ts]  # shapes and dtypes, no memory
    w = CheckpointWriter(url, keep_last=2, compression=compression)
    t0 = time.perf_counter()
    w.prepare(_as_layout(state, iter(layout)), block=True)
    prepare_s = time.perf_counter() - t0
    h = w.save(0, state)
    prepared_stall = h.metrics["stall_s"]
    prepared_total = h.wait()["total_s"]
    w.close()
    shutil.rmtree(url, ignore_errors=True)

    def med(k: str) -> float:
        return statistics.median(p[k] for p in pairs)

    return {
        "bytes": nbytes, "tensors": len(ts),
        "clone_fresh_s": clone_s, "memcpy_s": med("memcpy_s"), "disk_s": med("disk_s"),
        "first_stall_s": first_stall, "first_total_s": first_total,
        "first_stall_vs_clone": first_stall / clone_s,
        "steady_stall_s": med("stall_s"), "steady_total_s": med("total_s"),
        "steady_stall_vs_memcpy": med("stall_vs_memcpy"), "steady_total_vs_disk": med("total_vs_disk"),
        "prepare_s": prepare_s, "prepared_first_stall_s": prepared_stall,
        "prepared_first_total_s": prepared_total, "pairs": pairs,
    }


def _as_layout(state: Any, it) -> Any:
    """The state's structure with each tensor replaced by the next meta tensor."""
    if isinstance(state, torch.Tensor):
        return next(it)
    if isinstance(state, dict):
        return {k: _as_layout(v, it) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_as_layout(v, it) for v in state)
    return state


def bench_torch_save(state: Any, work: str, saves: int) -> dict[str, Any]:
    runs = []
    for i in range(saves):
        path = os.path.join(work, f"torch-{i}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        runs.append(time.perf_counter() - t0)
        os.unlink(path)
    return {"first_stall_s": runs[0], "first_total_s": runs[0],
            "steady_stall_s": statistics.median(runs[1:] or runs),
            "steady_total_s": statistics.median(runs[1:] or runs), "runs": runs}


def bench_dcp(state: Any, work: str, saves: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        for i in range(saves):
            path = os.path.join(work, f"dcp-{i}")
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=path)
            stall = time.perf_counter() - t0
            fut.result()
            runs.append({"stall_s": stall, "total_s": time.perf_counter() - t0})
            shutil.rmtree(path, ignore_errors=True)
    steady = runs[1:] or runs
    return {"first_stall_s": runs[0]["stall_s"], "first_total_s": runs[0]["total_s"],
            "steady_stall_s": statistics.median(r["stall_s"] for r in steady),
            "steady_total_s": statistics.median(r["total_s"] for r in steady), "runs": runs,
            "process_group": False}


def bench_training(model, opt, state_fn, work: str, batch: int, width: int, steps: int,
                   rounds: int = 3) -> dict[str, Any]:
    """Step time without a save and while a datapipe save persists (its stall excluded;
    every step that started before the save was durable), in alternating windows so that
    both see the same machine load; medians."""
    url = os.path.join(work, "train")
    w = CheckpointWriter(url, keep_last=1)
    w.save(0, state_fn()).wait()  # warm the staging buffer: measure the steady state
    _step(model, opt, batch, width)
    base: list[float] = []
    during: list[float] = []
    persist: list[float] = []
    for r in range(rounds):
        for _ in range(steps):
            t0 = time.perf_counter()
            _step(model, opt, batch, width)
            base.append(time.perf_counter() - t0)
        h = w.save(r + 1, state_fn())
        while not h.done():  # every step that started while the save persisted
            t0 = time.perf_counter()
            _step(model, opt, batch, width)
            during.append(time.perf_counter() - t0)
        persist.append(h.wait()["total_s"])
    w.close()  # (w.background stays readable)
    shutil.rmtree(url, ignore_errors=True)
    b = statistics.median(base)
    d = statistics.median(during) if during else float("nan")
    return {"step_s": b, "step_during_save_s": d, "ratio": d / b, "steps_overlapped": len(during),
            "persist_s": persist, "base_steps": base, "during_steps": during, "background": w.background}


def _spin(stop: Any) -> None:
    """A busy core: pure Python arithmetic until told to stop."""
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def _python_step(n: int = 20_000) -> int:
    """One 'training step' that holds the GIL the whole time, as a Python-heavy loop does."""
    return sum(i * i for i in range(n))


def _flat_state(mb: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(mb << 18, generator=g), "b": torch.randn(1 << 16, generator=g), "step": 0}


def bench_busy_trainer(work: str, mb: int, saves: int, background: str = "auto",
                       nice: int | None = None) -> dict[str, Any]:
    """Save() to durable in a node-local tier with an idle trainer (the caller waits), then
    with a trainer that keeps both cores busy: this thread runs GIL-holding Python steps
    and calls save() every few steps, and spinning processes take the other cores. Step
    time is compared between steps that overlap a save in flight and steps that do not
    (the save's own stall is reported on its own)."""
    import multiprocessing as mp

    state = _flat_state(mb)
    url = os.path.join(work, "busy-local")
    niced = {} if nice is None else {"nice": nice}  # None: the library's default
    w = CheckpointWriter(tiers=[Tier(url, every=1, keep_last=1, node_local=True)], background=background, **niced)
    w.save(0, state).wait()  # the staging buffer is taken once: measure the steady state
    idle = [w.save(i, state).wait()["tiers"][url]["durable_s"] for i in range(1, saves + 1)]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(max(1, (os.cpu_count() or 2) - 1))]
    for p in spinners:
        p.start()
    time.sleep(0.5)  # the spinners are running
    base: list[float] = []

    def no_save_window(steps: int = 100) -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            _python_step()
            base.append(time.perf_counter() - t0)

    try:
        no_save_window(30)
        base.clear()  # warm-up: the first steps run while the spinners start
        no_save_window()
        during: list[float] = []
        busy: list[float] = []
        stalls: list[float] = []
        step = saves + 1
        for _ in range(saves):
            h = w.save(step, state)
            stalls.append(h.metrics["stall_s"])
            step += 1
            while not h.done():
                t0 = time.perf_counter()
                _python_step()
                during.append(time.perf_counter() - t0)
            busy.append(h.wait()["tiers"][url]["durable_s"])
        no_save_window()  # steps without a save on both sides of the saves: the load moves
    finally:
        stop.set()
        for p in spinners:
            p.join()
        w.close()
        shutil.rmtree(url, ignore_errors=True)
    b, d = statistics.median(base), statistics.median(during) if during else float("nan")
    return {"bytes": mb << 20, "idle_durable_s": statistics.median(idle), "busy_durable_s": statistics.median(busy),
            "busy_vs_idle": statistics.median(busy) / statistics.median(idle), "step_s": b,
            "step_during_save_s": d, "step_ratio": d / b, "steps_overlapped": len(during),
            "stall_s": statistics.median(stalls), "spinners": len(spinners), "idle_runs": idle, "busy_runs": busy}


def _rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_rss(work: str, mb: int, saves: int, background: str = "auto") -> dict[str, Any]:
    """Resident memory over ``saves`` saves in a row of an ``mb`` MiB state to a node-local
    tier: the trainer's (this process) and, where a writer process runs (the default), the writer
    process's (with threads, the writer is the trainer's process). Growth is measured from the 5th save (the staging
    buffer and the I/O threads' buffers exist by then) to the largest value after it."""
    state = _flat_state(mb)
    url = os.path.join(work, "rss-local")
    rss, wrss = [], []
    with CheckpointWriter(tiers=[Tier(url, every=1, keep_last=1, node_local=True)], background=background) as w:
        for i in range(saves):
            state["step"] = i
            w.save(i, state).wait()
            rss.append(_rss_bytes())
            if w._process is not None:
                wrss.append(_rss_bytes(w._process.pid))
    shutil.rmtree(url, ignore_errors=True)

    def growth(xs: list[int]) -> dict[str, Any]:
        ref = xs[min(4, len(xs) - 1)]
        return {"ref": ref, "max_after": max(xs[4:] or xs), "growth": max(xs[4:] or xs) / ref - 1.0, "series": xs}

    return {"state_bytes": mb << 20, "saves": saves, "background": background, "trainer": growth(rss),
            "writer": growth(wrss) if wrss else None}


def run_tiers(cfg: dict[str, Any]) -> dict[str, Any]:
    """The issue-15 rows on their own: busy vs idle trainer, and resident memory."""
    work = tempfile.mkdtemp(prefix="bench-ckpt-tiers-", dir=cfg.get("dir"))
    try:
        out: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
        bg = cfg.get("background") or "auto"
        nice = cfg.get("nice")
        out["background"], out["nice"] = bg, "default" if nice is None else nice
        out["busy"] = bench_busy_trainer(work, cfg.get("busy_mb") or 64, cfg.get("saves") or 3, bg, nice)
        out["rss"] = bench_rss(work, cfg.get("rss_mb") or 200, cfg.get("rss_saves") or 100, bg)
        out["loadavg_after"] = os.getloadavg()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def tiers_table(out: dict[str, Any]) -> str:
    b, r = out["busy"], out["rss"]

    def mem(who: str, g: dict[str, Any]) -> str:
        return (f"{who} {g['ref'] / 2**20:.0f} MiB at save 5, at most {g['max_after'] / 2**20:.0f} MiB after: "
                f"{g['growth'] * 100:+.1f}% (within 5%: {'met' if abs(g['growth']) <= 0.05 else 'MISSED'})")

    writer = ("the writer is threads of the trainer's process" if r["writer"] is None
              else mem("writer process", r["writer"]))
    return "\n".join([
        f"background work: {out['background']}, nice {out['nice']}",
        f"machine: {out['cpus']} cpus, load average {out['loadavg_before'][0]:.1f} before, "
        f"{out['loadavg_after'][0]:.1f} after (other processes share these cores)",
        f"local tier, {b['bytes'] / 2**20:.0f} MiB state: save() to durable {b['idle_durable_s']:.3f} s with an idle "
        f"trainer, {b['busy_durable_s']:.3f} s with a busy one (1 GIL-holding thread + {b['spinners']} spinning "
        f"process(es)): {b['busy_vs_idle']:.2f}x (target <= 2: {'met' if b['busy_vs_idle'] <= 2 else 'MISSED'})",
        f"busy trainer step {b['step_s'] * 1e3:.2f} ms; while a save persists {b['step_during_save_s'] * 1e3:.2f} ms "
        f"({b['step_ratio']:.2f}x over {b['steps_overlapped']} steps; target <= 1.1: "
        f"{'met' if b['step_ratio'] <= 1.1 else 'MISSED'}); stall per save {b['stall_s'] * 1e3:.1f} ms",
        f"resident memory over {r['saves']} saves of {r['state_bytes'] / 2**20:.0f} MiB: "
        + mem("trainer", r["trainer"]) + "; " + writer,
    ])


def run(config: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = dict(DEFAULTS)
    if config and config.get("quick"):
        cfg.update(QUICK)
    cfg.update({k: v for k, v in (config or {}).items() if v is not None and k != "quick"})
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=cfg["dir"])
    try:
        model, opt = _state(cfg["layers"], cfg["width"])
        state_fn = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
        state = state_fn()
        out: dict[str, Any] = {"config": cfg, "torch_threads": torch.get_num_threads(),
                               "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
        out["datapipe"] = d = bench_datapipe(state, work, cfg["saves"], cfg["compression"])
        out["floors"] = {"bytes": d["bytes"], "tensors": d["tensors"], "memcpy_s": d["memcpy_s"],
                         "clone_fresh_s": d["clone_fresh_s"], "disk_s": d["disk_s"],
                         "disk_gbps": d["bytes"] / d["disk_s"] / 1e9}
        if cfg["torch_save"]:
            out["torch_save"] = bench_torch_save(state, work, cfg["saves"])
        if cfg["dcp"]:
            out["dcp_async_save"] = bench_dcp(state, work, cfg["saves"])
        out["training"] = bench_training(model, opt, state_fn, work, cfg["batch"], cfg["width"],
                                         cfg["train_steps"], cfg["train_rounds"])
        out["ratios"] = ratios(out)
        out["loadavg_after"] = os.getloadavg()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ratios(out: dict[str, Any]) -> dict[str, float]:
    d = out["datapipe"]
    return {
        "steady_stall_vs_memcpy": d["steady_stall_vs_memcpy"],
        "first_stall_vs_clone": d["first_stall_vs_clone"],
        "prepared_first_stall_s": d["prepared_first_stall_s"],
        "steady_total_vs_disk": d["steady_total_vs_disk"],
        "step_time_while_persisting": out["training"]["ratio"],
    }


TARGETS = {"steady_stall_vs_memcpy": 1.5, "first_stall_vs_clone": 1.0, "prepared_first_stall_s": 0.3,
           "steady_total_vs_disk": 1.2, "step_time_while_persisting": 1.1}


def table(out: dict[str, Any]) -> str:
    f = out["floors"]
    lines = [f"machine: {out['cpus']} cpus, load average {out['loadavg_before'][0]:.1f} before, "
             f"{out['loadavg_after'][0]:.1f} after (other processes share these cores)",
             f"state: {f['bytes'] / 2**30:.3f} GiB in {f['tensors']} tensors; "
             f"floors: memcpy {f['memcpy_s']:.3f} s, fresh clone {f['clone_fresh_s']:.3f} s, "
             f"disk {f['disk_s']:.3f} s ({f['disk_gbps']:.2f} GB/s) (medians)",
             f"{'method':<16}{'1st stall':>10}{'stall':>9}{'1st total':>10}{'total':>9}"
             f"{'stall/memcpy':>13}{'1st/clone':>10}{'total/disk':>11}"]
    for name in ("datapipe", "torch_save", "dcp_async_save"):
        r = out.get(name)
        if r is None:
            continue
        # datapipe: per-save ratios against floors measured next to each save (the
        # machine's load moves); the others: against the median floors
        sm = r.get("steady_stall_vs_memcpy", r["steady_stall_s"] / f["memcpy_s"])
        fc = r.get("first_stall_vs_clone", r["first_stall_s"] / f["clone_fresh_s"])
        td = r.get("steady_total_vs_disk", r["steady_total_s"] / f["disk_s"])
        lines.append(f"{name:<16}{r['first_stall_s']:>10.3f}{r['steady_stall_s']:>9.3f}"
                     f"{r['first_total_s']:>10.3f}{r['steady_total_s']:>9.3f}"
                     f"{sm:>13.2f}{fc:>10.2f}{td:>11.2f}")
    d, t = out["datapipe"], out["training"]
    lines.append(f"datapipe prepared ahead: prepare {d['prepare_s']:.3f} s off the path, "
                 f"first stall {d['prepared_first_stall_s']:.3f} s")
    lines.append(f"training step {t['step_s'] * 1e3:.1f} ms; while a save persists "
                 f"{t['step_during_save_s'] * 1e3:.1f} ms ({t['ratio']:.2f}x, {t['steps_overlapped']} steps); "
                 f"the save took {statistics.median(t['persist_s']):.2f} s to persist under training "
                 f"(writer background: {t['background']}, niced)")
    lines.append("targets: " + ", ".join(
        f"{k} {out['ratios'][k]:.2f} (<= {v}: {'met' if out['ratios'][k] <= v else 'MISSED'})"
        for k, v in TARGETS.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small state, a few seconds")
    p.add_argument("--layers", type=int, help="Linear layers (default 64: ~0.75 GiB with Adam)")
    p.add_argument("--width", type=int, help="features per layer (default 1024)")
    p.add_argument("--saves", type=int, help="saves per method (default 3; the first is cold)")
    p.add_argument("--dir", help="where to write (default: a temporary directory)")
    p.add_argument("--batch", type=int, help="training batch for the step-time rows (default 8)")
    p.add_argument("--train-rounds", type=int, help="alternating no-save/save windows (default 3)")
    p.add_argument("--compression", choices=["zstd"], help="datapipe chunk compression")
    p.add_argument("--no-dcp", dest="dcp", action="store_false", default=None)
    p.add_argument("--no-torch-save", dest="torch_save", action="store_false", default=None)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--tiers", action="store_true", help="only the local-tier rows: busy vs idle trainer, memory")
    p.add_argument("--busy-mb", type=int, help="state size for the busy/idle trainer rows (default 64 MiB)")
    p.add_argument("--rss-mb", type=int, help="state size for the memory row (default 200 MiB)")
    p.add_argument("--rss-saves", type=int, help="saves in a row for the memory row (default 100)")
    p.add_argument("--background", choices=["auto", "thread", "process"],
                   help="the writer's background work (default auto, the library's: a writer process here)")
    p.add_argument("--nice", type=int, help="the writer's nice increment, busy/idle rows (default: the library's)")
    a = p.parse_args(argv)
    if a.tiers:
        out = run_tiers(vars(a))
        print(tiers_table(out))
    else:
        out = run({k: v for k, v in vars(a).items()
                   if k not in ("json", "tiers", "busy_mb", "rss_mb", "rss_saves", "background", "nice")})
        print(table(out))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
