"""Image classification on CPU: JPEGs packed into shards, decoded and augmented in DataLoader
workers, a tiny CNN trained for a few steps.

    python examples/image_classification/train.py                  # a temporary folder
    python examples/image_classification/train.py --workdir /tmp/ic --images 1024 --epochs 3

The images are generated: squares of four colours (the classes) with noise, so that a tiny
network learns them in a few steps. To train on your own folder of labelled images, give
``--images-dir DIR`` with one subfolder per class (``DIR/cat/1.jpg``, ``DIR/dog/2.jpg``, ...).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from PIL import Image

import datapipe

CLASSES = ["red", "green", "blue", "grey"]
COLOURS = np.array([[200, 40, 40], [40, 180, 40], [40, 60, 200], [128, 128, 128]], dtype=np.float32)
SIDE = 32  # the network's input: SIDE x SIDE RGB


def generate_images(folder: str, n: int, seed: int = 0) -> None:
    """``n`` JPEGs in ``folder/<class>/<i>.jpg``, of random sizes around 40 pixels."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = i % len(CLASSES)
        side = int(rng.integers(36, 48))
        pixels = COLOURS[label] + rng.normal(0, 40, size=(side, side, 3))
        os.makedirs(os.path.join(folder, CLASSES[label]), exist_ok=True)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
            os.path.join(folder, CLASSES[label], f"{i:05d}.jpg"), quality=90)


class Augment:
    """The ``map=`` of the dataset, run in the DataLoader workers: a random crop of SIDE x SIDE,
    a random flip, a float tensor in [0, 1] (CHW), and the class from the sample's folder.
    A class (not a lambda) so that it pickles for any worker start method."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes

    def __call__(self, sample: dict) -> tuple[torch.Tensor, int]:
        image = sample["jpg"]  # a PIL image: decode="pil"
        rng = np.random.default_rng()
        x0 = int(rng.integers(0, image.width - SIDE + 1))
        y0 = int(rng.integers(0, image.height - SIDE + 1))
        pixels = np.asarray(image.crop((x0, y0, x0 + SIDE, y0 + SIDE)), dtype=np.float32) / 255
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        label = self.classes.index(sample["__key__"].split("/")[0])
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))), label


def tiny_cnn(classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, classes))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where the images, shards and nothing else go (default: a temporary folder)")
    ap.add_argument("--images-dir", help="your own images, one subfolder per class (default: generated)")
    ap.add_argument("--images", type=int, default=512, help="images to generate (default 512)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    a = ap.parse_args(argv)

    workdir = a.workdir or tempfile.mkdtemp(prefix="datapipe-image-classification-")
    images = a.images_dir or os.path.join(workdir, "images")
    if a.images_dir is None and not os.path.isdir(images):
        generate_images(images, a.images)
    shards = os.path.join(workdir, "shards")
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        print(datapipe.pack(images, shards, shard_bytes=1 << 20).summary())
    classes = sorted({key.split("/")[0] for key in datapipe.open_index(shards).keys()})

    torch.manual_seed(0)
    ds = datapipe.StreamingDataset(shards, decode="pil", map=Augment(classes), shuffle=True, seed=0)
    loader = datapipe.StreamingDataLoader(ds, batch_size=a.batch_size, num_workers=a.workers)
    model = tiny_cnn(len(classes))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    t0, steps, images_seen = time.perf_counter(), 0, 0
    for epoch in range(a.epochs):
        ds.set_epoch(epoch)
        correct = seen = 0
        for x, y in loader:  # x: a batch of augmented images, y: their classes
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
            steps += 1
        images_seen += seen
        print(f"epoch {epoch}: {seen} images, loss {loss.item():.3f}, train accuracy {correct / seen:.2f}")
    seconds = time.perf_counter() - t0
    print(f"{steps} steps, {images_seen / seconds:,.0f} images/s through {a.workers} workers; data in {workdir}")
    return {"steps": steps, "accuracy": correct / seen, "images_per_epoch": seen, "classes": classes}


if __name__ == "__main__":
    main()
