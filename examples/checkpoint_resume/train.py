"""Train, checkpoint, get killed, resume: every sample exactly once.

    python examples/checkpoint_resume/train.py --workdir /tmp/cr &     # trains, saving every 5 steps
    sleep 20; kill -9 %1                                              # a crash mid-run (any moment)
    python examples/checkpoint_resume/train.py --workdir /tmp/cr      # resumes from the newest checkpoint
    python examples/checkpoint_resume/verify.py /tmp/cr               # every sample once per epoch?

Each run appends one JSON line per step to ``WORKDIR/log.jsonl`` (its attempt, epoch, step and
the batch's sample keys) and saves model, optimizer and loader state with a CheckpointWriter
every ``--save-every`` steps. A run that finds a complete checkpoint resumes from it: the model
and optimizer from their state, the data stream from the StreamingDataLoader's state, so the
steps after the checkpoint are trained again on the same samples and nothing is seen twice.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid

import numpy as np
import torch

import datapipe

FEATURES, CLASSES = 16, 4


def make_dataset(url: str, samples: int) -> None:
    """Samples of a noisy linear problem: ``npy`` features and a ``cls`` label."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, CLASSES))
    with datapipe.ShardWriter(url, shard_samples=64) as writer:
        for i in range(samples):
            x = rng.normal(size=FEATURES).astype(np.float32)
            writer.write({"__key__": f"sample{i:05d}", "x.bin": x.tobytes(), "cls": str(int(np.argmax(x @ w)))})


def to_example(sample: dict) -> tuple[torch.Tensor, int, str]:
    """DataLoader workers: the sample's bytes to (features, label, key)."""
    x = torch.from_numpy(np.frombuffer(sample["x.bin"], dtype=np.float32).copy())
    return x, int(sample["cls"]), sample["__key__"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="dataset, checkpoints and log.jsonl (made if missing)")
    ap.add_argument("--samples", type=int, default=640)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=5, help="steps between checkpoints (default 5)")
    ap.add_argument("--step-sleep", type=float, default=0.05,
                    help="seconds each step spends 'on the accelerator' (default 0.05), to leave time to kill it")
    a = ap.parse_args(argv)

    os.makedirs(a.workdir, exist_ok=True)
    data, ckpt = os.path.join(a.workdir, "data"), os.path.join(a.workdir, "checkpoints")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        make_dataset(data, a.samples)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ds = datapipe.StreamingDataset(data, map=to_example, shuffle=True, seed=0)
    loader = datapipe.StreamingDataLoader(ds, batch_size=a.batch_size, num_workers=2)

    step, first_epoch, resumed_from = 0, 0, 0
    if any(c.complete for c in datapipe.list_checkpoints(ckpt)):
        state = datapipe.load_checkpoint(ckpt)  # the newest checkpoint that verifies
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        loader.load_state_dict(state["loader"])  # resumes the data stream exactly there
        step, first_epoch = int(state["step"]), int(state["epoch"])
        resumed_from = step
        print(f"resumed from the checkpoint of step {step} (epoch {first_epoch})", flush=True)

    attempt = uuid.uuid4().hex[:8]
    with open(os.path.join(a.workdir, "log.jsonl"), "a") as log, datapipe.CheckpointWriter(ckpt, keep_last=2) as writer:
        log.write(json.dumps({"attempt": attempt, "resumed_from": resumed_from}) + "\n")
        for epoch in range(first_epoch, a.epochs):
            ds.set_epoch(epoch)
            loss = None  # stays None for an epoch the checkpoint had already finished
            for x, y, keys in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(a.step_sleep)
                step += 1
                log.write(json.dumps({"attempt": attempt, "epoch": epoch, "step": step, "keys": list(keys)}) + "\n")
                log.flush()  # what a kill -9 leaves behind is every step up to the last one
                if step % a.save_every == 0:
                    writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                       "loader": loader.state_dict(), "epoch": epoch, "step": step})
            print(f"epoch {epoch} done at step {step}" + (f", loss {loss.item():.3f}" if loss is not None else ""),
                  flush=True)
    print(f"finished at step {step}", flush=True)


if __name__ == "__main__":
    main()
