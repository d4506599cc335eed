"""The training half of the demo: stream, train, checkpoint, crash, resume, prove."""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import datapipe
from datapipe.checkpoint import CheckpointWriter, load_checkpoint
from datapipe.loader import StreamingDataLoader

FEATURES = 64
CLASSES = 16
BATCH = 32
EPOCHS = 2
SAVE_EVERY = 10


def to_example(sample: dict[str, Any]) -> tuple[torch.Tensor, int, str]:
    """Picklable map for DataLoader workers: the first bytes of the 'image' as features."""
    img = np.frombuffer(sample["jpg"][:FEATURES].ljust(FEATURES, b"\x00"), dtype=np.uint8)
    return torch.from_numpy(img.astype(np.float32) / 255.0), int(sample["cls"]) % CLASSES, sample["__key__"]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _loader(dest: str, cache: Any, storage_options: Any) -> StreamingDataLoader:
    ds = datapipe.StreamingDataset(dest, cache=cache, shuffle=True, seed=7, window=None, decode="auto",
                                   map=to_example, storage_options=storage_options)
    return StreamingDataLoader(ds, batch_size=BATCH, num_workers=2)


def _run(dest: str, cache: Any, storage_options: Any, ckpt_url: str, *, stop_at: int | None,
         resume: bool, log: dict[str, Any]) -> None:
    model, opt = _model()
    loader = _loader(dest, cache, storage_options)
    writer = CheckpointWriter(ckpt_url, keep_last=2)
    step, start_epoch = 0, 0
    if resume:
        state = load_checkpoint(ckpt_url)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        loader.load_state_dict(state["loader"])
        step, start_epoch = int(state["step"]), int(state["epoch"])
        log["resumed_from"] = {"step": step, "epoch": start_epoch, "samples_into_epoch": state["loader_seen"]}
    t0 = time.perf_counter()
    seen = 0
    loss = None
    try:
        for epoch in range(start_epoch, EPOCHS):
            loader.dataset.set_epoch(epoch)
            keys = log["keys"].setdefault(epoch, [])
            bar = tqdm(loader, desc=f"{'resume' if resume else 'train'} epoch {epoch}", unit="batch", leave=False)
            for x, y, batch_keys in bar:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                seen += len(batch_keys)
                keys.extend(batch_keys)
                if step % SAVE_EVERY == 0:
                    h = writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                           "loader": loader.state_dict(), "loader_seen": loader.samples_seen,
                                           "step": step, "epoch": epoch})
                    log["saves"].append(h)
                    log["checkpoints"][step] = (epoch, loader.samples_seen)
                if stop_at is not None and step >= stop_at:
                    return  # a crash: whatever was not checkpointed is lost
    finally:
        writer.close()
        log["seconds"] += time.perf_counter() - t0
        log["samples"] += seen
        if loss is not None:
            log["loss"] = float(loss.detach())


def train_and_resume(dest: str, workdir: str, storage_options: Any, step: Callable[[str], None]) -> dict[str, Any]:
    cache_dir = os.path.join(workdir, "warm-cache")
    ckpt_url = os.path.join(workdir, "checkpoints")
    shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(ckpt_url, ignore_errors=True)
    cache = datapipe.TieredCache(hot_bytes=16 << 20, warm_dir=cache_dir, warm_bytes=64 << 20,
                                 storage_options=storage_options)
    n = datapipe.open_index(dest, storage_options).num_samples
    steps_per_epoch = -(-n // BATCH)
    crash = steps_per_epoch + steps_per_epoch // 2 + SAVE_EVERY // 2  # mid epoch 1, between two saves

    step(f"train {EPOCHS} shuffled epochs from the cold tier through the cache; crash at step {crash}")
    first: dict[str, Any] = {"keys": {}, "saves": [], "checkpoints": {}, "seconds": 0.0, "samples": 0}
    _run(dest, cache, storage_options, ckpt_url, stop_at=crash, resume=False, log=first)
    stalls = [h.wait()["stall_s"] for h in first["saves"]]
    print(f"ran {crash} steps, {first['samples']} samples in {first['seconds']:.1f} s "
          f"({first['samples'] / first['seconds']:,.0f} samples/s); {len(stalls)} checkpoints")

    step("resume from the latest checkpoint with the loader's state")
    second: dict[str, Any] = {"keys": {}, "saves": [], "checkpoints": {}, "seconds": 0.0, "samples": 0}
    _run(dest, cache, storage_options, ckpt_url, stop_at=None, resume=True, log=second)
    r = second["resumed_from"]
    print(f"resumed at step {r['step']} (epoch {r['epoch']}, {r['samples_into_epoch']} samples in); "
          f"trained {second['samples']} more samples in {second['seconds']:.1f} s")
    stalls += [h.wait()["stall_s"] for h in second["saves"]]

    step("check: the interrupted epoch, checkpointed part + resumed part, holds every sample once")
    epoch = r["epoch"]
    before = first["keys"][epoch][: r["samples_into_epoch"]]
    after = second["keys"][epoch]
    counts = Counter(before + after)
    once = len(counts) == n and set(counts.values()) == {1}
    print(f"epoch {epoch}: {len(before)} samples before the checkpoint + {len(after)} after resume = "
          f"{len(before) + len(after)}; distinct {len(counts)} of {n}; every sample exactly once: {once}")
    full = Counter(first["keys"][0]) if epoch == 1 else None
    if full is not None:
        print(f"epoch 0 (uninterrupted): {len(full)} distinct of {n}, max repeats {max(full.values())}")
    if not once:
        raise SystemExit("the resumed run did not see each remaining sample exactly once")

    stats = cache.stats(node=True)  # every worker process of this node, not only this one
    tiers = {k: v for k, v in stats.items() if k.endswith(("_hits", "_misses")) or "cold" in k}
    print("cache:", ", ".join(f"{k}={v}" for k, v in sorted(tiers.items())))
    print(f"checkpoint stall per save: median {np.median(stalls) * 1e3:.1f} ms, max {max(stalls) * 1e3:.1f} ms "
          f"over {len(stalls)} saves")
    cache.close()
    return {
        "train_samples_per_s": round((first["samples"] + second["samples"]) / (first["seconds"] + second["seconds"])),
        "cache": tiers,
        "checkpoint_stall_ms_median": round(float(np.median(stalls)) * 1e3, 2),
        "checkpoint_saves": len(stalls),
        "resumed_epoch_every_sample_once": once,
        "final_loss": round(second["loss"], 4),
    }
