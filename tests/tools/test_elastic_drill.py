"""The elastic drill on torchrun (tools/elastic_drill.py) end to end, and its parts on
their own: its restore onto the same and onto another world size (real FSDP2 ranks over
gloo), its exactly-once timeline against runs built to be right and runs damaged one way
at a time, its throttled store under a real TieredCache, and a foreign --dir refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.ranks import free_port, spawn_ranks
from tools import elastic_drill as ed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- end to end -------------------------------------------------------------------------------

def _run_drill(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The drill as a command; past ``timeout`` it gets SIGTERM, which ends it through its
    cleanup (every agent and rank it started killed), and only then SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.elastic_drill", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise AssertionError(f"the drill ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.timeout(600)
def test_elastic_drill(tmp_path):
    """Two torchrun agents of two ranks: node 1 throttled and named (data), killed (the job
    shrinks to 2 ranks, resharded from node 0's own parts and replicas), started again
    (the job grows back to 4 from a 2-rank checkpoint); every sample once."""
    out = _run_drill(["--dir", str(tmp_path / "drill"), "--samples", "2048", "--local-every", "4",
                      "--remote-every", "8", "--json"], timeout=500)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "named straggler: node 1 (data)" in out.stdout
    assert "every sample exactly once: True" in out.stdout
    figures = json.loads(out.stdout[out.stdout.index("\n{") + 1:])
    assert figures["named_straggler_nodes"] == [1] and figures["named_kind"] == "data"
    assert figures["named_message"].startswith("data:")
    assert 1 <= figures["named_after_windows"] <= 2
    assert figures["world_sizes"] == [4, 2, 4]
    assert figures["every_sample_exactly_once"] is True and figures["problems"] == []
    assert 0 <= figures["lost_steps"] <= 4
    shrink, grow = figures["restored"]["shrink"], figures["restored"]["grow"]
    # 4 -> 2 from node 0's disk: its own parts and the replicas of node 1's ranks (which of
    # the two rank 0's boxes lie in depends on the ranks torchrun gave node 0 at world size 4)
    assert (shrink["saved_world"], shrink["resharded"]) == (4, True)
    assert shrink["source"] in ("local", "peer replica") and "remote" not in shrink["sources"], shrink
    assert (grow["saved_world"], grow["resharded"]) == (2, True)
    assert shrink["step"] % 4 == 0 and grow["step"] > shrink["step"]
    # the kill -> step time and its floor are printed beside each other (not asserted)
    assert "kill -> next step:" in out.stdout and "process start" in out.stdout


def test_a_foreign_dir_is_refused(tmp_path):
    """A non-empty --dir the drill did not make is refused before anything is deleted."""
    work = tmp_path / "mine"
    (work / "node0").mkdir(parents=True)
    (work / "node0" / "keep.txt").write_text("not the drill's")
    out = _run_drill(["--dir", str(work)], timeout=120)
    assert out.returncode != 0 and "not made by the elastic drill" in out.stderr, out.stderr[-2000:]
    assert (work / "node0" / "keep.txt").read_text() == "not the drill's"


# -- the restore, onto the same and onto another world size -------------------------------------

HIDDEN = 16


def _full(model: Any, opt: Any) -> dict[str, Any]:
    """Every tensor of the state, gathered whole (a collective: every rank calls it)."""
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out[f"optim.{i}.exp_avg"] = s["exp_avg"].full_tensor()
        out[f"optim.{i}.exp_avg_sq"] = s["exp_avg_sq"].full_tensor()
        out[f"optim.{i}.step"] = s["step"]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _restore_ranks(rank: int, port: int, port2: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    from datapipe.checkpoint import CheckpointWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    node = rank // 2
    model, opt = ed.make_model(4, HIDDEN)
    torch.manual_seed(1)
    for _ in range(2):  # so the saved state is not the initial one a fresh model starts from
        torch.nn.functional.cross_entropy(model(torch.randn(4, 64)), torch.randint(0, 16, (4,))).backward()
        opt.step()
        opt.zero_grad()
    tiers = ed.make_tiers(root, node, 4, 4, 4)
    with CheckpointWriter(tiers=tiers, ranks_per_node=2, background="thread", commit_timeout=60) as w:
        w.save(4, ed.checkpoint_state(model, opt, {"pos": 17}, {"attempt": 1, "world": 4, "step": 4})).wait()
    ref = _full(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))
    results: dict[str, Any] = {}
    fresh, fresh_opt = ed.make_model(4, HIDDEN)
    got = ed.restore(root, node, tiers, fresh, fresh_opt)
    results["same_world"] = {"restore": {k: got[k] for k in ("step", "source", "resharded", "loader")},
                             "differ": _same(_full(fresh, fresh_opt), ref)}
    dist.barrier()
    dist.destroy_process_group()
    if rank < 2:  # node 0 alone: 4 -> 2 from its own parts and the replicas it holds
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank, world_size=2)
        ref = torch.load(os.path.join(root, "ref.pt"))
        tiers2 = ed.make_tiers(root, 0, 2, 4, 4)
        for case in ("local", "remote", "none"):
            if case == "remote" and rank == 0:  # node 0 lost a replica: no node holds every part
                shutil.rmtree(os.path.join(ed.node_tier(root, 0), "replica-of-rank-00003"))
            if case == "none" and rank == 0:  # and the remote tier is gone: parts of steps remain
                shutil.rmtree(os.path.join(root, "remote"))
            dist.barrier()
            m2, o2 = ed.make_model(2, HIDDEN)
            try:
                got = ed.restore(root, 0, tiers2, m2, o2)
            except RuntimeError as e:
                results[case] = {"error": str(e)}
                continue
            results[case] = {"restore": {k: got[k] for k in ("step", "source", "sources", "resharded", "saved_world",
                                                             "loader")},
                             "differ": _same(_full(m2, o2), ref)}
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(root, f"result-{rank}.json"), "w") as f:
        json.dump(results, f)
    os._exit(0)  # as the drill's ranks leave (tests/checkpoint/test_reshard.py says why)


@pytest.mark.timeout(240)
def test_restore_onto_the_same_and_another_world_size(tmp_path):
    """The drill's restore, one restore_checkpoint(reshard=True): at the world size that
    saved, each rank its own part; onto 2 ranks, rank 0 the parts of ranks 0 and 1 from
    their own folders, rank 1 those of ranks 2 and 3 from the replicas node 0 keeps; with a
    replica gone, that part from the remote tier; with that gone too, an error. Every
    tensor restored equals the saved one, gathered."""
    root = str(tmp_path)
    spawn_ranks(_restore_ranks, (free_port(), free_port(), root), 4)
    results = [json.load(open(os.path.join(root, f"result-{r}.json"))) for r in range(4)]
    for r in range(4):
        same = results[r]["same_world"]
        assert same["differ"] == [], (r, same)
        assert same["restore"] == {"step": 4, "source": "local", "resharded": False, "loader": {"pos": 17}}
    for r in range(2):
        local, remote = results[r]["local"], results[r]["remote"]
        assert local["differ"] == [] and remote["differ"] == [], (r, local, remote)
        # source: where this rank's bytes came from (the least local of its parts' copies)
        assert local["restore"] == {"step": 4, "source": ["local", "peer replica"][r], "resharded": True,
                                    "saved_world": 4, "sources": ["local", "peer replica"], "loader": {"pos": 17}}
        assert remote["restore"]["sources"] == ["local", "remote"] and remote["restore"]["saved_world"] == 4
        # parts of step 4 remain on node 0, none whole: an error, never a fresh start
        assert "no checkpoint step is whole" in results[r]["none"]["error"], results[r]["none"]


# -- the exactly-once timeline ------------------------------------------------------------------

B = 2  # samples per rank per step in the simulated runs


def _simulate(tmp: str, n_steps: int, plan: list[tuple[int, int, int]]) -> tuple[ed.Run, set[str]]:
    """Write the logs of a run as the drill's ranks do: attempt i+1 of ``plan`` = (world,
    the attempt it restores from (0: none), the step it restores); each attempt trains until
    the next one restores from it (or, the last, to the end of the epoch). Keys are dealt in
    one fixed order from the position the restored step had reached."""
    logdir = os.path.join(tmp, "log")
    os.makedirs(logdir)
    order = [f"k{i:05d}" for i in range(n_steps * 4 * B)]
    pos_at: dict[tuple[int, int], int] = {}  # (attempt, step) -> samples consumed after it
    ends: dict[int, int] = {}
    for _world, src, step in plan[1:]:
        ends[src] = max(ends.get(src, 0), step)
    for i, (world, src, step) in enumerate(plan, start=1):
        pos = pos_at[(src, step)] if src else 0
        pos_at[(i, step)] = pos
        restore = None if not src else {"step": step, "drill": {"attempt": src, "world": plan[src - 1][0],
                                                                  "step": step}}
        with open(os.path.join(logdir, f"attempt-{i:03d}.json"), "w") as f:
            json.dump({"attempt": i, "world": world, "restore": restore}, f)
        logs = [open(os.path.join(logdir, f"attempt-{i:03d}-rank-{r}.jsonl"), "w") for r in range(world)]
        s, last = step, i == len(plan)
        # an attempt trains past the step the next restores (those steps are lost), up to 2
        stop = None if last else ends.get(i, step) + 2
        while pos < len(order) and (stop is None or s < stop):
            s += 1
            batch = order[pos:pos + world * B]
            pos += len(batch)
            pos_at[(i, s)] = pos
            for r, log in enumerate(logs):
                log.write(json.dumps({"step": s, "t": 0.0, "keys": batch[r::world]}) + "\n")
        for log in logs:
            log.close()
    return ed.Run(tmp), set(order)


@st.composite
def _plans(draw: Any) -> list[tuple[int, int, int]]:
    """Chains of restores: each attempt restores from the one before it, at a step that
    attempt reached (at least the one it started from)."""
    plan = [(draw(st.sampled_from([4, 2])), 0, 0)]
    starts = [0]
    for _ in range(draw(st.integers(0, 3))):
        step = starts[-1] + draw(st.integers(0, 3))
        plan.append((draw(st.sampled_from([4, 2])), len(plan), step))
        starts.append(step)
    return plan


@given(_plans(), st.integers(0, 1 << 30))
def test_timeline_of_a_sound_run_holds_every_sample_once(tmp_path_factory, plan, salt):
    run, expected = _simulate(str(tmp_path_factory.mktemp("run")), 24, plan)
    final = len(plan)
    timeline = ed.sample_timeline(run, run.attempts(), final)
    assert timeline["chain"] == list(range(1, final + 1))
    assert ed.exactly_once(timeline, expected), timeline["problems"]


def test_timeline_finds_each_kind_of_damage(tmp_path):
    """A sample trained twice, a step a rank did not log, a restore of a step its saving
    attempt never trained: each makes the check False, the last two named as problems."""
    plan = [(4, 0, 0), (2, 1, 4), (4, 2, 8)]

    def damaged(name: str, edit: Any) -> dict[str, Any]:
        run, expected = _simulate(str(tmp_path / name), 24, plan)
        edit(run)
        timeline = ed.sample_timeline(run, run.attempts(), 3)
        assert not ed.exactly_once(timeline, expected), name
        return timeline

    def lines(run: ed.Run, attempt: int, rank: int) -> tuple[str, list[dict[str, Any]]]:
        path = os.path.join(run.logdir, f"attempt-{attempt:03d}-rank-{rank}.jsonl")
        return path, [json.loads(x) for x in open(path)]

    def twice(run: ed.Run) -> None:  # attempt 2 trains a sample attempt 1 had trained
        path, docs = lines(run, 2, 0)
        docs[0]["keys"][0] = lines(run, 1, 0)[1][0]["keys"][0]
        open(path, "w").write("".join(json.dumps(d) + "\n" for d in docs))

    def missing(run: ed.Run) -> None:  # rank 1 of attempt 2 lost the log line of step 6
        path, docs = lines(run, 2, 1)
        open(path, "w").write("".join(json.dumps(d) + "\n" for d in docs if d["step"] != 6))

    def unsaved(run: ed.Run) -> None:  # attempt 3 says it restored step 30 of attempt 2
        path = os.path.join(run.logdir, "attempt-003.json")
        doc = json.load(open(path))
        doc["restore"]["step"] = 30
        open(path, "w").write(json.dumps(doc))

    damaged("twice", twice)
    assert any("lacks steps [6]" in p for p in damaged("missing", missing)["problems"])
    assert any("attempt 2" in p and "lacks steps" in p for p in damaged("unsaved", unsaved)["problems"])


# -- the throttle below the loader ----------------------------------------------------------------

def test_throttled_store_under_a_tiered_cache(tmp_path):
    """Through TieredCache(cold_wrapper=), every cold read goes through the wrapper (it
    shows no local path) and is slowed while the switch file exists, never after; the
    bytes are the object's, and the cache's telemetry counts them as cold reads."""
    import datapipe
    from datapipe.storage import LocalStore
    from datapipe.telemetry import Telemetry

    cold = tmp_path / "cold"
    cold.mkdir()
    (cold / "a.bin").write_bytes(os.urandom(3000))
    (cold / "b.bin").write_bytes(os.urandom(5000))
    switch = tmp_path / "throttle"
    switch.write_text("on\n")
    made: list[ed.ThrottledStore] = []

    def wrapper(store: Any) -> ed.ThrottledStore:
        made.append(ed.ThrottledStore(store, switch=str(switch), bytes_per_s=1e6))
        return made[-1]

    tel = Telemetry(window_s=None)
    cache = datapipe.TieredCache(warm_dir=str(tmp_path / "warm"), warm_bytes=1 << 20, cold_wrapper=wrapper,
                                 telemetry=tel)
    try:
        assert cache.read(str(cold / "a.bin")) == (cold / "a.bin").read_bytes()
        throttled = sum(s.throttled for s in made)
        switch.unlink()
        assert cache.read(str(cold / "b.bin")) == (cold / "b.bin").read_bytes()
        assert cache.read(str(cold / "a.bin")) == (cold / "a.bin").read_bytes()  # a warm hit: no cold read
    finally:
        cache.close()
    assert throttled >= 1 and sum(s.throttled for s in made) == throttled  # none once the switch is gone
    counts, _hist = tel.totals().tier("cold")
    assert counts["bytes"] == 8000 and counts["reads"] >= 2
    store = ed.ThrottledStore(LocalStore(str(cold)), switch=str(switch), bytes_per_s=1e6)
    assert store.local_path("a.bin") is None and store.list() == ["a.bin", "b.bin"]
