"""A deterministic corpus of small files, like an image-caption dataset:
``<dir>/<group>/<key>.jpg`` (binary, lognormal sizes around ``mean_bytes``), ``.cls``
(a class id) and ``.json`` (a caption). ``python -m tools.corpus DIR --samples N``."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

__all__ = ["generate_corpus", "read_corpus"]

_WORDS = "a an the cat dog bird tree car road sky blue red small big runs sits flies over under near".split()


def read_corpus(root: str) -> dict[str, dict[str, object]]:
    """Every sample of a folder as ``{key: {"__key__": key, field: bytes}}``, files grouped
    into samples by datapipe's key rule: what a pack of ``root`` must hold."""
    from datapipe.format import split_member_name

    out: dict[str, dict[str, object]] = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            key, field = split_member_name(rel)
            with open(os.path.join(dirpath, f), "rb") as fh:
                out.setdefault(key, {"__key__": key})[field] = fh.read()
    return out


def generate_corpus(root: str, n_samples: int = 1000, seed: int = 0, mean_bytes: int = 16384,
                    per_dir: int = 1000, progress: bool = False) -> int:
    """Write ``n_samples`` samples of three files each; returns the bytes written."""
    rng = np.random.default_rng(seed)
    sigma = 0.5
    mu = np.log(mean_bytes) - sigma**2 / 2
    sizes = np.clip(rng.lognormal(mu, sigma, n_samples), 256, 16 * mean_bytes).astype(np.int64)
    pool = rng.integers(0, 256, int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
    total = 0
    it = range(n_samples)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="corpus", unit="samples", unit_scale=True)
    for i in it:
        d = os.path.join(root, f"{i // per_dir:05d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        key = os.path.join(d, f"sample{i:08d}")
        start = int(rng.integers(0, 4096))
        img = pool[start : start + int(sizes[i])]
        cls = str(int(rng.integers(0, 1000))).encode()
        caption = " ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), int(rng.integers(4, 16))))
        meta = json.dumps({"id": i, "caption": caption}).encode()
        for ext, data in (("jpg", img), ("cls", cls), ("json", meta)):
            with open(f"{key}.{ext}", "wb") as f:
                f.write(data)
            total += len(data)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-bytes", type=int, default=16384)
    a = ap.parse_args()
    n = generate_corpus(a.dir, a.samples, a.seed, a.mean_bytes, progress=True)
    print(f"wrote {a.samples} samples, {n / 1e6:.1f} MB, under {a.dir}")


if __name__ == "__main__":
    main()
