"""Peer adapters for bench_cache: MosaicML Streaming (`cache_limit`) and LitData
(`max_cache_size`) reading the same payloads from the same loopback S3 endpoint.

Each peer runs in its own spawned process, so whatever it imports (and the torchvision
stand-in below) never leaks into the caller. Each writes the payloads in its own format
with one payload per shard/chunk, so shards are the same size as datapipe's objects, and
reads E epochs with its own per-epoch shuffle. Bytes from cold are counted by wrapping the
peer's own download function; a hit is an access that needed no download.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

__all__ = ["run_peers"]


def _stub_torchvision() -> None:
    """`import streaming` imports torchvision, and PyPI's torchvision wheel fails beside this
    torch ("operator torchvision::nms does not exist"). Streaming only needs two names from
    it for its vision datasets, which this benchmark does not use, so a stand-in module is
    put in sys.modules of this (spawned, benchmark-only) process before importing it."""
    import importlib.machinery
    import sys
    import types

    mods = {}
    for name in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                 "torchvision.transforms.functional"):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__path__ = []
        mods[name] = m
    mods["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
    mods["torchvision.transforms.functional"].to_tensor = lambda x: x
    mods["torchvision"].datasets = mods["torchvision.datasets"]
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
    sys.modules.update(mods)


def _upload_dir(local: str, root: str, opts: dict) -> None:
    from datapipe.storage import open_store

    store = open_store(root, opts)
    for dirpath, _d, files in os.walk(local):
        for f in files:
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, local).replace(os.sep, "/")
            with open(p, "rb") as fh:
                store.put(rel, fh.read())


def _count_epochs(ds, counted: dict, epochs: int, set_epoch: bool = False) -> list[dict]:
    """Iterate ``epochs`` passes of a peer's dataset; per pass the objects read, the
    downloads its patched downloader counted, and the bytes they fetched."""
    per_epoch = []
    for e in range(epochs):
        if set_epoch:
            ds.set_epoch(e + 1)
        before = dict(counted)
        n = sum(1 for _ in ds)
        downloads = counted["files"] - before["files"]
        per_epoch.append({"accesses": n, "downloads": downloads,
                          "cold_bytes": counted["bytes"] - before["bytes"], "hits": n - downloads})
    return per_epoch


def _mosaic(cfg: dict, s3: dict, payloads: dict, orders, work: str, budget: int) -> dict:
    _stub_torchvision()
    os.environ["S3_ENDPOINT_URL"] = s3["endpoint_url"]
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.stream import Stream

    out = os.path.join(work, "mds-out")
    if not os.path.exists(os.path.join(out, "index.json")):
        with MDSWriter(out=out, columns={"data": "bytes"}, size_limit=cfg["object_bytes"] + 4096) as w:
            for name in sorted(payloads):
                w.write({"data": payloads[name]})
        _upload_dir(out, s3["root"] + "/mds", s3["opts"])
    counted = {"bytes": 0, "files": 0}
    orig = Stream._download_file

    def counting(self, from_basename, to_basename=None):
        local = orig(self, from_basename, to_basename)
        if from_basename != "index.json":
            counted["bytes"] += os.path.getsize(local)
            counted["files"] += 1
        return local

    Stream._download_file = counting
    local = os.path.join(work, f"mds-cache-{budget}")
    ds = StreamingDataset(remote=s3["root"] + "/mds", local=local, cache_limit=budget, shuffle=True,
                          shuffle_seed=cfg["seed"] + 1, batch_size=1)
    return {"per_epoch": _count_epochs(ds, counted, len(orders))}


def _litdata(cfg: dict, s3: dict, payloads: dict, orders, work: str, budget: int) -> dict:
    import litdata
    from litdata.streaming import downloader as dl

    out = os.path.join(work, "lit-out")
    if not os.path.exists(os.path.join(out, "index.json")):
        names = sorted(payloads)
        litdata.optimize(fn=_lit_item, inputs=[(n, payloads[n]) for n in names], output_dir=out,
                         chunk_bytes=cfg["object_bytes"] + 4096, num_workers=1, mode="overwrite")
        _upload_dir(out, s3["root"] + "/lit", s3["opts"])
    # LitData prefers obstore for chunk GETs when installed, and obstore refuses plain
    # http:// endpoints (reqwest "BadScheme") unless configured with allow_http, which
    # LitData does not pass through; its boto3 path is the documented alternative.
    dl._OBSTORE_AVAILABLE = False
    counted = {"bytes": 0, "files": 0}
    orig = dl.S3Downloader.download_file

    def counting(self, remote, local):
        existed = os.path.exists(local)
        orig(self, remote, local)
        if not existed and not remote.endswith("index.json") and os.path.exists(local):
            counted["bytes"] += os.path.getsize(local)
            counted["files"] += 1

    dl.S3Downloader.download_file = counting
    opts = {"endpoint_url": s3["endpoint_url"], "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    ds = litdata.StreamingDataset(s3["root"] + "/lit", cache_dir=os.path.join(work, f"lit-cache-{budget}"),
                                  shuffle=True, seed=cfg["seed"] + 1, max_cache_size=budget,
                                  storage_options=opts)
    return {"per_epoch": _count_epochs(ds, counted, len(orders), set_epoch=True)}


def _lit_item(item):
    name, data = item
    return {"name": name, "data": data}


def _child(kind, cfg, s3, payloads, orders, work, budget, q):
    try:
        fn = _mosaic if kind == "mosaicml_streaming" else _litdata
        q.put(fn(cfg, s3, payloads, orders, work, budget))
    except BaseException as e:
        q.put({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]})


def run_peers(cfg, s3, payloads: dict, orders, work: str, timeout_s: float = 900) -> dict:
    """{peer: {fraction: {per_epoch, hit_rate, steady_cold_bytes_per_epoch} | {error}}}"""
    from dataclasses import asdict

    c = asdict(cfg)
    s3d = {"endpoint_url": s3.endpoint_url, "opts": s3.storage_options,
           "root": s3.create_bucket("bench-peers")}
    ctx = mp.get_context("spawn")
    out: dict = {}
    for kind in ("mosaicml_streaming", "litdata"):
        out[kind] = {}
        for frac in cfg.fractions:
            budget = int(frac * cfg.objects) * cfg.object_bytes
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(kind, c, s3d, payloads, orders, work, budget, q))
            p.start()
            try:
                res = q.get(timeout=timeout_s)
            except Exception:
                res = {"error": f"no answer within {timeout_s} s"}
            p.join(10)
            if p.is_alive():
                p.kill()
            if "per_epoch" in res:
                pe = res["per_epoch"]
                acc = sum(e["accesses"] for e in pe)
                # accesses - downloads: negative when shards were evicted before their use
                # and downloaded again (thrashing), which per-access tracking would not hide
                res["hit_rate"] = sum(e["hits"] for e in pe) / acc if acc else None
                steady = [e["cold_bytes"] for e in pe[1:]] or [pe[0]["cold_bytes"]]
                res["steady_cold_bytes_per_epoch"] = sum(steady) / len(steady)
            out[kind][str(frac)] = res
    return out
