"""Recovery drill: lose a node mid-training, restore from the peer replica, prove that
every sample was seen exactly once across the failure.

    python -m tools.recovery_drill                 # a temporary folder, ~30 s
    python -m tools.recovery_drill --dir /tmp/drill --samples 640 --local-every 4

Two "nodes" of two ranks each run as separate processes on this machine (torch.distributed
over gloo; each node has its own local tier folder). They train a tiny model on a packed
dataset through StreamingDataset/StreamingDataLoader, averaging gradients with
all_reduce, and checkpoint model, optimizer and loader state: to the node's local tier
every few steps with ``replicate=1`` (each rank's part also goes to the same local rank
on the other node), and to a shared remote tier more rarely. Mid-training node 1's
processes are killed with SIGKILL and its local tier is deleted; the survivors are
stopped (a scheduler restarts the whole job), all ranks restart, restore (node 1's ranks
from the replicas node 0 keeps, without needing the remote tier), and finish the epoch.
The drill then checks, from each rank's log of the keys it trained on, that the
checkpointed part of the first run plus the resumed run hold every sample exactly once.
It prints ``every sample exactly once: <bool>`` and ``restored from: <source of node 1's
ranks>`` as computed, the restore time against reading the same bytes from disk, and the
steps lost. The exit status is 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import Any

from tools.drill_work import claim_work_dir, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE



def _tiers(work: str, rank: int, local_every: int, remote_every: int) -> list[Any]:
    from datapipe.checkpoint import Tier

    return [Tier(os.path.join(work, f"node{rank // RANKS_PER_NODE}"), every=local_every, keep_last=2, replicate=1),
            Tier(os.path.join(work, "remote"), every=remote_every, keep_last=2)]


# -- one rank -----------------------------------------------------------------------------

def _read_files_s(folder: str) -> tuple[float, int]:
    """Seconds and bytes to read every file under ``folder`` once with plain reads into one
    new buffer of their total size: the memory a restore fills (a read that dropped each
    file before the next would reuse one file's worth of memory and skip that cost)."""
    import torch

    paths = [os.path.join(d, f) for d, _dirs, files in os.walk(folder) for f in files]
    t0 = time.perf_counter()
    buf = torch.empty(sum(os.path.getsize(p) for p in paths), dtype=torch.uint8).numpy().data
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            n += fh.readinto(buf[n:])
    return time.perf_counter() - t0, n


def run_rank(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import datapipe
    from datapipe.checkpoint import CheckpointWriter, restore_checkpoint
    from datapipe.checkpoint.format import step_dir
    from datapipe.checkpoint.tiers import own_dir, peer_of, replica_dir
    from datapipe.loader import StreamingDataLoader
    from tools.demo_train import _model, to_example

    rank = a.rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=WORLD)
    tiers = _tiers(a.work, rank, a.local_every, a.remote_every)
    model, opt = _model()
    ds = datapipe.StreamingDataset(os.path.join(a.work, "data"), shuffle=True, seed=7, window=None, decode="auto",
                                   map=to_example, drop_last=True)
    loader = StreamingDataLoader(ds, batch_size=a.batch, num_workers=0)
    # stands for the rest of a real model's state: the bytes a restore moves
    ballast = torch.randn(a.extra_mb << 18, generator=torch.Generator().manual_seed(rank))
    step = 0
    if a.phase == "resume":
        r = restore_checkpoint(tiers, ranks_per_node=RANKS_PER_NODE)
        if not torch.equal(r.state["ballast"], ballast):
            raise SystemExit(f"rank {rank}: the restored state is not the one saved")
        model.load_state_dict(r.state["model"])
        opt.load_state_dict(r.state["optim"])
        loader.load_state_dict(r.state["loader"])
        step = int(r.state["step"])
        # the same bytes from a local disk, once: the folder this part was restored from
        if r.source == "peer replica":
            holder = peer_of(rank, WORLD, RANKS_PER_NODE)
            folder = os.path.join(a.work, f"node{holder // RANKS_PER_NODE}", replica_dir(rank), step_dir(r.step))
        else:
            folder = os.path.join(a.work, f"node{rank // RANKS_PER_NODE}", own_dir(rank), step_dir(r.step))
        disk_s, disk_bytes = _read_files_s(folder) if r.source != "remote" else (float("nan"), 0)
        with open(os.path.join(a.work, "log", f"restore-rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "step": r.step, "source": r.source, "sources": r.sources, "url": r.url,
                       "read_s": r.read_s, "restore_s": r.seconds, "bytes": r.bytes, "disk_s": disk_s,
                       "disk_bytes": disk_bytes, "skipped": r.skipped}, f)
    # A restart saves steps the lost run may have saved already on some nodes; those are
    # replaced by this run's saves, and the writer's "below a step saved before" warning
    # says what this drill knows.
    warnings.filterwarnings("ignore", message="saving step")
    writer = CheckpointWriter(tiers=tiers, ranks_per_node=RANKS_PER_NODE, commit_timeout=60, chunk_bytes=1 << 20,
                              background=a.background)
    log = open(os.path.join(a.work, "log", f"{a.phase}-rank-{rank}.jsonl"), "a")
    ds.set_epoch(0)
    for x, y, keys in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel: average the gradients
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= WORLD
        opt.step()
        step += 1
        log.write(json.dumps({"step": step, "keys": list(keys)}) + "\n")
        log.flush()
        # every step: a step no tier is due for returns at once without copying anything
        writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                           "loader": loader.state_dict(), "step": step, "ballast": ballast})
        time.sleep(a.step_sleep)
        if step == a.hold_at:
            # where the drill strikes: the saves made so far are durable (as a job whose
            # writer keeps up with its cadence has them) and this rank waits to be killed;
            # the other node blocks in the next all_reduce, so no rank passes this step
            writer.wait()
            open(os.path.join(a.work, "log", f"held-rank-{rank}"), "w").close()
            time.sleep(a.timeout * 10)
    writer.close()
    log.close()
    dist.destroy_process_group()


# -- the drill ------------------------------------------------------------------------------

def _launch(a: argparse.Namespace, work: str, phase: str, port: int,
            hold_at: dict[int, int] | None = None) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), LOCAL_RANK=str(rank % RANKS_PER_NODE),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "tools.recovery_drill", "--worker", "--rank", str(rank), "--port", str(port),
               "--work", work, "--phase", phase, "--batch", str(a.batch), "--local-every", str(a.local_every),
               "--remote-every", str(a.remote_every), "--step-sleep", str(a.step_sleep),
               "--extra-mb", str(a.extra_mb), "--background", a.background,
               "--hold-at", str((hold_at or {}).get(rank, 0)), "--timeout", str(a.timeout)]
        # each rank's output in its own file: the killed run's survivors end with gloo errors
        with open(os.path.join(work, "log", f"{phase}-rank-{rank}.out"), "wb") as out:
            # a session of its own: a rank and every process it starts (its checkpoint writer
            # process, DataLoader workers) are one group, killed together as a node's are
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def _kill_all(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGKILL to every process of these ranks (each rank's group) and wait until none is
    left: a node that fails takes all its processes with it, and a writer process still
    finishing a file would race the deletion of the node's tier and the restart's lease."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
    deadline = time.monotonic() + timeout
    for p in procs:
        while True:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"processes of rank pid {p.pid}'s group outlived SIGKILL for {timeout} s")
            time.sleep(0.01)


def _log(work: str, phase: str, rank: int) -> list[dict[str, Any]]:
    """A rank's log of (step, keys); a line cut short by SIGKILL is the last one and dropped."""
    path = os.path.join(work, "log", f"{phase}-rank-{rank}.jsonl")
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except ValueError:
                break
    return out


def _held(work: str, ranks: list[int]) -> bool:
    return all(os.path.exists(os.path.join(work, "log", f"held-rank-{r}")) for r in ranks)


WORK_SUBDIRS = ("node0", "node1", "remote", "log", "data", "corpus")
MARKER = ".datapipe-recovery-drill"  # in a --dir the drill made: it may delete its own subfolders there


def drill(a: argparse.Namespace) -> dict[str, Any]:
    import datapipe
    from tools.corpus import generate_corpus

    work = a.dir or tempfile.mkdtemp(prefix="recovery-drill-")
    claim_work_dir(work, MARKER, "recovery")
    for name in WORK_SUBDIRS:  # only in a folder the drill made (its marker is there)
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    os.makedirs(os.path.join(work, "log"))
    generate_corpus(os.path.join(work, "corpus"), a.samples, mean_bytes=1024)
    packed = datapipe.pack(os.path.join(work, "corpus"), os.path.join(work, "data"), shard_samples=64, workers=1)
    steps_per_epoch = a.samples // WORLD // a.batch
    # mid-interval after the local save 2/3 into the epoch (never on a step the local tier is due)
    kill_at = a.kill_at or (steps_per_epoch * 2 // 3 // a.local_every * a.local_every + (a.local_every + 1) // 2)
    t0 = time.perf_counter()
    print(f"drill: {a.samples} samples in {packed.shards} shards; {NODES} nodes x {RANKS_PER_NODE} ranks (gloo); "
          f"{steps_per_epoch} steps; local tier every {a.local_every} steps with replicate=1, remote every "
          f"{a.remote_every}; writer background: {a.background}; node 1 is killed at step {kill_at}")

    node1 = [r for r in range(WORLD) if r // RANKS_PER_NODE == 1]
    procs = _launch(a, work, "train", free_port(), hold_at=dict.fromkeys(node1, kill_at))
    deadline = time.monotonic() + a.timeout
    while not _held(work, node1):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _kill_all(procs)
            raise SystemExit(f"the training run ended or stalled before step {kill_at}: exit codes "
                             f"{[p.poll() for p in procs]} (output: {os.path.join(work, 'log')})")
        time.sleep(0.01)
    _kill_all([procs[r] for r in node1])
    failed_at = max(e[-1]["step"] for r in range(WORLD) if (e := _log(work, "train", r)))
    shutil.rmtree(os.path.join(work, "node1"))
    print(f"train: SIGKILL to ranks {node1} (node 1) at step {failed_at}; deleted node 1's local tier; "
          "node 0's ranks are stopped for the restart")
    # the job is restarted as a whole, as a scheduler does when one node fails
    _kill_all(procs)

    t_fail = time.perf_counter()
    procs = _launch(a, work, "resume", free_port())
    codes = [p.wait(timeout=a.timeout) for p in procs]
    if any(codes):
        bad = codes.index(next(c for c in codes if c))
        tail = open(os.path.join(work, "log", f"resume-rank-{bad}.out"), errors="replace").read()[-3000:]
        raise SystemExit(f"the resumed run failed: exit codes {codes}; rank {bad} said:\n{tail}")
    restored = [json.load(open(os.path.join(work, "log", f"restore-rank-{r}.json"))) for r in range(WORLD)]
    step = restored[0]["step"]
    print(f"restore: step {step}; sources by rank: {', '.join(restored[0]['sources'])}")
    node1_sources = sorted({restored[r]["source"] for r in node1})
    print(f"restored from: {' + '.join(node1_sources)}")

    keys: list[str] = []
    for r in range(WORLD):
        keys += [k for e in _log(work, "train", r) if e["step"] <= step for k in e["keys"]]
        keys += [k for e in _log(work, "resume", r) for k in e["keys"]]
    counts = Counter(keys)
    expected = datapipe.open_index(os.path.join(work, "data")).num_samples
    once = len(counts) == expected and set(counts.values()) == {1}
    lost = failed_at - step
    r2 = restored[node1[0]]
    ratio = r2["read_s"] / r2["disk_s"] if r2["disk_s"] > 0 else float("nan")
    print(f"restore of rank {node1[0]} ({r2['source']}): {r2['read_s']:.3f} s for {r2['bytes']:,} bytes, "
          f"whole restore {r2['restore_s']:.3f} s; reading the same {r2['disk_bytes']:,} bytes from local disk "
          f"(page cache) once into a new buffer: {r2['disk_s']:.4f} s (ratio {ratio:.1f}x)")
    r0 = restored[0]
    print(f"restore of rank 0 ({r0['source']}, read and verified from its own disk): {r0['read_s']:.3f} s "
          f"for {r0['bytes']:,} bytes; peer replica / local: {r2['read_s'] / r0['read_s']:.2f}x")
    print(f"lost steps: {lost} (failure at step {failed_at}, restored step {step}; local tier interval "
          f"{a.local_every})")
    print(f"wall time: {t_fail - t0:.1f} s to the failure, {time.perf_counter() - t_fail:.1f} s restart to the "
          "end of the epoch (process start-up included)")
    print(f"samples: {len(keys)} trained across the failure, {len(counts)} distinct of {expected}")
    print(f"every sample exactly once: {once}")
    result = {"every_sample_exactly_once": once, "restored_from": node1_sources, "restored_step": step,
              "failed_at": failed_at, "lost_steps": lost, "sources": restored[0]["sources"],
              "restore_s": r2["read_s"], "disk_read_s": r2["disk_s"], "restore_vs_disk": ratio,
              "local_restore_s": r0["read_s"],
              "replica_vs_local_restore": r2["read_s"] / r0["read_s"], "work": work}
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="work folder (kept): new, empty, or one an earlier drill made; "
                   "default: a temporary one, removed after")
    p.add_argument("--samples", type=int, default=640, help="dataset size (default 640)")
    p.add_argument("--batch", type=int, default=8, help="batch per rank (default 8)")
    p.add_argument("--local-every", type=int, default=4, help="local tier cadence in steps (default 4)")
    p.add_argument("--remote-every", type=int, default=8, help="remote tier cadence in steps (default 8)")
    p.add_argument("--kill-at", type=int, help="step at which node 1 is killed (default: mid-interval, 2/3 in)")
    p.add_argument("--extra-mb", type=int, default=16, help="MiB of extra state per rank (default 16)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds per step spent 'on the accelerator'")
    p.add_argument("--timeout", type=float, default=240.0, help="give up after this many seconds per phase")
    p.add_argument("--background", choices=["auto", "thread", "process"], default="auto",
                   help="the checkpoint writer's background work: threads or a writer process "
                        "(default auto, the library's: a writer process here)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    # one rank of the drill (started by the drill itself)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=["train", "resume"], help=argparse.SUPPRESS)
    p.add_argument("--hold-at", type=int, default=0, help=argparse.SUPPRESS)  # the step a rank waits to be killed at
    a = p.parse_args(argv)
    if a.worker:
        run_rank(a)
        return
    if a.samples % (WORLD * a.batch):
        p.error(f"--samples must be a multiple of {WORLD} ranks x --batch ({WORLD * a.batch})")
    out = drill(a)
    if a.json:
        print(json.dumps(out, indent=1))
    if not (out["every_sample_exactly_once"] and out["restored_from"] == ["peer replica"]
            and out["lost_steps"] <= a.local_every):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
