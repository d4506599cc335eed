"""The progress bars of pack, pack_tokens and index: a bar polled from shared counters that
worker processes add to (``polled_progress``), and no bar thread at all when progress is off."""

from __future__ import annotations

import io
import multiprocessing as mp
import threading

from tqdm import tqdm

from datapipe.progress import polled_progress, progress_bar


def _add(counters, n: int) -> None:
    with counters.get_lock():
        counters[0] += n
        counters[1] += 2 * n


def test_the_bar_ends_at_the_workers_last_count():
    # spawned workers: a fork while the poller holds the counters' lock would copy it held
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", 2)
    out = io.StringIO()
    bar = tqdm(total=None, file=out, mininterval=0)
    before = {t.name for t in threading.enumerate()}
    with polled_progress(bar, counters, lambda b: f"{counters[1]} units", True, name="test-progress-poller"):
        assert "test-progress-poller" in {t.name for t in threading.enumerate()} - before
        procs = [ctx.Process(target=_add, args=(counters, 7)) for _ in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    # caught up on exit: every count the workers added, whatever the poller saw meanwhile
    assert bar.n == counters[0] == 21
    assert "test-progress-poller" not in {t.name for t in threading.enumerate()}


def test_the_postfix_is_what_the_caller_computes_from_the_bar():
    counters = mp.get_context("spawn").Array("q", 2)
    out = io.StringIO()
    bar = tqdm(total=None, file=out, mininterval=0)
    seen = []
    release = threading.Event()

    def postfix(b) -> str:
        seen.append(b)
        release.set()
        return "42 MB/s"

    with polled_progress(bar, counters, postfix, True):
        _add(counters, 5)
        release.wait(10)
    assert seen and all(b is bar for b in seen)
    assert "42 MB/s" in out.getvalue()


def test_no_progress_starts_no_thread_and_closes_the_bar():
    counters = mp.get_context("spawn").Array("q", 2)
    bar = progress_bar(None, False)
    before = threading.active_count()
    calls = []
    with polled_progress(bar, counters, lambda b: calls.append(b) or "", False):
        assert threading.active_count() == before
        _add(counters, 3)
    assert calls == []  # nothing polled: no postfix computed
